"""The race's answer in one sentence per link setting: which method to use on this link,
by how much against the best 16-bit all-reduce, and whether the lead is more than noise.

Computed from the setting's table, nothing else:

- the **winner** is the method with the smallest mean time to target among those whose
  runs all reached it (else among those with any run that did, said so);
- the **reference** is the best 16-bit all-reduce that ran (``torch:fp16``,
  ``torch:bf16``, ``fp16``, ``bf16``): what anyone would use without gradzip; without
  one, the uncompressed baseline, named as such;
- **noise**: a time to target is known only to the spacing of the run's evaluations (the
  target is crossed somewhere between two of them), so a lead smaller than that spacing
  is no lead; with two or more seeds on both sides the lead must also exceed twice the
  standard error of the difference of the means; with one seed that noise is unmeasured,
  and the sentence says so.
"""

from __future__ import annotations

import math
import statistics

from gradzip.compare.summary import SIXTEEN_BIT, MethodSummary, SettingSummary


def eval_spacing(m: MethodSummary) -> float | None:
    """Median training time between successive evaluations over the method's runs."""
    gaps = [t1 - t0 for r in m.runs
            for (_, t0, _), (_, t1, _) in zip(r.history(), r.history()[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def _mean_ttt(m: MethodSummary) -> float:
    assert m.ttt is not None and m.ttt.reached is not None
    return m.ttt.reached.mean


def _reached(m: MethodSummary) -> bool:
    return bool(m.ttt and m.ttt.reached)


def _noise_clause(best: MethodSummary, ref: MethodSummary, lead_s: float) -> str:
    """Whether ``lead_s`` (seconds) exceeds evaluation spacing and seed noise."""
    spacing = max((s for s in (eval_spacing(best), eval_spacing(ref)) if s is not None),
                  default=0.0)
    if lead_s <= spacing:
        return (f"within evaluation noise: evaluations are {spacing:.1f} s apart, so each "
                "time is known only to that (train longer, with --steps, for a clearer "
                "answer)")
    b, r = best.ttt.reached, ref.ttt.reached  # type: ignore[union-attr]
    assert b is not None and r is not None
    if b.n < 2 or r.n < 2 or b.std is None or r.std is None:
        return (f"more than the {spacing:.1f} s between evaluations, but with one seed "
                "the seed-to-seed noise is unmeasured (run --seeds 3)")
    two_se = 2 * math.sqrt(b.std ** 2 / b.n + r.std ** 2 / r.n)
    if lead_s <= two_se:
        return (f"within seed noise: twice the standard error over {min(b.n, r.n)} seeds "
                f"is {two_se:.1f} s")
    return (f"more than the {spacing:.1f} s between evaluations and than seed noise "
            f"(twice the standard error over {min(b.n, r.n)} seeds: {two_se:.1f} s)")


def verdict(s: SettingSummary) -> str:
    """The recommendation sentence of one setting (see the module docstring)."""
    where = f"On this link ({s.setting.title()})"
    if s.mixed_source:
        return (f"{where}: no verdict, since its runs ran different versions of gradzip's "
                "source (see the note); rerun them from one checkout.")
    if s.target is None and s.baseline and s.method(s.baseline).diverged:
        return (f"{where}: no verdict, since the baseline `{s.baseline}` diverged (see the "
                "note), so its final loss sets no target; rerun it at a lower learning rate.")
    if s.target is None:
        return (f"{where}: no verdict, since no baseline (torch:none, none or a 16-bit "
                "all-reduce) finished with a validation loss to set the target.")
    if not any(m.ttt and m.ttt.runs for m in s.methods):
        return (f"{where}: no verdict, since no run here was measured (each needs timed "
                "training steps and an evaluation; the notes say what each run lacks).")
    reached = [m for m in s.methods if _reached(m)]
    if not reached:
        return (f"{where}: no method reached the target ({s.target:.4f}) within its steps; "
                "train longer (--steps) for a verdict.")
    complete = [m for m in reached if m.ttt and m.ttt.complete]
    best = min(complete or reached, key=_mean_ttt)
    partial = "" if complete else " (not all of its runs reached it)"
    sixteen = [m for m in reached if m.method in SIXTEEN_BIT]
    ref = min(sixteen, key=_mean_ttt) if sixteen else next(
        (m for m in reached if m.method == s.baseline), None)
    ref_name = ("the best 16-bit all-reduce" if sixteen
                else "the uncompressed baseline (no 16-bit all-reduce ran or reached it)")
    if ref is None:
        blind = [m.method for m in s.methods if (m.method in SIXTEEN_BIT or m.method ==
                                                  s.baseline) and not (m.ttt and m.ttt.runs)]
        why = (f"{', '.join(f'`{b}`' for b in blind)} ran but was not measured, so no "
               "speed-up against it is known" if blind else
               "neither a 16-bit all-reduce nor the uncompressed baseline reached it")
        return (f"{where}, `{best.method}` reached the target soonest, in "
                f"{_mean_ttt(best):.1f} s of training{partial}; {why}.")
    if best is ref or best.method in SIXTEEN_BIT:
        others = [m for m in reached if m is not best]
        after = (f"; the next, `{min(others, key=_mean_ttt).method}`, took "
                 f"{min(map(_mean_ttt, others)):.1f} s" if others else "")
        return (f"{where}, use `{best.method}`: it reached the target soonest, in "
                f"{_mean_ttt(best):.1f} s of training{partial}; no compression method beat "
                f"it here{after}.")
    if _mean_ttt(best) <= 0:
        return (f"{where}, `{best.method}` was at the target at its first evaluation, "
                "before any training time: the target says nothing about speed here "
                "(evaluate later, or train from a state further from it).")
    lead_s = _mean_ttt(ref) - _mean_ttt(best)
    speedup = _mean_ttt(ref) / _mean_ttt(best)
    return (f"{where}, use `{best.method}`: it reached the target soonest, in "
            f"{_mean_ttt(best):.1f} s of training{partial}, {speedup:.2f}x "
            f"as fast as {ref_name} `{ref.method}` ({_mean_ttt(ref):.1f} s, {lead_s:.1f} s "
            f"later); the lead is {_noise_clause(best, ref, lead_s)}.")


def verdicts(summaries: list[SettingSummary]) -> list[str]:
    """One sentence per setting, slowest link first (the summaries' order)."""
    return [verdict(s) for s in summaries]
