"""``--optimizer adamw_global``: AdamW sized for the mean of W replicas' steps."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gradzip.train.global_adamw import GlobalAdamW, kept_noise_fraction, mean_second_moment

BETAS = (0.9, 0.95)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=gen)),
            torch.nn.Parameter(torch.randn(5, generator=gen))]


def _step_alike(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, steps: int,
                grad: Callable[[torch.Tensor], torch.Tensor], atol: float = 0.0) -> None:
    """Step both optimizers ``steps`` times on the same gradients (``grad`` of each of
    ours' parameters); their parameters must stay equal (to ``atol``; 0: bit for bit)."""
    mine = [p for g in ours.param_groups for p in g["params"]]
    twins = [p for g in theirs.param_groups for p in g["params"]]
    for _ in range(steps):
        for p, q in zip(mine, twins, strict=True):
            p.grad = grad(p)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(mine, twins, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def test_one_replica_is_adamw() -> None:
    """At W = 1 the step is torch's AdamW's bit for bit, weight decay per group and
    epsilon included (the vector's gradients are small enough that epsilon counts)."""
    ours, theirs = _params(), _params()
    groups = [{"params": [ours[0]], "weight_decay": 0.1}, {"params": [ours[1]],
                                                            "weight_decay": 0.0}]
    a = GlobalAdamW(groups, lr=1e-2, betas=BETAS, replicas=1)
    b = torch.optim.AdamW([{"params": [theirs[0]], "weight_decay": 0.1},
                           {"params": [theirs[1]], "weight_decay": 0.0}],
                          lr=1e-2, betas=BETAS, foreach=False)
    gen = torch.Generator().manual_seed(1)
    _step_alike(a, b, 40, lambda p: (torch.randn(p.shape, generator=gen) + 0.3)
                * (1.0 if p.dim() > 1 else 1e-8))


def test_a_noiseless_gradient_gets_adamws_step_at_any_w() -> None:
    """All signal: the estimated noise is 0, so the mean's second moment is Adam's own."""
    ours, theirs = _params(), _params()
    a = GlobalAdamW(ours, lr=1e-2, betas=BETAS, weight_decay=0.0, replicas=8)
    b = torch.optim.AdamW(theirs, lr=1e-2, betas=BETAS, weight_decay=0.0, foreach=False)
    _step_alike(a, b, 20, lambda p: torch.linspace(-1, 1, p.numel()).reshape(p.shape),
                atol=1e-6)


def test_the_second_moment_lies_between_v_over_w_and_v() -> None:
    gen = torch.Generator().manual_seed(2)
    m, v = torch.randn(1000, generator=gen), torch.rand(1000, generator=gen) * 3
    for w in (2, 8, 64):
        second = mean_second_moment(m, v, w, kept_noise_fraction(0.9, 100))
        assert bool((second >= v / w * (1 - 1e-5)).all())
        assert bool((second <= v * (1 + 1e-5)).all())
    assert kept_noise_fraction(0.9, 1) == 1.0  # the first step: Adam's own (no noise known)
    assert kept_noise_fraction(0.9, 2) == pytest.approx(0.501385, abs=1e-6)
    assert kept_noise_fraction(0.9, 10_000) == pytest.approx(0.1 / 1.9)


def _mean_step(optimizer: type, replicas: int, steps: int, seed: int) -> torch.Tensor:
    """The change of W replicas averaged every step (DiLoCo at H = 1, outer lr 1) when
    each replica's gradient is a signal plus its own noise; W = 1 with the noise of the
    mean gradient is the step AdamW takes on the mean (DDP)."""
    gen = torch.Generator().manual_seed(seed)
    signal = torch.cat([torch.full((200,), 1.0), torch.full((800,), 0.05)])
    start = torch.zeros(1000)
    kwargs = {"lr": 1e-2, "betas": BETAS, "weight_decay": 0.0}
    params = [torch.nn.Parameter(start.clone()) for _ in range(replicas)]
    opts = [optimizer([p], replicas=replicas, **kwargs) if optimizer is GlobalAdamW
            else optimizer([p], foreach=False, **kwargs) for p in params]
    noise = 1.0 if replicas > 1 else 1.0 / 8 ** 0.5
    for _ in range(steps):
        for p, opt in zip(params, opts, strict=True):
            p.grad = signal + noise * torch.randn(1000, generator=gen)
            opt.step()
        mean = torch.stack([p.detach() for p in params]).mean(0)
        for p in params:
            p.data.copy_(mean)
    return params[0].detach() - start


def test_the_mean_of_w_steps_is_as_long_as_adamw_on_the_mean_gradient() -> None:
    """8 replicas with AdamW each move the noisy coordinates about 1/sqrt(8) as far as
    AdamW on the mean gradient does; sized for the mean, they move about as far."""
    ddp = _mean_step(torch.optim.AdamW, 1, 200, seed=3)
    plain = _mean_step(torch.optim.AdamW, 8, 200, seed=3)
    ours = _mean_step(GlobalAdamW, 8, 200, seed=3)
    noisy = slice(200, 1000)
    plain_ratio = float(plain[noisy].mean() / ddp[noisy].mean())
    our_ratio = float(ours[noisy].mean() / ddp[noisy].mean())
    assert plain_ratio < 0.6, plain_ratio
    assert 0.65 < our_ratio < 1.3, our_ratio
    loud = slice(0, 200)  # signal-dominated coordinates: every variant near AdamW's step
    assert 0.85 < float(ours[loud].mean() / ddp[loud].mean()) < 1.15


def test_the_optimizer_is_refused_where_gradients_are_summed_every_step(
        tmp_path: Path, capsys: Any) -> None:
    from train_helpers import flags

    from gradzip.cli import main

    code = main(["train", "--parallel", "ddp", "--optimizer", "adamw_global", "--codec", "int8",
                 "--print-config",
                 *flags(tmp_path / "cache", tmp_path / "out", "--max-steps", "2")])
    assert code != 0 and "needs a local-update --outer" in capsys.readouterr().err


def test_a_local_update_method_names_it_as_its_inner_optimizer() -> None:
    from gradzip.comm.method import parse_method

    method = parse_method("diloco(sync_every=1, lr=1, momentum=0, inner=adamw_global)")
    flags = method.train_flags()
    assert flags[flags.index("--optimizer") + 1] == "adamw_global"
    assert parse_method(str(method)) == method


def test_its_state_resumes_exactly() -> None:
    ours, twin = _params(), _params()
    a = GlobalAdamW(ours, lr=1e-2, betas=BETAS, replicas=4)
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(p.shape, generator=gen) for p in ours] for _ in range(6)]
    for step in grads[:3]:
        for p, g in zip(ours, step, strict=True):
            p.grad = g.clone()
        a.step()
    for p, q in zip(ours, twin, strict=True):
        q.data.copy_(p.data)
    b = GlobalAdamW(twin, lr=1e-2, betas=BETAS, replicas=4)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # a state_dict shares tensors
    for step in grads[3:]:
        for p, q, g in zip(ours, twin, step, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, twin, strict=True))


def test_w_is_the_worlds_ranks_and_there_must_be_a_world() -> None:
    from gradzip.comm.replicas import run_replicas
    from gradzip.train.components import build_optimizer
    from gradzip.train.config import OptimConfig

    config = OptimConfig(optimizer="adamw_global")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="once the process group exists"):
        build_optimizer(model, config)
    sizes = run_replicas(3, lambda rank: build_optimizer(model, config).replicas)
    assert sizes == [3, 3, 3]


def test_it_is_refused_under_ft_before_any_group_starts() -> None:
    import argparse
    from types import SimpleNamespace

    from gradzip.commands.train import check_ft

    args = argparse.Namespace(ft=2, ft_replica=None, ft_lighthouse=None)
    cfg = SimpleNamespace(optim=SimpleNamespace(optimizer="adamw_global"))
    with pytest.raises(ValueError, match="under --ft"):
        check_ft(args, cfg)


def test_beta1_zero_cannot_tell_noise_from_signal(tmp_path: Path, capsys: Any) -> None:
    from train_helpers import flags

    from gradzip.cli import main

    with pytest.raises(ValueError, match="beta1 > 0"):
        GlobalAdamW(_params(), betas=(0.0, 0.95), replicas=4)
    code = main(["train", "--parallel", "ddp", "--outer", "diloco", "--optimizer",
                 "adamw_global", "--beta1", "0", "--print-config",
                 *flags(tmp_path / "cache", tmp_path / "out", "--max-steps", "2")])
    assert code != 0 and "needs --beta1 > 0" in capsys.readouterr().err
