"""Compile a codec's kernels before anything is timed.

The entropy coders are numba kernels, compiled on first call (and cached on disk next to
their source: ``cache=True``). A cold first call costs 10-30 s on a small CPU, which
used to land inside a run's first steps (its tokens/s, its encode_ms, its time to
target). ``warm(specs)`` runs every spec's whole reduction (encode, the aggregation
protocol, decode) on two simulated ranks, on small tensors of each dtype, with codecs of
its own: the caller's codec state is never touched. ``warm_all()`` does it for every
registered stage and every lossless stage after every compressor, which ``make venv``
runs once (``gradzip codecs warm``), so that a fresh install's first run is fast.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from gradzip.aggregation.reduce import reduce
from gradzip.codecs.chain import Codec

if TYPE_CHECKING:
    from gradzip.collectives.communicator import Communicator

#: sizes of the warm-up tensors: small, and one past the coders' chunking thresholds
WARM_SIZES = (4096, 1 << 18)
#: the dtypes gradients arrive in
WARM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def warm(codecs: Iterable[str | Codec],
         dtypes: Iterable[torch.dtype] = (torch.float32,)) -> float:
    """Run each codec's reduction on 2 simulated ranks for each dtype and size; returns
    the seconds it took (mostly compilation when the kernels were not cached yet).

    ``codecs`` are specs or parsed codecs; a parsed one is copied (``Codec.fresh``), so
    neither its state nor a second parse of its spec is involved.
    """
    from gradzip.collectives.simulated import run_simulated

    start = time.perf_counter()
    dtypes = tuple(dtypes)
    for codec in _distinct(codecs):
        if codec.summable and all(s.name == "none" for s in codec.stages):
            continue  # nothing to compile
        for dtype in dtypes:
            for n in WARM_SIZES:
                xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)).to(dtype)
                      for r in range(2)]

                def work(rank: int, comm: Communicator, proto: Codec = codec,
                         xs: list[torch.Tensor] = xs) -> None:
                    mine = proto.fresh(seed=0, rank=rank)
                    reduce(mine, xs[rank].clone(), "warm", comm, shapes=[xs[rank].shape])

                run_simulated(2, work)
    return time.perf_counter() - start


def _distinct(codecs: Iterable[str | Codec]) -> list[Codec]:
    """One codec per distinct chain (specs parsed here, once each)."""
    built: dict[str, Codec] = {}
    for c in codecs:
        codec = c if isinstance(c, Codec) else Codec.from_spec(c)
        built.setdefault(str(codec), codec)
    return list(built.values())


def every_chain() -> list[str]:
    """Every compressor alone and followed by every lossless stage, and every lossless
    stage alone: every kernel signature a run can call."""
    import gradzip
    from gradzip.codecs import Compressor, LosslessCoder, SpecError, registered

    stages = registered()
    compressors = sorted(n for n, c in stages.items() if issubclass(c, Compressor))
    coders = sorted(n for n, c in stages.items() if issubclass(c, LosslessCoder))
    chains = [*compressors, *coders]
    chains += [f"{c} | {coder}" for c in compressors for coder in coders]
    usable = []
    for spec in chains:
        try:
            gradzip.codec(spec)
        except SpecError:  # a combination the grammar refuses
            continue
        usable.append(spec)
    return usable


def warm_all() -> tuple[int, float]:
    """Compile every chain's kernels for every gradient dtype: (chains, seconds)."""
    chains = every_chain()
    return len(chains), warm(chains, WARM_DTYPES)
