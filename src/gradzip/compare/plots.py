"""The report's PNG figures for one link setting, drawn with matplotlib's Agg renderer.

Figures are ``gradzip.figures.figure``s, on an Agg canvas without ``pyplot``: no display
is needed and no global backend is switched, so the report can be written from inside a
training harness. Every function returns the PNG's path, or
``None`` when the runs have nothing to draw (no evaluations, no byte counts, no phases).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradzip.compare.summary import MethodSummary, SettingSummary
from gradzip.figures import figure

_DPI = 110


def save(fig: Any, path: Path) -> Path:
    """Write the PNG, grown to hold a legend placed outside the axes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    return path


def legend(ax: Any) -> None:
    """The legend right of the axes, where it covers neither a curve nor a tick label."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _colors(summary: SettingSummary) -> dict[str, Any]:
    """One colour per method, the same in every figure of the setting."""
    return method_colors([m.method for m in summary.methods])


def method_colors(methods: list[str]) -> dict[str, Any]:
    """One colour per method, in order (tab10, repeating after ten)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def _label(method: str, width: int = 22) -> str:
    """A method's spec wrapped at spaces for a legend or a tick (words are not split)."""
    return textwrap.fill(method, width, break_long_words=False)


def seed_band(curves: list[list[tuple[float, float]]]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, min and max of several (x, loss) curves on the x values they share a span on.

    Curves are interpolated linearly onto the union of their x values inside the span
    every curve covers; a single curve is returned as it is (min = max = mean).
    """
    if len(curves) == 1:
        x, y = (np.array(v, dtype=float) for v in zip(*curves[0], strict=True))
        return x, y, y, y
    lo = max(c[0][0] for c in curves)
    hi = min(c[-1][0] for c in curves)
    xs = np.unique([x for c in curves for x, _ in c if lo <= x <= hi])
    ys = np.array([np.interp(xs, [p[0] for p in c], [p[1] for p in c]) for c in curves])
    return xs, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def _draw_method(ax: Any, curves: list[list[tuple[float, float]]], color: Any,
                 label: str) -> None:
    """A method's mean curve with its seed band; seeds that share no span are drawn apart."""
    xs, mid, low, high = seed_band(curves)
    if xs.size == 0:
        for i, c in enumerate(curves):
            ax.plot(*zip(*c, strict=True), marker=".", color=color,
                    label=label if i == 0 else None)
        return
    ax.plot(xs, mid, marker=".", color=color, label=label)
    if len(curves) > 1:
        ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)


def auto_switches(run: Any, index: int) -> list[tuple[float, float, str]]:
    """(x, loss, codec) where an ``auto`` run's choice changed (its first choice too):
    each decision's step placed on the run's evaluations (``index`` 0: step, 1: time),
    interpolated between them; [] for other methods."""
    history = run.history()
    decisions = (run.record.get("auto") or {}).get("decisions") or []
    if len(history) < 2 or not decisions:
        return []
    steps = [h[0] for h in history]
    out, previous = [], None
    for d in decisions:
        if d["method"] != previous:
            at = float(d["from_step"])
            out.append((float(np.interp(at, steps, [h[index] for h in history])),
                        float(np.interp(at, steps, [h[2] for h in history])), d["method"]))
        previous = d["method"]
    return out


def mark_auto_choices(ax: Any, runs: Sequence[Any], color: Any, index: int) -> None:
    """Mark on the first seed's curve where ``auto`` took each codec, named."""
    for run in runs[:1]:
        for x, y, codec in auto_switches(run, index):
            ax.plot([x], [y], marker="v", markersize=8, color=color,
                    markeredgecolor="black")
            ax.annotate(codec, (x, y), textcoords="offset points", xytext=(4, 8),
                        fontsize=8, color=color)


def plot_loss(summary: SettingSummary, path: Path, x: str = "time") -> Path | None:
    """Validation loss against training time (``x="time"``) or steps, one line per method
    (the mean over seeds) with the seeds' min-max range shaded, and the target."""
    index = 1 if x == "time" else 0
    colors = _colors(summary)
    fig, ax = figure()
    drawn = False
    for m in summary.methods:
        curves = [[(h[index], h[2]) for h in r.history()] for r in m.runs]
        curves = [c for c in curves if c]
        if not curves:
            continue
        _draw_method(ax, curves, colors[m.method], _label(m.method, 40))
        mark_auto_choices(ax, m.runs, colors[m.method], index)
        drawn = True
    if not drawn:
        return None
    if summary.target is not None:
        ax.axhline(summary.target, color="black", linestyle="--", linewidth=0.8,
                   label=f"target {summary.target:.4f} (mean of the seeds')")
    if x == "time" and summary.budget_s is not None:
        ax.axvline(summary.budget_s, color="grey", linestyle=":", linewidth=0.8,
                   label=f"time budget {summary.budget_s:.1f} s")
    ax.set_xlabel("training time (s, evaluation excluded)" if x == "time" else "step")
    ax.set_ylabel("validation loss (nats/token)")
    seeds = max(len(m.runs) for m in summary.methods)
    how = ("one seed per method" if seeds <= 1
           else f"mean over up to {seeds} seeds, min-max shaded")
    ax.set_title(f"{summary.setting.title()}: {how}", fontsize=10)
    ax.grid(alpha=0.3)
    legend(ax)
    return save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: a higher ratio (x) and a lower loss
    change (y) are better; a point is dominated if another is at least as good in both
    and better in one. Returned in order of increasing ratio."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(x2 >= x and y2 <= y and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i][0])


def plot_pareto(summary: SettingSummary, path: Path) -> Path | None:
    """Wire compression ratio vs fp32 (log x) against the change of final validation loss
    vs the baseline (%), with the Pareto front drawn and its methods marked."""
    rows: list[MethodSummary] = [m for m in summary.methods
                                 if m.ratio_fp32 is not None and m.delta_pct is not None]
    if not rows:
        return None
    points = [(m.ratio_fp32 or 0.0, m.delta_pct or 0.0) for m in rows]
    front = pareto_front(points)
    colors = _colors(summary)
    fig, ax = figure()
    fx, fy = zip(*(points[i] for i in front), strict=True)
    ax.plot(fx, fy, color="black", linewidth=1, linestyle="--", label="Pareto front", zorder=1)
    for i, (m, (x, y)) in enumerate(zip(rows, points, strict=True)):
        ax.scatter([x], [y], s=70 if i in front else 30, color=colors[m.method],
                   edgecolors="black" if i in front else "none", zorder=2)
        ax.annotate(_label(m.method), (x, y), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    ax.set_xscale("log")
    ax.margins(x=0.25, y=0.15)  # room for the labels of the outermost points
    ax.axhline(0, color="grey", linewidth=0.6)
    ax.set_xlabel("link bytes: compression ratio vs the fp32 all-reduce (log)")
    ax.set_ylabel(f"final validation loss vs {summary.baseline} (%)")
    ax.set_title(f"{summary.setting.title()}: right and low is better", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    legend(ax)
    return save(fig, path)


def plot_breakdown(summary: SettingSummary, path: Path) -> Path | None:
    """Stacked bars per method: compute, then comm (which overlaps backward), then codec
    time, ms per step; a black tick marks the measured mean step time, so the part of a
    bar above the tick is time that ran overlapped, not time the step took."""
    rows = [(m.method, m.breakdown) for m in summary.methods
            if m.breakdown and m.breakdown.compute is not None]
    if not rows:
        return None
    fig, ax = figure(max(5.0, 1.2 * len(rows) + 2), 4.5)
    xs = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for name, color, label in (("compute", "tab:blue", "compute (data+fwd+bwd+opt)"),
                               ("comm", "tab:orange", "comm (overlaps backward)"),
                               ("codec", "tab:green", "codec (encode+decode)")):
        heights = np.array([getattr(b, name) or 0.0 for _, b in rows])
        ax.bar(xs, heights, bottom=bottom, color=color, width=0.6, label=label)
        bottom += heights
    steps = [(i, b.step) for i, (_, b) in enumerate(rows) if b.step]
    if steps:
        ax.scatter(*zip(*steps, strict=True), marker="_", s=900, color="black", linewidths=2,
                   zorder=3, label="measured step time (mean)")
    ax.set_xticks(xs, [_label(name, 16) for name, _ in rows], fontsize=7)
    ax.set_ylabel("ms per step (mean over timed steps)")
    ax.set_title(f"{summary.setting.title()}: where a step's time goes", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    legend(ax)
    return save(fig, path)


def write_plots(summary: SettingSummary, out: Path) -> dict[str, Path]:
    """Every figure of one setting into ``out``; name -> path of those that were drawn."""
    slug = summary.setting.slug()
    made = {
        "loss_time": plot_loss(summary, out / f"loss_time_{slug}.png", "time"),
        "loss_steps": plot_loss(summary, out / f"loss_steps_{slug}.png", "step"),
        "pareto": plot_pareto(summary, out / f"pareto_{slug}.png"),
        "breakdown": plot_breakdown(summary, out / f"breakdown_{slug}.png"),
    }
    return {k: v for k, v in made.items() if v is not None}
