"""Training data: sources -> tokenizer -> memory-mapped token shards -> packed batches.

The trainer needs three names::

    data = prepare_data(DataConfig(sources=["stdlib"], max_tokens=200_000), rank, world_size)
    loader = BatchLoader(data.train, batch_size=8, seq_len=128, rank=rank,
                         world_size=world_size, seed=0)
    x, y = next(loader)          # int64 [B, T]; y is x shifted left by one

See ``prepare`` (caching, rank 0 builds / others wait), ``sources`` (readers and the
train/validation split), ``mixture`` (weights), ``cache`` (shards, resume) and ``loader``
(packing, per-rank shares, exact resume, background prefetch).
"""

from gradzip.train.data.cache import TokenShards, build_tokens
from gradzip.train.data.loader import BatchLoader
from gradzip.train.data.mixture import mix
from gradzip.train.data.prepare import DataConfig, PreparedData, prepare_data
from gradzip.train.data.sources import Doc, Source, open_source, parse_spec, split_of

__all__ = [
    "BatchLoader",
    "DataConfig",
    "Doc",
    "PreparedData",
    "Source",
    "TokenShards",
    "build_tokens",
    "mix",
    "open_source",
    "parse_spec",
    "prepare_data",
    "split_of",
]
