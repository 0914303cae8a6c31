"""``gradzip bench codecs``: ratio, error and speed of every codec on one core.

Two inputs: a heavy-tailed synthetic tensor (default 16M fp32 values, shaped as a
square-ish matrix so low-rank codecs see a matrix) and the real per-parameter
gradients of a small transformer LM. For each codec spec it reports the compression
ratio against fp32 and bf16 (from the payload's exact wire bytes), relative L2 error,
cosine similarity, and encode / decode throughput in MB of fp32 input per second with
``torch.set_num_threads(1)``; times are medians over repeats on the same key, so
stateful codecs are measured warm.

Times are CPU seconds of the process by default (``--clock cpu``): with one intra-op
thread that is the work one core does, and unlike wall time it does not swell when
other jobs share the machine. ``--clock wall`` measures elapsed time instead.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

BAR_MBPS = 200.0  # encode+decode per core: faster than a 1 Gbit/s link needs
SIGN_BAR_RATIO = 30.0
EXEMPT_FROM_SPEED_BAR = ("gradiveq", "sketch")
REAL_FLAT = "real LM gradient, flat bucket"
REAL_PER_PARAM = "real LM gradient, per parameter"


@dataclass
class CodecResult:
    spec: str
    input: str
    numel: int
    wire_bytes: int
    ratio_fp32: float
    ratio_bf16: float
    rel_l2_error: float
    cosine: float
    encode_mbps: float
    decode_mbps: float
    roundtrip_mbps: float
    meets_speed_bar: bool | None


def parse_size(text: str) -> int:
    """'16M' -> 16777216; '4k' -> 4096; plain integers as is."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"size must look like 16M, 4096 or 512k, got {text!r}") from None
    if value < 1:
        raise ValueError(f"size must be >= 1, got {text!r}")
    return value


def default_specs() -> list[str]:
    """One spec per registered compressor (defaults), plus representative chains."""
    from gradzip.codecs import Compressor, registered

    stages = registered()
    specs = [n for n, c in stages.items() if issubclass(c, Compressor)]
    chains = [
        ("topk", "qsgd", "topk(ratio=0.01) | qsgd(levels=16)"),
        ("int8", "ans", "int8 | ans"),
        ("qsgd", "eg", "qsgd(levels=16) | eg"),
        ("topk", "ans", "topk(ratio=0.01) | ans"),
    ]
    specs += [spec for a, b, spec in chains if a in stages and b in stages]
    return specs


def _square_shape(numel: int) -> tuple[int, ...]:
    rows = 2 ** int(math.log2(math.isqrt(numel))) if numel >= 4 else 1
    return (rows, numel // rows) if numel % rows == 0 else (numel,)


def _exempt(codec: Any) -> bool:
    """The 200 MB/s bar is for the lossy codecs; gradiveq and sketch are exempt, and
    chains with a lossless stage (and the ``lossless`` float codec) have their own
    bar of 100 MB/s encode in ``gradzip bench entropy``."""
    from gradzip.codecs import LosslessCoder

    names = {s.name for s in codec.stages}
    return bool(names & set(EXEMPT_FROM_SPEED_BAR) or "lossless" in names
                or any(isinstance(s, LosslessCoder) for s in codec.stages))


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(spec: str, tensors: dict[str, torch.Tensor], label: str, repeats: int,
            clock: str = "cpu") -> CodecResult:
    """Encode and decode every tensor ``repeats`` times; sizes/errors from the last round."""
    import gradzip

    now = CLOCKS[clock]
    codec = gradzip.codec(spec)
    numel = sum(t.numel() for t in tensors.values())
    enc_times, dec_times = [], []
    wire = 0
    err_sq = ref_sq = dot = est_sq = 0.0
    for _ in range(repeats):
        enc = dec = 0.0
        wire = 0
        err_sq = ref_sq = dot = est_sq = 0.0
        for key, x in tensors.items():
            t0 = now()
            p = codec.encode(x, key=key)
            t1 = now()
            y = codec.decode(p, key=key)
            t2 = now()
            enc += t1 - t0
            dec += t2 - t1
            wire += p.wire_bytes
            xf, yf = x.double(), y.double()
            err_sq += float((yf - xf).pow(2).sum())
            ref_sq += float(xf.pow(2).sum())
            dot += float((xf * yf).sum())
            est_sq += float(yf.pow(2).sum())
        enc_times.append(enc)
        dec_times.append(dec)
    mb = 4 * numel / 1e6
    enc_t, dec_t = statistics.median(enc_times), statistics.median(dec_times)
    speed = mb / (enc_t + dec_t)
    exempt = _exempt(codec)
    return CodecResult(
        spec=str(codec), input=label, numel=numel, wire_bytes=wire,
        ratio_fp32=4 * numel / wire, ratio_bf16=2 * numel / wire,
        rel_l2_error=math.sqrt(err_sq / ref_sq) if ref_sq else 0.0,
        cosine=dot / math.sqrt(ref_sq * est_sq) if ref_sq and est_sq else 0.0,
        encode_mbps=mb / enc_t, decode_mbps=mb / dec_t, roundtrip_mbps=speed,
        meets_speed_bar=None if exempt else speed >= BAR_MBPS,
    )


def run(args: argparse.Namespace) -> int:
    from gradzip.bench.samples import heavy_tailed, real_gradients

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    numel = parse_size(args.size)
    specs = args.codec or default_specs()
    inputs: list[tuple[str, dict[str, torch.Tensor]]] = [
        (f"heavy-tailed {args.size}",
         {"x": heavy_tailed(numel, args.seed).view(_square_shape(numel))})
    ]
    if not args.no_real:
        grads = real_gradients(seed=args.seed)
        # The DDP hook and the FSDP reduce-scatter hand most codecs one flat bucket;
        # per-parameter tensors are what shape-aware codecs (PowerSGD) see, and show
        # the fixed per-call cost on many small tensors.
        inputs.append((REAL_FLAT, {"bucket": torch.cat([g.reshape(-1) for g in grads.values()])}))
        inputs.append((REAL_PER_PARAM, grads))
    results: list[CodecResult] = []
    from tqdm import tqdm

    jobs = [(s, label, ts) for label, ts in inputs for s in specs]
    for spec, label, tensors in tqdm(jobs, desc="codecs", unit="codec", disable=args.quiet):
        result = measure(spec, tensors, label, args.repeats, args.clock)
        if label == REAL_PER_PARAM:
            result.meets_speed_bar = None  # see _bars
        results.append(result)
    _print_table(results)
    failures = _bars(results)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "machine": _machine(), "threads": args.threads, "repeats": args.repeats,
            "clock": args.clock,
            "results": [asdict(r) for r in results], "bar_failures": failures,
        }
        tmp = out / "codecs.json.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(out / "codecs.json")
        (out / "codecs.md").write_text(markdown_table(results))
        print(f"wrote {out / 'codecs.json'} and {out / 'codecs.md'}")
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    for line in failures:
        print(f"BAR MISSED: {line}")
    return 0


def _bars(results: list[CodecResult]) -> list[str]:
    """The issue's bars, checked on the heavy-tailed tensor and the flat real bucket.

    The per-parameter rows are reported but not held to the speed bar: there a fixed
    Python cost per call (~0.1 ms) on 52 tensors, 33 of them 128 values long, is what
    they measure, not the codec's throughput."""
    out = []
    for r in results:
        if r.input == REAL_PER_PARAM:
            continue
        where = f"{r.spec} on {r.input}"
        if r.meets_speed_bar is False:
            out.append(f"{where}: {r.roundtrip_mbps:.0f} MB/s < {BAR_MBPS:.0f} MB/s")
        if r.spec in ("signsgd", "onebit") and r.ratio_fp32 < SIGN_BAR_RATIO:
            out.append(f"{where}: ratio {r.ratio_fp32:.1f}x < {SIGN_BAR_RATIO:.0f}x")
    return out


def _machine() -> dict[str, Any]:
    import os
    import platform

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}


def _row(r: CodecResult) -> list[str]:
    bar = {None: "n/a", True: "yes", False: "NO"}[r.meets_speed_bar]
    return [r.spec, r.input, f"{r.ratio_fp32:.1f}x", f"{r.ratio_bf16:.1f}x",
            f"{r.rel_l2_error:.3g}", f"{r.cosine:.4f}", f"{r.encode_mbps:.0f}",
            f"{r.decode_mbps:.0f}", f"{r.roundtrip_mbps:.0f}", bar]


HEADERS = ["codec", "input", "ratio/fp32", "ratio/bf16", "rel L2 err", "cos sim",
           "enc MB/s", "dec MB/s", "enc+dec MB/s", ">=200"]


def _print_table(results: list[CodecResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gradzip codecs (1 thread; MB of fp32 input per second)")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("codec", "input") else "right")
    for r in results:
        table.add_row(*_row(r))
    Console(width=160).print(table)


def markdown_table(results: list[CodecResult]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _row(r)) + " |" for r in results]
    return "\n".join(lines) + "\n"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "codecs", help="ratio, error and encode/decode speed of every codec on one core",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="16M", help="elements of the synthetic tensor (default 16M)")
    p.add_argument("--codec", action="append", metavar="SPEC",
                   help="codec spec to measure (repeatable; default: every codec + some chains)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; medians are reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: per core)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: process CPU seconds (robust on a shared machine; default); "
                        "wall: elapsed seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tensor and model")
    p.add_argument("--no-real", action="store_true", help="skip the real-gradient input")
    p.add_argument("--out", help="directory for codecs.json and codecs.md")
    p.add_argument("--json", action="store_true", help="also print results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
