"""Kernel-counted link bytes: local gloo ranks, the loopback counter as ground truth.

Run *inside* a fresh network namespace (``gradzip.comm.netns.run_in_netns``), where
``lo``'s tx counter sees every byte every rank sends::

    python -m gradzip.bench.linkcount --ranks 4 --steps 6 --case none --case qsgd
    python -m gradzip.bench.linkcount --ranks 4 --probe

Each ``--case`` is a method for DDP (a codec spec, or ``diloco(sync_every=H) | SPEC`` for
DiLoCo synchronizing every H steps, without a codec: fp32), or ``fsdp2: SPEC`` for an
FSDP2 (``fully_shard``) model.
For each case every rank builds the same small MLP, wraps it, ``gradzip.attach``-es the
codec (setup traffic: parameter broadcast, new process group), and then the counter is
read around the training steps only. Rank 0 prints one JSON line per case, as soon as it
is done:

* ``kernel``: lo tx bytes over the steps, minus one barrier (the window closes with
  one); ``barrier``: the measured bytes of one barrier (mean of three, measured once
  when the ranks start); ``counter_at_start``: the counter when the window opened;
* ``wire`` / ``handed`` / ``raw``: the sums over ranks of ``CommStats`` totals;
  ``by_op``: ``bytes_by_op`` summed over ranks;
* ``other_model``: link-model bytes of collectives gradzip does not report (FSDP2's
  parameter all-gathers), so ``kernel`` compares with ``wire + other_model``.

``--probe`` instead measures gloo's own collectives on known sizes (what each really
sends against the link model, and the fixed cost of a call) and prints one JSON line
per collective.

What it found (gloo, torch 2.13, W = 2 and 4): all_reduce, all_gather(_into_tensor),
all_to_all and broadcast send what ``gradzip.collectives.linkmodel`` says to within 0.4 %
at 1 MiB, plus a fixed cost per call (TCP/IP headers, ACKs, gloo's preambles and
ring notifications, ~90 bytes per packet): per rank, all_reduce ~1.3 kB (W=2) /
~4.1 kB (W=4), all_gather ~0.65 / ~2.1 kB, all_to_all ~0.34 / ~1.0 kB, a barrier
~0.33 / ~0.67 kB. ``reduce_scatter_tensor`` is a full all-reduce: 2(W-1)/W x n.

Reading the counter: all ranks pass a barrier, rank 0 waits 50 ms (so trailing
packets and delayed ACKs land) and reads while the others wait 150 ms before going
on. The sleeps only keep the window edges clean; they decide nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any

#: the MLP: WIDTH x WIDTH layers, ~330k parameters at the defaults; with
#: ``BUCKET_MB`` it makes several DDP buckets
WIDTH = 256
DEPTH = 5
BUCKET_MB = 0.25
BATCH = 16


def _lo_tx_packets() -> int:
    """Packets ``lo`` has sent in this namespace (to tell per-message overhead apart)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[9])
    return 0


def _mark(rank: int) -> int:
    """Barrier, settle, and (rank 0) the lo tx byte counter; 0 on other ranks."""
    return _mark_packets(rank)[0]


def _mark_packets(rank: int) -> tuple[int, int]:
    """``_mark``, with lo's tx packet counter too."""
    import torch.distributed as dist

    from gradzip.comm.netns import loopback_bytes

    dist.barrier()
    if rank == 0:
        time.sleep(0.05)
        return loopback_bytes()[1], _lo_tx_packets()
    time.sleep(0.15)
    return 0, 0


def _barrier_cost(rank: int, repeats: int = 3) -> tuple[float, float]:
    """Bytes and packets one ``_mark`` (one barrier) adds, mean of ``repeats``."""
    first = _mark_packets(rank)
    last = first
    for _ in range(repeats):
        last = _mark_packets(rank)
    return (last[0] - first[0]) / repeats, (last[1] - first[1]) / repeats


def _barrier_bytes(rank: int, repeats: int = 3) -> float:
    """Bytes one ``_mark`` (one barrier) adds to the counter, mean of ``repeats``."""
    return _barrier_cost(rank, repeats)[0]


def _mlp(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


class _CountAllGather:
    """Wraps ``dist.all_gather_single`` (FSDP2's parameter all-gather): link-model bytes."""

    def __init__(self) -> None:
        self.wire = 0

    def __enter__(self) -> _CountAllGather:
        import torch.distributed as dist

        from gradzip.collectives.linkmodel import link_bytes

        self._saved = dist.all_gather_single
        saved = self._saved

        def counted(output: Any, input: Any, group: Any = None, **kw: Any) -> Any:
            n = input.numel() * input.element_size()
            self.wire += link_bytes("all_gather", n, dist.get_world_size(group), "gloo")
            return saved(output, input, group=group, **kw)

        dist.all_gather_single = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.all_gather_single = self._saved


def parse_case(case: str) -> tuple[str, Any]:
    """``(parallel, method)`` of a case: ``fsdp2: SPEC``, or a method run under DDP
    (its errors raise here, before any rank starts)."""
    from gradzip.comm.method import parse_method

    kind, sep, spec = case.partition(":")
    if sep and kind.strip() == "fsdp2":
        return "fsdp2", parse_method(spec)
    return "ddp", parse_method(case)


def _build(case: str) -> tuple[Any, Any]:
    """The model and gradzip's handle of ``case``: a method (``gradzip.comm.method``'s
    grammar: a codec spec for DDP, or ``diloco(sync_every=H) | SPEC``), or ``fsdp2: SPEC``
    for an FSDP2 model."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip
    from gradzip.comm.method import LocalUpdateMethod
    from gradzip.comm.outer import DiLoCo

    parallel, method = parse_case(case)
    base = _mlp(WIDTH, DEPTH)
    if parallel == "fsdp2":
        for layer in base:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        model = fully_shard(base)
        return model, gradzip.attach(model, method)
    if isinstance(method, LocalUpdateMethod):
        return base, DiLoCo(base, **method.options())
    model = DDP(base, bucket_cap_mb=BUCKET_MB)
    return model, gradzip.attach(model, method)


def _run_case(rank: int, case: str, steps: int, barrier: float) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from gradzip.comm.outer import DiLoCo

    model, handle = _build(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
    start = _mark(rank)  # setup traffic (broadcasts, new groups) ends before this
    with _CountAllGather() as gathers:
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if isinstance(handle, DiLoCo):
                handle.step()
            handle.stats.end_step()
    end = _mark(rank)
    handle.close()
    totals = handle.stats.totals()
    mine = {"wire": totals["bytes_wire"], "handed": totals["bytes_handed"],
            "raw": totals["bytes_raw"], "by_op": totals["bytes_by_op"],
            "calls_by_op": totals["calls_by_op"], "other_model": gathers.wire}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    by_op: dict[str, int] = {}
    calls: dict[str, int] = {}
    for r in everyone:
        for op, n in r["by_op"].items():
            by_op[op] = by_op.get(op, 0) + n
        for op, n in r["calls_by_op"].items():
            calls[op] = calls.get(op, 0) + n
    return {"kind": "case", "case": case, "world": dist.get_world_size(), "steps": steps,
            "params": sum(p.numel() for p in model.parameters()),
            "kernel": end - start - barrier, "barrier": barrier, "counter_at_start": start,
            "wire": sum(r["wire"] for r in everyone),
            "handed": sum(r["handed"] for r in everyone),
            "raw": sum(r["raw"] for r in everyone),
            "other_model": sum(r["other_model"] for r in everyone),
            "by_op": by_op, "calls_by_op": calls}


def _cases_rank(rank: int, cases: list[str], steps: int) -> None:
    barrier = _barrier_bytes(rank)  # the same for every case: same group, same ranks
    for case in cases:
        row = _run_case(rank, case, steps, barrier)
        if row is not None:
            print(json.dumps(row), flush=True)


# ---------------------------------------------------------------- gloo probes
def _probe_calls(nbytes: int, world: int) -> dict[str, Any]:
    """One call of each collective, on fp32 tensors; ``nbytes`` is what the model's
    ``nbytes`` means for that op (the input a rank hands in)."""
    import torch
    import torch.distributed as dist

    n = nbytes // 4
    t = torch.ones(n)
    return {
        "all_reduce": lambda: dist.all_reduce(t.clone()),
        "all_gather": lambda: dist.all_gather([torch.empty(n) for _ in range(world)], t),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(n * world), t),
        "all_to_all": lambda: dist.all_to_all([torch.empty(n // world) for _ in range(world)],
                                              list(t.reshape(world, -1))),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(n // world), t),
        "broadcast": lambda: dist.broadcast(t.clone(), src=0),
        "barrier": lambda: dist.barrier(),
    }


_MODEL_OP = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def _probe_rank(rank: int, sizes: list[int], repeats: int) -> None:
    import torch.distributed as dist

    from gradzip.collectives.linkmodel import link_bytes

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor names: deprecated
    world = dist.get_world_size()
    barrier, barrier_packets = _barrier_cost(rank)
    for nbytes in sizes:
        for op, call in _probe_calls(nbytes, world).items():
            if op == "barrier" and nbytes != sizes[0]:
                continue
            start = _mark_packets(rank)
            for _ in range(repeats):
                call()
            end = _mark_packets(rank)
            if rank == 0:
                model_op = _MODEL_OP.get(op, op)
                model = 0 if op == "barrier" else world * link_bytes(model_op, nbytes, world)
                print(json.dumps({
                    "kind": "probe", "op": op, "world": world,
                    "nbytes": 0 if op == "barrier" else nbytes,
                    "kernel_per_call": (end[0] - start[0] - barrier) / repeats,
                    "packets_per_call": (end[1] - start[1] - barrier_packets) / repeats,
                    "model_per_call": model, "barrier": barrier,
                    "barrier_packets": barrier_packets}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradzip.bench.linkcount", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="local gloo processes")
    p.add_argument("--steps", type=int, default=6, help="training steps per case")
    p.add_argument("--case", action="append", default=[],
                   help="codec spec for DDP, 'fsdp2: SPEC' or 'diloco(sync_every=H) | SPEC' "
                        "(repeatable)")
    p.add_argument("--probe", action="store_true", help="measure gloo's collectives instead")
    p.add_argument("--probe-bytes", default="64,4096,1048576",
                   help="bytes handed in per probe call, comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="calls per probe")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for all ranks")
    args = p.parse_args(argv)

    from gradzip.comm.launch import run_ranks
    from gradzip.comm.netns import loopback_bytes

    if loopback_bytes()[1] > 10**9:  # not proof, but a host's lo is rarely this quiet
        print("warning: lo has sent > 1 GB; is this a fresh namespace (run_in_netns)?",
              file=sys.stderr)
    if args.probe:
        sizes = [int(s) for s in args.probe_bytes.split(",")]
        run_ranks(_probe_rank, args.ranks, sizes, args.repeats, timeout=args.timeout)
        return 0
    if not args.case:
        p.error("give at least one --case SPEC, or --probe")
    for case in args.case:  # a bad spec fails before any rank starts
        parse_case(case)
    run_ranks(_cases_rank, args.ranks, args.case, args.steps, timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
