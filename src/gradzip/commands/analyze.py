"""``gradzip analyze``: how compressible are these gradients, how close to the limit, and
what would each codec cost?

    gradzip analyze runs/grads --out runs/analysis            # a capture archive
    gradzip analyze old_pt_buckets/ --workers 4 --per-param   # R_r_E_e_S_s_B_b.pt files
    gradzip analyze grad.pt --codecs "int8;qsgd | eg"         # one tensor file

Writes OUT/buckets.csv (one row per bucket; see gradzip.analyze.measures for every
column), OUT/params.csv with --per-param, OUT/errors.csv for buckets that failed (they are
skipped), Parquet copies when pyarrow is installed, and OUT/summary.md with its plots.
Run it again on the same OUT to resume: finished buckets are skipped.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

HELP = (  # shown by `gradzip --help`
    "compressibility of captured gradients: entropy, zip, "
    "Exp-Golomb, ANS, and what each codec costs"
)


def register(sub: Any) -> None:
    from gradzip.analyze import DEFAULT_CODECS

    p = sub.add_parser("analyze", help=HELP,
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="capture archive, directory of .pt buckets, or a .pt/.npy")
    p.add_argument("--out", default=None, help="results directory (default: SOURCE.analysis "
                                               "beside the source)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)),
                   help="worker processes (default: all cores)")
    p.add_argument("--per-param", action="store_true", help="also a row per parameter")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.add_argument("--codecs", default=";".join(DEFAULT_CODECS), metavar="SPEC;SPEC",
                   help="lossy codecs for the what-if, ';'-separated; 'none' to skip "
                        f"(default: {';'.join(DEFAULT_CODECS)})")
    p.add_argument("--whatif-steps", default="4", metavar="N|all",
                   help="run the what-if on N steps spread evenly over the source, first "
                        "and last included, or on all (default 4: it costs several times "
                        "the other columns and changes slowly over training)")
    p.add_argument("--slice-mb", type=float, default=16.0,
                   help="values read at a time per worker, in MB of fp32 (bounds memory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import gradzip
    from gradzip.analyze.runner import Options, run_analysis
    from gradzip.analyze.summary import write_summary

    codecs = tuple(c.strip() for c in args.codecs.split(";")
                   if c.strip() and c.strip() != "none")
    for spec in codecs:
        gradzip.codec(spec)  # a bad spec fails now, before any work
    if args.workers < 1 or args.slice_mb <= 0:
        raise ValueError("--workers must be >= 1 and --slice-mb > 0")
    steps = None if args.whatif_steps == "all" else _count(args.whatif_steps)
    source = Path(args.source)
    out = Path(args.out) if args.out else source.with_name(source.name + ".analysis")
    options = Options(per_param=args.per_param, codecs=codecs, whatif_steps=steps,
                      slice_elems=max(256, int(args.slice_mb * 2**20 / 4)))
    bar: Any = None  # made once the total is known (no "0bucket [00:00, ?bucket/s]" line)

    def progress(n: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="bucket", desc="analyze", disable=args.no_progress,
                       dynamic_ncols=True)
        bar.update(n)

    try:
        outcome = run_analysis(source, out, workers=args.workers, options=options,
                               on_bucket=progress)
    finally:
        if bar is not None:
            bar.close()
    summary = write_summary(out) if (out / "buckets.csv").is_file() else None
    print(f"{outcome.analyzed} bucket(s) analyzed, {outcome.resumed} already done, "
          f"{len(outcome.failed)} failed" + (f" (see {out / 'errors.csv'})"
                                               if outcome.failed else "")
          + (f"; summary: {summary}" if summary else "")
          + (f" (kernels compiled or loaded from cache first, in {outcome.compile_s:.1f} s)"
             if outcome.compile_s >= 1 else ""))
    return 1 if outcome.failed and not outcome.analyzed and not outcome.resumed else 0


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"--whatif-steps must be a number >= 0 or 'all', got {text!r}")
    return n
