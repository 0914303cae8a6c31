"""``gradzip bench gpu``: encode and decode speed per codec, and where each stops paying.

For each codec, on one bucket: encode and decode GB/s (CUDA events, median of
``repeat``: a call's whole cost, host-bound where launching takes longer than the
work) beside the plain copy's (``none``), the same from the device's own time only
(``device_*_gbps``, the profiler's kernel and copy times), the host syncs of one
call, what one call costs the host layer by layer (``launch_rows``), and for
the stages with a fused kernel (``codecs/kernels``) the same with the kernels off
(``GRADZIP_KERNELS=off``: the torch path on the same device, in the same run). Where
a stage's output does not depend on random draws, its payload is also encoded on the
CPU and compared bit for bit (``equal_cpu``): a GPU kernel must make what the CPU makes.

**Break-even link rate.** From the measured speeds and the stated time model of
``compare/sweep.py`` (a step costs its compute plus ``8 v / B``, a real link banks
nothing) for one bucket on ``WORLD`` ranks, each on its own link of rate ``B``: the
16-bit all-reduce costs ``fp16``'s encode and decode and sends ``2 (W-1)/W x 2n``
bytes; a summable codec costs one encode and one decode and sends ``2 (W-1)/W x
wire``; any other crosses two-phase (``aggregation/strategies.py``: every rank encodes
its bucket, each owner decodes W chunks, re-encodes its mean, and everyone decodes W
chunks: ``(1 + 1/W)`` encodes and 2 decodes) and sends about ``2 (W-1)/W x wire``. A
codec that saves bytes but costs time wins below ``B* = saved bits / extra seconds``.
Multi-round codecs (PowerSGD) exchange in rounds the model does not cover: n/a.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gradzip.collectives.linkmodel import link_bytes
from gradzip.compare.sweep import weigh

#: ranks of the break-even model (one 8-GPU node's worth, each on its own link)
WORLD = 8
#: stages with a fused kernel: a chain with one is timed with the kernels off as well
KERNEL_STAGES = ("int8", "qsgd", "fp8", "centroid", "ans", "lossless")
#: stages whose payload does not depend on random draws: a chain of only these is
#: compared with the CPU's
DETERMINISTIC = ("none", "fp16", "bf16", "int8", "fp8", "topk", "signsgd", "ef", "centroid",
                 "ans")
#: deterministic stages whose device kernel adds in another order than the CPU (a tree,
#: not one by one): equal on almost every input, not on all (``kernels/centroid.py``),
#: so a difference is counted rather than called a failure
SUM_ORDER = ("centroid",)
#: stages whose device backend writes another of their formats than the host's
#: default, and the option that asks a CPU for it (``ans``'s lanes, ``entropy/lanes.py``)
DEVICE_FORMAT = {"ans": "backend=lanes"}


def stage_names(spec: str) -> list[str]:
    """The stage names of a chain spec, in order (``"int8 | ans"``: int8, ans)."""
    return [part.split("(")[0].strip() for part in spec.split("|")]


def cpu_twin(spec: str) -> str:
    """The spec whose CPU payload a GPU's payload of ``spec`` must equal."""
    parts = []
    for part in (p.strip() for p in spec.split("|")):
        name, _, args = part.partition("(")
        option = DEVICE_FORMAT.get(name.strip())
        if option and "backend" not in args:
            part = f"{name.strip()}({option}{', ' + args if args.strip(') ') else ')'}"
        parts.append(part)
    return " | ".join(parts)


class SyncBox(list[int]):
    """``[count]`` of host syncs, and on CUDA where each came from (``sites``: the Python
    line that made the call, ``file:line``, counted)."""

    sites: Counter[str]


@contextmanager
def host_syncs(device: torch.device) -> Iterator[SyncBox]:
    """Count host syncs in the block: CUDA's sync debug warnings, or the CPU proxy."""
    box = SyncBox([0])
    box.sites = Counter()
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield box
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        box[0] = len(syncs)
        box.sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    else:
        from gradzip.bench.devicecheck import count_host_syncs

        with count_host_syncs() as counted:
            yield box
        box[0] = counted.total


def timed(fn: Callable[[], Any], device: torch.device, repeat: int) -> tuple[float, Any]:
    """Median seconds of ``fn`` (CUDA events on a GPU) and its last result."""
    times, out = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@contextmanager
def _kernels_off() -> Iterator[None]:
    before = os.environ.get("GRADZIP_KERNELS")
    os.environ["GRADZIP_KERNELS"] = "off"
    try:
        yield
    finally:
        if before is None:
            del os.environ["GRADZIP_KERNELS"]
        else:
            os.environ["GRADZIP_KERNELS"] = before


def _speeds(spec: str, x: torch.Tensor, shapes: list[torch.Size],
            repeat: int) -> tuple[float, float, Any, Any]:
    """(encode s, decode s, the codec, its last payload), after a warm-up call."""
    import gradzip

    codec = gradzip.codec(spec)
    payload = codec.encode(x, "b", shapes)  # warm: kernels, caches, compilation
    codec.decode(payload, "b", shapes, device=x.device)
    enc_s, payload = timed(lambda: codec.encode(x, "b", shapes), x.device, repeat)
    dec_s, _ = timed(lambda: codec.decode(payload, "b", shapes, device=x.device), x.device,
                     repeat)
    return enc_s, dec_s, codec, payload


def device_seconds(fn: Callable[[], Any], device: torch.device, reps: int = 3,
                   ) -> float | None:
    """Seconds of device work per call of ``fn``: the CUDA kernels' and copies' own time
    (``torch.profiler``), whatever the host spent launching them; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / reps / 1e6


def payload_equals_cpu(spec: str, x: torch.Tensor, shapes: list[torch.Size],
                       payload: Any) -> Any:
    """Whether the CPU encodes ``x`` to the same payload, bit for bit ('random' where the
    payload depends on draws, which differ between devices by design)."""
    import gradzip

    if not set(stage_names(spec)) <= set(DETERMINISTIC):
        return "random"
    mine = dict(payload.leaves())
    cpu = dict(gradzip.codec(cpu_twin(spec)).encode(x.cpu(), "b", shapes).leaves())
    equal = mine.keys() == cpu.keys() and all(
        mine[k].dtype == cpu[k].dtype and torch.equal(mine[k].cpu(), cpu[k]) for k in cpu)
    if equal or not set(stage_names(spec)) & set(SUM_ORDER):
        return equal
    return f"sum order: {_differing(mine, cpu)}"


def _differing(mine: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor]) -> str:
    """Which fields of two payloads differ, and in how many entries where comparable."""
    parts = []
    for name in sorted(mine.keys() | cpu.keys()):
        a, b = mine.get(name), cpu.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            parts.append(f"{name} (size or type)")
        elif not torch.equal(a.cpu(), b):
            parts.append(f"{name} {int((a.cpu() != b).sum())} of {b.numel()}")
    return ", ".join(parts)


def speed_row(spec: str, x: torch.Tensor, shapes: list[torch.Size],
              repeat: int) -> dict[str, Any]:
    """One codec's row of the speed table (an exception becomes the row's error)."""
    n = x.numel()
    row: dict[str, Any] = {"codec": spec, "bucket_mb": round(n * 4 / 1e6, 2)}
    try:
        enc_s, dec_s, codec, payload = _speeds(spec, x, shapes, repeat)
        with host_syncs(x.device) as enc_syncs:
            payload = codec.encode(x, "b", shapes)
        with host_syncs(x.device) as dec_syncs:
            out = codec.decode(payload, "b", shapes, device=x.device)
        sites = enc_syncs.sites + dec_syncs.sites
        row.update(ok=out.device == x.device, encode_s=enc_s, decode_s=dec_s,
                   sync_sites=", ".join(f"{k} x{v}" for k, v in sites.most_common()),
                   encode_gbps=round(n * 4 / enc_s / 1e9, 2),
                   decode_gbps=round(n * 4 / dec_s / 1e9, 2),
                   ratio=round(n * 4 / max(payload.wire_bytes, 1), 1),
                   wire_bytes=payload.wire_bytes, summable=codec.summable,
                   multi_round=codec.multi_round, encode_syncs=enc_syncs[0],
                   decode_syncs=dec_syncs[0],
                   equal_cpu=payload_equals_cpu(spec, x, shapes, payload),
                   payload_devices=",".join(sorted({t.device.type
                                                    for _, t in payload.leaves()})))
        on_device = [device_seconds(lambda: codec.encode(x, "b", shapes), x.device),
                     device_seconds(lambda: codec.decode(payload, "b", shapes,
                                                         device=x.device), x.device)]
        if on_device[0] and on_device[1]:
            row.update(device_encode_gbps=round(n * 4 / on_device[0] / 1e9, 1),
                       device_decode_gbps=round(n * 4 / on_device[1] / 1e9, 1))
        if set(stage_names(spec)) & set(KERNEL_STAGES):
            with _kernels_off():
                t_enc, t_dec, _, _ = _speeds(spec, x, shapes, repeat)
            row.update(torch_encode_gbps=round(n * 4 / t_enc / 1e9, 2),
                       torch_decode_gbps=round(n * 4 / t_dec / 1e9, 2))
    except Exception as e:  # noqa: BLE001 - one codec's failure is a row
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
    return row


def _cost(row: dict[str, Any], world: int) -> tuple[float, int]:
    """(seconds of codec work, bytes on one rank's link) per bucket (module doc)."""
    if row["summable"]:
        return row["encode_s"] + row["decode_s"], link_bytes("all_reduce", row["wire_bytes"],
                                                             world)
    wire = row["wire_bytes"]
    sent = link_bytes("all_to_all", wire, world) + link_bytes("all_gather", wire // world,
                                                              world)
    return (1 + 1 / world) * row["encode_s"] + 2 * row["decode_s"], sent


def add_break_evens(rows: list[dict[str, Any]], n: int, world: int = WORLD) -> None:
    """Each row's link rate against ``fp16``'s all-reduce (``wins_vs_fp16``)."""
    base = next((r for r in rows if r["codec"] == "fp16" and r.get("ok")), None)
    if base is None:
        return
    base_s = base["encode_s"] + base["decode_s"]
    base_bytes = link_bytes("all_reduce", 2 * n, world)
    for row in rows:
        if not row.get("ok"):
            continue
        if row["multi_round"] or row is base:
            row["wins_vs_fp16"] = "baseline" if row is base else "n/a (multi-round)"
            continue
        seconds, sent = _cost(row, world)
        row["wins_vs_fp16"] = weigh(seconds - base_s, 8.0 * (base_bytes - sent)).describe()


def add_copy_shares(rows: list[dict[str, Any]]) -> None:
    """Each row's encode and decode speed as a share of the plain copy's (``none``)."""
    copy = next((r for r in rows if r["codec"] == "none" and r.get("ok")), None)
    if copy is None:
        return
    for row in rows:
        if row.get("ok"):
            row["encode_of_copy"] = f"{row['encode_gbps'] / copy['encode_gbps']:.0%}"
            row["decode_of_copy"] = f"{row['decode_gbps'] / copy['decode_gbps']:.0%}"


def codec_speed(specs: list[str], device: torch.device, shapes: list[torch.Size],
                repeat: int) -> list[dict[str, Any]]:
    """The speed table: one row per codec, with shares of the copy and break-evens."""
    n = sum(s.numel() for s in shapes)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    rows = [speed_row(spec, x, shapes, repeat) for spec in specs]
    add_copy_shares(rows)
    add_break_evens(rows, n)
    for row in rows:
        row.pop("encode_s", None)
        row.pop("decode_s", None)
    return rows


def host_microseconds(fn: Callable[[], Any], device: torch.device, reps: int = 200,
                      ) -> float:
    """Host time per call of ``fn`` over ``reps`` back-to-back calls (the device may
    lag behind; it is waited for once, after the last)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round(host / reps * 1e6, 1)


def _decoding(codec: Any, x: torch.Tensor, shapes: list[torch.Size]) -> Callable[[], Any]:
    """A call that decodes ``codec``'s payload of ``x`` on ``x``'s device."""
    payload = codec.encode(x, "b", shapes)
    return lambda: codec.decode(payload, "b", shapes, device=x.device)


def launch_rows(device: torch.device, shapes: list[torch.Size]) -> list[dict[str, Any]]:
    """What one call costs the host, layer by layer: a torch launch, a Triton launch
    (where the kernels run), and ``none`` and ``int8`` decodes through ``Codec``."""
    import gradzip
    from gradzip.codecs import kernels

    n = sum(s.numel() for s in shapes)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    small = x[:256].contiguous()
    cases: dict[str, Callable[[], Any]] = {"torch launch (one multiply, 256 values)":
                                           lambda: small.mul(2.0)}
    if kernels.runs_on(small):
        from gradzip.codecs.kernels import quant
        from gradzip.codecs.kernels.blocks import block_table

        table, q = block_table([256], 256, device), small.to(torch.int8)
        scale = torch.ones(1, device=device)
        cases["Triton launch (dequantize, 256 values)"] = lambda: quant.dequantize(
            q, table, scale)
    for spec in ("none", "int8"):
        cases[f"{spec} decode through Codec.decode"] = _decoding(gradzip.codec(spec), x,
                                                                 shapes)
    return [{"call": name, "host_us": host_microseconds(fn, device)}
            for name, fn in cases.items()]


#: columns of the speed table in gpu.md
COLUMNS = ["codec", "ok", "encode_gbps", "decode_gbps", "encode_of_copy", "decode_of_copy",
           "device_encode_gbps", "device_decode_gbps", "torch_encode_gbps",
           "torch_decode_gbps", "ratio", "equal_cpu", "wins_vs_fp16",
           "encode_syncs", "decode_syncs", "sync_sites", "payload_devices", "error"]
