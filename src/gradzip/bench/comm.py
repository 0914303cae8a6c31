"""``gradzip bench comm``: DDP step time with and without a gradzip hook, 2 local ranks.

Spawns ``--ranks`` gloo processes on this machine (loopback; run it inside a
shaped network namespace to emulate a slow link, see DESIGN.md), trains a ~4M
parameter MLP with plain DDP and then with ``gradzip.attach`` for each codec, and
reports the median step time, the hook's codec compute (encode + decode ms) as a
share of the step, the collective time, and the measured compression ratio.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

DEFAULT_SPECS = ["none", "fp16", "qsgd", "ef | topk(ratio=0.01)", "ef | powersgd(rank=4)",
                 "efsignsgd"]


def _model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _rank_main(rank: int, specs: list[str], width: int, depth: int, steps: int, warmup: int,
               batch: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    torch.set_flush_denormal(True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, 1, generator=g)
    rows = []
    for spec in [None, *specs]:
        model = DDP(_model(width, depth))
        handle = gradzip.attach(model, spec) if spec else None
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        times = []
        before: dict[str, Any] = {}
        for step in range(warmup + steps):
            if step == warmup and handle:
                before = handle.stats.totals()
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step >= warmup:
                times.append(time.perf_counter() - start)
            if handle:
                handle.stats.end_step()
        row: dict[str, Any] = {"spec": spec or "(no hook: DDP all-reduce)",
               "params": sum(p.numel() for p in model.parameters()),
               "step_ms": statistics.median(times) * 1e3}
        if handle:
            after = handle.stats.totals()
            n = steps
            row["encode_decode_ms"] = (after["encode_ms"] + after["decode_ms"]
                                       - before["encode_ms"] - before["decode_ms"]) / n
            row["comm_ms"] = (after["comm_ms"] - before["comm_ms"]) / n
            row["ratio"] = ((after["bytes_raw"] - before["bytes_raw"])
                            / max(after["bytes_wire"] - before["bytes_wire"], 1))
            row["bytes_wire_per_step"] = (after["bytes_wire"] - before["bytes_wire"]) / n
            row["overhead_share"] = row["encode_decode_ms"] / row["step_ms"]
            handle.close()
        rows.append(row)
    return {"rows": rows}


def run(args: Any) -> int:
    from gradzip.comm.launch import run_ranks

    specs = args.spec or DEFAULT_SPECS
    import gradzip

    for spec in specs:  # fail on a bad spec before spawning anything
        gradzip.codec(spec)
    results = run_ranks(_rank_main, args.ranks, specs, args.width, args.depth, args.steps,
                        args.warmup, args.batch, timeout=3600.0)
    rows = results[0]["rows"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    base = rows[0]["step_ms"]
    print(f"{args.ranks} ranks, gloo over loopback, MLP {rows[0]['params'] / 1e6:.2f}M params, "
          f"batch {args.batch}, median of {args.steps} steps after {args.warmup} warm-up")
    print("| codec | step ms | vs no hook | encode+decode ms | share of step | comm ms "
          "| ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "ratio" not in r:
            print(f"| {r['spec']} | {r['step_ms']:.1f} | 1.00x | - | - | - | 1.0 |")
            continue
        name = r["spec"].replace("|", "\\|")  # a pipe would split the markdown cell
        print(f"| `{name}` | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x "
              f"| {r['encode_decode_ms']:.1f} | {100 * r['overhead_share']:.0f}% "
              f"| {r['comm_ms']:.1f} | {r['ratio']:.1f} |")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("comm", help="DDP step time with/without a gradzip hook (2 local ranks)")
    p.add_argument("--spec", action="append",
                   help=f"codec spec (repeatable); default: {'; '.join(DEFAULT_SPECS)}")
    p.add_argument("--ranks", type=int, default=2, help="local gloo processes")
    p.add_argument("--width", type=int, default=1024, help="MLP width (1024 x 4 = ~4.2M params)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per codec")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (the first one is uncompressed by design)")
    p.add_argument("--json", action="store_true", help="print rows as JSON")
    p.set_defaults(func=run)
