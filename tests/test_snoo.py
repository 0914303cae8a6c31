"""SNOO's outer step (``gradzip.train.snoo``): a Nesterov step on the K-step change."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradzip.train.snoo import NesterovOuterStep


def _fit(model: nn.Module, opt: torch.optim.Optimizer, outer: NesterovOuterStep,
         steps: range) -> list[bool]:
    ran = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        ran.append(outer.step())
    return ran


def test_every_k_steps_the_anchor_takes_a_nesterov_step_on_the_change() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = NesterovOuterStep(model, sync_every=3, lr=0.5, momentum=0.9)
    ran = _fit(model, opt, outer, range(2))
    inner = [p.detach().clone() for p in model.parameters()]
    ran += _fit(model, opt, outer, range(2, 3))
    assert ran == [False, False, True]
    # one more inner step from `inner`, then: delta = start - w; the first Nesterov step
    # with buffer b = delta moves start by lr * (delta + 0.9 * delta)
    reference = copy.deepcopy(nn.Linear(4, 1))
    with torch.no_grad():
        for r, w in zip(reference.parameters(), inner, strict=True):
            r.copy_(w)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _fit(reference, ref_opt, NesterovOuterStep(reference, sync_every=99, lr=1, momentum=0),
         range(2, 3))
    for p, s, w in zip(model.parameters(), start, reference.parameters(), strict=True):
        delta = s - w.detach()
        assert torch.allclose(p, s - 0.5 * 1.9 * delta, atol=1e-6)
    assert outer.outer_steps == 1


def test_state_restores_the_run_exactly() -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, NesterovOuterStep]:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), NesterovOuterStep(
            model, sync_every=2, lr=0.7, momentum=0.9)

    whole = build()
    _fit(*whole, range(9))
    first = build()
    _fit(*first, range(5))
    second = build()
    second[0].load_state_dict(first[0].state_dict())
    second[1].load_state_dict(first[1].state_dict())
    second[2].load_state_dict(copy.deepcopy(first[2].state_dict()))
    _fit(*second, range(5, 9))
    assert all(torch.equal(a, b) for a, b in zip(whole[0].parameters(),
                                                 second[0].parameters(), strict=True))
    with pytest.raises(ValueError, match="not SNOO's"):
        second[2].load_state_dict({"kind": "diloco"})
