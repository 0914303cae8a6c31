"""``gradzip report``: tables, figures and errors from synthetic results records.

Two link settings (100mbit shaped, 1gbit unshaped) x three methods (``torch:none``,
``torch:powersgd(rank=4)``, a gradzip chain) x two seeds, with evaluation histories
whose times to target, loss at the time budget and speed-ups are worked out by hand
in the comments below.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gradzip.cli import main
from gradzip.compare.plots import auto_switches, pareto_front
from gradzip.compare.report import write_report
from gradzip.compare.runs import parse_run, read_results
from gradzip.compare.summary import loss_at_time, summarize

TOPK = "ef | topk(ratio=0.01)"
PSGD = "torch:powersgd(rank=4)"
STEPS = [0, 10, 20, 30, 40]
#: validation losses at STEPS, per (method, seed)
LOSSES = {
    ("torch:none", 0): [5.0, 4.0, 3.5, 3.2, 3.0],
    ("torch:none", 1): [5.0, 4.1, 3.6, 3.25, 3.02],  # targets: seed 0 3.03, seed 1 3.0502
    (PSGD, 0): [5.0, 4.0, 3.4, 3.1, 3.03],  # reaches its seed's target at step 40
    (PSGD, 1): [5.0, 4.0, 3.4, 3.03, 3.02],  # ... at step 30
    (TOPK, 0): [5.0, 3.9, 3.3, 3.04, 3.01],  # ... at step 40 (3.04 > 3.03)
    (TOPK, 1): [5.0, 3.9, 3.3, 3.1, 3.05],  # ... at step 40 (3.05 <= 3.0502)
}
#: seconds per step, per setting and method
STEP_S = {
    "100mbit": {"torch:none": 1.0, PSGD: 0.5, TOPK: 0.25},
    "1gbit": {"torch:none": 0.2, PSGD: 0.18, TOPK: 0.25},
}


def record(rate: str, method: str, seed: int) -> dict[str, Any]:
    """A results record as ``gradzip compare`` writes it."""
    step_s = STEP_S[rate][method]
    losses = LOSSES[(method, seed)]
    rec: dict[str, Any] = {
        "codec": "none", "seed": seed, "world_size": 2, "dtype": "fp32", "params": 1000,
        "steps": 40, "resumed_from_step": None, "val_loss": losses[-1],
        "train_time_s": 40 * step_s, "step_time_ms_p50": step_s * 1000,
        "step_time_ms_mean": step_s * 1000, "tokens_per_s": 4096 / step_s,
        "eval_history": [{"step": s, "train_time_s": s * step_s, "val_loss": v}
                         for s, v in zip(STEPS, losses, strict=True)],
        "phase_ms_mean": {"data": 1.0, "forward": 10.0, "backward": 20.0, "optimizer": 4.0,
                          "comm": 30.0},
        "comm_ratio": 0.1, "encode_ms": None, "decode_ms": None,
        "bytes_raw_total": None, "bytes_wire_total": 40 * 1_000_000,
        "compare": {"method": method, "seed": seed, "ranks": 2, "rate": rate,
                    "link": "shared", "shaped": rate == "100mbit",
                    "achieved_rate_bits_per_s": 95.2e6 if rate == "100mbit" else None,
                    "link_model": "one token bucket on the loopback, shared by all ranks"},
    }
    if method == TOPK:  # gradzip's own counters: 100x fewer bytes than fp32
        rec.update(codec=TOPK, bytes_raw_total=40 * 1_000_000, bytes_wire_total=40 * 10_000,
                   encode_ms=40 * 2.0, decode_ms=40 * 1.0)
    if method == PSGD:
        rec["bytes_wire_total"] = 40 * 50_000
        if rate == "1gbit":  # no communication figures at all
            for k in ("bytes_wire_total", "bytes_raw_total", "comm_ratio", "encode_ms",
                      "decode_ms"):
                del rec[k]
    return rec


def all_records() -> list[dict[str, Any]]:
    return [record(rate, m, seed) for rate in STEP_S for m in STEP_S[rate] for seed in (0, 1)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def md_table(text: str, section: str) -> dict[str, dict[str, str]]:
    """The table under ``## section`` of report.md: method -> column -> cell."""
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]

    def cells(line: str) -> list[str]:
        parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        return [p.strip().replace("\\|", "|") for p in parts]

    head = cells(lines[0])
    return {c[0]: dict(zip(head, c, strict=True)) for c in map(cells, lines[2:])}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("report")
    path = write_report(all_records(), out)
    return out, path.read_text()


def test_table_of_the_slow_link(report: tuple[Path, str]) -> None:
    rows = md_table(report[1], "100mbit, 2 ranks, shared link")
    assert list(rows) == ["torch:none", PSGD, TOPK]  # the baseline first
    none, psgd, topk = rows["torch:none"], rows[PSGD], rows[TOPK]
    # bytes per step: 10_000 B = 9.77 KiB; fp32 all-reduce 1_000_000 B per step
    assert topk["link bytes/step"] == "9.77 KiB"
    assert (topk["vs fp32"], topk["vs 16-bit"]) == ("100x", "50.0x")
    # torch rows have no bytes_raw: the same model's fp32 bytes of the other runs
    assert (none["vs fp32"], psgd["vs fp32"], psgd["vs 16-bit"]) == ("1.00x", "20.0x", "10.0x")
    assert (topk["step ms p50"], topk["tokens/s"], topk["comm share"]) == \
        ("250.0", "16,384", "10.0%")
    # final losses: mean 3.03, sample std sqrt(2) * 0.02 = 0.0283; (3.03 / 3.01 - 1) = +0.66%
    assert (topk["final val loss"], topk["Δ vs baseline"]) == ("3.0300 ± 0.0283", "+0.66%")
    assert (none["final val loss"], none["Δ vs baseline"]) == ("3.0100 ± 0.0141", "+0.00%")
    # budget: the earliest last evaluation, topk's 40 x 0.25 = 10 s; torch:none at 10 s
    # evaluated 4.0 and 4.1; powersgd 3.4 twice (its step 20)
    assert none["val loss at 10.0 s"] == "4.0500 ± 0.0707"
    assert psgd["val loss at 10.0 s"] == "3.4000 ± 0.0000"
    # targets paired by seed (3.03, 3.0502): torch:none at step 40 (40 s) twice; powersgd
    # at 40 x 0.5 = 20 s and 30 x 0.5 = 15 s (mean 17.5, std 3.54); topk at step 40 in both
    # seeds, 10 s (a pooled target, 3.0401, would have given 7.5 s and one seed never)
    assert none["time to target (s)"] == "40.0 ± 0.0"
    assert psgd["time to target (s)"] == "17.5 ± 3.5"
    assert topk["time to target (s)"] == "10.0 ± 0.0"
    # speed-ups: 40 / 17.5 = 2.29; 40 / 10 = 4.00 and 17.5 / 10 = 1.75
    assert (none["speed-up vs torch:none"], none[f"vs {PSGD}"]) == ("1.00x", "0.44x")
    assert (psgd["speed-up vs torch:none"], psgd[f"vs {PSGD}"]) == ("2.29x", "1.00x")
    assert (topk["speed-up vs torch:none"], topk[f"vs {PSGD}"]) == ("4.00x", "1.75x")


def test_link_and_target_are_stated(report: tuple[Path, str]) -> None:
    text = report[1]
    slow = text.split("## 100mbit", 1)[1].split("\n## ", 1)[0]
    fast = text.split("## 1gbit", 1)[1]
    assert "achieved 95.2 Mbit/s; shaped." in slow
    assert "one token bucket on the loopback, shared by all ranks" in slow
    assert "**target** per seed" in slow and "(mean 3.0401)" in slow
    assert "`torch:none`" in slow
    assert "unshaped: results not representative of a slow link" in fast
    assert "unshaped" not in slow
    assert text.index("## 100mbit") < text.index("## 1gbit")  # slowest link first
    assert "linear interpolation" in text and "same seed" in text


def test_missing_comm_fields_render_as_dashes(report: tuple[Path, str]) -> None:
    psgd = md_table(report[1], "1gbit, 2 ranks, shared link")[PSGD]
    for col in ("link bytes/step", "vs fp32", "vs 16-bit", "comm share"):
        assert psgd[col] == "-", col
    # on the fast link the chain is the slowest: 40 x 0.2 = 8.0 s against 7.5 s for the
    # seed that got there
    assert psgd["time to target (s)"] == "6.3 ± 1.3"  # 40 x 0.18 = 7.2 and 30 x 0.18 = 5.4


def test_a_plain_train_record_without_comm_fields() -> None:
    rec = {"codec": "fp16", "seed": 0, "world_size": 1, "steps": 5, "val_loss": None,
           "eval_history": [], "bytes_wire_total": None, "comm_ratio": None}
    [s] = summarize([rec])
    assert s.setting.title() == "unlimited, 1 ranks, unshaped link"
    assert s.baseline is None and s.target is None
    from gradzip.compare.report import table

    _, [row] = table(s)
    assert row[0] == "fp16" and set(row[2:]) == {"-"}


def test_figures_are_written(report: tuple[Path, str]) -> None:
    out, text = report
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 9  # loss/time, loss/steps, Pareto, breakdown per setting; sweep
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
        assert f"]({p.name})" in text


def test_budget_interpolates_between_evaluations(tmp_path: Path) -> None:
    # torch:none seed 0 at 12.5 s: 4.0 + (3.5 - 4.0) * 0.25 = 3.875; seed 1: 3.975
    [slow, _] = summarize(all_records(), budget_s=12.5)
    at = slow.method("torch:none").at_budget
    assert at is not None and at.mean == pytest.approx(3.925)
    assert slow.method(TOPK).at_budget is None  # its evaluations end at 10 s
    run = parse_run(record("100mbit", "torch:none", 0), "x")
    assert loss_at_time(run, 0.0) == 5.0 and loss_at_time(run, 41.0) is None


def test_the_pareto_front() -> None:
    points = [(1.0, 0.0), (20.0, 0.5), (100.0, 0.66), (50.0, 1.0), (1.0, 0.2)]
    assert pareto_front(points) == [0, 1, 2]


def test_a_rerun_replaces_the_earlier_record() -> None:
    recs = all_records()
    again = record("100mbit", TOPK, 1)
    again["compare"]["seed"], again["val_loss"] = 1, 3.02
    [slow, _] = summarize([*recs, again])
    topk = slow.method(TOPK)
    assert len(topk.runs) == 2 and topk.val_loss and topk.val_loss.mean == pytest.approx(3.015)
    assert any("replaced by the later record 13" in n for n in slow.warnings)


def test_bad_lines_name_the_file_and_line(tmp_path: Path) -> None:
    good = json.dumps(record("100mbit", TOPK, 0))
    cases = {
        "broken.jsonl": (good + "\n{not json\n", ":2: not valid JSON"),
        "list.jsonl": ("\n" + good + "\n[1, 2]\n", ":3: a results record is a JSON object"),
        "types.jsonl": (json.dumps({**json.loads(good), "val_loss": "low"}) + "\n",
                        ":1: field 'val_loss' must be a number or null"),
        "nomethod.jsonl": (json.dumps({"seed": 1}) + "\n",
                           ":1: a record needs a 'method' or 'codec'"),
        "empty.jsonl": ("\n\n", ": empty"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{path}{message}")):
            read_results([path])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_results([tmp_path / "missing.jsonl"])


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = all_records()
    a = write_jsonl(tmp_path / "a.jsonl", recs[:6])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_jsonl(run_dir / "results.jsonl", recs[6:])
    out = tmp_path / "out"
    assert main(["report", str(a), str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "100mbit, 2 ranks, shared link" in printed and "4.00x" in printed
    assert TOPK in printed and f"report written to {out / 'report.md'}" in printed
    text = (out / "report.md").read_text()
    assert f"`{a}`" in text and "12 runs in 2 link setting(s)" in text
    assert md_table(text, "100mbit, 2 ranks, shared link")[TOPK]["vs fp32"] == "100x"


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record("1gbit", TOPK, 0)) + "\n{\n")
    assert main(["report", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert f"gradzip report: error: {bad}:2: not valid JSON" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 2
    assert "nope.jsonl: no such results file" in capsys.readouterr().err
    good = write_jsonl(tmp_path / "good.jsonl", all_records())
    assert main(["report", str(good), "--out", str(tmp_path), "--budget-s", "0"]) == 2
    assert "--budget-s must be a positive" in capsys.readouterr().err
    assert main(["report", str(good), "--out", str(tmp_path), "--latency-us", "-1"]) == 2
    assert "--latency-us must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_diloco_record_is_named_by_its_method_not_taken_for_the_baseline() -> None:
    """A DiLoCo run's codec is ``none`` (no per-step codec): named by ``codec`` it was
    listed as ``none`` and, beside a plain DDP ``none`` run, replaced it silently."""
    from gradzip.train.checks import method_of
    from gradzip.train.config import TrainConfig

    diloco = TrainConfig(outer="diloco", sync_every=32, outer_codec="int8")
    name = str(method_of(diloco))
    assert name == "diloco(sync_every=32, lr=0.7, momentum=0.9) | int8"
    assert str(method_of(TrainConfig(codec="ef | topk(ratio=0.01)"))) == "ef | topk(ratio=0.01)"
    base = {"seed": 0, "world_size": 2, "steps": 5, "val_loss": 3.0, "eval_history": [],
            "bytes_wire_total": None, "comm_ratio": None}
    ddp = {**base, "method": "none", "codec": "none"}
    local = {**base, "method": name, "codec": "none", "val_loss": 3.1}
    [s] = summarize([ddp, local])
    assert s.baseline == "none" and {m.method for m in s.methods} == {"none", name}
    assert not any("replaced" in n for n in s.notes)


def test_links_and_uplinks_reach_the_report(tmp_path: Path) -> None:
    """A run across nodes: the kernel's uplink bytes become a column, gradzip's per-link
    figures a list under the table."""
    records = []
    for method in ("torch:none", TOPK):
        for seed in (0, 1):
            rec = record("100mbit", method, seed)
            rec["compare"].update(link_kind="nodes=2x2", ranks=4,
                                  uplink_bytes={"sent": [400_000, 440_000],
                                                "received": [440_000, 400_000]})
            if method == TOPK:
                rec["links"] = {"inter_node": {"bytes_wire": 40 * 1_000,
                                               "compression_ratio": 12.0},
                                "intra_node": {"bytes_wire": 40 * 9_000,
                                               "compression_ratio": 1.0}}
            records.append(rec)
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["report", str(path), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "uplink bytes/step (kernel)" in text and "10.25 KiB" in text  # 420,000 B / 40
    assert f"**{TOPK}** per link, per rank per step: inter_node 1,000 B (12.00x), " \
           "intra_node 9,000 B (1.00x)" in text


def test_a_run_whose_clock_timed_nothing_names_no_winner(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A script run that lost its clock records zero training time: it must not
    "reach the target in 0.0 s"; the report says it was not measured."""
    records = [record("100mbit", m, 0) for m in ("torch:none", TOPK)]
    for r in records:
        if r["compare"]["method"] == TOPK:
            r["train_time_s"], r["timed_steps"] = 0.0, 0
            for h in r["eval_history"]:
                h["train_time_s"] = 0.0
    [s] = summarize(records)
    topk = s.method(TOPK)
    assert topk.ttt is not None and topk.ttt.reached is None and topk.ttt.runs == 0
    assert any(f"`{TOPK}` seed 0" in w and "not measured" in w for w in s.warnings)
    from gradzip.compare.report import print_tables
    from gradzip.compare.verdict import verdict

    assert "in 0.0 s" not in verdict(s) and TOPK not in verdict(s)
    print_tables([s])
    assert "was not measured" in capsys.readouterr().out
    for r in records:  # no run measured at all: no verdict
        r["train_time_s"], r["timed_steps"] = 0.0, 0
        for h in r["eval_history"]:
            h["train_time_s"] = 0.0
    [s] = summarize(records)
    assert "no verdict, since no run here was measured" in verdict(s)
    records[1]["eval_history"] = []  # no evaluation is also no measurement
    assert any("logged no evaluation" in w for w in summarize(records)[0].warnings)


def test_records_of_different_models_are_never_raced_against_each_other(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 4.26M-parameter run beside a 0.14M DiLoCo run on the same (unshaped) link:
    two settings, each named by its workload, neither a verdict across them."""
    small = {"method": "none", "codec": "none", "model": "small", "params": 4_260_000,
             "global_batch_tokens": 2048, "steps": 40, "dataset": "stdlib", "seed": 0,
             "world_size": 2, "val_loss": 4.0, "train_time_s": 100.0, "timed_steps": 35,
             "eval_history": [{"step": 40, "train_time_s": 100.0, "val_loss": 4.0}]}
    tiny = {**small, "method": "diloco(sync_every=8) | int8", "model": "tiny",
            "params": 140_000, "val_loss": 3.0, "train_time_s": 1.0,
            "eval_history": [{"step": 40, "train_time_s": 1.0, "val_loss": 3.0}]}
    a, b = (write_jsonl(tmp_path / f"{n}.jsonl", [r]) for n, r in (("a", small), ("b", tiny)))
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "as fast as" not in text and "as fast as" not in out
    assert "small (4.26M params)" in text and "tiny (0.14M params)" in text
    assert "model small vs tiny; params 4260000 vs 140000" in out
    [s_small, s_tiny] = sorted(summarize([small, tiny]), key=lambda s: s.setting.workload.model
                               or "")
    assert s_small.setting != s_tiny.setting and s_small.setting.slug() != s_tiny.setting.slug()
    # a different step size alone keeps runs apart too
    other_batch = {**small, "method": "int8", "global_batch_tokens": 4096}
    assert len(summarize([small, other_batch])) == 2
    assert len(summarize([small, {**small, "method": "int8"}])) == 1


def test_a_replaced_record_is_said_on_the_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", [record("100mbit", "torch:none", 0)])
    again = write_jsonl(tmp_path / "b.jsonl", [record("100mbit", "torch:none", 0)])
    assert main(["report", str(first), str(again), "--out", str(tmp_path / "rep")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a.jsonl:1 (`torch:none`, seed 0) is replaced by the later" in out


def test_a_run_whose_first_evaluation_came_after_the_budget_has_no_loss_there(
        tmp_path: Path) -> None:
    late = record("100mbit", PSGD, 0)  # 0.5 s a step: evaluated at 15 s and 20 s only
    late["eval_history"] = late["eval_history"][3:]
    records = [record("100mbit", m, 0) for m in ("torch:none", TOPK)] + [late]
    [s] = summarize(records)
    assert s.budget_s == 10.0  # the top-k run's last evaluation
    assert s.method(PSGD).at_budget is None and s.method(TOPK).at_budget is not None
    text = write_report(records, tmp_path).read_text()
    assert md_table(text, "100mbit, 2 ranks, shared link")[PSGD]["val loss at 10.0 s"] == "-"
    assert 'a run whose first evaluation\n  came after B, or that never evaluated, shows "-"' \
        in text


def test_what_auto_chose_is_a_table_and_a_bad_auto_field_is_refused(tmp_path: Path) -> None:
    rec = record("100mbit", "torch:none", 0)
    auto = {**record("100mbit", TOPK, 0), "auto": {"decisions": [
        {"from_step": 15, "method": "int8", "costs_ms": {"fp16": 55.6, "int8": 51.2},
         "why": "7.9% cheaper than fp16"}], "overhead": {
        "agree_ms": 12.0, "trials_ms": 26.4, "steps_ms": 12800.0, "fraction": 0.003}}}
    auto["compare"] = {**auto["compare"], "method": "auto"}
    text = write_report([rec, auto], tmp_path).read_text()
    assert "| `auto` | 0 | 15 | `int8` | `fp16` 55.6, `int8` 51.2 | 7.9% cheaper" in text
    assert ("What deciding cost: `auto` seed 0: 0.30% of its step time (agreement 12 ms, "
            "losing trial steps 26 ms)") in text
    with pytest.raises(ValueError, match=r"record 2: auto.overhead must be"):
        summarize([rec, {**auto, "auto": {**auto["auto"], "overhead": {"fraction": "x"}}}])
    auto["auto"]["decisions"][0].pop("costs_ms")
    with pytest.raises(ValueError, match=r"record 2: auto.decisions\[0\] must be"):
        summarize([rec, auto])


def test_the_report_says_how_many_steps_after_the_link_changed_auto_switched(
        tmp_path: Path) -> None:
    rec = record("100mbit", "torch:none", 0)
    auto = {**record("100mbit", TOPK, 0), "auto": {"decisions": [
        {"from_step": 15, "method": "fp16", "costs_ms": {"fp16": 30.0, "int8": 40.0},
         "why": "no candidate more than 5% cheaper"},
        {"from_step": 212, "method": "fp16", "costs_ms": {"fp16": 31.0, "int8": 40.0},
         "why": "no candidate more than 5% cheaper"},
        {"from_step": 230, "method": "int8", "costs_ms": {"fp16": 180.0, "int8": 90.0},
         "why": "50.0% cheaper than fp16"}]}}
    changes = [{"after_s": 15.0, "rate": "25mbit", "at_unix": 1.0e9, "at_step": 208}]
    auto["compare"] = {**auto["compare"], "method": "auto", "rate_changes": changes}
    rec["compare"] = {**rec["compare"], "rate_changes": changes}
    text = write_report([rec, auto], tmp_path).read_text()
    assert ("`auto` seed 0: to 25mbit at step 208, next decision at step 212 (4 steps "
            "later): kept `fp16`, switched to `int8` at step 230 (22 steps later)") in text
    auto["auto"]["decisions"].pop(1)
    text = write_report([rec, auto], tmp_path).read_text()
    assert ("`auto` seed 0: to 25mbit at step 208, next decision at step 230 (22 steps "
            "later): switched to `int8`.") in text
    auto["auto"]["decisions"].pop()
    text = write_report([rec, auto], tmp_path).read_text()
    assert "`auto` seed 0: to 25mbit at step 208, no decision after it" in text
    assert "`torch:none` seed 0: to" not in text  # only auto runs decide


def test_auto_choices_are_placed_on_its_loss_curve() -> None:
    """Where ``auto``'s choice changed (its first choice too), on the run's evaluations:
    by step, or by time interpolated between evaluations; a kept choice is no mark."""
    auto = {**record("100mbit", TOPK, 0), "auto": {"decisions": [
        {"from_step": 15, "method": "fp16", "costs_ms": {}, "why": ""},
        {"from_step": 25, "method": "fp16", "costs_ms": {}, "why": ""},
        {"from_step": 35, "method": "int8", "costs_ms": {}, "why": ""}]}}
    run = parse_run(auto, "record 1")
    by_step = auto_switches(run, 0)
    assert [(x, codec) for x, _, codec in by_step] == [(15.0, "fp16"), (35.0, "int8")]
    losses = LOSSES[(TOPK, 0)]
    assert by_step[0][1] == pytest.approx((losses[1] + losses[2]) / 2)
    by_time = auto_switches(run, 1)
    assert by_time[1][0] == pytest.approx(35 * STEP_S["100mbit"][TOPK])
    assert auto_switches(parse_run(record("100mbit", TOPK, 0), "record 1"), 1) == []
