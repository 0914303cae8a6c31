"""``gradzip bench capture``: what capturing every step costs, and how fast packing is.

Pairs of real ``gradzip train`` runs on 2 ranks (torchrun), the same except that one
captures every step (``--capture``), in alternating order; figures from the records:

* step-time overhead: the median over pairs of (p50 step with capture / p50 without);
* writer throughput: bytes captured / time the writer thread was busy (rank 0);
* archive size on disk against the raw bytes of the tensors it holds;
* ``archive pack`` throughput: the last archive written back out as
  ``R_{r}_E_{e}_S_{s}_B_{b}.pt`` bucket files and packed with ``--workers`` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("capture", help="step-time overhead of --capture, writer and packing "
                                       "throughput", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset (default: small)")
    p.add_argument("--codec", default="none", help="gradzip codec of the runs (default: none)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of timings (5)")
    p.add_argument("--pairs", type=int, default=3, help="run pairs (default 3)")
    p.add_argument("--workers", type=int, default=2, help="archive pack processes (default 2)")
    p.add_argument("--out", default="runs/bench-capture", help="directory for the runs")
    p.set_defaults(func=run)


def _train(args: argparse.Namespace, run_dir: Path, capture: Path | None) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    if capture is not None:
        shutil.rmtree(capture, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "gradzip", "train", "--model", args.model, "--parallel", "ddp",
           "--codec", args.codec, "--max-steps", str(args.steps), "--timing-warmup",
           str(args.warmup), "--threads", "1", "--eval-every", "0", "--eval-steps", "1",
           "--max-tokens", "500000", "--cache-dir", str(Path(args.out) / "cache"),
           "--log-every", str(args.steps), "--no-progress", "--no-tensorboard",
           "--out", str(run_dir), *(["--capture", str(capture)] if capture else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "results.jsonl").read_text().splitlines()[-1])


def _disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def _export_pt(archive_dir: Path, out: Path) -> int:
    """The archive's local buckets as .pt files (the format capture hooks write)."""
    import torch

    from gradzip.capture import Archive

    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[int, int, int, int], dict[str, Any]] = {}
    with Archive(archive_dir) as archive:
        for entry in archive.entries(kind="local"):
            key = (entry.rank, entry.epoch, entry.step, entry.bucket)
            groups.setdefault(key, {})[entry.name] = archive.tensor(entry)
    for (r, e, s, b), tensors in groups.items():
        torch.save(tensors, out / f"R_{r}_E_{e}_S_{s}_B_{b}.pt")
    return len(groups)


def run(args: argparse.Namespace) -> int:
    from gradzip.capture import Archive
    from gradzip.capture.convert import pack_directory

    if args.steps <= args.warmup or args.pairs < 1:
        raise ValueError("need --steps > --warmup and --pairs >= 1")
    out = Path(args.out)
    ratios, plain_ms, capture_ms, writer = [], [], [], []
    archive = out / "archive"
    for i in range(args.pairs):
        order = [False, True] if i % 2 == 0 else [True, False]
        rec = {c: _train(args, out / f"run-{i}-{'capture' if c else 'plain'}",
                         archive if c else None) for c in order}
        ratios.append(rec[True]["step_time_ms_p50"] / rec[False]["step_time_ms_p50"])
        plain_ms.append(rec[False]["step_time_ms_p50"])
        capture_ms.append(rec[True]["step_time_ms_p50"])
        cap = rec[True]["capture"]
        writer.append(cap["bytes"] / cap["writer_busy_s"] / 1e6 if cap["writer_busy_s"] else 0)
    with Archive(archive) as a:
        raw = sum(e.nbytes for e in a)
    disk = _disk_bytes(archive)
    pt_dir, packed = out / "pt", out / "packed"
    shutil.rmtree(pt_dir, ignore_errors=True)
    shutil.rmtree(packed, ignore_errors=True)
    files = _export_pt(archive, pt_dir)
    pt_bytes = sum(p.stat().st_size for p in pt_dir.glob("*.pt"))
    start = time.perf_counter()
    report = pack_directory(pt_dir, packed, workers=args.workers)
    elapsed = time.perf_counter() - start
    print(f"gradzip bench capture: {args.model}, 2 ranks, codec {args.codec}, every step "
          f"captured, {args.pairs} pairs of {args.steps}-step runs ({args.warmup} warm-up)")
    print(f"  step p50 without / with capture: {statistics.median(plain_ms):.1f} / "
          f"{statistics.median(capture_ms):.1f} ms; overhead (median of pair ratios): "
          f"{statistics.median(ratios) - 1:+.1%} (pairs: "
          + ", ".join(f"{r - 1:+.1%}" for r in ratios) + ")")
    print(f"  writer (rank 0): {statistics.median(writer):,.0f} MB/s while busy")
    print(f"  archive: {disk / 1e6:,.1f} MB on disk for {raw / 1e6:,.1f} MB of tensors "
          f"({disk / raw:.3f}x)")
    print(f"  archive pack: {files} .pt files, {pt_bytes / 1e6:,.1f} MB in {elapsed:.1f} s = "
          f"{pt_bytes / 1e6 / elapsed:,.0f} MB/s with {args.workers} workers "
          f"({report.packed} packed, {len(report.failed)} failed)")
    return 0
