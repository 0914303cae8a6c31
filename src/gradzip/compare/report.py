"""``report.md`` and the terminal table of a comparison.

``write_report(records, out)`` is what ``gradzip report`` and ``gradzip compare`` call:
it summarizes the records per link setting (``gradzip.compare.summary``), draws the
figures (``gradzip.compare.plots``) and writes ``report.md`` next to them. The table's
cells are made once (``table``) and rendered both as markdown and as a ``rich`` table,
so the terminal shows exactly what the report says.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradzip.compare.runs import DIVERGED_RISE
from gradzip.compare.summary import (
    TARGET_FACTOR,
    MethodSummary,
    SettingSummary,
    Speedup,
    Stat,
    TimeToTarget,
    summarize,
)

DASH = "-"

#: what each column means; printed above the tables of report.md
COLUMN_HELP = f"""\
- **link bytes/step**: `bytes_wire_total / steps`, the bytes rank 0 put on its links per
  optimizer step by gradzip's link byte model (`docs/results.md` in gradzip),
  uncompressed first steps included; mean over seeds.
- **uplink bytes/step (kernel)** (`nodes=NxL` links only): the bytes a node's uplink, the
  slow link between nodes, sent per step as the kernel counted them (frames with their
  headers, the whole run including setup and evaluations), mean over nodes and seeds:
  the figure every method is compared on there, PyTorch's included.
- **vs fp32**: `bytes_raw_total / bytes_wire_total`, PyTorch's uncompressed all-reduce of
  the same gradients over this method's bytes. The trainer keeps gradients in fp32 under
  every `--dtype` (bf16 and fp16 are autocast), so that all-reduce is an fp32 one.
  **vs 16-bit**: against an all-reduce of 16-bit gradients (what `torch:fp16` sends), half
  the fp32 bytes: the fp32 ratio x 2/4.
- **step ms p50**, **tokens/s**: over the timed steps (warm-up excluded); mean over seeds.
- **comm share**: time with a collective in flight / step time (`comm_ratio`). It overlaps
  backward, so it is not the time communication added to a step.
- **final val loss**: at the last evaluation, mean ± sample standard deviation over seeds;
  **Δ vs baseline**: the change of that mean against the baseline's. "(diverged)": the
  run's loss went non-finite, or ended above its first evaluation's and {DIVERGED_RISE}x its lowest;
  a diverged run reaches no target (the notes give its first, lowest and last losses).
- **val loss at B s**: the validation loss after B seconds of training time, linearly
  interpolated between the two evaluations around it (never extrapolated: "-" if a run's
  evaluations do not span B). By default B is the earliest time at which a run of the
  setting made its last evaluation (`--budget-s` sets it): a run whose first evaluation
  came after B, or that never evaluated, shows "-".
- **time to target**: training time (step time, evaluation excluded) of the first
  evaluation at or below the run's target: the final validation loss of the baseline run
  with the same seed (same initialization and data order) x {TARGET_FACTOR}, so seed
  luck cancels; its resolution is the evaluation schedule. Mean ± std over the seeds
  that reached it; "k/n not reached" counts those that did not.
- **speed-up**: the reference's mean time to target / this method's (above 1: sooner);
  first against the best 16-bit all-reduce (`torch:bf16` where the backend has it, else
  `torch:fp16`), then against the baseline and each `torch:powersgd(...)` of the setting.
- "-": not measured or not applicable (PyTorch's hooks have no gradzip byte counters).
"""

#: what each figure shows; printed once, above the settings
FIGURE_HELP = """\
- **Validation loss against training time and against steps**: one line per method, the
  mean over seeds (interpolated onto their common evaluation times), the seeds' min-max
  range shaded; the dashed line is the target, the dotted one the time budget.
- **Pareto front**: compression ratio against the fp32 all-reduce (log scale) against the
  change of final validation loss vs the baseline; right and low is better. The dashed
  front joins the outlined methods that no other method beats on both.
- **Step-time breakdown**, ms per step (means over timed steps): **compute** is data +
  forward + backward + optimizer as timed on the training thread (it includes whatever
  communication backward had to wait for); **comm** is the time with a collective in
  flight, which runs during backward; **codec** is encode + decode time per step (all
  steps, warm-up included). Comm and codec overlap compute, so a bar can be taller than
  the step: the black tick is the measured mean step time, and what lies above it ran
  overlapped. Exposed communication cannot be told apart from compute in these phases;
  the difference between a method's tick and the baseline's is the honest measure.
"""

#: what the link kinds of ``gradzip compare`` are
LINK_KINDS = {
    "shared": "one token bucket on the loopback shared by all ranks (each of W ranks gets "
              "about RATE/W when all send)",
    "per-rank": "one shaped link per rank (a veth pair each, like one NIC per node)",
    "unshaped": "the loopback, not rate-limited",
    "replicas": "modelled: the ranks are replicas in one process, each step's time one "
                "replica's CPU time plus a latency per collective and one rank's bytes over "
                "RATE (a NIC per rank); not emulated",
}


def fmt_bytes(b: float | None) -> str:
    """Bytes with a binary unit (``1.50 MiB``)."""
    if b is None:
        return DASH
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_ratio(r: float | None) -> str:
    """A compression ratio, three significant digits (``120x``, ``12.5x``, ``1.00x``)."""
    if r is None:
        return DASH
    return f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


def fmt_num(x: float | None, spec: str) -> str:
    """A number in a format spec, "-" when unknown."""
    return DASH if x is None else format(x, spec)


def fmt_pct(x: float | None) -> str:
    """A signed percentage, ``+0.66%``; a change that rounds to zero is ``+0.00%``."""
    return DASH if x is None else f"{round(x, 2) + 0.0:+.2f}%"


def fmt_stat(s: Stat | None, digits: int = 4) -> str:
    """``mean ± std`` (std only with more than one value)."""
    if s is None:
        return DASH
    return f"{s.mean:.{digits}f}" + (f" ± {s.std:.{digits}f}" if s.std is not None else "")


def fmt_ttt(t: TimeToTarget | None) -> str:
    """Time to target in seconds, with how many evaluated runs never reached it."""
    if t is None or t.runs == 0:
        return DASH
    if t.reached is None:
        return "not reached" + (f" ({t.runs}/{t.runs})" if t.runs > 1 else "")
    text = fmt_stat(t.reached, 1)
    return text + (f" ({t.not_reached}/{t.runs} not reached)" if t.not_reached else "")


def fmt_speedup(s: Speedup | None) -> str:
    """``5.20x``; ``*`` when some run of either side never reached the target."""
    return DASH if s is None else f"{s.value:.2f}x" + ("*" if s.partial else "")


def header(summary: SettingSummary) -> list[str]:
    """The column titles of one setting's table."""
    budget = f"val loss at {summary.budget_s:.1f} s" if summary.budget_s is not None \
        else "val loss at budget"
    refs = [f"speed-up vs {ref}" if i == 0 else f"vs {ref}"
            for i, ref in enumerate(summary.references)]
    uplink = ["uplink bytes/step (kernel)"] if _has_uplinks(summary) else []
    return ["method", "seeds", "link bytes/step", *uplink, "vs fp32", "vs 16-bit",
            "step ms p50", "tokens/s", "comm share", "final val loss", "Δ vs baseline",
            budget, "time to target (s)", *refs]


def _has_uplinks(summary: SettingSummary) -> bool:
    """Whether the setting's runs crossed node uplinks the kernel counted."""
    return any(m.uplink_per_step is not None for m in summary.methods)


def row(summary: SettingSummary, m: MethodSummary) -> list[str]:
    """One method's cells."""
    uplink = [fmt_bytes(m.uplink_per_step)] if _has_uplinks(summary) else []
    return [m.method, str(len(m.runs)), fmt_bytes(m.wire_per_step), *uplink,
            fmt_ratio(m.ratio_fp32),
            fmt_ratio(m.ratio_16bit), fmt_num(m.step_ms_p50, ".1f"),
            fmt_num(m.tokens_per_s, ",.0f"),
            fmt_num(None if m.comm_share is None else m.comm_share * 100, ".1f") +
            ("%" if m.comm_share is not None else ""),
            fmt_stat(m.val_loss) + _diverged_mark(m), fmt_pct(m.delta_pct),
            fmt_stat(m.at_budget), fmt_ttt(m.ttt),
            *(fmt_speedup(m.speedups.get(ref)) for ref in summary.references)]


def _diverged_mark(m: MethodSummary) -> str:
    """`` (diverged)`` after a final loss whose runs diverged (`` (1/3 diverged)`` when
    some did): that loss is not a converged method's (the notes say why)."""
    if not m.diverged:
        return ""
    return " (diverged)" if m.diverged == len(m.runs) else f" ({m.diverged}/{len(m.runs)} diverged)"


def table(summary: SettingSummary) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one setting's table, as plain text cells."""
    return header(summary), [row(summary, m) for m in summary.methods]


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table; ``|`` inside cells (spec chains) is escaped."""
    lines = ["| " + " | ".join(map(_md_cell, head)) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def _rate(bits: float) -> str:
    """An achieved rate to a tenth: ``100.4 Mbit/s``."""
    from gradzip.compare.sweep import rate_label

    return rate_label(bits, ".1f")


def link_lines(summary: SettingSummary) -> list[str]:
    """How the link of a setting was made: rate, kind, achieved rate, shaped or not."""
    runs, s = summary.runs, summary.setting
    rates = sorted({r.achieved_rate for r in runs if r.achieved_rate is not None})
    if not rates:
        achieved = "achieved rate not measured"
    elif len(rates) == 1:
        achieved = f"achieved {_rate(rates[0])}"
    else:
        achieved = f"achieved {_rate(rates[0])} to {_rate(rates[-1])} (varies between runs)"
    shaped = sum(r.shaped for r in runs)
    if s.link == "replicas":
        state, achieved = "modelled (not emulated: the validation across rates is the model's "\
            "own arithmetic)", "the nominal rate"
    elif shaped == len(runs):
        state = "shaped"
    elif shaped == 0:
        state = "**unshaped: results not representative of a slow link**"
    else:
        state = (f"shaped in {shaped} of {len(runs)} runs; **the unshaped ones are not "
                 "representative of a slow link**")
    kind = f"{s.link} link" + (f" ({LINK_KINDS[s.link]})" if s.link in LINK_KINDS else "")
    lines = [f"- **Link**: rate {s.rate or 'unlimited'}, {kind}, {achieved}; {state}."]
    models = sorted({r.link_model for r in runs if r.link_model})
    lines += [f"- **Link model**: {m}" for m in models]
    return lines


def setting_lines(summary: SettingSummary) -> list[str]:
    """Baseline, target and time budget of a setting, as markdown bullets."""
    lines = link_lines(summary)
    lines.append(f"- **Workload**: {summary.setting.workload.describe()} (runs race each "
                 "other only on the same model, parameters, tokens per step and data).")
    if summary.baseline and summary.target is not None:
        base = summary.method(summary.baseline)
        loss = base.val_loss.mean if base.val_loss else float("nan")
        lines.append(f"- **Baseline**: `{summary.baseline}`, final validation loss {loss:.4f} "
                     f"(mean of {len(base.runs)}); **target** per seed: that seed's "
                     f"baseline final loss x {TARGET_FACTOR} (mean {summary.target:.4f}).")
    if summary.budget_s is not None:
        why = "--budget-s" if summary.budget_given else \
            "the earliest last evaluation of the setting's runs"
        lines.append(f"- **Time budget** for the loss at a fixed time: {summary.budget_s:.1f} s "
                     f"of training time ({why}; linear interpolation between evaluations).")
    return lines


_PLOT_TITLES = {
    "loss_time": "Validation loss against training time",
    "loss_steps": "Validation loss against steps",
    "pareto": "Pareto front: compression ratio against loss change",
    "breakdown": "Step-time breakdown",
}


def setting_section(summary: SettingSummary, plots: dict[str, Path]) -> str:
    """One setting's markdown: link, baseline, table, notes and figures."""
    from gradzip.compare.verdict import verdict

    parts = [f"## {summary.setting.title()}", "\n".join(setting_lines(summary)),
             markdown_table(*table(summary)), f"**Verdict.** {verdict(summary)}"]
    if summary.notes or summary.warnings:
        parts.append("\n".join(f"- {n}" for n in summary.warnings + summary.notes))
    if per_link := per_link_lines(summary):
        parts.append("\n".join(per_link))
    if auto := auto_table(summary):
        parts.append(auto)
    if faults := fault_lines(summary):
        parts.append("\n".join(faults))
    if summary.trials:
        parts.append("\n".join(tuning_lines(summary)))
    parts += [f"![{_PLOT_TITLES[name]}]({path.name})" for name, path in plots.items()]
    return "\n\n".join(parts)


def tuning_lines(summary: SettingSummary) -> list[str]:
    """``--tune``: every trial of each tuned method, the raced one in bold."""
    lines = ["**Tuning** (`--tune`: every method ran every trial; the table races each "
             "method's trial with the lowest mean final validation loss):"]
    for method, results in summary.trials.items():
        cells = []
        for t in results:
            loss = "-" if t.val_loss is None else f"{t.val_loss:.4f}"
            cell = f"{t.trial} → {loss} ({t.seeds} seed{'s' if t.seeds > 1 else ''})"
            cells.append(f"**{cell}, raced**" if t.chosen else cell)
        lines.append(f"- `{method}`: " + "; ".join(cells))
    return lines


def per_link_lines(summary: SettingSummary) -> list[str]:
    """Each link of the methods whose reductions cross several (HSDP's shard and
    replicate, hierarchical DDP's intra- and inter-node): gradzip's link bytes per rank
    per step and ratio, from the first seed's record."""
    lines = []
    for m in summary.methods:
        record, steps = m.runs[0].record, m.runs[0].steps_run()
        links = record.get("links") or {}
        if not links or not steps:
            continue
        cells = [f"{name} {v['bytes_wire'] / steps:,.0f} B"
                 + (f" ({v['compression_ratio']:.2f}x)" if v.get("compression_ratio") else "")
                 for name, v in sorted(links.items())]
        lines.append(f"- **{m.method}** per link, per rank per step: " + ", ".join(cells))
    head = ("**Per link** (gradzip's link model, per rank per step; a DDP run's first "
            "step is flat and in no link):")
    return [head, *lines] if lines else []


def auto_table(summary: SettingSummary) -> str:
    """What every ``auto`` run chose, from which step, on which agreed costs (ms per
    step, the slowest rank's median over the trial): a markdown table, or ''."""
    rows = []
    for m in summary.methods:
        for r in m.runs:
            for d in (r.record.get("auto") or {}).get("decisions") or []:
                costs = ", ".join(f"`{name}` {ms:.1f}" for name, ms in d["costs_ms"].items())
                rows.append(f"| `{m.method}` | {r.seed} | {d['from_step']} | `{d['method']}` "
                            f"| {costs} | {d['why']} |")
    if not rows:
        return ""
    spent = [f"`{m.method}` seed {r.seed}: {o['fraction']:.2%} of its step time "
             f"(agreement {o['agree_ms']:.0f} ms, losing trial steps {o['trials_ms']:.0f} ms)"
             for m in summary.methods for r in m.runs
             if (o := (r.record.get("auto") or {}).get("overhead"))]
    foot = ["", "What deciding cost: " + "; ".join(spent) + "."] if spent else []
    reacted = [line for m in summary.methods for r in m.runs
               for line in _reactions(m.method, r)]
    if reacted:
        foot += ["", "When the link changed (placed at a step by the namespace's log and "
                 "the run's step clock): " + "; ".join(reacted) + "."]
    head = ("**What `auto` chose** (each trial's agreed cost, ms per step: the slowest "
            "rank's median)\n\n| method | seed | from step | chose | costs | why |\n"
            "|---|---:|---:|---|---|---|")
    return "\n".join([head, *rows, *foot])


def fault_lines(summary: SettingSummary) -> list[str]:
    """The faults of the setting's runs: how many, where, and what each cost.

    A ``down`` span of ``--rate`` (or one that loses or delays packets): the step it
    began in and the time from the last step
    that ended before it to the first that ended after the link came back, less that
    many of the run's median steps. A rank that died (``--kill``) under torchrun: the
    steps trained again and the time down, both on the race's clock
    (``Run.charged_s``). A replica group that died under ``--ft``: when, when it healed,
    and what the groups that went on lost."""
    lines = []
    for m in summary.methods:
        for r in m.runs:
            lines += [f"- `{m.method}` seed {r.seed}: {text}"
                      for text in _faults(r.record) + _deaths(r.record)]
    if not lines:
        return []
    return ["**Faults** (a link down: every packet dropped, placed at a step by the "
            "namespace's log and the run's step clock, its cost the stall beyond the run's "
            "median step; a rank or replica group that died: what the restart or the heal "
            "cost):", *lines]


def _deaths(record: dict[str, Any]) -> list[str]:
    """A line per death: a torchrun restart (``restarts``) or a torchft replica group
    that died and healed (``ft_job``)."""
    out = []
    own = [] if record.get("ft") else (record.get("restarts") or {}).get("each") or []
    for r in own:  # a torchft group's own restarts are its failures in ft_job
        lost = float(r.get("lost_train_s") or 0.0) + float(r.get("down_s") or 0.0)
        out.append(f"a rank died after step {r['from_step'] + r['lost_steps']} (its last "
                   f"logged step): torchrun restarted every worker from the checkpoint of "
                   f"step {r['from_step']}; {r['lost_steps']} logged step(s) trained again "
                   f"({r['lost_train_s']:.1f} s) and {r['down_s']:.1f} s from the last log "
                   f"line to the restart: {lost:.1f} s on the race's clock")
    for f in (record.get("ft_job") or {}).get("failures") or []:
        back = ("never healed" if f.get("back_s") is None else
                f"it was back {f['back_s']:.1f} s later, healed from a live peer")
        step = f" (after step {f['last_step']}, its last logged)" if f.get("last_step") \
            else ""
        out.append(f"replica group {f['replica']} died {f['died_s']:.1f} s into the job"
                   f"{step}: {back}; the other groups went on and lost "
                   f"{f['survivor_lost_s']:.1f} s each ({f['failed_rounds']} round(s) "
                   "rolled back)")
    return out


def _fault_kind(rate: str) -> str | None:
    """A schedule element's fault in words (``down``, ``loss 2%, delay 300ms``); None
    for a plain rate."""
    from gradzip.comm.netns import DOWN, split_rate

    if rate == DOWN:
        return "down"
    try:
        impairments = split_rate(rate)[1]
    except ValueError:
        return None
    return ", ".join(f"{k} {v}" for k, v in impairments.items()) or None


def _from_the_start(record: dict[str, Any]) -> list[str]:
    """A line for a link impaired from the run's first second (``100mbit+loss=2%``): it
    has no unimpaired steps to cost it against, so it only says so."""
    rate = (record.get("compare") or {}).get("rate")
    if not isinstance(rate, str):
        return []
    first = rate.split(">")[0].partition("@")[0].strip()
    fault = _fault_kind(first)
    return [f"{fault} from the start (no unimpaired steps to cost it against: race the "
            "plain rate beside it)"] if fault else []


def _faults(record: dict[str, Any]) -> list[str]:
    changes = (record.get("compare") or {}).get("rate_changes") or []
    clock = record.get("step_clock") or {}
    ends, every = clock.get("end_unix") or [], int(clock.get("every") or 1)
    median_s = (record.get("step_time_ms_p50") or 0.0) / 1e3
    out = _from_the_start(record)
    for i, change in enumerate(changes):
        fault = _fault_kind(str(change.get("rate")))
        if fault is None:
            continue
        up = changes[i + 1] if i + 1 < len(changes) else None
        span = (up["after_s"] - change["after_s"]) if up else None
        text = f"{fault} for {span:g} s" if span is not None else fault
        at, back = change.get("at_unix"), (up or {}).get("at_unix")
        ended = at is not None and record.get("failed") and (not ends or ends[-1] < (
            back if back is not None else float("inf")))
        if not ended and (change.get("at_step") is None or at is None):
            out.append(f"{text}, after the run's last step (no cost)")
            continue
        before = bisect.bisect_left(ends, at) - 1
        after = bisect.bisect_left(ends, back) if back is not None else len(ends)
        if ended or before < 0 or after >= len(ends):
            failed = record.get("failed") or {}
            where = (f"from step {change['at_step']}" if change.get("at_step") is not None
                     else f"in step {failed['step']}" if failed else "after its last step")
            out.append(f"{text} {where}: the run ended in it"
                       + (f" (a collective failed in step {failed['step']}: "
                          f"{failed['error']}; checkpoint of step {record.get('steps')})"
                          if failed else " (see its log)"))
            continue
        steps = (after - before) * every
        cost = ends[after] - ends[before] - steps * median_s
        out.append(f"{text} from step {change['at_step']}: {steps} step(s) took "
                   f"{ends[after] - ends[before]:.1f} s, {cost:.1f} s more than usual")
    return out


def _reactions(method: str, run: Any) -> list[str]:
    """For each change of the link's rate in an ``auto`` run: the step it fell in, the
    first decision after it (how many steps later, and whether it switched), and the
    first switch if a later decision made it."""
    decisions = (run.record.get("auto") or {}).get("decisions") or []
    if not decisions:
        return []
    out = []
    for change in (run.record.get("compare") or {}).get("rate_changes") or []:
        at = change.get("at_step")
        if at is None:
            continue
        held = ([d["method"] for d in decisions if d["from_step"] < at] or [None])[-1]
        after = [d for d in decisions if d["from_step"] >= at]
        text = f"`{method}` seed {run.seed}: to {change['rate']} at step {at}, "
        if not after:
            out.append(text + "no decision after it")
            continue
        first = after[0]
        verb = "kept" if first["method"] == held else "switched to"
        text += (f"next decision at step {first['from_step']} ({first['from_step'] - at} "
                 f"steps later): {verb} `{first['method']}`")
        switch = next((d for d in after[1:] if d["method"] != held), None)
        if verb == "kept" and switch is not None:
            text += (f", switched to `{switch['method']}` at step {switch['from_step']} "
                     f"({switch['from_step'] - at} steps later)")
        out.append(text)
    return out


def render(summaries: list[SettingSummary], out: Path,
           sources: Sequence[str] | None = None, *, fit_rate: str | None = None,
           latency_s: float | None = None) -> Path:
    """Draw every setting's figures into ``out`` and write ``out/report.md``; its path.

    With a shaped setting, the section across bandwidths (``compare.sweep``) follows:
    projected from ``fit_rate``'s setting (default the fastest shaped one) with
    ``latency_s`` per collective (default ``sweep.DEFAULT_LATENCY_S``)."""
    from gradzip.compare.plots import write_plots
    from gradzip.compare.sweep import DEFAULT_LATENCY_S, sweep
    from gradzip.compare.sweep_report import sweep_section

    out.mkdir(parents=True, exist_ok=True)
    runs = sum(len(s.runs) for s in summaries)
    intro = f"{runs} runs in {len(summaries)} link setting(s)"
    if sources:
        intro += ", from " + ", ".join(f"`{s}`" for s in sources)
    parts = ["# gradzip comparison", intro + ".",
             "Each setting (link rate, ranks, link kind) is compared on its own; rows are "
             "methods, figures are over their seeds.", "### Columns", COLUMN_HELP.strip(),
             "### Figures", FIGURE_HELP.strip()]
    parts += [setting_section(s, write_plots(s, out)) for s in summaries]
    projection = sweep(summaries, fit_rate, DEFAULT_LATENCY_S if latency_s is None
                       else latency_s)
    if projection is not None:
        parts.append(sweep_section(projection, out))
    parts += frontier_sections(summaries, projection, out)
    parts.append(recommendation(summaries, projection))
    path = out / "report.md"
    path.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return path


def frontier_sections(summaries: list[SettingSummary], projection: Any,
                      out: Path) -> list[str]:
    """The low-bandwidth frontier (``compare.frontier``) of every setting that ran a
    local-update method or SNOO; times to target where ``projection`` was fitted there."""
    from gradzip.compare.frontier import frontier, has_frontier
    from gradzip.compare.frontier_report import frontier_section

    parts = []
    for s in summaries:
        if not has_frontier(s):
            continue
        here = projection if projection is not None and projection.fitted == s.setting \
            else None
        bound = {c.method for c in here.curves if any(f.link_bound for f in c.fits)} \
            if here else set()
        parts.append(frontier_section(frontier(s, here), out, bound))
    return parts


def recommendation(summaries: list[SettingSummary], projection: Any) -> str:
    """The report's last section: each measured setting's verdict, then what the
    projection across bandwidths says."""
    from gradzip.compare.sweep_report import recommendation_line
    from gradzip.compare.verdict import verdict

    lines = ["## Recommendation", *(f"- {verdict(s)}" for s in summaries)]
    if projection is not None and (line := recommendation_line(projection)):
        lines.append(f"- {line}")
    return "\n".join(lines)


def write_report(records: list[dict[str, Any]], out: Path, budget_s: float | None = None, *,
                 where: list[str] | None = None, sources: Sequence[str] | None = None,
                 fit_rate: str | None = None, latency_s: float | None = None) -> Path:
    """Write ``report.md`` and its PNG figures into ``out`` from results records.

    ``budget_s`` fixes the time budget of the loss-at-time column (default: per setting,
    the earliest end of evaluations). ``where`` names each record in errors (``file:line``,
    default ``record N``); ``sources`` lists the input files in the report. Returns the
    path of ``report.md``; raises ValueError for a record the report cannot read.
    """
    if not records:
        raise ValueError("no results records to report on")
    return render(summarize(records, budget_s, where), Path(out), sources,
                  fit_rate=fit_rate, latency_s=latency_s)


#: columns of the first half when a table is split for a narrow terminal (the rest after)
_SPLIT_AT = 8


def _width(head: list[str], rows: list[list[str]]) -> int:
    """Characters a rich table of these cells needs without wrapping (3 per border)."""
    cols = zip(head, *rows, strict=True)
    return sum(max(len(c) for c in col) + 3 for col in cols) + 1


def _rich_table(title: str, head: list[str], rows: list[list[str]]) -> Any:
    """A rich Table of plain-text cells (escaped: specs may contain ``[``)."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title))
    t.add_column(escape(head[0]), no_wrap=True, min_width=min(max(len(r[0]) for r in rows), 40))
    for h in head[1:]:
        t.add_column(escape(h), justify="right", overflow="fold")
    for r in rows:
        t.add_row(*map(escape, r))
    return t


def rich_tables(summaries: list[SettingSummary], width: int | None = None) -> list[Any]:
    """The report's tables as ``rich`` Tables, one per setting; a table wider than
    ``width`` is split in two (bytes and speed, then quality and time to target), each
    half keeping the method column."""
    tables = []
    for s in summaries:
        title = s.setting.title()
        if not all(r.shaped for r in s.runs):
            title += " (unshaped: not a slow link)"
        if s.target is not None:
            title += f", target {s.target:.4f}"
        head, rows = table(s)
        if width is None or _width(head, rows) <= width:
            tables.append(_rich_table(title, head, rows))
            continue
        for part in (slice(1, _SPLIT_AT), slice(_SPLIT_AT, None)):
            tables.append(_rich_table(title, [head[0], *head[part]],
                                      [[r[0], *r[part]] for r in rows]))
    return tables


def print_tables(summaries: list[SettingSummary], console: Any = None) -> None:
    """Print the report's tables on the terminal, split in two where it is too narrow
    (a log file gets them whole)."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: do not squeeze the table into 80 columns
            console = Console(width=240)
    from rich.markup import escape

    from gradzip.compare.verdict import verdicts

    for t in rich_tables(summaries, console.width):
        console.print(t)
    for s in summaries:
        for warning in s.warnings:
            console.print(escape(f"note ({s.setting.link_title()}): {warning}"))
    for sentence in verdicts(summaries):
        console.print(escape(sentence))
