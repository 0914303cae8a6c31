"""``auto`` on FSDP2 (the reduce-scatter) and on HSDP's replicate link, on gloo ranks: one
controller step per backward whatever the number of units, every rank choosing alike,
no error-feedback mass lost in a switch, each link's choice recorded."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradzip.comm.launch import run_ranks

pytestmark = pytest.mark.dist


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 31), nn.Tanh(),
                         nn.Linear(31, 1))  # odd sizes: FSDP pads the last shards


def _shard(base: nn.Module, mesh: Any = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    m = copy.deepcopy(base)
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def _fake_clock(handle: Any, cost_ms: dict[int, float]) -> None:
    """Each step of candidate i takes ``cost_ms[i]``."""
    state, now = handle.state, [0.0]

    def clock() -> float:
        now[0] += cost_ms[state.current] / 1e3
        return now[0]

    state.clock = clock


def _grads(model: nn.Module) -> list[torch.Tensor]:
    """The full (unsharded) gradient of every parameter."""
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def _exact(base: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The mean over the ranks of ``base``'s gradients on each rank's batch."""
    local = copy.deepcopy(base)
    (local(x) - x[:, :1]).pow(2).mean().backward()
    out = []
    for p in local.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out.append(g / dist.get_world_size())
    return out


def _run(rank: int, spec: str, cost_ms: dict[int, float], steps: int,
         hsdp: bool) -> dict[str, Any]:
    """``steps`` backward passes of fixed weights: the delivered gradients summed against
    the exact means summed (error feedback spreads a gradient over later steps)."""
    import gradzip

    base, mesh, group = _model(), None, None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        group = mesh.get_group("replicate")
    model = _shard(base, mesh["shard"] if mesh is not None else None)
    handle = gradzip.attach(model, spec, replicate_group=group)
    _fake_clock(handle, cost_ms)
    delivered = [torch.zeros_like(p) for p in base.parameters()]
    exact = [torch.zeros_like(p) for p in base.parameters()]
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        (model(x) - x[:, :1]).pow(2).mean().backward()
        for d, g in zip(delivered, _grads(model), strict=True):
            d.add_(g)
        for e, g in zip(exact, _exact(base, x), strict=True):
            e.add_(g)
        model.zero_grad()
        handle.stats.end_step()
    err = max(float((d - e).abs().max()) for d, e in zip(delivered, exact, strict=True))
    scale = max(float(e.abs().max()) for e in exact)
    links = set(handle.stats.totals()["links"])
    return {"report": handle.report(), "err": err, "scale": scale, "links": links,
            "kind": handle.kind}


def _fsdp2(rank: int) -> dict[str, Any]:
    return {"choose": _run(rank, "auto(trial_steps=3, every=50, window=5)",
                           {0: 10.0, 1: 5.0}, 12, hsdp=False),
            "switch": _run(rank, 'auto(candidates="ef | topk(ratio=0.1); fp16", '
                                 'trial_steps=3, every=50)', {0: 10.0, 1: 5.0}, 14,
                           hsdp=False)}


def _hsdp(rank: int) -> dict[str, Any]:
    return _run(rank, "auto(trial_steps=3, every=50, window=5)", {0: 10.0, 1: 5.0}, 12,
                hsdp=True)


def test_fsdp2_auto_steps_once_per_backward_and_chooses_alike() -> None:
    ranks = run_ranks(_fsdp2, 2, timeout=300)
    for out in ranks:
        report = out["choose"]["report"]
        assert out["choose"]["kind"] == "fsdp2"
        assert report["links"] == {"all": "int8"}
        # warm-up 3 steps, then 3 steps of each candidate: decided as the 9th begins,
        # which only holds if the 4 units' reductions count as one step
        [decision] = report["decisions"]
        assert decision["from_step"] == 9 and decision["method"] == "int8"
        assert report["decisions"] == ranks[0]["choose"]["report"]["decisions"]
        assert out["choose"]["err"] < 0.05 * out["choose"]["scale"]


def test_fsdp2_auto_switch_loses_no_error_feedback_mass() -> None:
    """Leaving ``ef | topk`` for ``fp16``: each destination chunk's residual joins that
    unit's next gradient, so the delivered gradients sum to the exact means."""
    for out in run_ranks(_fsdp2, 2, timeout=300):
        switch = out["switch"]
        assert switch["report"]["current"] == "fp16"
        assert switch["err"] < 1e-2 * switch["scale"], switch


def test_hsdp_auto_chooses_for_the_replicate_link_only() -> None:
    ranks = run_ranks(_hsdp, 4, timeout=300)
    for out in ranks:
        assert out["report"]["links"] == {"shard": "none", "replicate": "int8"}
        assert out["report"]["decisions"] == ranks[0]["report"]["decisions"]
        assert out["links"] == {"shard", "replicate"}
        assert out["err"] < 0.05 * out["scale"]
