"""The frontier section of ``report.md`` (``frontier.py``): its tables and the figure
of the gap to DDP against training length; and the final gap against run length or
ranks across results files (``gradzip report --by-length``, ``--by-ranks``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradzip.compare.frontier import (
    CLOSED,
    FIT_FROM,
    FRONTIER_RATES,
    GAP_STEPS,
    LOCAL_KINDS,
    Frontier,
    FrontierRow,
    Gap,
    GapFit,
    LengthGap,
    baseline_diverged,
    gaps_by_length,
    run_length,
    run_ranks,
)
from gradzip.compare.report import fmt_bytes, fmt_pct, fmt_ratio, fmt_stat, markdown_table
from gradzip.compare.runs import DIVERGED_RISE
from gradzip.compare.summary import SettingSummary
from gradzip.compare.sweep import rate_label

FRONTIER_HELP = """
Link bytes per token are this rank's, all steps; **vs 16-bit DDP**: how many times
fewer than a 16-bit all-reduce of the same gradients every step sends (the per-step
baseline's fp32 all-reduce link model, halved). **bits/kept**: payload bits per value a
sparsifier kept, indices / values (values include scales and headers). **vs DDP** and
**vs SNOO**: final validation loss against theirs, seed by seed, averaged. **Time to
target**: to the baseline's final loss x 1.01, projected for real links by the race's
bandwidth model (the section across bandwidths); `≥` where the fitted run was
link-bound, so its compute time is a lower bound; `not reached` where no seed got there
in this horizon.
"""


def fmt_small_bytes(b: float | None) -> str:
    """Bytes with three significant digits below 1 KiB (``0.158 B``), else binary units."""
    if b is None or b >= 1024:
        return fmt_bytes(b)
    return f"{b:.3g} B"


def _seconds(row: FrontierRow, bits: float, bound: bool) -> str:
    if bits not in row.time_to_target:
        return "- (no shaped runs)"
    t = row.time_to_target[bits]
    if t is None:
        return "not reached"
    reached = f" ({row.reached}/{row.seeds} seeds)" if row.reached < row.seeds else ""
    return f"{'≥ ' if bound else ''}{t:,.1f} s{reached}"


def _bits(row: FrontierRow) -> str:
    b = row.bits_per_kept
    return f"{b['indices']:.2f} / {b['values']:.2f}" if b else "-"


def frontier_rows(f: Frontier, bound: set[str]) -> tuple[list[str], list[list[str]]]:
    head = ["method", "seeds", "link bytes/token", "vs 16-bit DDP", "bits/kept (idx / val)",
            "final val loss", f"vs DDP ({f.baseline})",
            f"vs SNOO ({f.snoo})" if f.snoo else "vs SNOO",
            *(f"time to target at {rate_label(b)}" for b in FRONTIER_RATES)]
    rows = [[r.method, str(r.seeds), fmt_small_bytes(r.bytes_per_token), fmt_ratio(r.vs_16bit),
             _bits(r), fmt_stat(r.val_loss), fmt_pct(r.vs_ddp_pct), fmt_pct(r.vs_snoo_pct),
             *(_seconds(r, b, r.method in bound) for b in FRONTIER_RATES)]
            for r in f.rows]
    return head, rows


def _closes(g: Gap) -> str:
    last = g.curve[-1]
    if last[1] <= CLOSED:
        return f"within {CLOSED:.0%} at step {last[0]:,.0f} (measured)"
    if g.fit is None:
        return "too few points to fit"
    at = g.fit.closes_at
    if at is None:
        return "does not close (the fitted gap does not shrink)"
    return f"~{at:,.0f} steps (projected)" if at < 1e6 else f"~{at:.1e} steps (projected)"


def gap_rows(f: Frontier) -> tuple[list[str], list[list[str]]]:
    head = ["method", *(f"gap at {s:,}" for s in GAP_STEPS), "last step", "gap there",
            f"fit from {FIT_FROM}: a·s^b", f"reaches {CLOSED:.0%}"]
    rows = []
    for g in f.gaps:
        behind = g.curve[-1][1] > CLOSED  # a fit only says something for a gap to close
        fit = f"{g.fit.a:.3g}·s^{g.fit.b:.3f}" if g.fit and behind else "-"
        rows.append([g.method, *(fmt_pct(100 * v) if (v := g.at(s)) is not None else "-"
                                 for s in GAP_STEPS),
                     f"{g.curve[-1][0]:,.0f}", fmt_pct(100 * g.curve[-1][1]), fit,
                     _closes(g)])
    return head, rows


def _draw_fit(ax: Any, fit: GapFit | None, start: float, last: float, color: Any) -> None:
    """A fitted gap, dashed, from ``start`` to where it would reach ``CLOSED`` (at least
    ``last``, at most 100x it)."""
    if fit is None:
        return
    end = min(max(fit.closes_at or last, last), 100 * last)
    xs = [start * (end / start) ** (i / 60) for i in range(61)]
    ax.plot(xs, [100 * fit.at(x) for x in xs], color=color, lw=0.9, ls="--")


def _finish(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """The 1% line, the zero line, a log x axis, labels and the legend."""
    from gradzip.compare.plots import legend

    ax.axhline(100 * CLOSED, color="grey", lw=0.8, ls=":", label=f"{CLOSED:.0%} of DDP")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    legend(ax)


def plotted_gaps(f: Frontier) -> list[Gap]:
    """The figure's methods: local-update methods, SNOO and the per-step method with the
    lowest final loss, each with every seed the setting ran (a one-seed probe stays in
    the tables)."""
    seeds = max(r.seeds for r in f.rows)
    rows = {r.method: r for r in f.rows}
    per_step = [r for r in f.rows if r.kind not in LOCAL_KINDS and r.method != f.baseline
                and r.val_loss is not None and r.seeds == seeds
                and not f.setting.method(r.method).diverged]
    best = min(per_step, key=lambda r: r.val_loss.mean if r.val_loss else 0.0, default=None)
    return [g for g in f.gaps if rows[g.method].seeds == seeds
            and (rows[g.method].kind in LOCAL_KINDS or (best and g.method == best.method))]


def plot_gaps(f: Frontier, path: Path) -> Path | None:
    """The gap to DDP against steps, measured (solid) and fitted (dashed, extended to
    where it would reach ``CLOSED``), for ``plotted_gaps``."""
    from gradzip.compare.plots import method_colors, save
    from gradzip.figures import figure

    gaps = plotted_gaps(f)
    if not gaps:
        return None
    fig, ax = figure(10.0, 4.8)  # room for long method names in the legend
    colors = method_colors([m.method for m in f.setting.methods])
    last = max(g.curve[-1][0] for g in gaps)
    for g in gaps:
        steps = [s for s, _ in g.curve]
        ax.plot(steps, [100 * v for _, v in g.curve], color=colors[g.method], lw=1.2,
                label=g.method)
        if g.curve[-1][1] > CLOSED:
            _draw_fit(ax, g.fit, FIT_FROM, last, colors[g.method])
    _finish(ax, "optimizer steps", f"val loss vs {f.baseline} (%)",
            f"Gap to DDP against length, {f.setting.setting.title()}")
    return save(fig, path)


def frontier_section(f: Frontier, out: Path, bound: set[str]) -> str:
    """``bound``: methods whose projection is a lower bound (link-bound at the fit)."""
    parts = [f"## The low-bandwidth frontier: {f.setting.setting.title()}",
             FRONTIER_HELP.strip(), markdown_table(*frontier_rows(f, bound)),
             "### The gap to DDP against length",
             f"Loss over {f.baseline}'s at the same step, seed by seed, averaged; fitted "
             f"from step {FIT_FROM} where positive. A projected length is an extrapolation "
             "of this horizon's trend, not a measurement. The figure shows the "
             "local-update methods, SNOO and the per-step method of lowest final loss "
             "that ran every seed.",
             markdown_table(*gap_rows(f))]
    png = plot_gaps(f, out / f"gap_{f.setting.setting.slug()}.png")
    if png is not None:
        parts.append(f"![gap to DDP against length]({png.name})")
    return "\n\n".join(parts)


@dataclass(frozen=True)
class Axis:
    """What the final gaps are plotted against: run length, or ranks (replicas)."""

    name: str  # the report's file: NAME.md
    png: str  # its figure
    title: str
    label: str  # the x axis
    column: str  # a column head, formatted with the value
    symbol: str  # the variable of the fit: a·SYMBOL^b
    x_of: Callable[[SettingSummary], float | None]
    projects: bool  # whether reaching 1% further along the axis means anything


LENGTH = Axis("lengths", "gap_length.png", "The gap to DDP against run length",
              "run length (optimizer steps, each with its own schedule)", "{:,.0f} steps",
              "s", run_length, True)
RANKS = Axis("ranks", "gap_ranks.png", "The gap to DDP against the number of ranks",
             "ranks (or replicas), the same global batch", "W = {:,.0f}",
             "W", run_ranks, False)


def _length_closes(g: LengthGap) -> str:
    if not g.points:
        return "diverged at every length"
    last = g.points[-1]
    if last[1] <= CLOSED:
        return f"within {CLOSED:.0%} at {last[0]:,.0f} steps (measured)"
    at = g.fit.closes_at if g.fit else None
    if g.fit is None:
        return "fewer than 3 lengths behind DDP: no fit"
    if at is None:
        return "does not close (the fitted gap does not shrink)"
    return f"~{at:,.0f} steps (projected)" if at < 1e6 else f"~{at:.1e} steps (projected)"


def length_rows(gaps: list[LengthGap], axis: Axis = LENGTH, also: Sequence[float] = ()
                ) -> tuple[list[str], list[list[str]]]:
    """The table's head and rows: a column per length (or ranks) with a gap or a
    divergence, and ``also`` (lengths whose baseline diverged: every cell "-")."""
    lengths = sorted({s for g in gaps for s, _ in g.points}
                     | {s for g in gaps for s, _, _ in g.diverged} | set(also))
    head = ["method", *(axis.column.format(s) for s in lengths),
            f"fit: a·{'steps' if axis.projects else axis.symbol}^b",
            *([f"reaches {CLOSED:.0%}"] if axis.projects else [])]
    rows = []
    for g in gaps:
        cells = {s: fmt_pct(100 * gap) for s, gap in g.points}
        cells |= {s: f"diverged ({k}/{n})" for s, k, n in g.diverged}
        behind = bool(g.points) and g.points[-1][1] > CLOSED
        fit = f"{g.fit.a:.3g}·{axis.symbol}^{g.fit.b:.3f}" if g.fit and behind else "-"
        rows.append([g.method, *(cells.get(s, "-") for s in lengths),
                     fit, *([_length_closes(g)] if axis.projects else [])])
    return head, rows


def diverged_line(gaps: list[LengthGap], axis: Axis = LENGTH,
                  baseline_at: list[float] | None = None) -> str | None:
    """The sentence under the table naming each length where a method, or the
    baseline, diverged."""
    cells = [f"`{g.method}` at {axis.column.format(s)} ({k} of {n} runs)"
             for g in gaps for s, k, n in g.diverged]
    cells += [f"the baseline at {axis.column.format(s)} (no gap there)"
              for s in baseline_at or []]
    if not cells:
        return None
    return ("Diverged, and left out of the fit: " + "; ".join(cells) + " (the loss went "
            f"non-finite, or ended above its first evaluation's and {DIVERGED_RISE}x its "
            "lowest; the main report's notes give each run's losses).")


def plot_length_gaps(gaps: list[LengthGap], baseline: str, path: Path,
                     axis: Axis = LENGTH) -> Path | None:
    """Final gap to DDP against run length or ranks (markers), fits dashed (against
    length: to where they would reach ``CLOSED``, at most 100x the longest run)."""
    from gradzip.compare.plots import method_colors, save
    from gradzip.figures import figure

    if not gaps:
        return None
    fig, ax = figure(10.0, 4.8)  # room for long method names in the legend
    colors = method_colors([g.method for g in gaps])
    if not any(g.points for g in gaps):
        return None
    last = max(s for g in gaps for s, _ in g.points)
    first = min(s for g in gaps for s, _ in g.points)
    for g in (g for g in gaps if g.points):
        xs, ys = zip(*g.points, strict=True)
        ax.plot(xs, [100 * y for y in ys], marker="o", color=colors[g.method], lw=1.0,
                label=g.method)
        if g.points[-1][1] > CLOSED and axis.projects:
            _draw_fit(ax, g.fit, first, last, colors[g.method])
    _finish(ax, axis.label, f"final val loss vs {baseline} (%)",
            f"{axis.title}" + (" (fits dashed)" if axis.projects else ""))
    if not axis.projects:  # a few numbers of ranks: each one a labelled tick
        ranks = sorted({s for g in gaps for s, _ in g.points})
        ax.set_xticks(ranks, [f"{w:g}" for w in ranks])
        ax.minorticks_off()
    return save(fig, path)


def length_report(summaries: list[SettingSummary], out: Path,
                  sources: list[str], axis: Axis = LENGTH) -> Path:
    """``out/lengths.md`` (or ``ranks.md``) and its figure: the final gap to DDP of runs
    of several lengths (or ranks), one results file each (``gradzip report --by-length``,
    ``--by-ranks``)."""
    gaps = gaps_by_length(summaries, axis.x_of)
    base_diverged = baseline_diverged(summaries, axis.x_of)
    baseline = next((s.baseline for s in summaries if s.baseline), "DDP")
    out.mkdir(parents=True, exist_ok=True)
    what = "length" if axis.projects else "number of ranks"
    parts = [f"# {axis.title}",
             "From " + ", ".join(f"`{s}`" for s in sources) + f": one results file per "
             f"{what}. Each method's final validation loss over {baseline}'s, seed by seed, "
             f"averaged; `a·{axis.symbol}^b` is fitted by least squares on logarithms over the "
             f"points where the gap is positive"
             + (f", and the length at which it reaches {CLOSED:.0%} is an extrapolation of "
                "that trend, not a measurement." if axis.projects else "."),
             markdown_table(*length_rows(gaps, axis, base_diverged))]
    if line := diverged_line(gaps, axis, base_diverged):
        parts.append(line)
    png = plot_length_gaps(gaps, baseline or "DDP", out / axis.png, axis)
    if png is not None:
        parts.append(f"![{axis.title.lower()}]({png.name})")
    path = out / f"{axis.name}.md"
    path.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return path
