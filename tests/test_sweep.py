"""The bandwidth sweep: the time model, its validation and break-even bandwidths, on
synthetic records made by the model itself (so every figure is known exactly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradzip.compare.report import write_report
from gradzip.compare.summary import summarize
from gradzip.compare.sweep import BreakEven, Curve, Fit, break_even, link_burst, sweep

RATES = {"25mbit": 25e6, "50mbit": 50e6, "100mbit": 100e6, "1gbit": 1e9}
#: per method: seconds of compute per step, link bytes per rank per step, one collective
METHODS = {"torch:none": (0.010, 500_000), "torch:fp16": (0.011, 250_000),
           "int8": (0.014, 130_000), "ef | topk(ratio=0.05)": (0.016, 40_000)}
EFFICIENCY = 0.96
STEPS = 300
EVALS = range(0, STEPS + 1, 25)


def loss_at(method: str, step: int) -> float:
    """Every method converges to 3.0; topk slower, reaching the target later."""
    slow = 2.0 if method.startswith("ef") else 1.0
    return 3.0 + 2.0 * (1 - min(step / (200 * slow), 1.0)) ** 2


def record(method: str, rate: str, seed: int = 0) -> dict[str, Any]:
    """A compare record whose times follow the model: 2 ranks on a shared link, a
    token bucket of tc's burst for the rate."""
    t0, per_rank = METHODS[method]
    truth = Fit(method, seed, None, t0, 1.0, 2 * per_rank, EFFICIENCY)
    step_s = truth.step_s(RATES[rate], 0.0, link_burst(rate))  # its latency is in t0
    return {
        "seed": seed, "world_size": 2, "steps": STEPS, "val_loss": loss_at(method, STEPS),
        "train_time_s": STEPS * step_s, "bytes_wire_total": STEPS * per_rank,
        "bytes_raw_total": STEPS * 500_000, "aggregation": {"all_reduce": STEPS},
        "extra_collectives": 0, "step_time_ms_p50": step_s * 1e3,
        "eval_history": [{"step": s, "train_time_s": s * step_s,
                          "val_loss": loss_at(method, s)} for s in EVALS],
        "compare": {"method": method, "seed": seed, "ranks": 2, "rate": rate,
                    "link": "shared", "shaped": True,
                    "achieved_rate_bits_per_s": EFFICIENCY * RATES[rate]},
    }


def records() -> list[dict[str, Any]]:
    return [record(m, r) for r in RATES for m in METHODS]


def test_the_model_fitted_at_one_rate_projects_the_others_exactly() -> None:
    sw = sweep(summarize(records()))
    assert sw is not None and sw.fitted.rate == "1gbit"  # the fastest shaped rate
    assert {c.rate for c in sw.checks} == {"25mbit", "50mbit", "100mbit"}
    assert len(sw.checks) == 3 * 3  # topk never reaches the target: no time to check
    assert "ef | topk(ratio=0.05)" not in {c.method for c in sw.curves}
    assert sw.worst_error() == pytest.approx(0.0, abs=1e-9)
    none = next(c for c in sw.curves if c.method == "torch:none")
    # target 3.0 x 1.01 = 3.03: loss(step) <= 3.03 first at step 200 (175 gives 3.0312)
    assert none.steps == 200
    assert none.mean("t0_s") == pytest.approx(0.010)
    assert none.mean("link_bytes") == 1_000_000  # both ranks through one bucket


def test_break_even_against_the_16_bit_all_reduce() -> None:
    sw = sweep(summarize(records()))
    assert sw is not None and sw.baseline is not None
    assert sw.baseline.method == "torch:fp16"
    evens = sw.break_evens()
    # int8: A = 200 (0.014 + 50us), K = 200 * 8 * 260 kB / 0.96 (both ranks), against
    # fp16's A = 200 (0.011 + 50us), K = 200 * 8 * 500 kB / 0.96: B* = dK / dA
    k16, k8 = 200 * 8 * 500_000 / EFFICIENCY, 200 * 8 * 260_000 / EFFICIENCY
    assert evens["int8"].kind == "below"
    assert evens["int8"].bits_per_s == pytest.approx((k16 - k8) / (200 * 0.003))
    # torch:none sends more but computes less (no cast): it wins only above B*
    knone = 200 * 8 * 1_000_000 / EFFICIENCY
    assert evens["torch:none"].kind == "above"
    assert evens["torch:none"].bits_per_s == pytest.approx((k16 - knone) / (200 * -0.001))
    assert evens["torch:none"].describe().startswith("wins only above")


@pytest.mark.parametrize("a, k, kind", [
    (1.0, 10.0, "below"), (-1.0, 10.0, "always"), (1.0, -10.0, "never"),
    (-1.0, -10.0, "above"), (0.0, 0.0, "never"), (-1.0, 0.0, "always"),
    (1.0, 0.0, "never"), (1.0, -10.0, "never")])
def test_break_even_kinds(a: float, k: float, kind: str) -> None:
    base = Curve("torch:fp16", 10.0, 100.0, 1, 1)
    m = Curve("m", 10.0 + a, 100.0 - k, 1, 1)
    even = break_even(m, base)
    assert even.kind == kind
    if kind in ("below", "above"):
        assert even.bits_per_s == pytest.approx(k / a)
    assert isinstance(even, BreakEven) and even.describe()


def test_unshaped_runs_have_no_projection() -> None:
    recs = records()
    for r in recs:
        r["compare"]["shaped"] = False
    assert sweep(summarize(recs)) is None


def test_the_report_shows_the_projection_and_its_validation(tmp_path: Path) -> None:
    text = write_report(records(), tmp_path, latency_s=50e-6).read_text()
    assert "## Across bandwidths: projected from 1gbit, 2 ranks, shared link" in text
    assert "largest error 0.0%, within the 15% bar" in text
    assert "wins below" in text and "(the 16-bit baseline)" in text
    assert (tmp_path / "sweep_1gbit-2r-shared.png").stat().st_size > 1000
    # the last section recommends per range of rates: int8 where bytes cost most
    last = text.split("## Recommendation")[1]
    assert "soonest to the target is `int8` from 10 Mbit/s to" in last
    assert last.rstrip().endswith("100 Gbit/s.")
    # fitted at 100mbit instead, the others validate it
    text = write_report(records(), tmp_path, fit_rate="100mbit").read_text()
    assert "projected from 100mbit" in text and "| 1gbit |" in text


def test_a_link_bound_fit_is_flagged_in_the_report(tmp_path: Path) -> None:
    """At 25 Mbit/s the bucket never refills between torch:none's steps: its t0 is
    only bounded, and the report says so."""
    text = write_report(records(), tmp_path, fit_rate="25mbit").read_text()
    assert "Link-bound at the fitted rate" in text and "`torch:none`" in text
    sw = sweep(summarize(records()), fit_rate="25mbit")
    assert sw is not None
    none = next(c for c in sw.curves if c.method == "torch:none")
    assert all(f.link_bound for f in none.fits)


def test_the_emulated_curve_passes_through_the_measured_runs() -> None:
    """The dashed curve of the figure: the model on the token-bucket link at each rate,
    where the records (made by that model) lie."""
    sw = sweep(summarize(records()))
    assert sw is not None
    fp16 = next(c for c in sw.curves if c.method == "torch:fp16")
    for rate, bits in RATES.items():
        measured = next(r["compare"] for r in records()
                        if r["compare"]["method"] == "torch:fp16"
                        and r["compare"]["rate"] == rate)
        step_s = record("torch:fp16", rate)["train_time_s"] / STEPS
        assert fp16.emulated_at(bits) == pytest.approx(200 * step_s)
        assert measured["rate"] == rate
    assert fp16.at(1e8) > fp16.emulated_at(1e8)  # a real NIC banks no credit


def test_a_run_at_its_target_from_the_first_evaluation_does_not_break_the_report(
        tmp_path: Path) -> None:
    """A time to target of 0 s (an evaluation at step 0 already at the target) is
    left out of the validation instead of dividing by it."""
    recs = records()
    for r in recs:
        if r["compare"]["method"] == "int8" and r["compare"]["rate"] == "50mbit":
            r["eval_history"][0]["val_loss"] = 1.0
    text = write_report(recs, tmp_path).read_text()
    assert "| int8 | 50mbit |" not in text and "| int8 | 25mbit |" in text
