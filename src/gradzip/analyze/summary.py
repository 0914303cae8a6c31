"""The summary of an analysis: Markdown tables and PNG plots from ``buckets.csv``.

``write_summary(out_dir)`` writes ``OUT/summary.md``: a describe-style table per metric
(count, mean, std, min, quartiles, max), per-step and (with ``params.csv``) per-layer
breakdowns, and plots: histograms of a metric over buckets, bits per value over training
steps, and the code lengths of the first study's column.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from gradzip.figures import figure

#: the metrics the describe table covers, with what they mean
METRICS = {
    "first_study_saving_vs_fp16": "first study: saving vs fp16 (EG order 0 + sign bit, 1e6)",
    "fixed_entropy_bits": "fixed 1e6: order-0 entropy, bits/value",
    "fixed_eg_best_bits": "fixed 1e6: best Exp-Golomb, bits/value",
    "fixed_eg_eta": "fixed 1e6: best Exp-Golomb efficiency (entropy / bits)",
    "fixed_ans_eta": "fixed 1e6: ANS efficiency",
    "int8_entropy_bits": "int8 (block abs-max): entropy, bits/value",
    "int8_eg_eta": "int8: best Exp-Golomb efficiency",
    "raw_deflate_ratio": "zip of the raw values (deflate), ratio vs captured",
    "h5_deflate_ratio": "zip of the HDF5 bytes (deflate), ratio vs captured",
    "raw_zstd_ratio": "zstd of the raw values, ratio vs captured",
    "lossless_ratio": "gradzip lossless float codec, ratio vs captured",
    "field_entropy_ratio": "field-entropy bound, ratio vs captured",
    "kurtosis": "excess kurtosis",
    "ggd_shape": "generalized-Gaussian shape (2 Gaussian, 1 Laplace)",
    "zero_fraction": "fraction of zeros",
}


#: what the less obvious rows of the metric table mean
EXPLAINED = [
    "- **first study**: the column of the study this analysis first reproduced: values "
    "rounded to integers at a fixed scale of 1e6 (q = round(x * 1e6)), each coded as the "
    "order-0 Exp-Golomb codeword of |q| plus one sign bit; the saving is 1 - bytes / (2 x "
    "values), i.e. against sending the values as fp16. It is lossy (1e-6 absolute "
    "precision), so it is not comparable with the lossless ratios.",
    "- **field-entropy bound**: the ratio an ideal coder would reach coding the sign, "
    "exponent and mantissa fields each on its own, with one order-0 table per field for "
    "the whole bucket. It bounds only such coders: gradzip's `lossless` fits up to eight "
    "exponent tables to the bucket's 16K-value blocks (a bucket's tensors differ in "
    "scale, so their exponents differ in distribution) and takes zstd's repeats, so it "
    "can beat this bound.",
    "- Ratios are captured bytes / coded bytes (higher is better); efficiencies (eta) are "
    "entropy / bits actually spent (1 is the limit).",
]


def whatif_section(rows: list[dict[str, str]]) -> list[str]:
    """The what-if as a table: per lossy codec, over the buckets it ran on, link bytes
    against fp32 and the captured dtype, and the error it made."""
    specs = [k[:-len(": ratio_fp32")] for k in rows[0] if k.endswith(": ratio_fp32")]
    if not specs:
        return []
    lines = ["## What if each codec sent these gradients", "",
             "Each lossy codec's real protocol on the captured ranks of a step (a simulated "
             "group, one row per bucket; `--whatif-steps` chooses the steps). Ratio: link "
             "bytes of PyTorch's fp32 all-reduce (or of the captured dtype) over the "
             "codec's; error: relative L2 error of what a rank sent, and of the mean every "
             "rank received against the exact mean; cosine: of the mean.", ""]
    table = []
    for spec in specs:
        ran = [r for r in rows if r.get(f"{spec}: ratio_fp32")]
        cells = [column(ran, f"{spec}: {c}") for c in ("ratio_fp32", "ratio_captured",
                                                       "rel_error", "mean_rel_error",
                                                       "mean_cosine")]
        table.append([f"`{spec}`".replace("|", "\\|"), str(len(ran)),
                      *(f"{c.mean():.4g}" if c.size else "-" for c in cells)])
    lines += _table(["codec", "buckets", "ratio vs fp32", "ratio vs captured",
                     "error sent", "error of the mean", "cosine of the mean"], table)
    return lines


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], name: str) -> np.ndarray:
    vals = []
    for r in rows:
        try:
            vals.append(float(r.get(name) or "nan"))
        except ValueError:
            vals.append(math.nan)
    a = np.array(vals, dtype=np.float64)
    return a[np.isfinite(a)]


def describe(values: np.ndarray) -> list[str]:
    if values.size == 0:
        return ["0"] + ["-"] * 7
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    std = values.std(ddof=1) if values.size > 1 else 0.0
    return [str(values.size)] + [f"{v:.4g}" for v in (values.mean(), std, values.min(),
                                                      q1, q2, q3, values.max())]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _breakdown(rows: list[dict[str, str]], by: str, metric: str) -> list[list[str]]:
    groups: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault(r.get(by) or "-", []).append(r)
    def order(k: str) -> Any:
        return (0, float(k)) if k.replace(".", "", 1).isdigit() else (1, k)
    return [[k, str(len(g)), f"{column(g, metric).mean():.4g}" if column(g, metric).size
             else "-"] for k, g in sorted(groups.items(), key=lambda kv: order(kv[0]))]


def histogram(values: np.ndarray, metric: str) -> Any:
    """A histogram of one metric over buckets: titled, counts on whole-number ticks."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = figure(6, 3.5)
    ax.hist(values, bins=min(50, max(5, values.size // 2)))
    ax.set_title(f"{METRICS[metric]}: {values.size} buckets", fontsize=10)
    ax.set_xlabel(METRICS[metric])
    ax.set_ylabel("buckets")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def write_plots(rows: list[dict[str, str]], out: Path) -> list[str]:
    """The summary's PNGs in ``out``: a histogram of each metric the rows have, and the
    bits per value against step where the rows carry steps; returns their file names."""
    made = []
    for metric in ("first_study_saving_vs_fp16", "fixed_eg_eta", "lossless_ratio"):
        values = column(rows, metric)
        if values.size:
            histogram(values, metric).savefig(out / f"hist_{metric}.png", dpi=110)
            made.append(f"hist_{metric}.png")
    steps = [(float(r["step"]), float(r["fixed_eg_best_bits"]), float(r["fixed_entropy_bits"]))
             for r in rows if r.get("step") and r.get("fixed_eg_best_bits")]
    if steps:
        steps.sort()
        s, eg, h = zip(*steps, strict=True)
        fig, ax = figure(6, 3.5)
        ax.plot(s, eg, ".", label="best Exp-Golomb")
        ax.plot(s, h, ".", label="order-0 entropy")
        ax.set_xlabel("training step")
        ax.set_ylabel("bits per value (fixed 1e6)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bits_over_steps.png", dpi=110)
        made.append("bits_over_steps.png")
    return made


def describe_source(rows: list[dict[str, str]]) -> str:
    """Where the rows came from: the one source, or the directory of several files,
    with the ranks and steps they hold."""
    sources = sorted({r.get("source") or "?" for r in rows})
    where = sources[0] if len(sources) == 1 else \
        f"{os.path.commonpath(sources)} ({len(sources)} files)"
    ranks = sorted({int(r["rank"]) for r in rows if r.get("rank")})
    steps = {(r.get("epoch"), r["step"]) for r in rows if r.get("step")}
    if not steps:
        return where
    return f"{where}, ranks {', '.join(map(str, ranks))}, {len(steps)} step(s)"


def write_summary(out_dir: str | Path) -> Path:
    """``OUT/summary.md`` (and its PNGs) from the analysis in ``out_dir``."""
    out = Path(out_dir)
    rows = read_rows(out / "buckets.csv")
    if not rows:
        raise ValueError(f"{out}/buckets.csv holds no rows: nothing to summarize")
    impl = rows[0].get("deflate_impl", "?")
    lines = [f"# Gradient compressibility: {len(rows)} buckets", "",
             f"Source: {describe_source(rows)}. Deflate by {impl}. Ratios are against "
             f"the captured dtype ({rows[0].get('dtype')}); bits are per value.", "",
             "## Per metric", ""]
    lines += _table(["metric", "count", "mean", "std", "min", "25%", "50%", "75%", "max"],
                    [[desc, *describe(column(rows, name))] for name, desc in METRICS.items()])
    lines += ["", *EXPLAINED, ""]
    lines += whatif_section(rows)
    lines += ["", "## Per step", ""]
    lines += _table(["step", "buckets", "fixed 1e6 best EG bits/value"],
                    _breakdown(rows, "step", "fixed_eg_best_bits"))
    params = out / "params.csv"
    if params.is_file():
        prows = read_rows(params)
        for r in prows:
            r["layer"] = ".".join(r["name"].split(".")[:-1]) or r["name"]
        lines += ["", "## Per layer", ""]
        lines += _table(["layer", "tensors", "fixed 1e6 best EG bits/value"],
                        _breakdown(prows, "layer", "fixed_eg_best_bits"))
    flagged = [r["key"] for r in rows if r.get("fixed_misordered") == "True"]
    lines += ["", f"Buckets whose symbols are not ordered by probability (rank-mapped EG "
                  f">10% shorter than plain EG): {len(flagged)}"
              + (f", e.g. {', '.join(flagged[:5])}" if flagged else ""), ""]
    lines += [f"![{p}]({p})" for p in write_plots(rows, out)]
    path = out / "summary.md"
    tmp = path.with_name("summary.md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path
