"""``gradzip report RESULTS.jsonl [...] --out DIR``: compare training runs side by side.

Reads the results records of ``gradzip compare`` (or of any ``gradzip train`` runs) and
writes DIR/report.md with PNG figures: per link setting (rate, ranks, link kind) a table
of methods over their seeds -- link bytes per step and compression ratio, step time,
tokens/s, communication share, final validation loss and its change against the
baseline (torch:none, else none), the loss at a fixed time budget, the time to reach
the baseline's final loss x 1.01 and the speed-up against the baseline and
torch:powersgd -- then validation loss against time and steps, the Pareto front of
compression against loss, and the step-time breakdown. The same tables are printed.
With shaped runs, a section projects time to target from 10 Mbit/s to 100 Gbit/s
(validated against the other shaped rates) with each method's break-even bandwidth.
Where local-update methods or SNOO ran, a frontier section compares them with DDP and
SNOO and fits each method's gap to DDP against training length. With --by-length, each
results file is one run length (compare --steps N) and OUT/lengths.md fits the final gap
against the length.

Records without a "compare" object are grouped by their codec and seed, as runs on an
unshaped loopback. A run directory may be given instead of its results.jsonl.

Example: gradzip report runs/compare/results.jsonl --out runs/compare/report
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

HELP = "report.md and plots comparing runs from results.jsonl"  # shown by `gradzip --help`


def register(sub: Any) -> None:
    p = sub.add_parser("report", help=HELP,
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", metavar="RESULTS.jsonl",
                   help="results files (one JSON record per line) or run directories")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for report.md and the PNG figures (created if needed)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="training-time budget in seconds for the 'val loss at S s' column "
                        "(default: per setting, the earliest last evaluation of its runs)")
    from gradzip.commands.compare import add_sweep_options

    add_sweep_options(p)
    p.add_argument("--by-length", action="store_true",
                   help="each results file is one run length (compare --steps N): write "
                        "OUT/lengths.md, each method's final gap to DDP against the length, "
                        "with a fitted trend and the length at which it would reach 1%%")
    p.add_argument("--by-ranks", action="store_true",
                   help="each results file is one number of ranks (or compare --replicas "
                        "W; the same global batch): write OUT/ranks.md, each method's final "
                        "gap to DDP against W, with its figure")
    p.add_argument("--quiet", action="store_true", help="do not print the tables")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradzip.compare.report import print_tables, render
    from gradzip.compare.runs import read_results
    from gradzip.compare.summary import summarize

    if args.budget_s is not None and not args.budget_s > 0:
        raise ValueError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if not args.latency_us >= 0:
        raise ValueError(f"--latency-us must be >= 0, got {args.latency_us}")
    paths = [Path(p) for p in args.results]
    if args.by_length and args.by_ranks:
        raise ValueError("--by-length and --by-ranks each need their own results files: "
                         "choose one")
    if args.by_length or args.by_ranks:
        return _by_length(paths, Path(args.out), args.budget_s, ranks=args.by_ranks)
    records, where = read_results(paths)
    summaries = summarize(records, args.budget_s, where)
    report = render(summaries, Path(args.out), [str(p) for p in paths],
                    fit_rate=args.sweep_from, latency_s=args.latency_us * 1e-6)
    if not args.quiet:
        print_tables(summaries)
    print(f"report written to {report}")
    return 0


def _by_length(paths: list[Path], out: Path, budget_s: float | None,
               ranks: bool = False) -> int:
    """``--by-length`` (``--by-ranks``): one summary per results file (one length, or
    one number of ranks, each)."""
    from gradzip.compare.frontier_report import LENGTH, RANKS, length_report
    from gradzip.compare.runs import read_results
    from gradzip.compare.summary import summarize

    flag, what = ("--by-ranks", "number of ranks") if ranks else ("--by-length", "length")
    if len(paths) < 2:
        raise ValueError(f"{flag} compares runs of several: give one results file per "
                         f"{what} (two or more)")
    summaries = []
    for path in paths:
        records, where = read_results([path])
        found = summarize(records, budget_s, where)
        if len(found) != 1:
            raise ValueError(f"{path}: {flag} needs one link setting per results "
                             f"file, found {len(found)}")
        summaries += found
    written = length_report(summaries, out, [str(p) for p in paths],
                            RANKS if ranks else LENGTH)
    print(f"report written to {written}")
    return 0
