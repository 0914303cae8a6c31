"""Per link setting: the baseline, the target, and every method's figures over its seeds.

The question the report answers is "on this link, which method reaches the quality of
uncompressed training soonest". So, within one setting (rate, ranks, link kind):

- the **baseline** is ``torch:none`` (DDP without a hook) if it ran, else gradzip's
  ``none``, else the 16-bit all-reduce; the **target** of a run is paired with its
  seed: the final validation loss of the baseline run with the same seed (same
  initialization, same data order) x 1.01.
  Seeds differ by more than 1% from one another on short runs, so a pooled target would
  measure seed luck, not the method; a run whose seed has no baseline run gets the
  baseline's mean final loss x 1.01;
- a run's **time to target** is the training time (``train_time_s`` of ``eval_history``:
  step time only, evaluation excluded) of its first evaluation at or below its target;
  runs that never got there are counted, not dropped; a run that diverged (its loss went
  non-finite, or grew back past its first evaluation's: ``Run.diverged``) counts as
  never getting there, whatever an early evaluation touched, and is noted;
- its **loss at the time budget** is the validation loss at a fixed training time,
  linearly interpolated between the two evaluations around it (never extrapolated);
  the default budget is the earliest end of any run's evaluations in the setting (a
  run whose first evaluation came later has none);
- **speed-ups** are ratios of mean times to target: first against the best 16-bit
  all-reduce that ran (``torch:bf16`` where the backend has it, else ``torch:fp16``:
  what anyone would use without gradzip), then against the baseline and every
  ``torch:powersgd(...)`` of the setting;
- with ``--tune``, each method's runs are those of its best trial (``trials.py``).

Compression ratios come from the link byte model's totals: ``bytes_raw_total /
bytes_wire_total`` is against PyTorch's uncompressed all-reduce of the same gradients.
The trainer keeps parameters, and so gradients, in fp32 under every ``--dtype``
(bf16/fp16 are autocast), so that baseline is fp32; against a 16-bit all-reduce (what
``torch:fp16`` sends) the ratio is half of it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from gradzip.compare.runs import Run, Setting, parse_run
from gradzip.compare.trials import TrialResult, best_trial

#: the target is the baseline's mean final validation loss times this
TARGET_FACTOR = 1.01
#: bytes per gradient element in ``bytes_raw``: the trainer's gradients are fp32
GRAD_BYTES = 4
#: preferred baselines (whose final loss sets the target), in order: uncompressed, else
#: the 16-bit all-reduce
BASELINES = ("torch:none", "none", "torch:bf16", "torch:fp16")
#: 16-bit all-reduces: the first reference of every speed-up
SIXTEEN_BIT = ("torch:bf16", "torch:fp16", "bf16", "fp16")


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (``None`` for a single value) of n values."""

    mean: float
    std: float | None
    n: int


def stat(values: Iterable[float | None]) -> Stat | None:
    """The Stat of the known values; ``None`` when there are none."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    return Stat(statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else None, len(v))


def mean(values: Iterable[float | None]) -> float | None:
    """Mean of the known values, ``None`` when there are none."""
    s = stat(values)
    return s.mean if s else None


def time_to_target(run: Run, target: float) -> float | None:
    """Training time of the run's first evaluation at or below ``target``; None if never,
    or if the run diverged (``Run.reached``)."""
    hit = run.reached(target)
    return hit[1] if hit else None


def loss_at_time(run: Run, budget_s: float) -> float | None:
    """Validation loss at ``budget_s`` of training time, interpolated linearly between the
    evaluations around it; ``None`` outside the evaluated span (no extrapolation)."""
    points = [(t, loss) for _, t, loss in run.history()]
    for (t0, l0), (t1, l1) in zip(points, points[1:], strict=False):
        if t0 <= budget_s <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (budget_s - t0) / (t1 - t0)
    if points and points[-1][0] == budget_s:  # a single evaluation exactly at the budget
        return points[-1][1]
    return None


def final_eval_time(run: Run) -> float | None:
    """Training time of the run's last evaluation, ``None`` without evaluations."""
    h = run.history()
    return h[-1][1] if h else None


@dataclass(frozen=True)
class TimeToTarget:
    """Times to target of a method's runs: a Stat over those that reached it, and a count
    of those that did not (among the runs that had evaluations)."""

    reached: Stat | None
    not_reached: int
    runs: int

    @property
    def complete(self) -> bool:
        """Every evaluated run reached the target: the mean is not flattered."""
        return self.runs > 0 and self.not_reached == 0


@dataclass(frozen=True)
class Speedup:
    """Ratio of mean times to target; ``partial`` when some run of either side never
    reached the target (the mean is then over the runs that did)."""

    value: float
    partial: bool


@dataclass(frozen=True)
class Breakdown:
    """Mean ms per step: compute (data + forward + backward + optimizer, as timed on the
    training thread), comm (time with a collective in flight; it overlaps backward),
    codec (encode + decode per step) and the measured mean step time."""

    compute: float | None
    comm: float | None
    codec: float | None
    step: float | None


@dataclass
class MethodSummary:
    """One method's row: figures averaged over its seeds."""

    method: str
    runs: list[Run]
    wire_per_step: float | None = None
    #: ``nodes=NxL`` links: a node's uplink bytes per step, counted by the kernel
    uplink_per_step: float | None = None
    raw_per_step: float | None = None
    raw_inferred: bool = False
    step_ms_p50: float | None = None
    tokens_per_s: float | None = None
    comm_share: float | None = None
    val_loss: Stat | None = None
    delta_pct: float | None = None
    at_budget: Stat | None = None
    ttt: TimeToTarget | None = None
    speedups: dict[str, Speedup | None] = field(default_factory=dict)
    breakdown: Breakdown | None = None

    @property
    def ratio_fp32(self) -> float | None:
        """Link bytes of the fp32 all-reduce / this method's link bytes."""
        if self.raw_per_step and self.wire_per_step:
            return self.raw_per_step / self.wire_per_step
        return None

    @property
    def ratio_16bit(self) -> float | None:
        """The same against a 16-bit all-reduce (half the fp32 bytes)."""
        r = self.ratio_fp32
        return r * 2 / GRAD_BYTES if r is not None else None

    @property
    def diverged(self) -> int:
        """How many of its runs diverged (``Run.diverged``)."""
        return sum(r.diverged() is not None for r in self.runs)

    @property
    def seeds(self) -> list[int | None]:
        """The seeds of the runs, in order."""
        return [r.seed for r in self.runs]


@dataclass
class SettingSummary:
    """One link setting: its runs, baseline, target, time budget and method rows."""

    setting: Setting
    methods: list[MethodSummary]
    baseline: str | None
    target: float | None  # the mean of the seeds' targets
    budget_s: float | None
    budget_given: bool
    references: list[str]
    notes: list[str] = field(default_factory=list)
    #: seed -> the target of that seed's runs (its baseline run's final loss x 1.01)
    seed_targets: dict[int | None, float] = field(default_factory=dict)
    #: ``--tune``: each tuned method's trials, the chosen one raced (``trials.py``)
    trials: dict[str, list[TrialResult]] = field(default_factory=dict)
    #: notes the terminal shows too: unmeasured runs, replaced records, runs kept apart
    warnings: list[str] = field(default_factory=list)

    @property
    def mixed_source(self) -> bool:
        """Its runs ran more than one version of gradzip's source (``sources_of``)."""
        return len(sources_of(self.runs)) > 1

    def target_for(self, run: Run) -> float | None:
        """The target of ``run``: its seed's, else the mean target."""
        return self.seed_targets.get(run.seed, self.target)

    @property
    def runs(self) -> list[Run]:
        """Every run of the setting."""
        return [r for m in self.methods for r in m.runs]

    def method(self, name: str) -> MethodSummary:
        """The row of one method (KeyError if it did not run here)."""
        for m in self.methods:
            if m.method == name:
                return m
        raise KeyError(name)


def _breakdown(runs: list[Run]) -> Breakdown:
    """The step-time components of a method, averaged over its runs."""
    def compute(r: Run) -> float | None:
        parts = [r.phase(p) for p in ("data", "forward", "backward", "optimizer")]
        known = [p for p in parts if p is not None]
        return sum(known) if known else None

    def codec(r: Run) -> float | None:
        enc, dec, steps = r.num("encode_ms"), r.num("decode_ms"), r.steps_run()
        if (enc is None and dec is None) or not steps:
            return None
        return ((enc or 0.0) + (dec or 0.0)) / steps

    return Breakdown(mean(map(compute, runs)), mean(r.phase("comm") for r in runs),
                     mean(map(codec, runs)), mean(r.num("step_time_ms_mean") for r in runs))


def _raw_by_model(runs: list[Run]) -> dict[Any, float]:
    """Raw (fp32 all-reduce) link bytes per step by model size, from runs that have them:
    the same model on the same ranks sends the same raw bytes whatever the method."""
    found: dict[Any, list[float]] = {}
    for r in runs:
        raw = r.per_step("bytes_raw_total")
        if raw and r.num("params") is not None:
            found.setdefault(r.num("params"), []).append(raw)
    return {k: statistics.fmean(v) for k, v in found.items()}


def _method_row(name: str, runs: list[Run], raw_by_model: dict[Any, float]) -> MethodSummary:
    """A method's figures that do not depend on the other methods."""
    row = MethodSummary(name, runs)
    row.wire_per_step = mean(r.per_step("bytes_wire_total") for r in runs)
    row.uplink_per_step = mean(r.uplink_per_step() for r in runs)
    row.raw_per_step = mean(r.per_step("bytes_raw_total") for r in runs)
    if row.raw_per_step is None and row.wire_per_step is not None:
        row.raw_per_step = mean(raw_by_model.get(r.num("params")) for r in runs)
        row.raw_inferred = row.raw_per_step is not None
    row.step_ms_p50 = mean(r.num("step_time_ms_p50") for r in runs)
    row.tokens_per_s = mean(r.num("tokens_per_s") for r in runs)
    row.comm_share = mean(r.num("comm_ratio") for r in runs)
    row.val_loss = stat(r.num("val_loss") for r in runs)
    row.breakdown = _breakdown(runs)
    return row


def _time_to_target(runs: list[Run], targets: dict[int | None, float],
                    fallback: float) -> TimeToTarget:
    """Times to target (each run's seed's target) of the measured runs with evaluations;
    the others are left out (the setting's notes name the unmeasured ones). A diverged
    run did not reach it, whatever an early evaluation touched (``Run.diverged``)."""
    evaluated = [r for r in runs if r.history() and r.unmeasured() is None]
    times = [time_to_target(r, targets.get(r.seed, fallback)) for r in evaluated]
    return TimeToTarget(stat(times), sum(t is None for t in times), len(evaluated))


def _speedup(ref: MethodSummary, row: MethodSummary) -> Speedup | None:
    """Mean time to target of ``ref`` / that of ``row``."""
    if not (ref.ttt and row.ttt and ref.ttt.reached and row.ttt.reached):
        return None
    if row.ttt.reached.mean <= 0:
        return None
    return Speedup(ref.ttt.reached.mean / row.ttt.reached.mean,
                   not (ref.ttt.complete and row.ttt.complete))


def _default_budget(runs: list[Run]) -> float | None:
    """The earliest end of evaluations over the measured runs (a run whose first
    evaluation came after it has no loss there)."""
    ends = [t for r in runs if r.unmeasured() is None and r.diverged() is None
            and (t := final_eval_time(r)) is not None]
    return min(ends) if ends else None


def summarize_setting(setting: Setting, runs: list[Run],
                      budget_s: float | None = None) -> SettingSummary:
    """Every method's row in one setting, with target, budget and speed-ups filled in."""
    by_method, trials = choose_trials(runs)
    baseline = next((b for b in BASELINES if b in by_method), None)
    order = ([baseline] if baseline else []) + [m for m in by_method if m != baseline]
    raw_by_model = _raw_by_model(runs)
    rows = [_method_row(m, by_method[m], raw_by_model) for m in order]
    base = rows[0] if baseline else None
    # a baseline that diverged in any seed sets no target and no loss change: its other
    # seeds' mean would stand in for that seed's, and its loss is no reference
    sound = base is not None and not base.diverged
    seed_targets = ({r.seed: loss * TARGET_FACTOR for r in base.runs
                     if (loss := r.num("val_loss")) is not None}
                    if base and sound else {})
    target = statistics.fmean(seed_targets.values()) if seed_targets else None
    budget = budget_s if budget_s is not None else _default_budget(runs)
    sixteen = next((m for m in SIXTEEN_BIT if m in by_method), None)
    refs = list(dict.fromkeys(([sixteen] if sixteen else []) + ([baseline] if baseline else [])
                              + [m for m in order if m.startswith("torch:powersgd")]))
    for row in rows:
        if base and sound and base.val_loss and row.val_loss:
            row.delta_pct = (row.val_loss.mean / base.val_loss.mean - 1) * 100
        if budget is not None:
            row.at_budget = stat(loss_at_time(r, budget) for r in row.runs
                                 if r.unmeasured() is None)
        if target is not None:
            row.ttt = _time_to_target(row.runs, seed_targets, target)
    for row in rows:
        row.speedups = {ref: _speedup(rows[order.index(ref)], row) for ref in refs}
    return SettingSummary(setting, rows, baseline, target, budget, budget_s is not None,
                          refs, _notes(rows, baseline, target), seed_targets, trials,
                          warnings=_unmeasured_notes(rows) + _diverged_notes(rows)
                          + _source_notes(runs))


def sources_of(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs by the gradzip source they ran (the record's ``gradzip_source``, a string
    where present: ``parse_run``; records written before it was recorded are left out:
    their source is unknown, not another)."""
    out: dict[str, list[Run]] = {}
    for r in runs:
        if (digest := r.record.get("gradzip_source")) is not None:
            out.setdefault(digest, []).append(r)
    return out


def _source_notes(runs: list[Run]) -> list[str]:
    """A note when the runs of one comparison ran different code: each source with the
    methods that ran it. Typically a tree edited while its race ran (each run starts on
    the code of its own start), or records of two checkouts read together."""
    sources = sources_of(runs)
    if len(sources) < 2:
        return []
    parts = [f"{digest} ({', '.join(dict.fromkeys(r.method for r in its))})"
             for digest, its in sources.items()]
    return [f"These runs ran {len(sources)} different versions of gradzip's source "
            f"(gradzip_source {'; '.join(parts)}), so their differences are not only "
            "their methods': no verdict. Rerun them from one unchanging checkout (a tree "
            "edited during a race changes every run that starts after the edit)."]


def choose_trials(runs: list[Run]) -> tuple[dict[str, list[Run]], dict[str, list[TrialResult]]]:
    """Each method's runs of its best ``--tune`` trial (lowest mean final validation
    loss over seeds), and, for methods with several trials, every trial's result."""
    by_method: dict[str, dict[str, list[Run]]] = {}
    for r in runs:
        by_method.setdefault(r.method, {}).setdefault(r.trial, []).append(r)
    chosen, results = {}, {}
    for method, by_trial in by_method.items():
        # a trial with a diverged seed ranks with the unfinished ones: last
        best = best_trial({t: [None if r.diverged() else r.num("val_loss") for r in rs]
                           for t, rs in by_trial.items()})
        chosen[method] = by_trial[best]
        if len(by_trial) > 1:
            results[method] = [TrialResult(t, mean(r.num("val_loss") for r in rs), len(rs),
                                           t == best) for t, rs in by_trial.items()]
    return chosen, results


def _unmeasured_notes(rows: list[MethodSummary]) -> list[str]:
    """One note per run whose time to target cannot be known (``Run.unmeasured``)."""
    return [f"`{r.method}` seed {r.seed} ({r.where}) was not measured: {why}; it has no "
            "time to target and names no winner." for m in rows for r in m.runs
            if (why := r.unmeasured()) is not None]


def _diverged_notes(rows: list[MethodSummary]) -> list[str]:
    """One note per run that diverged (``Run.diverged``): it reaches no target and names
    no winner, and its loss figures are those of a diverged run."""
    return [f"`{r.method}` seed {r.seed} ({r.where}) diverged: {why}. It counts as not "
            "reaching the target and names no winner; lower its learning rate." for m in rows
            for r in m.runs if (why := r.diverged()) is not None]


def _notes(rows: list[MethodSummary], baseline: str | None, target: float | None) -> list[str]:
    """What a reader must know about the setting's figures beyond the column definitions."""
    notes = []
    if baseline is None:
        notes.append("No baseline (`torch:none`, `none` or a 16-bit all-reduce) ran in this "
                     "setting: no target, no loss change and no speed-ups.")
    elif baseline.startswith("torch:") and baseline[6:] in ("bf16", "fp16"):
        notes.append(f"No uncompressed baseline ran: the target is set by `{baseline}`.")
    elif (diverged := next(r for r in rows if r.method == baseline).diverged):
        notes.append(f"The baseline `{baseline}` diverged in {diverged} of its runs: no "
                     "target and no loss change.")
    elif target is None:
        notes.append(f"The baseline `{baseline}` has no validation loss: no target.")
    inferred = [r.method for r in rows if r.raw_inferred]
    if inferred:
        notes.append("Compression ratios of " + ", ".join(f"`{m}`" for m in inferred)
                     + " use the fp32 bytes per step of the other runs of the same model "
                       "(their records have no `bytes_raw_total`).")
    if any(s and s.partial for r in rows for s in r.speedups.values()):
        notes.append("`*`: some runs never reached the target; the speed-up compares the "
                     "means of the runs that did, which flatters the method whose runs did "
                     "not all get there.")
    return notes


def _dedupe(runs: list[Run]) -> tuple[list[Run], dict[Setting, list[str]]]:
    """Keep the last record of each (setting, method, seed): a re-run replaces the old
    one. Returns the runs kept and, per setting, a note for each replaced record."""
    last: dict[tuple[Any, ...], Run] = {}
    notes: dict[Setting, list[str]] = {}
    for r in runs:
        key = (r.setting, r.method, r.trial, r.seed if r.seed is not None else id(r))
        if key in last:
            notes.setdefault(r.setting, []).append(
                f"{last[key].where} (`{r.method}`, seed {r.seed}) is replaced by the later "
                f"{r.where}.")
        last[key] = r
    return list(last.values()), notes


def summarize(records: list[dict[str, Any]], budget_s: float | None = None,
              where: list[str] | None = None) -> list[SettingSummary]:
    """Settings, slowest link first, each with its method rows (see the module docstring).

    ``where`` names each record in errors and notes (``file:line``); by default
    ``record N``. ``budget_s`` overrides the default time budget of every setting.
    """
    names = where or [f"record {i}" for i in range(1, len(records) + 1)]
    runs, replaced = _dedupe([parse_run(rec, w) for rec, w in zip(records, names, strict=True)])
    by_setting: dict[Setting, list[Run]] = {}
    for r in runs:
        by_setting.setdefault(r.setting, []).append(r)
    links = Counter(s.link_title() for s in by_setting)
    for setting, its_runs in list(by_setting.items()):
        if links[setting.link_title()] > 1:  # several workloads on one link: name them
            named = replace(setting, qualified=True)
            for r in its_runs:
                r.setting = named
            del by_setting[setting]
            by_setting[named] = its_runs
    out = []
    for setting in sorted(by_setting, key=Setting.sort_key):
        summary = summarize_setting(setting, by_setting[setting], budget_s)
        summary.warnings += replaced.get(setting, []) + _kept_apart(setting, by_setting)
        out.append(summary)
    return out


def _kept_apart(setting: Setting, by_setting: dict[Setting, list[Run]]) -> list[str]:
    """A note for each other setting on the same link whose runs ran another workload:
    they are not compared with this one's, and the note says what differs."""
    notes = []
    for other, runs in by_setting.items():
        if other != setting and other.link_title() == setting.link_title():
            diff = "; ".join(setting.workload.differences(other.workload))
            notes.append(f"Not compared with the {len(runs)} run(s) of another workload on "
                         f"this link ({diff}): runs race each other only on the same model, "
                         "parameters, tokens per step and data.")
    return notes

