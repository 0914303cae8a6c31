"""Every rank takes the same path and gets the same answer, on real gloo ranks at W=3, 5.

What one rank decides from its own data (a payload size, a NaN) must be agreed before
it changes which collectives run: gloo aborts on a mismatch ("collective mismatch"),
NCCL hangs or corrupts. The data here differs by rank on purpose: rank 0's nonzeros sit
in the first third of the tensor, the other ranks' are spread out, so data-dependent
payload sizes differ between ranks (before the fix, ``aggregate=auto`` picked
``['gather', 'two_phase', 'two_phase']`` for these at W=3 and gloo aborted).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.aggregation import path_for, reduce, reduce_scatter
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.launch import run_ranks

pytestmark = pytest.mark.dist

N = 30_000
SHAPES = [torch.Size((100, 150)), torch.Size((15_000,))]

#: one spec per aggregation path, several with payload sizes that depend on the data
REDUCE_SPECS = [
    "fp16 | aggregate=two_phase", "ef | fp16",                      # all_reduce, summable
    "threshold(v=0.5)", "none | zstd", "int8 | ans", "ef | topk(ratio=0.05) | eg",  # auto
    "qsgd | aggregate=gather", "ef | qsgd | aggregate=two_phase",  # forced paths
    "ef | powersgd(rank=2)", "signsgd", "terngrad", "sketch", "int8(shared=narrow)",  # rounds
    "ef | sharedtopk(k=16, chunk=1024)",
]
#: FSDP's reduce-scatter: summable, exchanged, multi-round
SCATTER_SPECS = ["fp16", "ef | fp16", "ef | qsgd", "threshold(v=0.5) | zstd",
                 "ef | powersgd(rank=2)"]


def _data(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(N, generator=g)
    if rank == 0:
        x[N // 3:] = 0.0  # nonzeros in the first third only
    else:
        x[torch.rand(N, generator=g) < 0.6] = 0.0  # sparser, spread out
    return x


def _reduce_everything(rank: int, nan_rank: int) -> dict:
    comm = TorchCommunicator()
    world = comm.world_size
    out: dict = {}
    for spec in REDUCE_SPECS:
        codec = gradzip.codec(spec, rank=rank, seed=7)
        paths: list[str] = []
        codec.observer = None
        means = []
        for step in range(2):
            mean, _ = reduce(codec, _data(rank, step), "w", comm, shapes=SHAPES)
            means.append(mean)
            paths.append(path_for(codec, _data(rank, step), world, SHAPES,
                                           comm.counter.backend))
        bad = _data(rank, 2)
        if rank == nan_rank:
            bad[5] = float("nan")
        try:
            reduce(codec, bad, "w", comm, shapes=SHAPES)
            error = None
        except gradzip.NonFiniteGradientError as e:
            error = str(e)
        # the next, finite step goes on on every rank: no NaN stayed in any rank's state
        after, _ = reduce(codec, _data(rank, 3), "w", comm, shapes=SHAPES)
        out[spec] = {"means": means, "paths": paths, "error": error, "after": after}
    for spec in SCATTER_SPECS:
        codec = gradzip.codec(spec, rank=rank, seed=7)
        chunks = _data(rank, 0).reshape(world, -1) if N % world == 0 else \
            _data(rank, 0)[: N - N % world].reshape(world, -1)
        shard = reduce_scatter(codec, chunks, "fsdp", comm)
        bad = chunks.clone()
        if rank == nan_rank:
            bad[world - 1, 0] = float("inf")
        try:
            reduce_scatter(codec, bad, "fsdp", comm)
            error = None
        except gradzip.NonFiniteGradientError as e:
            error = str(e)
        after = reduce_scatter(codec, chunks, "fsdp", comm)  # and the next step goes on
        out["scatter " + spec] = {"shard": shard, "error": error, "after": after}
    return out


@pytest.mark.parametrize("world", [3, 5])
def test_every_path_agrees_across_ranks_and_every_rank_sees_a_nan(world: int) -> None:
    results = run_ranks(_reduce_everything, world, 1, timeout=400.0)
    for spec in REDUCE_SPECS:
        first = results[0][spec]
        assert first["error"] and "at least one rank" in first["error"], spec
        for r in results[1:]:
            mine = r[spec]
            assert mine["paths"] == first["paths"], spec
            for a, b in zip(mine["means"], first["means"], strict=True):
                assert torch.equal(a, b), f"{spec}: ranks disagree on the mean"
            assert mine["error"] == first["error"], spec  # the same words everywhere
            assert torch.equal(mine["after"], first["after"]), spec
        assert first["after"].isfinite().all(), spec
    for spec in SCATTER_SPECS:
        errors = {r["scatter " + spec]["error"] for r in results}
        assert len(errors) == 1 and None not in errors, (spec, errors)
        shards = torch.stack([r["scatter " + spec]["shard"] for r in results])
        assert shards.isfinite().all()
        after = torch.stack([r["scatter " + spec]["after"] for r in results])
        assert after.isfinite().all(), spec  # no rank kept a NaN residual


# ---------------------------------------------------------------- DDP: one rank's NaN
def _ddp_nan(rank: int, spec: str) -> dict:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)),
                bucket_cap_mb=0.002)
    handle = gradzip.attach(model, spec)
    errors = []
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(8, 16, generator=g)
        if step == 2 and rank == 1:
            x[0, 0] = float("nan")
        model.zero_grad()
        try:
            model(x).pow(2).mean().backward()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the hook's error, through DDP
            errors.append("non-finite" in str(e) and "at least one rank" in str(e))
    handle.close()
    return {"errors": errors, "chained": handle.chained}


@pytest.mark.parametrize("spec", ["none", "fp16", "randomk(ratio=0.5)", "ef | qsgd", "int8 | ans"])
def test_a_nan_on_one_ddp_rank_stops_every_rank(spec: str) -> None:
    """Under nonfinite='error' every rank's backward fails at the step that held the NaN
    (none waits in a collective the NaN rank skipped), then training goes on."""
    results = run_ranks(_ddp_nan, 3, spec, timeout=240.0)
    for r in results:
        assert r["errors"] == [None, None, True, None], (spec, r)
    assert results[0]["chained"] == (spec in ("none", "fp16", "randomk(ratio=0.5)"))


@pytest.mark.parametrize("spec", ["ef | fp16", "ef | topk(ratio=0.1)", "powersgd(rank=2)",
                                  "efsignsgd"])
def test_propagate_on_one_rank_returns_nan_and_keeps_the_state_clean(spec: str) -> None:
    """World size 1 (one GPU with AMP): a NaN step comes back all NaN (so a GradScaler
    skips it) and the next, finite step is finite: no NaN entered the codec's state."""
    from gradzip.collectives import run_simulated

    def work(rank: int, comm: object) -> list[bool]:
        codec = gradzip.codec(spec, nonfinite="propagate")
        finite = []
        for step in range(3):
            x = _data(1, step)
            if step == 1:
                x[7] = float("nan")
            mean, _ = reduce(codec, x, "w", comm, shapes=SHAPES)  # type: ignore[arg-type]
            finite.append(bool(mean.isfinite().all()))
            if step == 1:
                assert mean.isnan().all()
        return finite

    assert run_simulated(1, work) == [[True, False, True]]
