"""``gradzip bench comm``: DDP step time, gradzip's hooks against PyTorch's own, 2 local ranks.

Spawns ``--ranks`` gloo processes on this machine (loopback; ``--rate 100mbit`` runs
the whole benchmark inside a fresh network namespace whose loopback is shaped, see
``gradzip.comm.netns``), and times, on one ~4M parameter MLP with the same DDP
buckets for every row:

* ``compute-only``: the plain model's forward/backward/step on every rank at once,
  no DDP and no communication (the floor any hook is measured against);
* PyTorch's own hooks, methods ``torch:none`` (DDP without a hook: its C++
  all-reduce), ``torch:fp16`` (``fp16_compress_hook``), ``torch:bf16``
  (``bf16_compress_hook``, which refuses gloo: reported, not run) and
  ``torch:powersgd(rank=R)`` (``powerSGD_hook``, error feedback and warm start on,
  compressing from step 2);
* gradzip's hooks (``gradzip.attach`` with each codec spec).

Each gradzip row is paired with PyTorch's row for the same algorithm (``none`` ~
``torch:none``, ``fp16`` ~ ``torch:fp16``, ``bf16`` ~ ``torch:bf16``,
``ef | powersgd(rank=R)`` ~ ``torch:powersgd(rank=R)``) and every row is compared
with ``compute-only``.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

COMPUTE_ONLY = "compute-only"
DEFAULT_SPECS = ["none", "fp16", "bf16", "ef | powersgd(rank=4)", "ef | topk(ratio=0.01)",
                 "efsignsgd"]
TORCH_FIXED = ["torch:none", "torch:fp16", "torch:bf16"]
#: PowerSGDState's minimum when error feedback or warm start is on
POWERSGD_START_ITER = 2


def is_torch_method(method: str) -> bool:
    from gradzip.comm.torch_hooks import is_torch_method as is_torch

    return is_torch(method)


def torch_equivalent(method: str) -> str:
    """The gradzip spec computing what PyTorch's hook ``method`` computes."""
    from gradzip.comm.torch_hooks import parse_torch_method

    kind, params = parse_torch_method(method)  # ValueError naming what exists
    return f"ef | powersgd(rank={params['rank']})" if kind == "powersgd" else kind


def _canonical(spec: str) -> str:
    import gradzip

    return str(gradzip.codec(spec))


def pair_rows(specs: Iterable[str], torch_methods: Iterable[str]) -> dict[str, str | None]:
    """gradzip spec -> the PyTorch method for the same algorithm among ``torch_methods``
    (compared by canonical spec, so ``ef|powersgd(rank=4)`` pairs too), else None."""
    by_canon = {_canonical(torch_equivalent(m)): m for m in torch_methods}
    return {s: by_canon.get(_canonical(s)) for s in specs}


def default_torch_methods(specs: Iterable[str]) -> list[str]:
    """PyTorch's rows worth running next to ``specs``: the counterparts that exist."""
    out: list[str] = []
    for spec in specs:
        canon = _canonical(spec)
        for m in [*TORCH_FIXED, *_powersgd_candidates(canon)]:
            if _canonical(torch_equivalent(m)) == canon and m not in out:
                out.append(m)
    order = {m: i for i, m in enumerate(TORCH_FIXED)}
    return sorted(out, key=lambda m: (order.get(m, len(order)), m))


def _powersgd_candidates(canon: str) -> list[str]:
    """``torch:powersgd(rank=R)`` for an ``ef | powersgd(...)`` spec (its rank may be the
    codec's default, left out of the canonical spec: try the plausible ones)."""
    m = re.fullmatch(r"ef \| powersgd(?:\(rank=(\d+)\))?", canon)
    if not m:
        return []
    if m.group(1):
        return [f"torch:powersgd(rank={m.group(1)})"]
    return [f"torch:powersgd(rank={r})" for r in range(1, 33)
            if _canonical(f"ef | powersgd(rank={r})") == canon][:1]


def _powersgd_rank(method: str) -> int:
    from gradzip.comm.torch_hooks import parse_torch_method

    return parse_torch_method(method)[1]["rank"]


def _model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _bucket_count(module: Any, bucket_cap_mb: float | None) -> int:
    """How many buckets DDP makes of ``module`` (its own assignment function)."""
    import torch.distributed as dist

    params = [p for p in module.parameters() if p.requires_grad][::-1]
    cap = int(25 * 1024 * 1024 if bucket_cap_mb is None else bucket_cap_mb * 1024 * 1024)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [first, cap],
                                                         [False] * len(params))
    return len(buckets)


def _one_bucket_mb(module: Any) -> float:
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return nbytes / 2**20 + 1.0


def _step(model: Any, opt: Any, x: Any, y: Any) -> None:
    import torch

    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


class _Run:
    """One method under test: its model, optimizer and hook, and its timed steps."""

    def __init__(self, row: dict[str, Any], model: Any, handle: Any) -> None:
        import torch

        from gradzip.comm.launch import CollectiveRecorder

        self.row, self.model, self.handle = row, model, handle
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.before: dict[str, Any] = {}
        # PyTorch's hooks call dist.all_reduce: count what they hand it
        ddp_hook = row["method"] not in (COMPUTE_ONLY, "torch:none") and not handle
        self.recorder = CollectiveRecorder() if ddp_hook else None

    def step(self, x: Any, y: Any, timed: bool) -> None:
        if timed and self.recorder:
            self.recorder.__enter__()
        try:
            start = time.perf_counter()
            _step(self.model, self.opt, x, y)
            if timed:
                self.times.append(time.perf_counter() - start)
        finally:
            if timed and self.recorder:
                self.recorder.__exit__()
        if self.handle:
            self.handle.stats.end_step()

    def start_timing(self) -> None:
        if self.handle:
            self.before = self.handle.stats.totals()

    def finish(self, params: int) -> None:
        """Fill the row: median step, and gradzip's stats or PyTorch's payload bytes."""
        row, steps = self.row, len(self.times)
        row["step_ms"] = statistics.median(self.times) * 1e3
        row["step_times_ms"] = [t * 1e3 for t in self.times]
        if self.recorder:
            row["payload_bytes_per_step"] = self.recorder.bytes / steps
            row["payload_ratio"] = 4 * params / max(row["payload_bytes_per_step"], 1)
        if self.handle:
            after, before = self.handle.stats.totals(), self.before
            row["encode_decode_ms"] = (after["encode_ms"] + after["decode_ms"]
                                       - before["encode_ms"] - before["decode_ms"]) / steps
            row["comm_ms"] = (after["comm_ms"] - before["comm_ms"]) / steps
            row["ratio"] = ((after["bytes_raw"] - before["bytes_raw"])
                            / max(after["bytes_wire"] - before["bytes_wire"], 1))
            row["bytes_wire_per_step"] = (after["bytes_wire"] - before["bytes_wire"]) / steps
            row["overhead_share"] = row["encode_decode_ms"] / row["step_ms"]
            self.handle.close()


def _rank_main(rank: int, methods: list[str], width: int, depth: int, steps: int, warmup: int,
               batch: int, bucket_cap_mb: float | None, one_bucket: bool,
               nonfinite: str = "error") -> dict[str, Any]:
    """One rank's rows, every method on the same model, data and buckets, interleaved:
    timed step i runs every method once (starting with a different one each time),
    so a change in the machine's load falls on all rows alike."""
    import torch
    import torch.distributed as dist

    torch.set_flush_denormal(True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, 1, generator=g)
    backend = dist.get_backend()
    plain = _model(width, depth)
    params = sum(p.numel() for p in plain.parameters())
    if one_bucket:
        bucket_cap_mb = _one_bucket_mb(plain)
    rows: list[dict[str, Any]] = []
    runs = [run for method in methods
            if (run := _setup(method, plain, bucket_cap_mb, backend, params, rows, nonfinite))]
    for run in runs:
        for _ in range(warmup):
            run.step(x, y, timed=False)
        run.start_timing()
    for i in range(steps):
        for run in runs[i % len(runs):] + runs[:i % len(runs)]:
            dist.barrier()  # every rank starts the step together, as under DDP
            run.step(x, y, timed=True)
    for run in runs:
        run.finish(params)
    # PyTorch's powerSGD_hook callbacks hold the process group; a last collective lets
    # them finish first, or gloo's thread may destroy the group at exit and abort
    dist.barrier()
    return {"rows": rows, "backend": backend}


def _setup(method: str, plain: Any, bucket_cap_mb: float | None, backend: str, params: int,
           rows: list[dict[str, Any]], nonfinite: str) -> _Run | None:
    """``method``'s row (appended to ``rows``) and its run, or None if unsupported."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    width, depth = plain[0].in_features, (len(plain) - 1) // 2
    row: dict[str, Any] = {"method": method, "params": params}
    rows.append(row)
    if method == COMPUTE_ONLY:  # every rank at once, as under DDP, but alone
        row["buckets"] = 0
        return _Run(row, _model(width, depth), None)
    cap = _bucket_cap(method, plain, bucket_cap_mb, backend, row)
    model = DDP(_model(width, depth), bucket_cap_mb=cap)
    try:
        handle = _install(model, method, backend, nonfinite)
    except _Unsupported as e:  # the same on every rank
        row["unsupported"] = f"not supported on {backend}"
        row["error"] = str(e)
        return None
    return _Run(row, model, handle)


class _Unsupported(Exception):
    """PyTorch's hook refuses this backend (bf16_compress_hook needs NCCL)."""


def _bucket_cap(method: str, plain: Any, bucket_cap_mb: float | None, backend: str,
                row: dict[str, Any]) -> float | None:
    """The method's bucket cap: PyTorch's PowerSGD gets one bucket on gloo (it hangs or
    aborts with several), and the row says so."""
    cap = bucket_cap_mb
    if (method.startswith("torch:powersgd") and backend == "gloo"
            and _bucket_count(plain, cap) > 1):
        cap = _one_bucket_mb(plain)
        row["note"] = ("one bucket: PyTorch's powerSGD_hook hangs or aborts on gloo with "
                       f"several (the other rows have {_bucket_count(plain, bucket_cap_mb)})")
    row["bucket_cap_mb"] = cap
    row["buckets"] = _bucket_count(plain, cap)
    return cap


def _install(model: Any, method: str, backend: str, nonfinite: str) -> Any:
    """Register ``method``'s comm hook on the DDP ``model``; gradzip's handle or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import gradzip

    if method == "torch:none":
        return None
    if method == "torch:fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if method == "torch:bf16":
        try:
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        except (TypeError, RuntimeError) as e:
            raise _Unsupported(str(e)) from None
        return None
    if is_torch_method(method):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=_powersgd_rank(method),
            start_powerSGD_iter=POWERSGD_START_ITER, use_error_feedback=True,
            warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None
    return gradzip.attach(model, method, nonfinite=nonfinite)


def paired_ratio(row: dict[str, Any], base: dict[str, Any]) -> float:
    """Median over timed steps of row's step time / base's in the same round (the
    steps are interleaved, so each pair saw the same machine load); the ratio of
    medians when the per-step times are not there."""
    a, b = row.get("step_times_ms"), base.get("step_times_ms")
    if a and b and len(a) == len(b):
        return statistics.median(x / y for x, y in zip(a, b, strict=True))
    return float(row["step_ms"]) / float(base["step_ms"])


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Fill ``vs_compute_only`` for every timed row, and ``torch_pair``/``vs_torch`` for
    gradzip rows whose PyTorch counterpart is among ``rows``."""
    by_method = {r["method"]: r for r in rows}
    compute = by_method.get(COMPUTE_ONLY)
    torch_methods = [r["method"] for r in rows if is_torch_method(r["method"])]
    specs = [r["method"] for r in rows
             if r["method"] != COMPUTE_ONLY and not is_torch_method(r["method"])]
    pairs = pair_rows(specs, torch_methods)
    for r in rows:
        if "step_ms" not in r:
            continue
        if compute and r is not compute:
            r["vs_compute_only"] = paired_ratio(r, compute)
        pair = pairs.get(r["method"])
        if pair:
            r["torch_pair"] = pair
            other = by_method[pair]
            if "step_ms" in other:
                r["vs_torch"] = paired_ratio(r, other)
                if other.get("buckets") != r.get("buckets"):
                    r["torch_pair_buckets"] = other.get("buckets")
            else:
                r["torch_pair_missing"] = other.get("unsupported", "did not run")


def _methods(args: Any) -> list[str]:
    given = args.spec or DEFAULT_SPECS
    specs = [s for s in given if not is_torch_method(s) and s != COMPUTE_ONLY]
    torch_given = [s for s in given if is_torch_method(s)]
    import gradzip

    for s in torch_given:
        torch_equivalent(s)  # fail on an unknown name before spawning anything
    for s in specs:
        gradzip.codec(s)
    if args.no_torch:
        torch_methods = torch_given
    else:
        torch_methods = list(dict.fromkeys([*torch_given, *default_torch_methods(specs)]))
    return [COMPUTE_ONLY, *torch_methods, *specs]


def _netns_argv(args: Any) -> list[str]:
    """This command again, without ``--rate`` (it runs inside the shaped namespace)."""
    argv = [sys.executable, "-m", "gradzip", "bench", "comm", "--ranks", str(args.ranks),
            "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--link-note", f"loopback shaped to {args.rate} (tbf, one link shared by all ranks)"]
    for s in args.spec or []:
        argv += ["--spec", s]
    if args.bucket_cap_mb is not None:
        argv += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    argv += ["--nonfinite", args.nonfinite]
    for flag in ("one_bucket", "no_torch", "json"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    return argv


def _run_shaped(args: Any) -> int:
    from gradzip.comm.netns import NetnsError, rate_bits_per_second, run_in_netns

    try:
        rate_bits_per_second(args.rate)
    except ValueError as e:
        print(f"gradzip bench comm: error: --rate: {e}", file=sys.stderr)
        return 2
    try:
        proc = run_in_netns(_netns_argv(args), rate=args.rate, timeout=4 * 3600.0,
                            on_line=lambda line: print(line, flush=True))
    except NetnsError as e:
        print(f"gradzip bench comm: error: --rate needs a network namespace: {e}",
              file=sys.stderr)
        return 2
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr, end="")
    return proc.returncode


def _fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_table(rows: list[dict[str, Any]], args: Any, backend: str = "gloo") -> str:
    compute = next((r for r in rows if r["method"] == COMPUTE_ONLY), None)
    ddp = [r for r in rows if r["method"] != COMPUTE_ONLY and "buckets" in r]
    caps = sorted({r["buckets"] for r in ddp if "note" not in r})
    link = getattr(args, "link_note", None) or "unlimited loopback"
    lines = [
        f"{args.ranks} ranks, {backend} over {link}, MLP {rows[0]['params'] / 1e6:.2f}M params, "
        f"batch {args.batch}, median of {args.steps} interleaved steps after {args.warmup} "
        "warm-up (ratios: median of per-step ratios); "
        f"DDP buckets: {', '.join(map(str, caps)) or '-'}"
        + (" (--one-bucket)" if args.one_bucket else
           f" (bucket_cap_mb {args.bucket_cap_mb or '25, first bucket 1 MB: PyTorch default'})"),
        "| method | buckets | step ms | vs compute-only | vs PyTorch | encode+decode ms "
        "| comm ms | ratio |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        name = r["method"].replace("|", "\\|")  # a pipe would split the markdown cell
        name = f"`{name}`"
        if "unsupported" in r:
            lines.append(f"| {name} | {r['buckets']} | {r['unsupported']} | - | - | - | - | - |")
            continue
        if r.get("note"):
            notes.append(f"{r['method']}: {r['note']}")
            name += " *"
        vs_c = "1.00x" if r is compute else _fmt_x(r.get("vs_compute_only"))
        pair = r.get("torch_pair")
        if pair is None:
            vs_t = "-"
        elif "vs_torch" in r:
            vs_t = f"{r['vs_torch']:.2f}x ({pair})"
            if "torch_pair_buckets" in r:  # not the same buckets: say so in the cell
                vs_t = (f"{r['vs_torch']:.2f}x ({pair}, {r['torch_pair_buckets']} vs "
                        f"{r['buckets']} buckets)")
        else:
            vs_t = f"- ({pair}: {r.get('torch_pair_missing', 'did not run')})"
        if "encode_decode_ms" in r:
            extra = (f"{r['encode_decode_ms']:.1f} | {r['comm_ms']:.1f} | {r['ratio']:.1f}")
        elif "payload_ratio" in r:
            extra = f"- | - | {r['payload_ratio']:.1f} (payload)"
        else:
            extra = "- | - | -"
        lines.append(f"| {name} | {r['buckets']} | {r['step_ms']:.1f} | {vs_c} | {vs_t} "
                     f"| {extra} |")
    lines += [f"\\* {n}" for n in notes]
    return "\n".join(lines)


def run(args: Any) -> int:
    if args.rate:
        return _run_shaped(args)
    from gradzip.comm.launch import run_ranks

    methods = _methods(args)
    results = run_ranks(_rank_main, args.ranks, methods, args.width, args.depth, args.steps,
                        args.warmup, args.batch, args.bucket_cap_mb, args.one_bucket,
                        args.nonfinite,
                        timeout=3600.0)
    rows = results[0]["rows"]
    add_comparisons(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(format_table(rows, args, results[0]["backend"]))
    return 0


_EPILOG = """\
rows:
  compute-only            the plain model (no DDP, no communication) stepping on
                          every rank at once: the floor; "vs compute-only" is each
                          row's step time over it
  torch:none              DDP without a hook (PyTorch's C++ all-reduce)
  torch:fp16, torch:bf16  PyTorch's fp16_compress_hook / bf16_compress_hook
                          (bf16 refuses gloo: reported as not supported)
  torch:powersgd(rank=R)  PyTorch's powerSGD_hook, error feedback and warm start
                          on, compressing from step 2; on gloo it runs with one
                          bucket (it hangs with several) and says so
  SPEC                    gradzip.attach with that codec spec
pairing ("vs PyTorch", gradzip step time over PyTorch's for the same algorithm):
  none ~ torch:none, fp16 ~ torch:fp16, bf16 ~ torch:bf16,
  ef | powersgd(rank=R) ~ torch:powersgd(rank=R)
  PyTorch rows for the given specs' counterparts are added unless --no-torch;
  --spec torch:... adds one explicitly. --one-bucket (every row one bucket) is the
  fair comparison for PowerSGD.
"""


def register(sub: Any) -> None:
    import argparse

    p = sub.add_parser(
        "comm", help="DDP step time: gradzip's hooks vs PyTorch's own and compute only",
        description=__doc__.split("\n\n")[0] if __doc__ else None, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", action="append", metavar="METHOD",
                   help="gradzip codec spec or torch:none|fp16|bf16|powersgd(rank=R) "
                        f"(repeatable); default: {'; '.join(DEFAULT_SPECS)} and their "
                        "PyTorch counterparts")
    p.add_argument("--no-torch", action="store_true",
                   help="don't add PyTorch's counterparts of the gradzip specs")
    p.add_argument("--ranks", type=int, default=2, help="local gloo processes")
    p.add_argument("--width", type=int, default=1024, help="MLP width (1024 x 4 = ~4.2M params)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (gradzip's first and PowerSGD's first two "
                        "steps are uncompressed by design)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket_cap_mb for every row (default: PyTorch's, 25 MB with "
                        "a 1 MB first bucket)")
    p.add_argument("--one-bucket", action="store_true",
                   help="one DDP bucket for every row (bucket_cap_mb above the model size)")
    p.add_argument("--rate", default=None,
                   help="run everything in a fresh network namespace whose loopback is "
                        "shaped to this tc rate, e.g. 100mbit (no root needed)")
    p.add_argument("--nonfinite", choices=("error", "propagate"), default="error",
                   help="gradzip's policy for NaN/Inf gradients: error (default) checks "
                        "every bucket; propagate lets them cross as DDP's own all-reduce "
                        "does (for none: no check at all)")
    p.add_argument("--link-note", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print rows as JSON")
    p.set_defaults(func=run)
