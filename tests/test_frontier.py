"""The low-bandwidth frontier (``compare.frontier``) on synthetic records whose losses
follow a known gap law, so every figure of the table and the fit is known exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradzip.compare.frontier import CLOSED, fit_gap, frontier, has_frontier, method_kind
from gradzip.compare.report import write_report
from gradzip.compare.summary import summarize

STEPS = 2000
EVALS = range(50, STEPS + 1, 50)
#: per method: (link bytes per rank per step, gap law a * s ** b, offset by seed)
METHODS: dict[str, tuple[float, float, float]] = {
    "torch:none": (560_000, 0.0, 0.0),
    "snoo(sync_every=32) | fp16": (280_000, -0.01, 0.0),  # 1% better than DDP throughout
    "sparseloco": (200, 2.0, -0.5),
    "diloco(sync_every=32) | int8": (4_400, 0.5, -0.25),
}


def ddp_loss(step: float, seed: int) -> float:
    return 3.0 + 3.0 / (1 + step / 100) + 0.01 * seed


def loss(method: str, step: float, seed: int) -> float:
    _, a, b = METHODS[method]
    gap = a if b == 0.0 else a * step ** b
    return ddp_loss(step, seed) * (1 + gap)


def record(method: str, seed: int) -> dict[str, Any]:
    per_rank = METHODS[method][0]
    step_s = 0.02 + 8 * 2 * per_rank / 100e6
    rec = {
        "seed": seed, "world_size": 2, "steps": STEPS, "global_batch_tokens": 1024,
        "val_loss": loss(method, STEPS, seed), "train_time_s": STEPS * step_s,
        # a local method's bytes_raw is its fp32 pseudo-gradient all-reduce per sync
        "bytes_wire_total": STEPS * per_rank,
        "bytes_raw_total": STEPS * 560_000 // (32 if method != "torch:none" else 1),
        "aggregation": {"all_reduce": STEPS}, "extra_collectives": 0,
        "eval_history": [{"step": s, "train_time_s": s * step_s,
                          "val_loss": loss(method, s, seed)} for s in EVALS],
        "compare": {"method": method, "seed": seed, "ranks": 2, "rate": "100mbit",
                    "link": "shared", "shaped": True, "achieved_rate_bits_per_s": 96e6},
    }
    if method == "sparseloco":
        rec["bits_per_kept_value"] = {"indices": 7.5 + seed, "values": 2.5}
    return rec


def records() -> list[dict[str, Any]]:
    return [record(m, seed) for m in METHODS for seed in (0, 1)]


def test_only_settings_with_local_updates_or_snoo_have_a_frontier() -> None:
    assert [method_kind(m) for m in METHODS] == ["torch", "snoo", "local", "local"]
    assert has_frontier(summarize(records())[0])
    plain = [r for r in records() if r["compare"]["method"] in ("torch:none", "int8")]
    assert not has_frontier(summarize(plain)[0])


def test_the_table_compares_seed_by_seed_against_ddp_and_snoo() -> None:
    f = frontier(summarize(records())[0], None)
    assert f.baseline == "torch:none" and f.snoo == "snoo(sync_every=32) | fp16"
    rows = {r.method: r for r in f.rows}
    sparse = rows["sparseloco"]
    gap_end = 2.0 * STEPS ** -0.5
    assert sparse.vs_ddp_pct == pytest.approx(100 * gap_end)
    assert sparse.vs_snoo_pct == pytest.approx(100 * ((1 + gap_end) / 0.99 - 1))
    assert sparse.bytes_per_token == pytest.approx(200 / 1024)
    # a 16-bit all-reduce: half the fp32 all-reduce's 560,000 bytes per step
    assert sparse.vs_16bit == pytest.approx(280_000 / 200)
    assert sparse.bits_per_kept == {"indices": 8.0, "values": 2.5}
    assert rows["snoo(sync_every=32) | fp16"].vs_snoo_pct is None  # not against itself
    assert sparse.time_to_target == {}  # no bandwidth model given: no time column


def test_the_gap_law_is_recovered_and_projected_to_one_percent() -> None:
    f = frontier(summarize(records())[0], None)
    gaps = {g.method: g for g in f.gaps}
    sparse = gaps["sparseloco"]
    assert sparse.at(300) == pytest.approx(2.0 * 300 ** -0.5)
    assert sparse.fit is not None
    assert (sparse.fit.a, sparse.fit.b) == (pytest.approx(2.0), pytest.approx(-0.5))
    assert sparse.fit.closes_at == pytest.approx((CLOSED / 2.0) ** (1 / -0.5))  # 40,000
    assert gaps["snoo(sync_every=32) | fp16"].fit is None  # never behind DDP
    assert fit_gap([(300, 0.1), (1000, 0.12), (2000, 0.15)]).closes_at is None


def test_the_report_has_the_frontier_section_and_its_figure(tmp_path: Path) -> None:
    write_report(records(), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "## The low-bandwidth frontier" in text
    assert "~40,000 steps (projected)" in text
    assert "not reached" in text  # sparseloco never reaches DDP x 1.01 in this horizon
    assert (tmp_path / "gap_100mbit-2r-shared.png").stat().st_size > 10_000


def _length_records(steps: int) -> list[dict[str, Any]]:
    """Runs of ``steps`` whose final gap follows 3.0 * steps ** -0.5 (sparseloco) and
    stays at -1% (snoo)."""
    out = []
    for method in ("torch:none", "sparseloco", "snoo(sync_every=32) | fp16"):
        for seed in (0, 1):
            rec = record(method, seed)
            gap = {"torch:none": 0.0, "sparseloco": 3.0 * steps ** -0.5}.get(method, -0.01)
            rec["steps"], rec["val_loss"] = steps, ddp_loss(steps, seed) * (1 + gap)
            rec["eval_history"] = [h for h in rec["eval_history"] if h["step"] <= steps]
            out.append(rec)
    return out


def test_by_length_fits_the_final_gap_of_runs_of_several_lengths(tmp_path: Path) -> None:
    import json

    from gradzip.cli import main

    files = []
    for steps in (300, 1000, 2000, 4000):
        path = tmp_path / f"len{steps}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _length_records(steps)))
        files.append(str(path))
    assert main(["report", "--by-length", *files, "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "lengths.md").read_text()
    # 3 / sqrt(steps) reaches 1% at (3 / 0.01) ** 2 = 90,000 steps
    assert "| sparseloco | +17.32% | +9.49% | +6.71% | +4.74% | 3·s^-0.500 | " \
        "~90,000 steps (projected) |" in text
    assert "within 1% at 4,000 steps (measured)" in text  # snoo: never behind
    assert (tmp_path / "out" / "gap_length.png").stat().st_size > 10_000
    assert main(["report", "--by-length", files[0], "--out", str(tmp_path / "o")]) == 2


def test_by_length_leaves_a_diverged_length_out_of_the_fit_and_says_so(
        tmp_path: Path) -> None:
    import json

    from gradzip.cli import main

    files = []
    for steps in (300, 1000, 2000, 4000):
        recs = _length_records(steps)
        if steps == 4000:  # sparseloco blows up late, finite: 40 at its last evaluation
            for rec in recs[2:4]:
                rec["eval_history"][-1]["val_loss"] = rec["val_loss"] = 40.0
        path = tmp_path / f"len{steps}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        files.append(str(path))
    assert main(["report", "--by-length", *files, "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "lengths.md").read_text()
    # the fit over the three lengths that did not diverge is the same law
    assert "| sparseloco | +17.32% | +9.49% | +6.71% | diverged (2/2) | 3·s^-0.500 | " \
        "~90,000 steps (projected) |" in text, text
    assert "Diverged, and left out of the fit: `sparseloco` at 4,000 steps (2 of 2 " \
        "runs)" in text, text
    # a length that only a diverged run of a method has keeps its column; a length whose
    # baseline diverged has no gap at all
    recs = _length_records(4000)[:4]  # torch:none and sparseloco, no snoo
    for rec in recs[2:]:
        rec["eval_history"][-1]["val_loss"] = rec["val_loss"] = 40.0
    Path(files[-1]).write_text("".join(json.dumps(r) + "\n" for r in recs))
    files.append(str(tmp_path / "len8000.jsonl"))
    Path(files[-1]).write_text("".join(json.dumps(r) + "\n" for r in _length_records(8000)[:4]))
    blown = _length_records(1000)
    for rec in blown[:2]:  # torch:none at 1,000 steps
        rec["eval_history"][-1]["val_loss"] = rec["val_loss"] = 40.0
    Path(files[1]).write_text("".join(json.dumps(r) + "\n" for r in blown))
    assert main(["report", "--by-length", *files, "--out", str(tmp_path / "o2")]) == 0
    text = (tmp_path / "o2" / "lengths.md").read_text()
    assert "| sparseloco | +17.32% | - | +6.71% | diverged (2/2) | +3.35% |" in text, text
    assert "the baseline at 1,000 steps (no gap there)" in text, text


def test_by_ranks_puts_the_final_gap_of_each_number_of_replicas_side_by_side(
        tmp_path: Path) -> None:
    import json

    from gradzip.cli import main

    files = []
    for world in (2, 4, 8):
        recs = []
        for method in ("torch:none", "sparseloco"):
            for seed in (0, 1):
                rec = record(method, seed)
                gap = 0.05 * world ** 0.5 if method == "sparseloco" else 0.0
                rec["val_loss"] = ddp_loss(STEPS, seed) * (1 + gap)
                rec["world_size"] = rec["compare"]["ranks"] = world
                rec["compare"]["link"] = "replicas"
                recs.append(rec)
        path = tmp_path / f"w{world}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        files.append(str(path))
    assert main(["report", "--by-ranks", *files, "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "ranks.md").read_text()
    assert "| method | W = 2 | W = 4 | W = 8 | fit: a·W^b |" in text
    assert "| sparseloco | +7.07% | +10.00% | +14.14% | 0.05·W^0.500 |" in text
    assert "projected" not in text  # more ranks is not a horizon to extrapolate to
    assert (tmp_path / "out" / "gap_ranks.png").stat().st_size > 10_000
    assert main(["report", "--by-ranks", "--by-length", *files, "--out",
                 str(tmp_path / "o")]) == 2
