"""Reductions: a codec's payloads from every rank become the mean (or FSDP's shard).

Above the codecs and below the hooks: ``reduce`` and ``reduce_scatter`` take a codec, a
tensor and a ``Communicator`` (``gradzip.collectives``) and run one of the strategies in
``strategies.py`` (all-reduce, gather, two-phase, multi-round, reduce-scatter), chosen
by ``path_for`` (``choose.py``). The same code runs on a real process group
(``gradzip.comm``) and on the simulated one.
"""

from gradzip.aggregation.choose import choose, modeled_bytes, path_for
from gradzip.aggregation.reduce import reduce, reduce_scatter
from gradzip.aggregation.strategies import (
    STRATEGIES,
    AllReduce,
    Gather,
    MeanStrategy,
    MultiRound,
    ReduceScatter,
    TwoPhase,
)

__all__ = [
    "STRATEGIES", "AllReduce", "Gather", "MeanStrategy", "MultiRound", "ReduceScatter",
    "TwoPhase", "choose", "modeled_bytes", "path_for", "reduce", "reduce_scatter",
]
