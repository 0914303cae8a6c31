"""``gradzip bench gpu``: is gradzip correct and fast where users train, CUDA + NCCL?

One command for one GPU (at most a few minutes on an H100), writing ``gpu.json`` and
``gpu.md`` into ``--out``. Three parts:

1. **Stream order.** A hook's future must order the compute stream after the NCCL
   collective. The probe queues a long ``torch.cuda._sleep`` on a side stream, calls
   the hook there (so NCCL, which waits for the calling stream, starts only after the
   sleep), then waits on the hook's future from the compute stream and times it with
   CUDA events: a correctly chained future makes the compute stream wait the whole
   sleep; a future that carries no CUDA events (``torch.futures.collect_all``, which
   gradzip's chained path used to return) lets it run on at once, which is the race
   where decode reads the sum before NCCL wrote it. PyTorch's ``fp16_compress_hook``
   is the control, and a ``collect_all`` hook the negative control that the probe must
   catch.
2. **DDP on a one-rank NCCL group** for each codec family: a small MLP trained a few
   steps under ``gradzip.attach``; no crash, finite, and for lossless codecs the same
   parameters as eager training, bit for bit; the host syncs of a compressed step's
   backward (where the hooks run, every thread), per reduction (a bucket, or a
   parameter for the multi-round codecs that reduce one at a time).
   Then **resume on the device** (``gpu_resume.py``): every stateful codec, and DiLoCo
   with an exchange in flight, saved, loaded on the CPU as a checkpoint is, and resumed;
   and **HSDP on a 1x1 mesh** against native HSDP (``gpu_hsdp.py``).
   Then **several ranks on the one GPU** (``gpu_ranks.py``): 3 and 4 processes on
   ``cuda:0`` over gloo with NCCL's rules enforced (``strict.py``), every aggregation
   path, a NaN on one rank, Streaming DiLoCo with overlap, SparseLoCo, hierarchical DDP
   and HSDP 2x2, and a negative control; and **Streaming DiLoCo's overlap race**
   against the caching allocator (``gpu_overlap.py``).
3. **Encode and decode speed** per codec on a 25 MB fp32 bucket of three tensors
   (CUDA events, median of ``--repeat``), with the host syncs of each call counted by
   ``torch.cuda.set_sync_debug_mode("warn")``, the fused kernels against the torch
   path, payloads checked against the CPU's, and the link rate below which each codec
   beats the 16-bit all-reduce (``gpu_speed.py``).

``--smoke`` runs the same on the CPU over a one-rank gloo group, small, with the sync
counts from ``gradzip.bench.devicecheck.count_host_syncs``; the tests run it. The
stream probe needs CUDA and is reported as skipped there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.bench.gpu_hsdp import hsdp_rows
from gradzip.bench.gpu_overlap import overlap_rows
from gradzip.bench.gpu_ranks import ranks_rows
from gradzip.bench.gpu_resume import resume_rows
from gradzip.bench.gpu_speed import COLUMNS, codec_speed, host_syncs, launch_rows

#: codec families of the DDP check and the speed table (``--codecs`` overrides)
SPECS = ["none", "fp16", "bf16", "randomk(ratio=0.01)", "topk(ratio=0.01)",
         "ef | topk(ratio=0.01)", "int8", "qsgd", "terngrad", "natural", "signsgd",
         "efsignsgd", "onebit", "dgc", "powersgd(rank=4)", "sketch", "demo", "gradiveq",
         "fp8", "fp8(format=e5m2)", "centroid", "centroid(bits=4) | ans", "int8 | ans",
         "qsgd | eg", "none | zstd", "lossless"]
#: exact codecs: DDP on one rank must equal eager training bit for bit
LOSSLESS = {"none", "none | zstd", "lossless", "none | lz4"}
#: the 25 MB bucket of the speed table: two matrices and a bias (6,553,600 fp32 values)
BUCKET = [torch.Size((2048, 2048)), torch.Size((1151, 2048)), torch.Size((2048,))]
SMOKE_BUCKET = [torch.Size((128, 256)), torch.Size((31, 256)), torch.Size((256,))]


class _Bucket:
    """What a DDP comm hook reads of a ``GradBucket`` (which Python cannot build)."""

    def __init__(self, buffer: torch.Tensor, shapes: list[torch.Size],
                 last: bool = True, params: list[nn.Parameter] | None = None) -> None:
        self._buffer = buffer
        #: the same parameters across calls keep a hook's bucket layout (and its state)
        self._params = params or [nn.Parameter(torch.empty(s, device=buffer.device))
                                  for s in shapes]
        self._last = last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return [p.view(-1) for p in self._params]


# ---------------------------------------------------------------- 1. stream order
def _collect_all_hook(group: Any, bucket: _Bucket) -> torch.futures.Future:
    """The race this probe exists for: a future from ``collect_all`` has no CUDA events."""
    buf = bucket.buffer()
    work = dist.all_reduce(buf, group=group, async_op=True)
    return torch.futures.collect_all([work.get_future()]).then(lambda _: buf)


def _blocking_hook(group: Any, bucket: _Bucket) -> torch.futures.Future:
    """The other failure: a hook that waits for NCCL on the host (ordered, but backward
    stalls on every bucket). The host-time bound must catch it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fut = default_hooks.fp16_compress_hook(group, bucket)  # type: ignore[arg-type]
    fut.wait()
    torch.cuda.synchronize()
    return fut


def _waited_ms(hook: Callable[[Any, Any], torch.futures.Future], state: Any,
               bucket: _Bucket, sleep_cycles: int) -> tuple[float, float]:
    """(milliseconds the compute stream waited on the hook's future behind a delayed
    NCCL, milliseconds the hook call held the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.cuda.stream(side):
        torch.cuda._sleep(sleep_cycles)  # NCCL waits for the stream it is called from
        called = time.perf_counter()
        fut = hook(state, bucket)
        host_ms = (time.perf_counter() - called) * 1e3
    fut.wait()  # a CUDA-aware future makes the current (compute) stream wait
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), host_ms


def stream_order(n: int) -> list[dict[str, Any]]:
    """One row per hook and bucket kind: how long the compute stream waited, against
    the sleep (``ordered``), and whether the hook call returned to the host before NCCL
    ran (``early``). A bucket that is not the step's last must be both: only the last
    one may wait on the host (the chained path reads its non-finite flags there)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import gradzip

    sleep_ms, cycles = _calibrate_sleep()
    rows = []
    # (name, hook, state, expected ordered, expected early on a bucket that is not last)
    hooks: list[tuple[str, Any, Any, bool, bool]] = [
        ("torch fp16_compress_hook (control)", default_hooks.fp16_compress_hook, None,
         True, True),
        ("collect_all (negative control)", _collect_all_hook, None, False, True),
        ("host wait (negative control)", _blocking_hook, None, True, False),
    ]
    for spec in ("none", "fp16", "randomk(ratio=0.1)", "ef | int8"):
        state, hook = gradzip.ddp_hook(spec)
        hooks.append((f"gradzip {spec}", hook, state, True, True))
    for name, hook, state, expect, expect_early in hooks:
        params = _Bucket(torch.ones(n, device="cuda"), [torch.Size((n,))]).parameters()
        # warm, untimed: gradzip's first step is uncompressed by design and its second
        # compiles the Triton kernels (seconds, once per process: run 3 timed it, 3.5 s
        # for ef | int8); every hook's first call also pays NCCL's and the allocator's
        # first use (63 ms for PyTorch's own fp16 hook)
        for _ in range(1 if state is None else 2):
            hook(state, _Bucket(torch.ones(n, device="cuda"), [torch.Size((n,))],
                                params=params)).wait()
            torch.cuda.synchronize()
        for last in (False, True):
            bucket = _Bucket(torch.ones(n, device="cuda"), [torch.Size((n,))], last=last,
                             params=params)
            waited, host_ms = _waited_ms(hook, state, bucket, cycles)
            ordered, early = waited >= 0.8 * sleep_ms, host_ms < 0.5 * sleep_ms
            ok = ordered == expect and (last or early == expect_early)
            rows.append({"hook": name, "last": last, "sleep_ms": round(sleep_ms, 2),
                         "waited_ms": round(waited, 2), "host_ms": round(host_ms, 2),
                         "ordered": ordered, "early": early, "expected": expect,
                         "expected_early": expect_early if not last else "-", "ok": ok})
        if state is not None:
            state.close()
    return rows + torch_hook_timing(n, sleep_ms, cycles)


def torch_hook_timing(n: int, sleep_ms: float, cycles: int) -> list[dict[str, Any]]:
    """``torch:fp16`` measured as a method with a delay in the hook, before its NCCL
    all-reduce (PyTorch's hook wrapped with a ``torch.cuda._sleep`` on the calling
    stream): its recorded communication time must cover the sleep (CUDA events,
    ``gradzip.comm.eventtimes``). The host clock in the future's callback, what it
    read before, is the negative control: NCCL runs the callback at enqueue."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from gradzip.comm.torch_hooks import attach_torch

    class _Model:  # what attach_torch reads of a DDP model
        bucket_bytes_cap = 1 << 30
        bucket_bytes_cap_default = False
        module = nn.Linear(1, 1)

        def register_comm_hook(self, state: Any, hook: Any) -> None:
            self.state, self.hook = state, hook

    original = default_hooks.fp16_compress_hook

    def delayed(group: Any, bucket: Any) -> torch.futures.Future:
        torch.cuda._sleep(cycles)  # the all-reduce starts after it, on this stream
        return original(group, bucket)

    model = _Model()
    default_hooks.fp16_compress_hook = delayed  # type: ignore[assignment]
    try:
        handle = attach_torch(model, "torch:fp16")
    finally:
        default_hooks.fp16_compress_hook = original  # type: ignore[assignment]
    seen: list[float] = []
    for _ in range(2):  # a warm-up, then the measured call
        handle.stats.end_step()
        before = handle.stats.totals()["comm_ms"]
        called = time.perf_counter()
        bucket = _Bucket(torch.ones(n, device="cuda"), [torch.Size((n,))])
        model.hook(model.state, bucket).then(
            lambda f, t=called: seen.append((time.perf_counter() - t) * 1e3)).wait()
        torch.cuda.synchronize()
    handle.stats.end_step()
    events_ms = handle.stats.totals()["comm_ms"] - before
    handle.close()
    rows = [("torch:fp16 timed by events", events_ms, True),
            ("torch:fp16 host clock in callback (negative control)", seen[-1], False)]
    return [{"hook": name, "last": "-", "sleep_ms": round(sleep_ms, 2),
             "waited_ms": round(ms, 2), "ordered": ms >= 0.8 * sleep_ms, "expected": want,
             "ok": (ms >= 0.8 * sleep_ms) == want} for name, ms, want in rows]


def _calibrate_sleep(target_ms: float = 50.0) -> tuple[float, int]:
    """Cycles of ``torch.cuda._sleep`` that take about ``target_ms``, and the ms measured."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    cycles = int(cycles * target_ms / max(start.elapsed_time(end), 1e-3))
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), cycles


# ---------------------------------------------------------------- 2. DDP, one rank
def _mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 8)).to(device)


def _train(model: nn.Module, device: torch.device, steps: int, handle: Any = None,
           counted: list[int] | None = None, sites: Counter[str] | None = None) -> None:
    """``steps`` SGD steps on fixed batches; ``counted`` gets the host syncs of the
    backward passes after the first two (compression on, buffers warm), ``sites``
    where they came from (on CUDA)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g).to(device)
        y = torch.randn(32, 8, generator=g).to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if counted is not None and step >= 2:
            with host_syncs(device) as box:
                loss.backward()  # the hooks run here, and DDP waits for their futures
            counted.append(box[0])
            if sites is not None:
                sites.update(box.sites)
        else:
            loss.backward()
        opt.step()
        if handle is not None:
            handle.stats.end_step()


def ddp_one_rank(specs: list[str], device: torch.device, steps: int = 4) -> list[dict[str, Any]]:
    """Each codec trains the MLP under DDP; compared with eager training of a copy."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    eager = _mlp(device)
    _train(eager, device, steps)
    rows = []
    for spec in specs:
        row: dict[str, Any] = {"codec": spec}
        try:
            model = DDP(_mlp(device), bucket_cap_mb=0.1,
                        device_ids=[device.index] if device.type == "cuda" else None)
            handle = gradzip.attach(model, spec)
            counted: list[int] = []
            sites: Counter[str] = Counter()
            _train(model, device, steps, handle, counted, sites)
            if device.type == "cuda":
                torch.cuda.synchronize()
            totals = handle.stats.totals()
            # reductions per compressed step (the first step is plain, by design)
            per_step = (sum(totals["aggregation"].values())
                        - totals["aggregation"].get("plain", 0)) / max(steps - 1, 1)
            handle.close()
            diff = max(float((a - b).detach().abs().max()) for a, b in
                       zip(model.module.parameters(), eager.parameters(), strict=True))
            finite = all(bool(p.isfinite().all()) for p in model.parameters())
            row.update(ok=finite and (diff == 0.0 or spec not in LOSSLESS), finite=finite,
                       max_diff_to_eager=diff, exact_expected=spec in LOSSLESS,
                       reductions=sum(totals.get("aggregation", {}).values()),
                       comm_ms_per_step=round(totals["comm_ms"] / max(totals["steps"], 1), 3),
                       syncs_per_reduction=round(
                           sum(counted) / max(per_step * len(counted), 1), 2),
                       path="chained" if handle.chained else "comm thread",
                       sync_sites=", ".join(f"{k} x{v}" for k, v in sites.most_common(6)))
        except Exception as e:  # noqa: BLE001 - one codec's failure is a row, not the end
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
    return rows


def nonfinite(specs: list[str], device: torch.device, steps: int = 5) -> list[dict[str, Any]]:
    """Where a NaN in step 2 surfaces as ``NonFiniteGradientError``: in that step's
    backward on every path (the chained path on CUDA reads its flags in the last
    bucket's callback, before any optimizer step); later steps train again."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    rows = []
    for spec in specs:
        model = DDP(_mlp(device), bucket_cap_mb=0.1,
                    device_ids=[device.index] if device.type == "cuda" else None)
        handle = gradzip.attach(model, spec)
        errors: list[int] = []
        message = ""
        for step in range(steps):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).to(device)
            if step == 2:
                x[0, 0] = float("nan")
            model.zero_grad()
            try:
                model(x).pow(2).mean().backward()
            except Exception as e:  # noqa: BLE001 - the hook's error, through DDP
                errors.append(step)
                message = str(e)
            handle.stats.end_step()
        handle.close()
        expected = 2  # in the NaN step's own backward, on every path and device
        rows.append({"codec": spec, "path": "chained" if handle.chained else "comm thread",
                     "nan_step": 2, "error_step": errors[0] if errors else None,
                     "ok": errors == [expected] and "at least one rank" in message,
                     "error": next((line.strip()[:100] for line in message.splitlines()
                                    if "non-finite" in line), message[:100])})
    return rows


# ---------------------------------------------------------------- 3. speed and syncs
# ---------------------------------------------------------------- the command
def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (str(r.get(c, "")).replace("|", "\\|") for c in cols)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(record: dict[str, Any]) -> str:
    """The three tables (for docs/benchmarks/gpu.md)."""
    parts = [f"Device: {record['device']}; torch {record['torch']}; backend "
             f"{record['backend']}; {record['date']}", "", "Stream order:", ""]
    if record["stream_order"]:
        parts.append(_table(record["stream_order"],
                            ["hook", "last", "sleep_ms", "waited_ms", "host_ms", "ordered",
                             "early", "expected", "expected_early", "ok"]))
    else:
        parts.append("skipped (needs CUDA)")
    parts += ["", "DDP on one rank:", "", _table(record["ddp"], [
        "codec", "ok", "path", "finite", "max_diff_to_eager", "exact_expected", "reductions",
        "syncs_per_reduction", "sync_sites", "comm_ms_per_step", "error"]), "",
        "A NaN in step 2 under nonfinite='error':", "",
        _table(record["nonfinite"], ["codec", "path", "nan_step", "error_step", "ok", "error"]),
        "", "Resumed on the device from a checkpoint loaded on the CPU:", "",
        _table(record.get("resume", []), ["state", "ok", "finite", "max_diff_to_kept",
                                          "error"]),
        "", "HSDP on a 1x1 mesh against native HSDP (host syncs of the last backward, "
        "per unit):", "",
        _table(record.get("hsdp", []), ["replicate", "ok", "finite", "max_diff_to_native",
                                        "syncs_per_unit", "syncs_per_backward", "error"]),
        "", "Several ranks on the one device, over gloo with NCCL's rules enforced "
        "(`bench/gpu_ranks.py`, `bench/strict.py`):", "",
        _table(record.get("ranks", []), ["case", "world", "ok", "checked_collectives",
                                         "detail"]),
        "", "Streaming DiLoCo's overlapped exchanges against the caching allocator, "
        "sleeps on both streams (`bench/gpu_overlap.py`):", "",
        _table(record.get("overlap", []), ["run", "ok", "equal_to_uncached", "ranks_agree",
                                           "finite"]),
        "",
        f"Encode/decode of a {record['bucket_mb']} MB bucket:", "",
        _table(record["speed"], COLUMNS), "",
        "What one call costs the host (back to back, the device waited for once):", "",
        _table(record.get("launch", []), ["call", "host_us"])]
    return "\n".join(parts) + "\n"


@contextmanager
def _one_rank_group(backend: str, device: torch.device) -> Iterator[None]:
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    smoke = args.smoke or not torch.cuda.is_available()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: running the CPU smoke mode (--smoke)")
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    backend = "gloo" if device.type == "cpu" else "nccl"
    specs = [s.strip() for s in args.codecs.split(";") if s.strip()] if args.codecs else SPECS
    shapes = SMOKE_BUCKET if smoke else BUCKET
    torch.set_flush_denormal(True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "backend": backend, "smoke": smoke,
        "date": time.strftime("%Y-%m-%d"), "bucket_mb": round(
            sum(s.numel() for s in shapes) * 4 / 1e6, 2)}
    with _one_rank_group(backend, device):
        started = time.perf_counter()
        record["stream_order"] = stream_order(1 << 20) if device.type == "cuda" else []
        print(f"stream order: {len(record['stream_order'])} hooks "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        record["ddp"] = ddp_one_rank(specs, device)
        print(f"ddp: {sum(r['ok'] for r in record['ddp'])}/{len(specs)} ok "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        record["nonfinite"] = nonfinite(["none", "fp16", "ef | int8", "powersgd(rank=2)"],
                                        device)
        record["resume"] = resume_rows(device, _mlp(device))
        record["hsdp"] = hsdp_rows(device, _mlp(device), lambda: host_syncs(device))
        print(f"hsdp 1x1: {sum(r['ok'] for r in record['hsdp'])}/{len(record['hsdp'])} "
              f"ok ({time.perf_counter() - started:.0f} s)", flush=True)
        print(f"resume: {sum(r['ok'] for r in record['resume'])}/{len(record['resume'])} "
              f"ok ({time.perf_counter() - started:.0f} s)", flush=True)
        record["speed"] = codec_speed(specs, device, shapes, args.repeat)
        record["launch"] = launch_rows(device, shapes)
        print(f"speed: done ({time.perf_counter() - started:.0f} s)", flush=True)
    record["ranks"] = ranks_rows(device.type)
    print(f"several ranks: {sum(r['ok'] for r in record['ranks'])}/{len(record['ranks'])} "
          f"ok ({time.perf_counter() - started:.0f} s)", flush=True)
    record["overlap"] = overlap_rows(device.type)
    print(f"overlap race: {sum(r['ok'] for r in record['overlap'])}/"
          f"{len(record['overlap'])} ok ({time.perf_counter() - started:.0f} s)", flush=True)
    record["ok"] = all(r["ok"] for part in ("stream_order", "ddp", "nonfinite", "resume",
                                            "hsdp", "speed", "ranks", "overlap")
                       for r in record[part])
    text = markdown(record)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in (("gpu.json", json.dumps(record, indent=2, default=str)),
                           ("gpu.md", text)):
            tmp = out / (name + ".tmp")
            tmp.write_text(data)
            tmp.replace(out / name)
        print(f"wrote {out / 'gpu.json'} and {out / 'gpu.md'}")
    return 0 if record["ok"] else 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "gpu", help="CUDA + NCCL: stream order of the hooks, DDP per codec on one rank, "
                    "encode/decode GB/s and host syncs (--smoke: the same on CPU)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for gpu.json and gpu.md")
    p.add_argument("--smoke", action="store_true",
                   help="run on the CPU over gloo, small (what the tests run)")
    p.add_argument("--codecs", metavar="SPECS",
                   help="semicolon-separated codec specs (default: one per codec family)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per codec; the median")
    p.set_defaults(func=run)
