"""The race's one-sentence answer: the winner, its lead over the best 16-bit all-reduce,
and whether that lead is more than evaluation spacing and seed noise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradzip.compare.report import table, write_report
from gradzip.compare.runs import load_results
from gradzip.compare.summary import summarize
from gradzip.compare.sweep import steps_to_target
from gradzip.compare.verdict import verdict, verdicts
from gradzip.train.metrics import append_results

LOSSES = [5.0, 4.0, 3.5, 3.2, 3.0]  # the baseline's: target 3.0 x 1.01 = 3.03


def record(method: str, seed: int, step_s: float, losses: list[float] = LOSSES,
           evals_every: int = 10) -> dict[str, Any]:
    """A results record as ``gradzip compare`` writes it: evaluations every 10 steps."""
    steps = [i * evals_every for i in range(len(losses))]
    return {
        "method": method, "codec": "none", "seed": seed, "world_size": 2, "params": 1000,
        "steps": steps[-1], "val_loss": losses[-1], "train_time_s": steps[-1] * step_s,
        "step_time_ms_p50": step_s * 1e3, "tokens_per_s": 4096 / step_s,
        "eval_history": [{"step": s, "train_time_s": s * step_s, "val_loss": v}
                         for s, v in zip(steps, losses, strict=True)],
        "compare": {"method": method, "seed": seed, "ranks": 2, "rate": "100mbit",
                    "link": "shared", "shaped": True, "achieved_rate_bits_per_s": 95e6},
    }


def sentence(records: list[dict[str, Any]]) -> str:
    [summary] = summarize(records)
    return verdict(summary)


def test_a_lead_beyond_evaluation_spacing_with_one_seed_says_seed_noise_is_unmeasured(
        ) -> None:
    text = sentence([record("torch:none", 0, 1.0), record("torch:fp16", 0, 0.6),
                     record("int8", 0, 0.3)])
    # target reached at the last evaluation (step 40): 40 s, 24 s and 12 s
    assert "use `int8`" in text and "in 12.0 s of training" in text, text
    assert "2.00x as fast as the best 16-bit all-reduce `torch:fp16` (24.0 s, 12.0 s later)" \
        in text, text
    assert "more than the 6.0 s between evaluations" in text, text
    assert "one seed" in text and "--seeds 3" in text, text


def test_a_lead_inside_the_evaluation_spacing_is_noise() -> None:
    text = sentence([record("torch:none", 0, 1.0), record("torch:fp16", 0, 0.32),
                     record("int8", 0, 0.3)])
    assert "use `int8`" in text and "within evaluation noise" in text, text


def test_seed_noise_decides_with_several_seeds() -> None:
    base = [record("torch:none", s, 1.0) for s in range(3)]
    steady = sentence(base + [record("torch:fp16", s, 0.6 + 0.01 * s) for s in range(3)]
                      + [record("int8", s, 0.3 + 0.01 * s) for s in range(3)])
    assert "more than the" in steady and "than seed noise" in steady, steady
    noisy = sentence(base + [record("torch:fp16", s, (0.3, 0.6, 0.9)[s]) for s in range(3)]
                     + [record("int8", s, (0.1, 0.5, 0.6)[s]) for s in range(3)])
    assert "within seed noise" in noisy and "over 3 seeds" in noisy, noisy


def test_when_the_16bit_all_reduce_wins_no_compression_method_beat_it() -> None:
    text = sentence([record("torch:none", 0, 1.0), record("torch:fp16", 0, 0.3),
                     record("int8", 0, 0.5)])
    assert "use `torch:fp16`" in text and "no compression method beat it" in text, text
    assert "the next, `int8`, took 20.0 s" in text, text


def test_without_a_16bit_run_the_reference_is_the_uncompressed_baseline() -> None:
    text = sentence([record("torch:none", 0, 1.0), record("int8", 0, 0.5)])
    assert "as fast as the uncompressed baseline" in text and "`torch:none`" in text, text


def test_no_baseline_and_no_target_reached_are_said_plainly() -> None:
    assert "no verdict" in sentence([record("int8", 0, 0.5)])
    slow = [5.0, 4.5, 4.2, 4.0, 3.9]
    text = sentence([record("torch:none", 0, 1.0), record("int8", 0, 0.5, slow)])
    assert "use `torch:none`" in text  # only the baseline got there
    text = sentence([record("torch:none", 0, 1.0, slow[:4] + [3.0]),
                     record("int8", 0, 0.5, slow)])
    assert "use `torch:none`" in text


def test_the_report_carries_the_verdict(tmp_path: Path) -> None:
    records = [record("torch:none", 0, 1.0), record("torch:fp16", 0, 0.6),
               record("int8", 0, 0.3)]
    report = write_report(records, tmp_path).read_text()
    [text] = verdicts(summarize(records))
    assert f"**Verdict.** {text}" in report


def test_figures_keep_legends_off_the_axes_and_say_how_many_seeds(
        tmp_path: Path, monkeypatch) -> None:
    """A legend sample once sat over a tick label; one seed was titled "min-max shaded"."""
    from gradzip.compare import plots

    figures = []
    save = plots.save
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig) or save(fig, path))
    records = [record("torch:none", 0, 1.0), record("int8", 0, 0.3)]
    for r in records:
        r.update(bytes_raw_total=4e6, bytes_wire_total=1e6 if r["method"] == "int8" else 4e6,
                 phase_ms_mean={"data": 1.0, "forward": 2.0, "backward": 3.0,
                                "optimizer": 1.0, "comm": 2.0})
    write_report(records, tmp_path)
    assert len(figures) == 5  # 4 of the setting, the projection across bandwidths
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            assert legend is not None
            assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    titles = [ax.get_title() for fig in figures for ax in fig.axes]
    assert any("one seed per method" in t for t in titles)
    assert not any("min-max" in t for t in titles)


def test_runs_of_different_gradzip_source_get_no_verdict_and_a_note_naming_them() -> None:
    # a race whose tree was edited after its first run: the later runs ran other code
    runs = [record("torch:none", 0, 1.0), record("torch:fp16", 0, 0.6), record("int8", 0, 0.3)]
    for r, source in zip(runs, ["aaaa", "aaaa", "bbbb"], strict=True):
        r["gradzip_source"] = source
    [summary] = summarize(runs)
    text = verdict(summary)
    assert "no verdict" in text and "different versions of gradzip's source" in text, text
    [note] = [w for w in summary.warnings if "gradzip_source" in w]
    assert "aaaa (torch:none, torch:fp16); bbbb (int8)" in note, note
    runs[2]["gradzip_source"] = "aaaa"  # one source: the race is judged
    assert "use `int8`" in sentence(runs)
    del runs[2]["gradzip_source"]  # a record from before the field: unknown, not another
    assert "use `int8`" in sentence(runs)
    runs[2]["gradzip_source"] = 7
    with pytest.raises(ValueError, match="record 3: field 'gradzip_source' must be a string"):
        summarize(runs)


def test_the_source_digest_changes_with_any_python_file_and_nothing_else(
        tmp_path: Path) -> None:
    from gradzip.train.metrics import python_tree_digest, source_digest

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = python_tree_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("not code")
    assert python_tree_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    edited = python_tree_digest(tmp_path)
    assert edited != first and len(edited) == 16
    (tmp_path / "sub" / "b.py").rename(tmp_path / "b2.py")  # the same bytes, moved
    assert python_tree_digest(tmp_path) != edited
    assert source_digest() is source_digest()  # taken once per process: at its start


def test_a_run_that_diverged_after_reaching_the_target_names_no_winner_and_is_flagged(
        tmp_path: Path) -> None:
    # int8 touches the target at its first evaluation after step 0, then blows up while
    # staying finite (as sparseloco(lr=4) did at W = 8: 3.93 at step 650, 1.8e7 at 2,000)
    blown = [5.0, 3.0, 4.0, 9.0, 40.0]
    records = [record("torch:none", 0, 1.0), record("torch:fp16", 0, 0.6),
               record("int8", 0, 0.3, blown)]
    [summary] = summarize(records)
    text = verdict(summary)
    assert "use `torch:fp16`" in text and "int8" not in text, text
    [note] = [w for w in summary.warnings if "diverged" in w]
    assert "`int8` seed 0" in note and "40 at step 40" in note, note
    assert "first (5 at step 0)" in note and "lowest (3 at step 10)" in note, note
    assert summary.method("int8").ttt.not_reached == 1  # type: ignore[union-attr]
    int8 = summary.method("int8").runs[0]
    assert steps_to_target(int8, 3.03) is None  # the bandwidth projection's reach too
    assert int8.reached(3.03) is None and int8.reached(100.0) is None
    report = write_report(records, tmp_path).read_text()
    assert "40.0000 (diverged)" in report and note in report
    # a loss that ends a little above its lowest, or never rose past its first, is no
    # divergence: noise, or a schedule's end
    for losses in ([5.0, 4.0, 3.5, 3.0, 3.2], [5.0, 3.0, 3.5, 4.0, 4.9]):
        [summary] = summarize(records[:2] + [record("int8", 0, 0.3, losses)])
        assert not [w for w in summary.warnings if "diverged" in w], losses


def test_a_diverged_baseline_sets_no_target_and_a_non_finite_loss_is_divergence(
        tmp_path: Path) -> None:
    nan = [5.0, 4.0, 3.5, float("nan"), float("nan")]
    base = record("torch:none", 0, 1.0, nan)
    base["val_loss"] = float("nan")
    # as the trainer writes it: strict JSON, so the NaNs are nulls on disk
    append_results(base, [tmp_path / "results.jsonl"])
    [on_disk] = load_results([tmp_path / "results.jsonl"])
    assert on_disk["eval_history"][3]["val_loss"] is None
    [summary] = summarize([on_disk, record("int8", 0, 0.3)])
    text = verdict(summary)
    assert "no verdict" in text and "`torch:none` diverged" in text, text
    [note] = [w for w in summary.warnings if "diverged" in w]
    assert "non-finite at step 30" in note, note


def test_a_baseline_that_diverged_in_one_seed_of_two_sets_no_target_or_loss_change() -> None:
    runs = [record("torch:none", 0, 1.0), record("torch:none", 1, 1.0, [5.0, 4.0, 9.0, 20, 40]),
            record("int8", 0, 0.3), record("int8", 1, 0.3)]
    [summary] = summarize(runs)
    assert summary.target is None and all(m.delta_pct is None for m in summary.methods)
    assert "`torch:none` diverged" in verdict(summary)
    assert "The baseline `torch:none` diverged in 1 of its runs: no target and no loss " \
        "change." in summary.notes
    head, rows = table(summary)
    final = head.index("final val loss")
    assert rows[0][final].endswith("(1/2 diverged)") and "diverged" not in rows[1][final]


def test_a_tune_trial_with_a_diverged_seed_is_not_the_one_raced() -> None:
    # lr=3e-3 ends lowest, but its loss went non-finite on the way (a NaN evaluation)
    wild, tame = [5.0, float("nan"), 3.5, 3.0, 2.8], [5.0, 4.0, 3.5, 3.2, 2.95]
    runs = [record("torch:none", 0, 1.0)]
    for lr, losses in (("3e-3", wild), ("1e-3", tame)):
        rec = record("int8", 0, 0.3, losses)
        rec["compare"]["trial"] = {"lr": lr}
        runs.append(rec)
    [summary] = summarize(runs)
    chosen = [t for t in summary.trials["int8"] if t.chosen]
    assert [t.trial for t in chosen] == ["lr=1e-3"], summary.trials
