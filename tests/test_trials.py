"""``gradzip compare --tune``: an equal tuning budget per method, the best trial raced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradzip.compare.matrix import plan
from gradzip.compare.report import write_report
from gradzip.compare.summary import summarize
from gradzip.compare.trials import best_trial, parse_tune, trial_flags, trial_label


def test_tune_is_the_product_of_its_values() -> None:
    assert parse_tune("") == [()]
    trials = parse_tune("lr=1e-3,3e-3; warmup-steps=10,50")
    assert trials == [(("lr", "1e-3"), ("warmup-steps", "10")),
                      (("lr", "1e-3"), ("warmup-steps", "50")),
                      (("lr", "3e-3"), ("warmup-steps", "10")),
                      (("lr", "3e-3"), ("warmup-steps", "50"))]
    assert trial_flags(trials[1]) == ["--lr", "1e-3", "--warmup-steps", "50"]
    assert trial_label(trials[1]) == "lr=1e-3, warmup-steps=50"


@pytest.mark.parametrize("text, message", [
    ("lr", "OPTION=V1,V2"), ("lr=", "OPTION=V1,V2"), ("LR=1", "OPTION=V1,V2"),
    ("lr=1;lr=2", "given twice")])
def test_bad_tune_values_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tune(text)


def test_every_method_gets_every_trial_and_its_own_run_directory(tmp_path: Path) -> None:
    runs = plan(["torch:fp16", "int8"], ["100mbit"], [2], 2, ("--model", "tiny"),
                trials=parse_tune("lr=1e-3,3e-3"))
    assert len(runs) == 2 * 2 * 2 and len({r.slug for r in runs}) == 8
    r = next(r for r in runs if r.method == "int8" and r.trial == (("lr", "3e-3"),))
    argv = r.argv(tmp_path, tmp_path)
    assert argv[argv.index("--lr") + 1] == "3e-3" and "--lr" in r.what


def test_the_best_trial_has_the_lowest_mean_loss_and_unfinished_ones_rank_last() -> None:
    assert best_trial({"a": [3.0, 3.2], "b": [3.05, 3.1], "c": [2.0, None]}) == "b"
    assert best_trial({"a": [None], "b": [None]}) == "a"


def record(method: str, seed: int, lr: str, loss: float) -> dict[str, Any]:
    return {"seed": seed, "world_size": 2, "steps": 10, "val_loss": loss,
            "train_time_s": 1.0,
            "eval_history": [{"step": 10, "train_time_s": 1.0, "val_loss": loss}],
            "compare": {"method": method, "seed": seed, "ranks": 2, "rate": "100mbit",
                        "link": "shared", "shaped": False, "trial": {"lr": lr}}}


def test_the_report_races_each_methods_best_trial_and_lists_them_all(tmp_path: Path) -> None:
    records = [record("torch:none", s, lr, loss) for s in (0, 1)
               for lr, loss in (("1e-3", 3.2), ("3e-3", 3.0))]
    records += [record("int8", s, lr, loss) for s in (0, 1)
                for lr, loss in (("1e-3", 3.01), ("3e-3", 3.3))]
    [s] = summarize(records)
    assert [r.trial for r in s.method("torch:none").runs] == ["lr=3e-3", "lr=3e-3"]
    assert [r.trial for r in s.method("int8").runs] == ["lr=1e-3", "lr=1e-3"]
    assert s.target == pytest.approx(3.0 * 1.01)
    assert [t.chosen for t in s.trials["int8"]] == [True, False]
    text = write_report(records, tmp_path).read_text()
    assert "**lr=1e-3 → 3.0100 (2 seeds), raced**" in text
    assert "lr=3e-3 → 3.3000 (2 seeds)" in text


def test_the_16_bit_all_reduce_is_the_first_reference_of_every_speed_up() -> None:
    records = [record(m, 0, "1", loss) for m, loss in
               (("torch:none", 3.0), ("torch:fp16", 3.0), ("int8", 3.0))]
    [s] = summarize(records)
    assert s.references[:2] == ["torch:fp16", "torch:none"]
    [s] = summarize(records[1:])  # no uncompressed run: the 16-bit one sets the target
    assert s.baseline == "torch:fp16" and s.references == ["torch:fp16"]
    assert any("target is set by `torch:fp16`" in n for n in s.notes)


@pytest.mark.parametrize("argv, message", [
    (["--tune", "seed=1,2"], "compare sets --seed for every run itself"),
    (["--tune", "lr=1e-3,3e-3", "--lr", "0.002"], "--tune lr and a fixed --lr"),
    (["--start-step", "-1"], "--start-step must be >= 0"),
    (["--sweep-from", "1Gbit"], "--sweep-from '1Gbit' is not one of the rates raced"),
])
def test_bad_tuning_and_sweep_options_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        message: str) -> None:
    from gradzip.cli import main

    assert main(["compare", *argv, "--out", str(tmp_path / "race")]) == 2
    assert message in capsys.readouterr().err
