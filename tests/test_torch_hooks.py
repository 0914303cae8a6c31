"""PyTorch's own DDP hooks as methods (``torch:...``), measured like gradzip's codecs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.comm.launch import run_ranks
from gradzip.comm.torch_hooks import attach_torch, describe, parse_torch_method


def test_names_parse_and_bad_ones_say_what_exists() -> None:
    assert parse_torch_method("torch:fp16") == ("fp16", {})
    assert parse_torch_method("torch:powersgd(rank=4)") == (
        "powersgd", {"rank": 4, "start_iter": 2})
    assert describe("torch:powersgd(rank=2, start_iter=5)") == {
        "torch_hook": "powerSGD_hook", "rank": 2, "start_iter": 5}
    for bad in ("torch:qsgd", "torch:powersgd(rank=x)", "torch:powersgd(rank=0)",
                "torch:powersgd(start_iter=1)"):
        with pytest.raises(ValueError, match="torch:"):
            parse_torch_method(bad)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def _pair(rank: int, method: str, theirs_hook, state) -> dict:  # noqa: ANN001
    """The same model under PyTorch's hook directly and through ``attach_torch``."""
    base = _model()
    theirs = DDP(copy.deepcopy(base), bucket_cap_mb=1)
    theirs.register_comm_hook(state, theirs_hook)
    ours = DDP(copy.deepcopy(base), bucket_cap_mb=1)
    handle = attach_torch(ours, method)
    equal = True
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 1, generator=g)
        for m in (theirs, ours):
            m.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        handle.stats.end_step()
        equal &= all(torch.equal(a.grad, b.grad)
                     for a, b in zip(theirs.parameters(), ours.parameters(), strict=True))
    totals = handle.stats.totals()
    handle.close()
    return {"equal": equal, "totals": totals,
            "params": sum(p.numel() for p in base.parameters())}


def _hooks(rank: int) -> dict:
    out = {"none": _pair(rank, "torch:none", default_hooks.allreduce_hook, None),
           "fp16": _pair(rank, "torch:fp16", default_hooks.fp16_compress_hook, None)}
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                        start_powerSGD_iter=2, use_error_feedback=True,
                                        warm_start=True)
    out["powersgd"] = _pair(rank, "torch:powersgd(rank=2)", powerSGD_hook.powerSGD_hook, state)
    for method, cap in (("torch:bf16", 1), ("torch:powersgd(rank=2)", 0.001)):
        try:
            attach_torch(DDP(_model(), bucket_cap_mb=cap), method)
        except ValueError as e:
            out[method] = str(e)
    # powerSGD_hook's callbacks hold the group: without a collective after the last step
    # gloo's thread may drop the last reference and abort the exit ("Resource deadlock")
    torch.distributed.barrier()
    return out


@pytest.mark.dist
def test_pytorch_hooks_run_unchanged_and_are_measured_like_codecs() -> None:
    r0, r1 = run_ranks(_hooks, 2, timeout=180.0)
    for name in ("none", "fp16", "powersgd"):
        assert r0[name]["equal"] and r1[name]["equal"], name  # the wrapper changes nothing
        assert r0[name]["totals"]["comm_ms"] > 0
    none, fp16, psgd = (r0[k]["totals"] for k in ("none", "fp16", "powersgd"))
    # 2 ranks: a ring all-reduce puts its input on the link once, plus gloo's per call
    n = 4 * r0["none"]["params"] * 6
    assert n < none["bytes_wire"] < 1.05 * n and none["bytes_raw"] == none["bytes_wire"]
    assert 1.9 < fp16["compression_ratio"] <= 2.0  # gloo's per-call bytes on a tiny model
    assert psgd["compression_ratio"] > 2.0  # 2 plain steps, then rank-2 factors
    assert psgd["aggregation"] == {"plain": 2, "torch": 4}
    assert "needs NCCL" in r0["torch:bf16"]
    assert "several DDP buckets" in r0["torch:powersgd(rank=2)"]
