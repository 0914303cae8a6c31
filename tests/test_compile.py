"""torch.compile and gradzip: compiled models keep their comm hooks eager and exact;
compiled autograd's per-parameter hook calls are refused at attach, by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.comm.launch import run_ranks

pytestmark = pytest.mark.dist


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 1))


def _compiled_vs_eager(rank: int, spec: str) -> dict:
    """The same DDP model trained eagerly and compiled (aot_eager: dynamo's DDP graph
    split and AOT autograd, without the C++ compile CI cannot afford), same codec."""
    torch._dynamo.reset()
    base = _model()
    runs = {}
    for name in ("eager", "compiled"):
        model = DDP(copy.deepcopy(base))
        handle = gradzip.attach(model, spec)
        step_model = torch.compile(model, backend="aot_eager") if name == "compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 16, generator=g)
            opt.zero_grad()
            step_model(x).pow(2).mean().backward()
            opt.step()
            handle.stats.end_step()
        runs[name] = [p.detach().clone() for p in model.parameters()]
        runs[name + "_reductions"] = sum(handle.stats.totals()["aggregation"].values())
        handle.close()
    return runs


@pytest.mark.parametrize("spec", ["fp16", "ef | int8"])
def test_compiled_ddp_matches_eager_bit_for_bit(spec: str) -> None:
    for r in run_ranks(_compiled_vs_eager, 2, spec, timeout=300.0):
        assert r["compiled_reductions"] == r["eager_reductions"] > 0
        for a, b in zip(r["eager"], r["compiled"], strict=True):
            assert torch.equal(a, b), spec


def _python_reducer(rank: int) -> str:
    torch._dynamo.config.optimize_ddp = "python_reducer"
    model = DDP(_model())
    try:
        gradzip.attach(model, "fp16")
    except ValueError as e:
        return str(e)
    return "attached"


def test_compiled_autograd_python_reducer_is_refused_at_attach() -> None:
    """Compiled autograd with DDP's Python reducer calls a comm hook once per parameter
    with ``(grad, param)`` inside the compiled graph; gradzip's hooks reduce buckets with
    host work, so attach says so instead of failing in backward with an AttributeError."""
    for message in run_ranks(_python_reducer, 2):
        assert "python_reducer" in message and "optimize_ddp" in message
