"""``gradzip bench train``: trainer throughput, one process vs N ranks, and phase shares.

Each configuration is a real ``gradzip train`` run (a subprocess; ``torchrun`` for more
than one rank) in its own directory; the figures are read back from its
``results.jsonl``: tokens/s and step time (warm-up steps excluded), and the share of
step time in each phase (data wait, forward, backward, optimizer) plus communication,
which overlaps backward under DDP.

The CPU is split evenly: one process gets ``cores`` intra-op threads, each of N ranks
gets ``cores / N``, so the comparison is the same hardware used two ways.

``--profile`` also runs torch.profiler over the timed steps of each run and holds its
figures to the trainer's own timers, per rank (``profile_check`` in the JSON): the
profiler's communication time per step within 0.5x-1.5x of the timers' (or 5 ms above
them, whichever is looser), and its step time within 10% (or 2 ms). The two measure
the same collectives differently (gloo's worker-thread ranges against launch-to-
completion), so on 2 busy cores they differ by scheduling delays: measured
-0.8..+3.9 ms per step. These are benchmark bars, not test assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="trainer tokens/s and time per phase, 1 process vs N ranks",
                       description=__doc__)
    p.add_argument("--model", default="small", help="model preset (default: small)")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default: 1,2)")
    p.add_argument("--codecs", default="none",
                   help='codec specs separated by ";" (default: none)')
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default: 30)")
    p.add_argument("--warmup", type=int, default=5,
                   help="steps excluded from the timing (default: 5)")
    p.add_argument("--batch-size", type=int, default=8, help="per rank (default: 8)")
    p.add_argument("--seq-len", type=int, default=128, help="(default: 128)")
    p.add_argument("--max-tokens", type=int, default=500_000,
                   help="training tokens prepared from the stdlib corpus (default: 500000)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="CPU cores to split between the ranks (default: all)")
    p.add_argument("--out", default="runs/bench-train", help="directory for the runs")
    p.add_argument("--json", action="store_true", help="print the records as JSON lines")
    p.add_argument("--profile", action="store_true",
                   help="profile the timed steps and check the profiler against the timers")
    p.set_defaults(func=run)


#: how far the profiler may read from the trainer's timers, per step (see the docstring)
COMM_BAR = (0.5, 1.5, 5.0)  # lower factor, upper factor, or this many ms above
STEP_BAR = (0.10, 2.0)  # relative, or this many ms


def profile_check(run_dir: Path, ranks: int) -> list[dict[str, Any]]:
    """Per rank: the profiler's and the timers' comm and step ms, and whether each
    agrees within its bar."""
    rows = []
    for rank in range(ranks):
        summary = json.loads((run_dir / "profile" / f"summary_rank{rank}.json").read_text())
        prof, timers = summary["profiler"], summary["timers"]
        comm, step = timers.get("comm", 0.0), timers["step"]
        low, high, slack = COMM_BAR
        comm_ok = low * comm <= prof["comm_ms"] <= max(high * comm, comm + slack)
        step_ok = abs(prof["step_ms"] - step) <= max(STEP_BAR[0] * step, STEP_BAR[1])
        rows.append({"rank": rank, "profiler_comm_ms": prof["comm_ms"], "timers_comm_ms": comm,
                     "profiler_step_ms": prof["step_ms"], "timers_step_ms": step,
                     "comm_within_bar": comm_ok, "step_within_bar": step_ok})
    return rows


def launch(n: int, codec: str, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``gradzip train`` run; its results record."""
    parallel = "none" if n == 1 and codec == "none" else "ddp"
    train_args = [
        "train", "--model", args.model, "--parallel", parallel, "--codec", codec,
        "--max-steps", str(args.steps), "--timing-warmup", str(args.warmup),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--max-tokens", str(args.max_tokens), "--cache-dir", str(Path(args.out) / "cache"),
        "--threads", str(max(args.cores // n, 1)), "--eval-every", "0", "--eval-steps", "1",
        "--log-every", str(args.steps), "--no-progress", "--no-tensorboard", "--out", str(run_dir),
        "--results-file", str(Path(args.out) / "results.jsonl"),
    ]
    if args.profile:  # the timed steps, with no logging or evaluation inside them
        train_args += ["--profile", "--profile-steps", f"{args.warmup + 1}:{args.steps}",
                       "--log-every", str(args.steps + 1)]
    if n == 1:
        cmd = [sys.executable, "-m", "gradzip", *train_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(n), "-m", "gradzip", *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(args.cores // n, 1))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    record = json.loads((run_dir / "results.jsonl").read_text().splitlines()[-1])
    if args.profile:
        record["profile_check"] = profile_check(run_dir, n)
    return record


def run(args: argparse.Namespace) -> int:
    import shutil

    from rich.console import Console
    from rich.table import Table

    ranks = [int(r) for r in args.ranks.split(",")]
    codecs = [c.strip() for c in args.codecs.split(";") if c.strip()]
    if not ranks or min(ranks) < 1 or not codecs or args.steps <= args.warmup:
        raise ValueError("need --ranks >= 1, at least one codec and --steps > --warmup")
    records: list[dict[str, Any]] = []
    for codec in codecs:
        for n in ranks:
            run_dir = Path(args.out) / f"{n}rank-{len(records)}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a refused re-run
            records.append(launch(n, codec, run_dir, args))
    if args.json:
        for r in records:
            print(json.dumps(r))
        return 0
    table = Table(title=f"gradzip train: {args.model}, {args.batch_size}x{args.seq_len} tokens "
                        f"per rank, {args.steps} steps ({args.warmup} warm-up excluded)")
    for col in ("ranks", "codec", "tokens/s", "step ms p50", "p90", "data", "forward",
                "backward", "optimizer", "comm", "bytes/step", "final loss"):
        table.add_column(col, justify="right")
    for r in records:
        share = r["phase_share"]
        steps = r["steps"] or 1
        wire = r["bytes_wire_total"]
        table.add_row(
            str(r["world_size"]), r["codec"], f"{r['tokens_per_s']:,.0f}",
            f"{r['step_time_ms_p50']:.0f}", f"{r['step_time_ms_p90']:.0f}",
            *(f"{share.get(k, 0.0):.1%}" for k in ("data", "forward", "backward", "optimizer")),
            f"{r['comm_ratio']:.1%}" if r["comm_ratio"] is not None else "-",
            f"{wire / steps / 2**20:.2f} MiB" if wire else "-", f"{r['train_loss']:.3f}")
    console = Console()
    if not console.is_terminal:  # a log file: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)
    if args.profile:
        _print_profile_checks(records)
    print(f"records appended to {Path(args.out) / 'results.jsonl'}")
    return 0


def _print_profile_checks(records: list[dict[str, Any]]) -> None:
    for r in records:
        for c in r["profile_check"]:
            verdict = "within" if c["comm_within_bar"] and c["step_within_bar"] else "OUTSIDE"
            print(f"{r['world_size']} ranks, {r['codec']}, rank {c['rank']}: profiler comm "
                  f"{c['profiler_comm_ms']:.1f} ms vs timers {c['timers_comm_ms']:.1f} ms, "
                  f"step {c['profiler_step_ms']:.1f} vs {c['timers_step_ms']:.1f} ms: "
                  f"{verdict} the bars")
