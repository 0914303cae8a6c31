"""The low-bandwidth frontier: local-update methods against a matched baseline.

For a setting whose runs include local-update methods (``diloco``, ``sparseloco``) or
SNOO, one table row per method over its seeds:

- link bytes per token, and how many times fewer than a 16-bit DDP all-reduce of the
  same gradients sends every step (the per-step baseline's fp32 all-reduce link model,
  halved: what ``torch:bf16`` sends on NCCL);
- for sparsifiers, payload bits per kept value for indices and values;
- final validation loss, and its change against DDP (the setting's baseline) and
  against SNOO (DDP plus DiLoCo's outer step), seed by seed;
- the time to the baseline's final loss x 1.01 at 100 Mbit/s and 1 Gbit/s from the
  race's bandwidth model (``sweep.py``; real links, no token-bucket credit).

**The gap against length.** A method's gap to DDP at step ``s`` is its loss over DDP's
at the same step, minus 1, seed by seed, averaged. From step ``FIT_FROM`` on, where the
gap is positive, ``gap = a * s ** b`` is fitted by least squares on logarithms; with
``b < 0`` the gap would reach ``CLOSED`` (1%) at ``(CLOSED / a) ** (1 / b)`` steps: a
projection from this run's horizon, not a measurement.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from gradzip.compare.runs import Run
from gradzip.compare.summary import GRAD_BYTES, MethodSummary, SettingSummary, Stat
from gradzip.compare.sweep import Sweep

#: the steps the table of gaps reports
GAP_STEPS = (300, 1000, 2000)
#: the fit of the gap uses evaluations from this step on (earlier ones are warm-up)
FIT_FROM = 300
#: the gap the projection asks for: within 1% of DDP
CLOSED = 0.01
#: rates of the time-to-target columns, bits/s
FRONTIER_RATES = (100e6, 1e9)
#: method kinds of the frontier (``gradzip.comm.method``)
LOCAL_KINDS = ("local", "snoo")


def method_kind(name: str) -> str:
    """``codec``, ``torch``, ``local`` or ``snoo`` (``unknown`` if it does not parse)."""
    from gradzip.comm.method import parse_method

    try:
        return str(parse_method(name).kind)
    except ValueError:
        return "unknown"


@dataclass(frozen=True)
class GapFit:
    """``gap = a * steps ** b`` over the evaluations from ``FIT_FROM`` on."""

    a: float
    b: float
    points: int

    def at(self, steps: float) -> float:
        return self.a * steps ** self.b

    @property
    def closes_at(self) -> float | None:
        """Steps at which the fitted gap reaches ``CLOSED``; None if it does not shrink."""
        if self.b >= 0:
            return None
        return (CLOSED / self.a) ** (1 / self.b) if self.a > CLOSED else None


@dataclass
class Gap:
    """One method's gap to DDP against training length."""

    method: str
    #: (step, mean gap over the seeds evaluated at that step in both)
    curve: list[tuple[float, float]]
    fit: GapFit | None

    def at(self, step: float) -> float | None:
        return next((g for s, g in self.curve if s == step), None)


@dataclass
class FrontierRow:
    """One method's row of the frontier table, over its seeds."""

    method: str
    kind: str
    seeds: int
    bytes_per_token: float | None
    vs_16bit: float | None
    bits_per_kept: dict[str, float] | None
    val_loss: Stat | None
    vs_ddp_pct: float | None
    vs_snoo_pct: float | None
    #: rate -> modelled seconds to the target (None: no seed reached it); empty without
    #: a bandwidth model fitted on this setting (no shaped runs)
    time_to_target: dict[float, float | None] = field(default_factory=dict)
    reached: int = 0


@dataclass
class Frontier:
    """A setting's frontier: its rows, its SNOO method (if any) and each method's gap."""

    setting: SettingSummary
    rows: list[FrontierRow]
    snoo: str | None
    gaps: list[Gap]

    @property
    def baseline(self) -> str | None:
        return self.setting.baseline


def has_frontier(summary: SettingSummary) -> bool:
    """Whether the setting ran a local-update method or SNOO next to a baseline."""
    return summary.baseline is not None and any(
        method_kind(m.method) in LOCAL_KINDS for m in summary.methods)


def frontier(summary: SettingSummary, projection: Sweep | None) -> Frontier:
    """The frontier table and the gaps of one setting (``has_frontier``)."""
    snoo = next((m.method for m in summary.methods if method_kind(m.method) == "snoo"),
                None)
    base = summary.method(summary.baseline) if summary.baseline else None
    ref = summary.method(snoo) if snoo else None
    rows = [_row(m, base, ref, projection) for m in summary.methods]
    gaps = [gap(m, base) for m in summary.methods if base is not None and m is not base]
    return Frontier(summary, rows, snoo, [g for g in gaps if g.curve])


def _row(m: MethodSummary, base: MethodSummary | None, snoo: MethodSummary | None,
         projection: Sweep | None) -> FrontierRow:
    tokens = [t for r in m.runs if (t := r.num("global_batch_tokens"))]
    per_token = m.wire_per_step / statistics.fmean(tokens) if tokens and m.wire_per_step \
        else None
    row = FrontierRow(m.method, method_kind(m.method), len(m.runs), per_token,
                      vs_16bit(m, base), _bits_per_kept(m.runs), m.val_loss,
                      paired_change(m.runs, base.runs) if base else None,
                      paired_change(m.runs, snoo.runs) if snoo and snoo is not m else None)
    if projection is None:  # no shaped runs to fit the bandwidth model on: no column
        return row
    curve = next((c for c in projection.curves if c.method == m.method), None)
    for bits in FRONTIER_RATES:
        row.time_to_target[bits] = curve.at(bits) if curve else None
    row.reached = curve.reached if curve else 0
    return row


def vs_16bit(m: MethodSummary, base: MethodSummary | None) -> float | None:
    """How many times fewer link bytes per step than a 16-bit all-reduce of the model's
    gradients every step: the per-step baseline's fp32 all-reduce (its link model,
    ``bytes_raw``), halved. A local-update method's own ``bytes_raw`` is per
    synchronization, so it is not the reference."""
    ref = base.raw_per_step if base is not None and method_kind(base.method) in (
        "torch", "codec") else None
    if not ref or not m.wire_per_step:
        return None
    return ref * 2 / GRAD_BYTES / m.wire_per_step


def _bits_per_kept(runs: list[Run]) -> dict[str, float] | None:
    found = [b for r in runs if isinstance(b := r.record.get("bits_per_kept_value"), dict)]
    if not found:
        return None
    return {k: statistics.fmean(float(b[k]) for b in found) for k in ("indices", "values")}


def paired_change(runs: list[Run], reference: list[Run]) -> float | None:
    """Mean over the seeds both ran of final val loss / the reference's - 1, in %; a
    run that diverged on either side is no gap (``Run.diverged``)."""
    ref = {r.seed: loss for r in reference
           if (loss := r.num("val_loss")) is not None and r.diverged() is None}
    changes = [loss / ref[r.seed] - 1 for r in runs
               if (loss := r.num("val_loss")) is not None and r.seed in ref
               and r.diverged() is None]
    return 100 * statistics.fmean(changes) if changes else None


def gap(m: MethodSummary, base: MethodSummary) -> Gap:
    """``m``'s gap to ``base`` at every step both evaluated, over their common seeds; a
    run that diverged on either side is left out (its curve would fit its blow-up)."""
    ref = {r.seed: {s: loss for s, _, loss in r.history()} for r in base.runs
           if r.diverged() is None}
    kept = [r for r in m.runs if r.diverged() is None]
    by_step: dict[float, list[float]] = {}
    for r in kept:
        theirs = ref.get(r.seed, {})
        for s, _, loss in r.history():
            if s in theirs:
                by_step.setdefault(s, []).append(loss / theirs[s] - 1)
    seeds = len(kept)
    curve = sorted((s, statistics.fmean(g)) for s, g in by_step.items() if len(g) == seeds)
    return Gap(m.method, curve, fit_gap(curve))


def fit_gap(curve: list[tuple[float, float]]) -> GapFit | None:
    """Least squares of log gap on log steps, from ``FIT_FROM`` on where the gap is
    positive; None with fewer than 3 such points."""
    return _least_squares([(math.log(s), math.log(g)) for s, g in curve
                           if s >= FIT_FROM and g > 0])


def _least_squares(pts: list[tuple[float, float]]) -> GapFit | None:
    """``log gap = log a + b log steps`` by least squares; None with under 3 points."""
    if len(pts) < 3:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return GapFit(math.exp(my - b * mx), b, len(pts))


@dataclass
class LengthGap:
    """One method's final gap to DDP in runs of several lengths (each run with its own
    learning-rate schedule), and ``gap = a * steps ** b`` fitted over them."""

    method: str
    #: (steps, final loss over the baseline's, seed by seed, averaged, minus 1)
    points: list[tuple[float, float]]
    fit: GapFit | None
    #: (steps, runs that diverged, runs) where some run diverged: no point, not fitted
    diverged: list[tuple[float, int, int]] = field(default_factory=list)


def run_length(summary: SettingSummary) -> float | None:
    """The steps the setting's baseline runs trained (one length per results file)."""
    if summary.baseline is None:
        return None
    steps = [s for r in summary.method(summary.baseline).runs if (s := r.num("steps"))]
    return max(steps) if steps else None


def run_ranks(summary: SettingSummary) -> float | None:
    """The ranks (or replicas) of the setting's runs."""
    return float(summary.setting.ranks) if summary.setting.ranks else None


def gaps_by_length(summaries: list[SettingSummary],
                   x_of: Callable[[SettingSummary], float | None] = run_length
                   ) -> list[LengthGap]:
    """Each method's final gap at each length (a summary per length: the runs of one
    ``--steps``; or per ``x_of``, e.g. ``run_ranks``), in the order methods first appear,
    for methods raced at two lengths or more; fitted where 3 or more leave it behind
    DDP. A length where some run of a method diverged (``Run.diverged``) gives it no
    point: its loss is no gap to fit, and keeping only the seeds that held would flatter
    it; ``LengthGap.diverged`` says where."""
    points: dict[str, list[tuple[float, float]]] = {}
    diverged: dict[str, list[tuple[float, int, int]]] = {}
    for s in summaries:
        steps = x_of(s)
        if steps is None:
            continue
        base = s.method(s.baseline) if s.baseline else None
        if base is not None and base.diverged:  # no reference here (``baseline_diverged``)
            continue
        for m in s.methods:
            if base is None or m is base:
                continue
            if m.diverged:
                diverged.setdefault(m.method, []).append((steps, m.diverged, len(m.runs)))
                points.setdefault(m.method, [])
            elif (change := paired_change(m.runs, base.runs)) is not None:
                points.setdefault(m.method, []).append((steps, change / 100))
    out = []
    for method, pts in points.items():
        if len(pts) + len(diverged.get(method, [])) < 2:  # one length has no trend
            continue
        pts.sort()
        positive = [(math.log(x), math.log(g)) for x, g in pts if g > 0]
        out.append(LengthGap(method, pts, _least_squares(positive),
                             sorted(diverged.get(method, []))))
    return out


def baseline_diverged(summaries: list[SettingSummary],
                      x_of: Callable[[SettingSummary], float | None] = run_length
                      ) -> list[float]:
    """The lengths (or ranks) whose baseline diverged: ``gaps_by_length`` has no gap there."""
    return [x for s in summaries if s.baseline and s.method(s.baseline).diverged
            and (x := x_of(s)) is not None]


__all__ = ["CLOSED", "FIT_FROM", "FRONTIER_RATES", "GAP_STEPS", "Frontier", "FrontierRow",
           "Gap", "GapFit", "LengthGap", "baseline_diverged", "fit_gap", "frontier", "gap",
           "gaps_by_length", "has_frontier", "method_kind", "paired_change", "run_length",
           "run_ranks"]
