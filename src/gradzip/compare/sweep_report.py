"""The report's section across bandwidths: projected time to target from 10 Mbit/s to
100 Gbit/s, the model's validation against the shaped runs, break-even bandwidths, and
the curves as a PNG (``gradzip.compare.sweep`` has the model)."""

from __future__ import annotations

from pathlib import Path

from gradzip.compare.runs import rate_bits_per_s
from gradzip.compare.sweep import (
    SWEEP_RATES,
    TABLE_RATES,
    VALIDATION_BAR,
    Sweep,
    rate_label,
)

MODEL_TEXT = """\
Projected from each run's own figures at the fitted rate: time to target
`T(B) = n (t0 + c·α + 8 max(0, v − credit) / (η B))`, with `n` the steps to the run's
target (the same at every rate: the same seed trains the same on every link), `v` the
bytes per step on the slowest link (a shared link carries every rank's; a per-rank link
one rank's; a node uplink what the kernel counted), `c` the collectives per step, `α`
the latency of one, `η` the payload share of the nominal rate measured on the link,
`t0` the rest of a step (compute, codec, framework), and `credit = min(β, B t0 / 8)`
what the link sends at once after idling through the step's compute: the emulated
link is a token bucket of β bytes (tc's burst, 10 ms of traffic and at least 256 KiB),
a real NIC banks nothing (β = 0). `t0` is solved from each run at the fitted rate; the
validation projects the other shaped rates with their own β; the table, the curves,
the break-even and the recommendation are for real links (β = 0). Break-even: the rate
below which the method reaches the target before the best 16-bit all-reduce."""


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def curve_rows(sw: Sweep) -> tuple[list[str], list[list[str]]]:
    """The projection table: per method, its fitted figures and projected times."""
    head = ["method", "seeds reached", "steps to target", "bytes/step (slowest link)",
            "collectives/step", "t0 ms", *(f"T at {rate_label(b)} (s)" for b in TABLE_RATES),
            "break-even vs 16-bit"]
    evens = sw.break_evens()
    rows = []
    for c in sw.curves:
        even = ("(the 16-bit baseline)" if sw.baseline is not None
                and c.method == sw.baseline.method else
                evens[c.method].describe() if c.method in evens else "no 16-bit baseline ran")
        rows.append([c.method, f"{c.reached}/{c.runs}", f"{c.steps:.0f}",
                     f"{c.mean('link_bytes') / 1024:,.1f} KiB", f"{c.mean('collectives'):.1f}",
                     f"{c.mean('t0_s') * 1e3:.1f}",
                     *(_seconds(c.at(b)) for b in TABLE_RATES), even])
    return head, rows


def check_rows(sw: Sweep) -> tuple[list[str], list[list[str]]]:
    """The validation table: measured against projected at every other shaped rate."""
    head = ["method", "rate", "measured time to target (s)", "projected (s)", "error"]
    rows = [[c.method, c.rate, f"{c.measured_s:.1f}", f"{c.projected_s:.1f}",
             f"{c.error * 100:+.1f}%"] for c in sw.checks]
    return head, rows


def validation_line(sw: Sweep) -> str:
    """One sentence on how well the model held, or how to check it."""
    worst = sw.worst_error()
    rates = sorted({c.rate for c in sw.checks})
    if worst is None:
        return ("**Validation**: no other shaped rate ran with the same ranks and link; "
                "race at three or more rates (`--rate 25mbit,100mbit,1gbit`) to check "
                "the model.")
    held = "within" if worst <= VALIDATION_BAR else "**outside**"
    return (f"**Validation** against {len(sw.checks)} measured times to target at "
            f"{len(rates)} other rate(s) ({', '.join(rates)}): largest error "
            f"{worst * 100:.1f}%, {held} the {VALIDATION_BAR * 100:.0f}% bar.")


def recommendation_line(sw: Sweep) -> str:
    """Which method the model says reaches the target first, per range of rates."""
    spans = sw.best_by_rate()
    if not spans:
        return ""
    parts = [f"`{m}` from {rate_label(a)} to {rate_label(b)}" for a, b, m in spans]
    worst = sw.worst_error()
    checked = f"validated to {worst * 100:.0f}%" if worst is not None else \
        "validated at no other rate"
    return (f"Across bandwidths (real links, projected from {sw.fitted.title()}; "
            f"{checked}): soonest to the target is " + "; ".join(parts) + ".")


def sweep_section(sw: Sweep, out: Path) -> str:
    """The markdown section, with its figure drawn into ``out``."""
    from gradzip.compare.report import markdown_table

    title = (f"## Across bandwidths: projected from {sw.fitted.title()} "
             f"(α = {sw.latency_s * 1e6:.0f} µs per collective)")
    parts = [title, MODEL_TEXT, markdown_table(*curve_rows(sw)), validation_line(sw)]
    bound = sorted({f.method for c in sw.curves for f in c.fits if f.link_bound})
    if bound:
        parts.insert(3, "Link-bound at the fitted rate (the step is all link time, so "
                        "`t0` is only an upper bound; fit at a faster rate with "
                        "`--sweep-from`): " + ", ".join(f"`{m}`" for m in bound) + ".")
    if sw.checks:
        parts.append(markdown_table(*check_rows(sw)))
    png = plot_sweep(sw, out / f"sweep_{sw.fitted.slug()}.png")
    if png is not None:
        parts.append(f"![Projected time to target against bandwidth]({png.name})")
    return "\n\n".join(parts)


def plot_sweep(sw: Sweep, path: Path) -> Path | None:
    """Projected time to target against bandwidth (log-log), one line per method on a
    real link (solid) and on the emulated one (dashed, where the measured times, the
    markers, should lie); break-evens as dotted verticals."""
    from gradzip.compare.plots import legend, method_colors, save
    from gradzip.figures import figure

    if not sw.curves:
        return None
    fig, ax = figure(7.5, 4.5)
    colors = method_colors([c.method for c in sw.curves])
    for c in sw.curves:
        ax.plot(SWEEP_RATES, [c.at(b) for b in SWEEP_RATES], color=colors[c.method],
                label=c.method)
        ax.plot(SWEEP_RATES, [c.emulated_at(b) for b in SWEEP_RATES],
                color=colors[c.method], linestyle="--", linewidth=0.8)
    for check in sw.checks:
        bits = rate_bits_per_s(check.rate)
        if bits is not None and check.method in colors:
            ax.scatter([bits], [check.measured_s], color=colors[check.method], marker="o",
                       edgecolors="black", zorder=3)
    for method, even in sw.break_evens().items():
        if even.bits_per_s is not None and SWEEP_RATES[0] <= even.bits_per_s <= SWEEP_RATES[-1]:
            ax.axvline(even.bits_per_s, color=colors[method], linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (bit/s)")
    ax.set_ylabel("time to target (s, projected)")
    ax.set_title("Time to target: solid, a real link; dashed, the emulated link (token "
                 "bucket)\nwith its measured runs (dots); dotted, break-even vs 16-bit",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    legend(ax)
    return save(fig, path)

