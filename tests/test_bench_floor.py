"""``gradzip bench floor``: its replicas step as it says (DDP is AdamW on the mean
gradient, ``own`` is each replica's AdamW, averaging makes the copies equal)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from gradzip.bench.floor import (
    DDP,
    Replicas,
    Variant,
    group_of,
    job_config,
    parse_variants,
)
from gradzip.bench.pooled_adamw import PooledFactoredAdamW, PooledOptions
from gradzip.cli import main
from gradzip.train.components import build_model
from gradzip.train.config import JobConfig
from gradzip.train.loop import lr_at

VOCAB, SEQ, BATCH = 64, 16, 2


def tiny_config(steps: int = 4) -> JobConfig:
    args = argparse.Namespace(model="tiny", batch_size=BATCH, max_tokens=200_000,
                              cache_dir="runs/.cache/data", steps=steps, seed=0)
    cfg = job_config(args)
    cfg.model.vocab_size = VOCAB
    return cfg


def batches(world: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(world):
            x = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
            step.append((x[:, :-1], x[:, 1:]))
        out.append(step)
    return out


def initial(variant: str, world: int, steps: int = 4, **kw) -> Replicas:
    """The replicas as ``train`` starts them, before any step."""
    cfg = tiny_config(steps)
    torch.manual_seed(0)
    return Replicas(build_model(cfg.model), Variant.parse(variant), world, cfg, **kw)


def train(variant: str, world: int, steps: int, sync_every: int = 1, **kw) -> Replicas:
    reps = initial(variant, world, steps, **kw)
    for step, step_batches in enumerate(batches(world, steps), start=1):
        reps.step(step_batches, lr_at(step, reps.cfg.optim, steps))
        if step % sync_every == 0:
            reps.average()
    return reps


def test_variants_parse_and_ddp_comes_first() -> None:
    assert [v.label for v in parse_variants("own/own; own/mean;own/own")] == \
        [DDP, "own/own", "own/mean"]
    assert Variant.parse("global/mean").rule("tok_emb.weight") == "mean"
    assert Variant.parse("global/mean").rule("blocks.0.mlp.up.weight") == "global"
    for bad in ("own", "own/own/own", "adam/own"):
        with pytest.raises(ValueError, match="HIDDEN/EMBEDDING"):
            Variant.parse(bad)


def test_groups_of_the_preset_model() -> None:
    names = [n for n, _ in build_model(tiny_config().model).named_parameters()]
    assert [n for n in names if group_of(n) == "embedding"] == ["tok_emb.weight"]


def test_ddp_variant_is_adamw_on_the_mean_gradient() -> None:
    """mean/mean at W = 2 is torch's AdamW on the loss averaged over both batches."""
    steps, cfg = 3, tiny_config(3)
    reps = train(DDP, world=2, steps=steps)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    for step, step_batches in enumerate(batches(2, steps), start=1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o, steps)
        opt.zero_grad()
        loss = sum(model(x, y)[1] for x, y in step_batches) / 2
        loss.backward()
        opt.step()
    for got, want in zip(reps.weights[1], model.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    assert all(a is b for a, b in zip(reps.weights[0], reps.weights[1], strict=True))


def test_one_replica_own_is_ddp_bit_for_bit() -> None:
    own, ddp = train("own/own", world=1, steps=3), train(DDP, world=1, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(own.weights[0], ddp.weights[0], strict=True))


def test_replicas_drift_between_averages_and_meet_at_them() -> None:
    reps = train("own/mean", world=2, steps=3, sync_every=2)  # the last step is local
    emb = reps.names.index("tok_emb.weight")
    hidden = [i for i, n in enumerate(reps.names) if n != "tok_emb.weight"]
    assert reps.weights[0][emb] is reps.weights[1][emb]  # shared: one tensor
    assert all(not torch.equal(reps.weights[0][i], reps.weights[1][i]) for i in hidden)
    reps.average()
    assert all(torch.equal(reps.weights[0][i], reps.weights[1][i]) for i in hidden)


def test_own_differs_from_ddp_at_two_replicas() -> None:
    """The floor the benchmark measures: per-replica AdamW is not DDP's AdamW."""
    own, ddp = train("own/own", world=2, steps=3), train(DDP, world=2, steps=3)
    assert not all(torch.allclose(a, b, atol=1e-6)
                   for a, b in zip(own.weights[0], ddp.weights[0], strict=True))


def test_global_rule_steps_with_adamw_global_for_the_replicas() -> None:
    reps = train("global/own", world=2, steps=3)
    kinds = {type(opt).__name__: opt for opt in reps.optimizers}
    assert set(kinds) == {"GlobalAdamW", "AdamW"}
    assert kinds["GlobalAdamW"].replicas == 2
    own = train("own/own", world=2, steps=3)
    hidden = reps.names.index("blocks.0.mlp.up.weight")
    assert not torch.allclose(reps.weights[0][hidden], own.weights[0][hidden], atol=1e-7)


def test_outer_lr_extrapolates_the_replicas_mean_from_the_last_average() -> None:
    """An outer step of lr 2: each unshared tensor becomes the last average plus twice
    the replicas' mean move since (DiLoCo's outer SGD without momentum)."""
    start = initial("own/mean", world=2)
    reps = train("own/mean", world=2, steps=2, sync_every=3, outer_lr=2.0)
    hidden = reps.names.index("blocks.0.mlp.up.weight")
    mean = (reps.weights[0][hidden] + reps.weights[1][hidden]) / 2
    reps.average()
    expected = start.weights[0][hidden] + 2 * (mean - start.weights[0][hidden])
    for w in reps.weights:
        torch.testing.assert_close(w[hidden], expected)
    moved = train("own/mean", world=2, steps=2, sync_every=3, outer_lr=2.0)
    for _ in range(2):  # the second average extrapolates from the first, not from the start
        moved.average()
    torch.testing.assert_close(moved.weights[0][hidden], expected)


def test_inner_lr_scale_shortens_only_the_replicas_own_steps() -> None:
    """AdamW's first step is linear in lr: a scale of one half halves each replica's
    own step and leaves the shared (DDP) tensors' step as it was."""
    start = initial("own/mean", world=1)
    full = train("own/mean", world=1, steps=1)
    half = train("own/mean", world=1, steps=1, inner_lr_scale=0.5)
    hidden = full.names.index("blocks.0.mlp.up.weight")
    emb = full.names.index("tok_emb.weight")
    torch.testing.assert_close(half.weights[0][hidden] - start.weights[0][hidden],
                               (full.weights[0][hidden] - start.weights[0][hidden]) / 2)
    assert torch.equal(half.weights[0][emb], full.weights[0][emb])


def test_outer_momentum_is_nesterov_sgd_on_the_negated_mean_move() -> None:
    """Two averages with momentum 0.9 at lr 0.7 step as torch's SGD(nesterov=True)
    would on the pseudo-gradient anchor - mean (DiLoCo's outer step)."""
    start = initial("own/mean", world=2)
    hidden = start.names.index("blocks.0.mlp.up.weight")
    reps = initial("own/mean", world=2, outer_lr=0.7, outer_momentum=0.9)
    outer = start.weights[0][hidden].detach().clone().requires_grad_(True)
    sgd = torch.optim.SGD([outer], lr=0.7, momentum=0.9, nesterov=True)
    for step_batches in batches(2, 4)[:2]:
        for _ in range(2):  # two local steps, then the outer step
            reps.step(step_batches, 1e-3)
        mean = (reps.weights[0][hidden] + reps.weights[1][hidden]) / 2
        outer.grad = (outer.detach() - mean).clone()
        sgd.step()
        reps.average()
        for w in reps.weights:
            torch.testing.assert_close(w[hidden], outer.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("keys", [("m", ["exp_avg"]), ("mv", ["exp_avg", "exp_avg_sq"])])
def test_sync_moments_averages_the_replicas_adamw_moments(keys) -> None:
    mode, averaged = keys
    plain = train("own/mean", world=2, steps=2, sync_every=3)
    reps = train("own/mean", world=2, steps=2, sync_every=3, sync_moments=mode)
    hidden = reps.names.index("blocks.0.mlp.up.weight")
    before = [{k: v.clone() for k, v in reps.state_of(w[hidden]).items()}
              for w in reps.weights]
    reps.average()
    after = [reps.state_of(w[hidden]) for w in reps.weights]
    for key in ("exp_avg", "exp_avg_sq"):
        if key in averaged:
            torch.testing.assert_close(after[0][key], (before[0][key] + before[1][key]) / 2)
            assert torch.equal(after[0][key], after[1][key])
        else:
            assert all(torch.equal(a[key], b[key]) for a, b in zip(after, before, strict=True))
    plain.average()  # the weights average as without it
    assert all(torch.equal(a, b) for a, b in zip(plain.weights[0], reps.weights[0],
                                                 strict=True))


def test_sync_moments_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="sync_moments"):
        initial("own/mean", world=2, sync_moments="v")


@pytest.mark.parametrize("value", ["1", "-0.1"])
def test_cli_refuses_an_outer_momentum_outside_0_1(tmp_path, capsys, value: str) -> None:
    rc = main(["bench", "floor", "--outer-momentum", value, "--out", str(tmp_path / "out")])
    assert rc != 0
    assert "--outer-momentum must be in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--outer-lr", "--inner-lr-scale"])
def test_cli_refuses_a_step_size_that_is_not_positive(tmp_path, capsys, flag: str) -> None:
    rc = main(["bench", "floor", flag, "0", "--out", str(tmp_path / "out")])
    assert rc != 0
    assert f"{flag} must be above 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [["--stats-carry"], ["--noise-corrected", "--floor-own"],
                                   ["--stats-every", "5"], ["--pooled-stat", "full"]])
def test_cli_refuses_pooled_flags_no_variant_uses(tmp_path, capsys, flags: list[str]) -> None:
    rc = main(["bench", "floor", "--variants", "own/mean", *flags,
               "--out", str(tmp_path / "out")])
    assert rc != 0
    err = capsys.readouterr().err
    assert all(f in err for f in flags if f.startswith("--")) and "pooled rule" in err
    assert not (tmp_path / "out").exists()


def test_pooled_options_reach_the_pooled_optimizer() -> None:
    reps = initial("mean/pooled", world=2, pooled=PooledOptions(every=5, carry=True))
    [pooled] = [opt for opt in reps.optimizers if isinstance(opt, PooledFactoredAdamW)]
    assert (pooled.every, pooled.carry, pooled.stat) == (5, True, "factored")


@pytest.mark.parametrize("flag", ["--replicas", "--steps", "--sync-every", "--stats-every",
                                  "--eval-every"])
def test_cli_refuses_a_count_below_one(tmp_path, capsys, flag: str) -> None:
    rc = main(["bench", "floor", flag, "0", "--out", str(tmp_path / "out")])
    assert rc != 0
    assert f"{flag} must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_negative_stats_warmup(tmp_path, capsys) -> None:
    rc = main(["bench", "floor", "--stats-warmup", "-1", "--out", str(tmp_path / "out")])
    assert rc != 0
    assert "--stats-warmup must be 0 or more" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_writes_one_record_per_variant(tmp_path, capsys) -> None:
    out = tmp_path / "floor"
    rc = main(["bench", "floor", "--model", "tiny", "--replicas", "2", "--steps", "4",
               "--eval-every", "2", "--eval-batches", "1", "--max-tokens", "200000",
               "--cache-dir", str(tmp_path / "cache"), "--variants", "own/own",
               "--out", str(out), "--quiet"])
    assert rc in (0, None)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in records] == [DDP, "own/own"]
    assert records[0]["vs_ddp"] == 0
    assert [e["step"] for e in records[1]["evals"]] == [2, 4]
    assert "own/own" in capsys.readouterr().out


def test_cli_refuses_a_bad_variant_before_any_work(tmp_path, capsys) -> None:
    rc = main(["bench", "floor", "--variants", "own/adam", "--out", str(tmp_path / "out")])
    assert rc != 0
    assert "HIDDEN/EMBEDDING" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_pooled_rule_steps_every_replicas_copies_with_one_optimizer() -> None:
    reps = train("mean/pooled", world=2, steps=3)
    [pooled] = [opt for opt in reps.optimizers if isinstance(opt, PooledFactoredAdamW)]
    emb = reps.names.index("tok_emb.weight")
    assert [copy[0] for copy in pooled.copies] == [reps.weights[0][emb], reps.weights[1][emb]]
    own = train("mean/own", world=2, steps=3)
    assert not torch.allclose(reps.weights[0][emb], own.weights[0][emb], atol=1e-7)
