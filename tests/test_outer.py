"""DiLoCo (``gradzip.comm.outer``) on 2 gloo ranks: the averaging control equals
synchronous SGD, state survives a checkpoint exactly, bytes are counted, bad options fail."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradzip.comm.launch import run_ranks
from gradzip.comm.outer import DiLoCo, check_options

pytestmark = pytest.mark.dist


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _inner(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = _batch(step, rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _average_h1_vs_ddp(rank: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = copy.deepcopy(_model())
    outer = DiLoCo(local, sync_every=1, outer="average")
    opt = torch.optim.SGD(local.parameters(), lr=0.05)
    ddp = DDP(copy.deepcopy(_model()))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(6):
        _inner(local, opt, step, rank)
        assert outer.step()
        _inner(ddp, ddp_opt, step, rank)
    return max(float((a - b).abs().max())
               for a, b in zip(local.parameters(), ddp.parameters(), strict=True))


def test_averaging_every_step_is_synchronous_sgd() -> None:
    assert all(diff < 1e-6 for diff in run_ranks(_average_h1_vs_ddp, 2))


def _train(rank: int, steps: range, model: nn.Module, outer: DiLoCo,
           opt: torch.optim.Optimizer) -> None:
    for step in steps:
        _inner(model, opt, step, rank)
        outer.step()
        outer.stats.end_step()  # as the trainer does every step (the hooks' contract)


def _resume_is_exact(rank: int, spec: str) -> tuple[bool, int, int, int]:
    whole = copy.deepcopy(_model())
    w_outer = DiLoCo(whole, sync_every=3, codec=spec)
    w_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    _train(rank, range(10), whole, w_outer, w_opt)

    first = copy.deepcopy(_model())
    f_outer = DiLoCo(first, sync_every=3, codec=spec)
    f_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(rank, range(4), first, f_outer, f_opt)  # stop between sync boundaries
    saved = (copy.deepcopy(f_outer.state_dict()), copy.deepcopy(f_opt.state_dict()))

    second = copy.deepcopy(_model())  # a fresh process would start from the same init
    s_outer = DiLoCo(second, sync_every=3, codec=spec)
    s_opt = torch.optim.AdamW(second.parameters(), lr=1e-2)
    s_outer.load_state_dict(saved[0])
    s_opt.load_state_dict(saved[1])
    _train(rank, range(4, 10), second, s_outer, s_opt)
    same = all(torch.equal(a, b) for a, b in zip(whole.parameters(), second.parameters(),
                                                 strict=True))
    totals = w_outer.stats.totals()
    return same, s_outer.syncs, totals["bytes_wire"], totals["bytes_raw"]


@pytest.mark.parametrize("spec", [None, "ef | topk(ratio=0.25)"])
def test_resume_across_a_sync_boundary_is_bit_exact(spec: str | None) -> None:
    for same, syncs, wire, raw in run_ranks(_resume_is_exact, 2, spec):
        assert same and syncs == 3  # steps 3, 6 and 9
        n = sum(p.numel() for p in _model().parameters())
        assert raw >= 3 * 4 * n  # three fp32 all-reduces of the pseudo-gradient (+ transport)
        assert (wire == raw) if spec is None else (wire < raw)


@pytest.mark.parametrize("args, message", [
    ((0, 0.7, 0.9, "diloco"), "sync_every"),
    ((8, 0.0, 0.9, "diloco"), "outer lr"),
    ((8, 0.7, 1.0, "diloco"), "momentum"),
    ((8, 0.7, 0.9, "streaming"), "outer must be one of"),
])
def test_bad_options_are_clear_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_options(*args)
