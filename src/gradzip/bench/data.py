"""``gradzip bench data``: cost of the data pipeline on its own, stage by stage.

Stages, each timed separately on a cold cache in a fresh directory:

1. **tokenizer**: training the byte-level BPE on the train split (characters/s);
2. **build**: ``prepare_data`` with that tokenizer on a cold cache — reading the sources,
   encoding, writing the train and validation shards atomically (tokens/s);
3. **open**: a second ``prepare_data`` on the finished cache (what every later run pays);
4. **loader**: ``BatchLoader`` alone — tokens/s of batch assembly with no prefetch
   (one thread gathering windows from the memory maps), and the time ``next()`` blocks
   per step with the prefetch thread while the consumer "computes" for ``--step-ms``.

The shards were just written, so the loader reads from the page cache: that is the usual
case (a training corpus that fits RAM), not a cold disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class DataBenchResult:
    sources: str
    vocab_size: int
    max_tokens: int | None
    corpus_chars_tokenizer: int
    tokenizer_seconds: float
    tokenizer_chars_per_s: float
    train_tokens: int
    val_tokens: int
    build_seconds: float
    build_tokens_per_s: float
    shard_mb: float
    chars_per_token: float
    cached_open_seconds: float
    batch_size: int
    seq_len: int
    loader_tokens_per_s: float
    prefetch_wait_ms_median: float
    prefetch_wait_ms_max: float
    step_ms: float


def measure(sources: list[str], vocab_size: int, max_tokens: int | None, batch_size: int,
            seq_len: int, steps: int, step_ms: float, cache_dir: Path) -> DataBenchResult:
    """Run every stage once in ``cache_dir`` (must be empty) and time it."""
    from gradzip.train.data import BatchLoader, DataConfig, prepare_data
    from gradzip.train.data.mixture import interleave
    from gradzip.train.data.prepare import Plan, train_tokenizer
    from gradzip.train.data.sources import split_of

    cfg = DataConfig(sources=sources, cache_dir=str(cache_dir), vocab_size=vocab_size,
                     max_tokens=max_tokens)
    plan = Plan(cfg)
    t0 = time.perf_counter()
    tok = train_tokenizer(plan)
    tok_s = time.perf_counter() - t0
    tok_file = tok.save(cache_dir / "bench-tokenizer")
    # the characters the trainer saw: the same stream again, counted (not timed)
    streams = [(d.text for d in s.docs() if split_of(d.key, cfg.val_fraction) == "train")
               for s in plan.sources]
    chars = sum(len(t) for t in interleave(streams, plan.weights, plan.train_chars()))

    # the real entry point with that tokenizer: reads, encodes and writes train + val shards
    full = DataConfig(sources=sources, cache_dir=str(cache_dir), tokenizer=str(tok_file),
                      max_tokens=max_tokens)
    t0 = time.perf_counter()
    data = prepare_data(full)
    build_s = time.perf_counter() - t0
    ntrain, nval = data.train.num_tokens, data.val.num_tokens
    sample = "".join(d.text for _, d in zip(range(200), plan.sources[0].docs(), strict=False))
    chars_per_token = len(sample) / max(1, len(tok.encode(sample)))
    t0 = time.perf_counter()
    data = prepare_data(full)  # what every later run pays: fingerprint, map the shards
    open_s = time.perf_counter() - t0

    with BatchLoader(data.train, batch_size, seq_len, seed=0, prefetch=0) as loader:
        next(loader)  # first touch of the maps and the epoch permutation
        t0 = time.perf_counter()
        for _ in range(steps):
            next(loader)
        loader_s = time.perf_counter() - t0
    waits = []
    with BatchLoader(data.train, batch_size, seq_len, seed=0, prefetch=2) as loader:
        next(loader)
        for _ in range(min(steps, 100)):
            time.sleep(step_ms / 1000)  # the training step the prefetch hides behind
            t0 = time.perf_counter()
            next(loader)
            waits.append((time.perf_counter() - t0) * 1000)
    return DataBenchResult(
        sources=",".join(sources), vocab_size=tok.vocab_size, max_tokens=max_tokens,
        corpus_chars_tokenizer=chars, tokenizer_seconds=tok_s,
        tokenizer_chars_per_s=chars / tok_s, train_tokens=ntrain, val_tokens=nval,
        build_seconds=build_s, build_tokens_per_s=(ntrain + nval) / build_s,
        shard_mb=(ntrain + nval) * data.train.dtype.itemsize / 1e6,
        chars_per_token=chars_per_token, cached_open_seconds=open_s, batch_size=batch_size,
        seq_len=seq_len, loader_tokens_per_s=steps * batch_size * seq_len / loader_s,
        prefetch_wait_ms_median=statistics.median(waits), prefetch_wait_ms_max=max(waits),
        step_ms=step_ms)


def markdown(r: DataBenchResult) -> str:
    """The result as a Markdown table (pasted into docs/benchmarks/data.md)."""
    rows = [
        ("tokenizer training", f"{r.tokenizer_seconds:.1f} s for {r.corpus_chars_tokenizer:,}"
         f" chars ({r.tokenizer_chars_per_s / 1e6:.2f} M chars/s), vocab {r.vocab_size}"),
        ("cache build (train+val)", f"{r.build_seconds:.1f} s for "
         f"{r.train_tokens + r.val_tokens:,} tokens ({r.build_tokens_per_s / 1e3:.0f} k tokens/s)"
         f", {r.shard_mb:.1f} MB of shards; {r.chars_per_token:.2f} chars/token"),
        ("open finished cache", f"{r.cached_open_seconds:.2f} s"),
        ("loader, no prefetch", f"{r.loader_tokens_per_s / 1e6:.1f} M tokens/s "
         f"(batch {r.batch_size} x {r.seq_len})"),
        ("loader, prefetch=2", f"next() waits median {r.prefetch_wait_ms_median:.3f} ms, "
         f"max {r.prefetch_wait_ms_max:.2f} ms with a {r.step_ms:.0f} ms step"),
    ]
    lines = ["| stage | cost |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "data", help="tokens/s of the tokenizer, the shard cache build and the batch loader",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--source", action="append", metavar="SPEC",
                   help="data source spec (repeatable; default: stdlib)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (default 4096)")
    p.add_argument("--max-tokens", type=int, default=2_000_000,
                   help="cap on train tokens built (default 2000000)")
    p.add_argument("--full", action="store_true", help="no cap: the whole corpus")
    p.add_argument("--batch-size", type=int, default=16, help="loader batch (default 16)")
    p.add_argument("--seq-len", type=int, default=512, help="loader sequence length")
    p.add_argument("--steps", type=int, default=300, help="loader batches timed")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="simulated training step while prefetching (default 20 ms)")
    p.add_argument("--cache-dir", help="build here and keep it (default: a temporary dir)")
    p.add_argument("--out", help="directory for data.json and data.md")
    p.add_argument("--json", action="store_true", help="also print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    sources = args.source or ["stdlib"]
    max_tokens = None if args.full else args.max_tokens
    if args.cache_dir:
        cache = Path(args.cache_dir)
        if cache.exists() and any(cache.iterdir()):
            raise ValueError(f"--cache-dir {cache} is not empty; the benchmark times a cold build")
        cache.mkdir(parents=True, exist_ok=True)
    else:
        cache = Path(tempfile.mkdtemp(prefix="gradzip-bench-data-"))
    try:
        result = measure(sources, args.vocab_size, max_tokens, args.batch_size, args.seq_len,
                         args.steps, args.step_ms, cache)
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)
    table = markdown(result)
    print(f"data pipeline: {result.sources}, max_tokens={max_tokens}, "
          f"{os.cpu_count()} cores\n{table}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from gradzip.train.data.atomic import atomic_write_bytes

        atomic_write_bytes(out / "data.json", json.dumps(asdict(result), indent=2).encode())
        atomic_write_bytes(out / "data.md", table.encode())
        print(f"wrote {out / 'data.json'} and {out / 'data.md'}")
    if args.json:
        print(json.dumps(asdict(result)))
    return 0
