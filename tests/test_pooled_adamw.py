"""The ``pooled`` rule of ``gradzip bench floor``: AdamW whose denominator is the
replicas' pooled factored second moment."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradzip.bench.pooled_adamw import PooledFactoredAdamW, factored, row_col_means

KW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _step_both(grads: list[torch.Tensor], **opts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One replica under the pooled rule (``opts``) and one under AdamW, the same
    gradients."""
    torch.manual_seed(0)
    start = torch.randn(5, 3)
    ours, theirs = start.clone(), start.clone()
    pooled = PooledFactoredAdamW([[ours]], weight_decays=[0.1], **KW, **opts)  # type: ignore[arg-type]
    adamw = torch.optim.AdamW([theirs], weight_decay=0.1, **KW)  # type: ignore[arg-type]
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        pooled.step()
        adamw.step()
    return ours, theirs


def test_one_replica_with_a_rank_one_second_moment_is_adamw() -> None:
    """Gradients a x b_t have g^2 = a^2 x b_t^2 at every step, so the factored second
    moment is the elementwise one: the step is AdamW's."""
    torch.manual_seed(1)
    a = torch.randn(5)
    ours, theirs = _step_both([torch.outer(a, torch.randn(3)) for _ in range(6)])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_full_rank_second_moment_is_not_adamws() -> None:
    torch.manual_seed(1)
    ours, theirs = _step_both([torch.randn(5, 3) for _ in range(6)])
    assert not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-5)


def test_a_vector_is_factored_back_to_itself() -> None:
    g = torch.tensor([1.0, -2.0, 3.0])
    torch.testing.assert_close(factored(*row_col_means(g)), g.square().reshape(3, 1))


def _replicas(every: int, floor_own: bool = False) -> tuple[list[torch.Tensor],
                                                             PooledFactoredAdamW]:
    copies = [torch.zeros(4, 2) for _ in range(2)]
    opt = PooledFactoredAdamW([[c] for c in copies], weight_decays=[0.0], every=every,
                              floor_own=floor_own, **KW)  # type: ignore[arg-type]
    return copies, opt


def test_a_replica_divides_by_the_rows_the_other_replica_saw() -> None:
    """Replica 1 sees row 0 large once (its token occurred); replica 0 sees only small
    dense gradients. Pooled, replica 0's step on row 0 is much shorter than AdamW's
    on its own gradient would be."""
    copies, opt = _replicas(every=1)
    small = torch.full((4, 2), 1e-3)
    big = small.clone()
    big[0] = 1.0
    copies[0].grad, copies[1].grad = small.clone(), big
    opt.step()
    assert float(copies[0][0].abs().max()) < 0.01 * KW["lr"]  # AdamW's would be lr
    assert float(copies[0][1].abs().max()) == pytest.approx(KW["lr"], rel=0.01)


def test_between_refreshes_the_last_pooled_estimate_is_used() -> None:
    copies, opt = _replicas(every=3)
    for step in range(1, 4):
        for c in copies:
            c.grad = torch.full((4, 2), 1.0 if step == 1 else 100.0)
        before = copies[0].clone()
        opt.step()
        moved = float((copies[0] - before).abs().max())
        if step == 2:  # divided by step 1's small pooled estimate: a long step
            assert moved > 5 * KW["lr"]
    assert moved < 2 * KW["lr"]  # step 3 refreshed it with the large gradients: bounded


def test_floor_own_keeps_a_stale_estimate_from_lengthening_a_step() -> None:
    copies, opt = _replicas(every=3, floor_own=True)
    for step in range(1, 3):
        for c in copies:
            c.grad = torch.full((4, 2), 1.0 if step == 1 else 100.0)
        before = copies[0].clone()
        opt.step()
    assert float((copies[0] - before).abs().max()) <= KW["lr"] * 1.01


def test_every_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="every must be at least 1"):
        PooledFactoredAdamW([[torch.zeros(2)]], weight_decays=[0.0], every=0,
                            **KW)  # type: ignore[arg-type]


def _alternating(world: int, noise_corrected: bool, steps: int = 4) -> torch.Tensor:
    """Replica copies after ``steps`` of gradients whose sign flips every step: noise."""
    copies = [torch.zeros(3, 2) for _ in range(world)]
    opt = PooledFactoredAdamW([[c] for c in copies], weight_decays=[0.0], stat="full",
                              noise_corrected=noise_corrected, **KW)  # type: ignore[arg-type]
    for step in range(steps):
        for c in copies:
            c.grad = torch.full((3, 2), (-1.0) ** step)
        opt.step()
    return copies[0]


def test_noise_correction_is_nothing_for_one_replica() -> None:
    torch.testing.assert_close(_alternating(1, True), _alternating(1, False))


def test_noise_correction_lengthens_the_step_on_noise_by_at_most_root_w() -> None:
    plain, corrected = _alternating(2, False), _alternating(2, True)
    ratio = float(corrected.abs().max() / plain.abs().max())
    assert 1.05 < ratio <= 2 ** 0.5 + 1e-6, ratio


def test_a_warmup_refreshes_each_early_step_then_waits_for_every() -> None:
    """With every = 30 and warmup = 3 the statistics are pooled at steps 1, 2 and 3 and
    next at step 30: the estimate changes exactly at those steps."""
    copies, opt = _replicas(every=30)
    opt.warmup = 3
    refreshed = []
    for step in range(1, 32):
        before = opt.pooled[0]
        for c in copies:
            c.grad = torch.full((4, 2), float(step))
        opt.step()
        if opt.pooled[0] is not before:
            refreshed.append(step)
    assert refreshed == [1, 2, 3, 30]


def test_carried_the_second_moment_grows_with_the_replicas_own_gradient_at_once() -> None:
    """Refreshed at step 1 from small gradients, then a hundredfold gradient: without
    carry the stale estimate lets the step grow far past lr; carried on with the
    replica's own squared gradient it stays AdamW's bounded step."""
    steps = {}
    for carry in (False, True):
        copies, opt = _replicas(every=30)
        opt.carry = carry
        for step in range(1, 3):
            for c in copies:
                c.grad = torch.full((4, 2), 1.0 if step == 1 else 100.0)
            before = copies[0].clone()
            opt.step()
        steps[carry] = float((copies[0] - before).abs().max())
    assert steps[False] > 5 * KW["lr"]
    assert steps[True] <= KW["lr"] * 1.01


@pytest.mark.parametrize("every", [3, 7])
def test_one_replica_carried_between_refreshes_is_adamw(every: int) -> None:
    """One replica's every-coordinate statistics, refreshed every few steps and carried
    on with its own g^2 between: AdamW's second moment and bias correction at every
    step. Without the carry the stale estimate is not AdamW."""
    torch.manual_seed(2)
    grads = [torch.randn(5, 3) * (1 + t) for t in range(12)]
    ours, theirs = _step_both(grads, stat="full", every=every, carry=True)
    torch.testing.assert_close(ours, theirs)
    stale, theirs = _step_both(grads, stat="full", every=every)
    assert not torch.allclose(stale, theirs, rtol=1e-4, atol=1e-6)
