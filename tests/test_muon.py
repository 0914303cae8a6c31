"""``--optimizer muon`` (MuLoCo's inner optimizer, issue 43): Muon on the hidden
matrices, AdamW on the rest, one optimizer to the schedule, checkpoints and DiLoCo."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from gradzip.train.config import ModelConfig, OptimConfig
from gradzip.train.model import GPT

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                reason="torch.optim.Muon needs PyTorch >= 2.9")


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, n_layer=2, dim=32, n_head=2, max_seq_len=16))


def _optimizer(model: GPT) -> Any:
    from gradzip.train.components import build_optimizer

    return build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-2))


def _step(model: GPT, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=g)
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    from gradzip.train.muon import split_for_muon

    model = _model()
    muon, adam_matrices, vectors = split_for_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].split(".")[-2] for p in muon} == {"qkv", "proj", "up", "gate",
                                                          "down"}
    assert [names[id(p)] for p in adam_matrices] == ["tok_emb.weight"]
    assert all(p.dim() == 1 for p in vectors) and vectors
    opt = _optimizer(model)
    assert isinstance(opt, torch.optim.Optimizer)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_learned_positions_and_an_untied_head_stay_on_adamw() -> None:
    from gradzip.train.muon import split_for_muon

    model = GPT(ModelConfig(vocab_size=64, n_layer=1, dim=32, n_head=2, max_seq_len=16,
                            pos="learned", tie_embeddings=False))
    _, adam_matrices, _ = split_for_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in adam_matrices) == ["head.weight", "pos_emb.weight",
                                                           "tok_emb.weight"]


def test_the_schedule_still_reaches_both_halves_after_a_load() -> None:
    """Loading replaces each optimizer's group dicts: the schedule must reach the new
    ones (a resume, a restart or a torchft heal would otherwise freeze the lr)."""
    model = _model()
    opt = _optimizer(model)
    _step(model, opt, 0)
    twin = _optimizer(copy.deepcopy(model))
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for group in twin.param_groups:
        group["lr"] = 1.25e-3
    assert {g["lr"] for g in twin.muon.param_groups + twin.adamw.param_groups} == {1.25e-3}


def test_the_schedule_moves_both_halves_and_a_step_moves_every_weight() -> None:
    model = _model()
    opt = _optimizer(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert {g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups} == {5e-3}
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, 0)
    schedule.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_restored_state_continues_bit_for_bit() -> None:
    model = _model()
    opt = _optimizer(model)
    for seed in range(3):
        _step(model, opt, seed)
    twin = copy.deepcopy(model)
    twin_opt = _optimizer(twin)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step(model, opt, 3)
    _step(twin, twin_opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(),
                                                 strict=True))
    with pytest.raises(ValueError, match="not --optimizer muon's"):
        twin_opt.load_state_dict(torch.optim.AdamW(twin.parameters()).state_dict())


def test_a_local_update_method_names_its_inner_optimizer() -> None:
    from gradzip.comm.method import parse_method

    method = parse_method("diloco(sync_every=8, inner=muon) | int8")
    flags = method.train_flags()
    assert flags[flags.index("--optimizer") + 1] == "muon"
    assert "inner=muon" in str(method) and parse_method(str(method)) == method
    plain = parse_method("diloco(sync_every=8) | int8")
    assert "inner" not in str(plain) and parse_method("diloco(sync_every=8, inner=adamw) | "
                                                      "int8") == plain
    assert "--optimizer" in parse_method("sparseloco(inner=muon)").train_flags()
    with pytest.raises(ValueError, match="inner must be one of adamw, muon"):
        parse_method("diloco(inner=lion) | int8")


def test_muon_is_refused_where_matrices_are_sharded(tmp_path: Path, capsys: Any) -> None:
    from train_helpers import flags

    from gradzip.cli import main

    code = main(["train", "--parallel", "fsdp", "--optimizer", "muon", "--print-config",
                 *flags(tmp_path / "cache", tmp_path / "out", "--max-steps", "2")])
    assert code != 0 and "use --parallel ddp" in capsys.readouterr().err


def test_muloco_trains_and_its_record_says_so(tmp_path: Path) -> None:
    """DiLoCo with Muon inner steps, one process: the loss falls, the method is named."""
    from train_helpers import flags, last_result

    from gradzip.cli import main

    out = tmp_path / "run"
    assert main(["train", "--parallel", "ddp", "--outer", "diloco", "--outer-codec", "int8",
                 "--sync-every", "5", "--optimizer", "muon", "--lr", "3e-3",
                 *flags(tmp_path / "cache", out, "--max-steps", "30", "--eval-every",
                        "10", "--ckpt-every", "10")]) == 0
    record = last_result(out)
    losses = [h["val_loss"] for h in record["eval_history"]]
    assert losses[-1] < losses[0]
    assert "inner=muon" in record["method"]
