"""``gradzip bench ...``: the measurement commands, one module each under gradzip.bench."""

from __future__ import annotations

import importlib
from typing import Any

BENCH_MODULES = [
    "gradzip.bench.aggregate",  # gradzip bench aggregate
    "gradzip.bench.capture",  # gradzip bench capture
    "gradzip.bench.codecs",  # gradzip bench codecs
    "gradzip.bench.comm",  # gradzip bench comm
    "gradzip.bench.data",  # gradzip bench data
    "gradzip.bench.entropy",  # gradzip bench entropy
    "gradzip.bench.floor",  # gradzip bench floor
    "gradzip.bench.gpu",  # gradzip bench gpu
    "gradzip.bench.linkbytes",  # gradzip bench link
    "gradzip.bench.page",  # gradzip bench page NAME [--run]
    "gradzip.bench.train",  # gradzip bench train
]


HELP = "measure codecs, entropy coders, communication and training"  # shown by `gradzip --help`


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help=HELP)
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bsub)
