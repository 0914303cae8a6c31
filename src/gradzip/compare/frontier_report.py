"""The frontier section of ``report.md`` (``frontier.py``): its tables and the figure
of the gap to DDP against training length."""

from __future__ import annotations

from pathlib import Path

from gradzip.compare.frontier import (
    CLOSED,
    FIT_FROM,
    FRONTIER_RATES,
    GAP_STEPS,
    Frontier,
    FrontierRow,
    Gap,
)
from gradzip.compare.report import fmt_bytes, fmt_pct, fmt_ratio, fmt_stat, markdown_table
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
    t = row.time_to_target.get(bits)
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


def plot_gaps(f: Frontier, path: Path) -> Path | None:
    """The gap to DDP against steps, measured (solid) and fitted (dashed, extended to
    where it would reach ``CLOSED``)."""
    from gradzip.compare.plots import figure, legend, method_colors, save

    if not f.gaps:
        return None
    fig, ax = figure()
    colors = method_colors([m.method for m in f.setting.methods])
    last = max(g.curve[-1][0] for g in f.gaps)
    for g in f.gaps:
        steps = [s for s, _ in g.curve]
        ax.plot(steps, [100 * v for _, v in g.curve], color=colors[g.method], lw=1.2,
                label=g.method)
        if g.fit is not None:
            end = min(max(g.fit.closes_at or last, last), 100 * last)
            xs = [FIT_FROM * (end / FIT_FROM) ** (i / 60) for i in range(61)]
            ax.plot(xs, [100 * g.fit.at(x) for x in xs], color=colors[g.method], lw=0.9,
                    ls="--")
    ax.axhline(100 * CLOSED, color="grey", lw=0.8, ls=":", label=f"{CLOSED:.0%} of DDP")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel(f"val loss vs {f.baseline} (%)")
    ax.set_title(f"Gap to DDP against length, {f.setting.setting.title()}", fontsize=9)
    legend(ax)
    return save(fig, path)


def frontier_section(f: Frontier, out: Path, bound: set[str]) -> str:
    """``bound``: methods whose projection is a lower bound (link-bound at the fit)."""
    parts = [f"## The low-bandwidth frontier: {f.setting.setting.title()}",
             FRONTIER_HELP.strip(), markdown_table(*frontier_rows(f, bound)),
             "### The gap to DDP against length",
             f"Loss over {f.baseline}'s at the same step, seed by seed, averaged; fitted "
             f"from step {FIT_FROM} where positive. A projected length is an extrapolation "
             "of this horizon's trend, not a measurement.",
             markdown_table(*gap_rows(f))]
    png = plot_gaps(f, out / f"gap_{f.setting.setting.slug()}.png")
    if png is not None:
        parts.append(f"![gap to DDP against length]({png.name})")
    return "\n\n".join(parts)
