"""``bench/strict.py``: NCCL's rules enforced on gloo (the several-ranks GPU cell's shim)."""

from __future__ import annotations

import pytest
import torch

from gradzip.comm.launch import run_ranks

pytestmark = pytest.mark.dist


def _cases(rank: int) -> dict[str, str]:
    import torch.distributed as dist

    from gradzip.bench.strict import StrictCollectives

    out = {}
    with StrictCollectives(torch.device("cpu")) as strict:
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
        out["sum"] = str(t.tolist())
        work = dist.all_reduce(torch.ones(2), async_op=True)
        work.wait()
        dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, None, True).wait()  # positional
        try:  # the length differs between ranks: refused on every rank, nothing hangs
            dist.all_gather([torch.zeros(2 + rank) for _ in range(2)], torch.zeros(2 + rank))
            out["unequal"] = "ran"
        except RuntimeError as e:
            out["unequal"] = type(e).__name__
        out["calls"] = str(strict.calls)
    with StrictCollectives(torch.device("cuda", 0)):
        try:  # a host tensor on ranks that run on a GPU: refused before any exchange
            dist.all_reduce(torch.ones(2))
            out["host"] = "ran"
        except RuntimeError as e:
            out["host"] = str(e)
    out["restored"] = dist.all_reduce.__module__  # torch's own again, not the shim's
    return out


def test_the_shim_checks_devices_and_shapes_and_runs_the_rest() -> None:
    for out in run_ranks(_cases, 2):
        assert out["sum"] == "[1.0, 1.0, 1.0]"
        assert out["unequal"] == "StrictViolation"
        assert out["calls"] == "{'all_reduce': 3}"
        assert "NCCL refuses" in out["host"] and "cpu" in out["host"]
        assert out["restored"].startswith("torch.distributed")
