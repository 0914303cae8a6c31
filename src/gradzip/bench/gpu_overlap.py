"""``gradzip bench gpu``: Streaming DiLoCo's overlapped exchanges against the allocator.

The exchange thread allocates each fragment's mean on gradzip's stream; the outer step
reads it on the main stream. Were the block not kept for the main stream
(``SideStreams.adopt``), the caching allocator could give it to the next exchange while
the outer step still read it, and one rank's anchor would drift silently. The race is
widened on purpose: two fragments whose exchanges overlap each other
(``overlap_steps`` > ``sync_every / fragments``), a ``torch.cuda._sleep`` on gradzip's
stream before every exchange and one on the main stream after every inner step. The
reference is the same run without the caching allocator
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every block is fresh, no reuse can corrupt
anything): the anchors must equal it bit for bit, on both ranks (2 processes on the
one GPU, ``strict.StrictCollectives``). A third run without ``adopt`` is reported
beside them, not judged: the race it opens need not strike in one run. On the CPU
(``--smoke``) there are no streams; the runs must still agree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: device cycles each sleep spins (about 1-2 ms on an H100-class GPU)
SLEEP_CYCLES = 2_000_000
STEPS = 12


def overlap_rank(rank: int, kind: str, adopt: bool = True) -> torch.Tensor:
    """One rank's anchors after ``STEPS`` inner steps of the widened race."""
    from gradzip.bench.gpu_ranks import Blocks, batch, flat, rank_device
    from gradzip.bench.strict import StrictCollectives
    from gradzip.comm.outer import DiLoCo
    from gradzip.comm.reducer import Reducer
    from gradzip.comm.streams import SideStreams

    device = rank_device(kind)
    sleep = device.type == "cuda"
    reduce_mean = Reducer.reduce_mean

    def slow_reduce_mean(self: Reducer, *args: Any, **kwargs: Any) -> torch.Tensor:
        if sleep:  # on the exchange thread: gradzip's stream is current
            torch.cuda._sleep(SLEEP_CYCLES)
        return reduce_mean(self, *args, **kwargs)

    Reducer.reduce_mean = slow_reduce_mean  # type: ignore[method-assign]
    if not adopt:
        SideStreams.adopt = staticmethod(lambda tensor: tensor)  # type: ignore[method-assign]
    with StrictCollectives(device):
        model = Blocks().to(device)
        outer = DiLoCo(model, codec="ef | int8", sync_every=4, fragments=2, overlap_steps=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            for step in range(STEPS):
                opt.zero_grad()
                model(batch(step, rank, device)).pow(2).mean().backward()
                opt.step()
                if sleep:
                    torch.cuda._sleep(SLEEP_CYCLES)
                outer.step()
        finally:
            outer.close()
    return flat(outer.anchor)


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """``name=value`` in the environment the next spawned ranks inherit."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def overlap_rows(kind: str, timeout: float = 300.0) -> list[dict[str, Any]]:
    """The race with the caching allocator, without it (the reference), and without
    ``adopt`` (reported only)."""
    from gradzip.comm.launch import run_ranks

    try:
        cached = run_ranks(overlap_rank, 2, kind, timeout=timeout)
        with _env("PYTORCH_NO_CUDA_MEMORY_CACHING", "1"):
            reference = run_ranks(overlap_rank, 2, kind, timeout=timeout)
        unadopted = run_ranks(overlap_rank, 2, kind, False, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a failed launch is a failed row
        return [{"run": "launch", "ok": False, "detail": f"{type(e).__name__}: {e}"[:300]}]
    rows = []
    for name, runs, judged in (("caching allocator, adopt", cached, True),
                               ("caching allocator, no adopt (not judged)", unadopted, False)):
        same = all(torch.equal(a, b) for a, b in zip(runs, reference, strict=True))
        agree = torch.equal(runs[0], runs[1])
        finite = all(bool(torch.isfinite(r).all()) for r in runs)
        rows.append({"run": name, "ok": (same and agree and finite) if judged else True,
                     "equal_to_uncached": same, "ranks_agree": agree, "finite": finite})
    return rows
