"""Measuring a training run: phase timers, logging sinks and the results record.

Metric names are grouped by prefix and carry their unit, as in torchtitan:
``loss/train``, ``time/step(ms)``, ``time/backward(ms)``, ``comm/bytes_wire``,
``comm/share(%)``, ``throughput/tokens_per_s``, ``mem/peak(MiB)``.

Sinks: rank 0 prints a line per log interval (under a tqdm progress bar); every rank
writes ``logs/rank<r>.log``; rank 0 writes TensorBoard scalars to ``tb/`` and, when asked
for and installed, Weights & Biases (offline without an API key).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gradzip.train.data.atomic import atomic_write_bytes

PHASES = ("data", "forward", "backward", "comm", "optimizer")


class PhaseTimer:
    """Wall time per phase of one step, in milliseconds.

    On CUDA each phase boundary synchronizes the device, otherwise kernels queued in
    one phase would be billed to the next; on CPU ops run eagerly so no sync is needed.
    ``comm`` is filled in from outside (a DDP hook or the codec's stats) because
    communication runs inside backward, overlapped with it.
    """

    def __init__(self, device: torch.device,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self.clock = clock  # seconds: the wall, or a replica's CPU time (--replicas)
        self.current: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = self.clock()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.current[name] += (self.clock() - t0) * 1e3

    def add(self, name: str, ms: float) -> None:
        self.current[name] += ms

    def end_step(self) -> dict[str, float]:
        """This step's milliseconds per phase (zero for phases that did not run)."""
        out = {p: self.current.get(p, 0.0) for p in PHASES}
        self.current = defaultdict(float)
        return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100).item())


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


#: the most step ends a record's ``step_clock`` keeps (about 70 KB of JSON)
STEP_CLOCK_MAX = 5000


class RunMetrics:
    """A run's numbers from one source, as torchtitan's ``MetricsProcessor``: the step
    timings and counters, each log interval's metrics and the results record's measured
    fields. Communication comes from the codec's ``CommStats`` only (None: no gradzip
    communication, e.g. FSDP's own reduce-scatter). The first ``warmup`` steps are left
    out of the timing statistics (allocator and cache warm-up) but not of the totals.
    """

    def __init__(self, warmup: int, tokens_per_step: int, comm: Any, grad_clip: float,
                 link: Any = None) -> None:
        self.warmup, self.tokens_per_step = warmup, tokens_per_step
        self.comm, self.grad_clip = comm, grad_clip
        #: --replicas: the link model (``replicas.LinkModel``) whose time for the step's
        #: bytes and collectives is the step's communication time
        self.link = link
        self.link_ms_total = 0.0
        self.steps_seen = 0
        self.step_ms: list[float] = []
        #: when each step ended (Unix seconds, ms resolution): places events outside the
        #: run, such as a link whose rate changed, at a step
        self.step_end_unix: list[float] = []
        self.phase_ms: dict[str, float] = defaultdict(float)
        self.tokens = 0  # tokens (all ranks) in the timed steps
        self.nonfinite_steps = 0
        self.clipped_steps = 0
        self.last_comm: dict[str, Any] = {}
        self._interval_ms, self._interval_tokens = 0.0, 0

    def end_step(self, step_ms: float, phases: dict[str, float],
                 grad_norm: float | None) -> float:
        """Close a step: its communication (from ``CommStats``), time and counters;
        returns the step's time in ms (with a link model: ``step_ms`` plus the model's
        time for the step's bytes)."""
        if self.comm is not None:
            self.comm.end_step()
            self.last_comm = self.comm.summary()
            phases["comm"] = self.last_comm["comm_ms"]
        if self.link is not None:  # the link's time is the model's, not the threads' wait
            c = self.last_comm
            phases["comm"] = 1e3 * self.link.seconds(c.get("bytes_wire", 0),
                                                     sum(c.get("calls_by_op", {}).values()))
            self.last_comm = {**c, "comm_ms": phases["comm"]}
            self.link_ms_total += phases["comm"]
            step_ms += phases["comm"]
        if grad_norm is not None and not math.isfinite(grad_norm):
            self.nonfinite_steps += 1
        elif grad_norm is not None and 0 < self.grad_clip < grad_norm:
            self.clipped_steps += 1
        self.steps_seen += 1
        self.step_end_unix.append(round(time.time(), 3))
        self._interval_ms += step_ms
        self._interval_tokens += self.tokens_per_step
        if self.steps_seen <= self.warmup:
            return step_ms
        self.step_ms.append(step_ms)
        self.tokens += self.tokens_per_step
        for k, v in phases.items():
            self.phase_ms[k] += v
        return step_ms

    def interval(self, loss: float, lr: float, step_ms: float, phases: dict[str, float],
                 grad_norm: float | None, device: torch.device) -> dict[str, Any]:
        """The metrics logged for the interval that ends now (then a new one starts)."""
        m: dict[str, Any] = {
            "loss/train": loss, "optim/lr": lr,
            "throughput/tokens_per_s": self._interval_tokens / (self._interval_ms / 1e3),
            "time/step(ms)": step_ms,
            **{f"time/{k}(ms)": v for k, v in phases.items()},
            "mem/peak(MiB)": peak_memory(device)["mem_peak"] / 2**20,
        }
        if grad_norm is not None:
            m["optim/grad_norm"] = grad_norm
        c = self.last_comm
        if c:
            m.update({"comm/time(ms)": c["comm_ms"], "comm/share(%)": 100 * c["comm_ms"] / step_ms,
                      "comm/bytes_raw": c["bytes_raw"], "comm/bytes_wire": c["bytes_wire"]})
            if c["bytes_wire"]:
                m["comm/compression_ratio"] = c["bytes_raw"] / c["bytes_wire"]
            for k in ("density", "residual_norm", "grad_rel_error", "grad_cos_sim",
                      "encode_ms", "decode_ms", "extra_collective_ms"):
                if c.get(k) is not None:
                    m[f"comm/{k}"] = c[k]
        self._interval_ms, self._interval_tokens = 0.0, 0
        return m

    def step_clock(self, first_step: int) -> dict[str, Any]:
        """When the steps ended (Unix seconds), for the record: every step's up to
        ``STEP_CLOCK_MAX`` steps, then every ``every``-th (a long run's record stays
        small; an event is then placed to within ``every`` steps). Entry i is the end
        of step ``first_step + i * every``."""
        every = max(1, math.ceil(len(self.step_end_unix) / STEP_CLOCK_MAX))
        return {"first_step": first_step, "every": every,
                "end_unix": self.step_end_unix[::every]}

    def timing(self) -> dict[str, Any]:
        """Step-time statistics over the timed steps (None where there are none)."""
        timed, n = sum(self.step_ms), len(self.step_ms)
        return {
            "timed_steps": n,
            "step_time_ms_mean": timed / n if n else None,
            "step_time_ms_p50": percentile(self.step_ms, 50),
            "step_time_ms_p90": percentile(self.step_ms, 90),
            "step_time_ms_p95": percentile(self.step_ms, 95),
            "tokens_per_s": self.tokens / (timed / 1e3) if timed else None,
            "phase_ms_mean": {k: v / n for k, v in self.phase_ms.items()} if n else {},
            # Share of step time per phase; comm overlaps backward, so shares can sum > 1.
            "phase_share": {k: v / timed for k, v in self.phase_ms.items()} if timed else {},
            "comm_ratio": (self.phase_ms.get("comm", 0.0) / timed
                           if timed and self.comm is not None else None),
        }

    def communication(self) -> dict[str, Any]:
        """The record's communication fields, totals over every step of this process
        (with a link model, its time: replicas' collectives are copies between threads)."""
        fields = communication_fields(self.comm)
        if self.link is not None and self.comm is not None:
            seconds = self.link_ms_total / 1e3
            fields.update(comm_time_ms_total=self.link_ms_total, comm_time_ms_by_op=None,
                          effective_bandwidth_bytes_per_s=(
                              fields["bytes_wire_total"] / seconds if seconds else None))
        return fields

    def counters(self) -> dict[str, int]:
        return {"nonfinite_grad_steps": self.nonfinite_steps,
                "clipped_steps": self.clipped_steps}


#: the record's communication fields (all None without gradzip communication)
COMM_FIELDS = ("comm_time_ms_total", "comm_time_ms_by_op", "extra_collective_time_ms",
               "bytes_raw_total", "bytes_wire_total", "bytes_handed_total",
               "effective_bandwidth_bytes_per_s", "aggregation", "compression_ratio",
               "compression_ratio_steady", "encode_ms", "decode_ms", "extra_collectives",
               "index_bytes", "bits_per_kept_value", "density", "residual_norm",
               "grad_rel_error", "grad_cos_sim", "links")


def communication_fields(comm: Any) -> dict[str, Any]:
    """The record's communication fields from a ``CommStats`` (all None without one):
    totals over every step; the steady ratio over the steps compressed throughout."""
    if comm is None:
        return dict.fromkeys(COMM_FIELDS)
    t = comm.totals()
    steady = comm.steady_bytes()
    seconds = t["comm_ms"] / 1e3
    return {
        "comm_time_ms_total": t["comm_ms"],
        "comm_time_ms_by_op": t["comm_ms_by_op"],
        "extra_collective_time_ms": t["extra_collective_ms"],
        "bytes_raw_total": t["bytes_raw"],
        "bytes_wire_total": t["bytes_wire"],
        "bytes_handed_total": t["bytes_handed"],
        "effective_bandwidth_bytes_per_s": t["bytes_wire"] / seconds if seconds else None,
        "aggregation": t["aggregation"],
        "compression_ratio": t["compression_ratio"],
        "compression_ratio_steady": _ratio(steady["bytes_raw"], steady["bytes_wire"]),
        "encode_ms": t["encode_ms"],
        "decode_ms": t["decode_ms"],
        "extra_collectives": t["extra_collectives"],
        "index_bytes": t["index_bytes"],
        "bits_per_kept_value": t["bits_per_kept_value"],
        "density": t["density"],
        "residual_norm": t["residual_norm"],
        "grad_rel_error": t["grad_rel_error"],
        "grad_cos_sim": t["grad_cos_sim"],
        "links": t["links"] or None,
    }


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory in bytes: allocated and reserved CUDA memory (the caching allocator's
    pool), or the process's peak RSS on CPU (which has no separate reserved figure)."""
    if device.type == "cuda":
        return {"mem_peak": torch.cuda.max_memory_allocated(device),
                "mem_reserved_peak": torch.cuda.max_memory_reserved(device),
                "mem_peak_kind": "cuda"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"mem_peak": rss if sys.platform == "darwin" else rss * 1024,
            "mem_reserved_peak": None, "mem_peak_kind": "cpu_rss"}


def git_commit() -> str:
    """The commit of the gradzip checkout (with "-dirty" if modified), or "unknown"."""
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty.strip() else "")


@functools.cache
def source_digest() -> str:
    """The first 16 hex digits of a SHA-256 over gradzip's Python source: every ``.py``
    file of the package, by its path in the package and its bytes.

    Two runs with the same digest ran the same code, committed or not, checked out or
    installed; ``git_commit`` cannot say that of a dirty tree. A race whose tree is edited
    while it runs starts the later runs on the edited code under the same commit name,
    and the report refuses to compare them (``compare.summary``). Cached per process:
    the trainer takes it when it starts, before the run imports anything lazily.
    """
    return python_tree_digest(Path(__file__).resolve().parents[1])


def python_tree_digest(package: Path) -> str:
    """``source_digest`` of the package at ``package``: its ``.py`` files, in order."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def append_results(record: dict[str, Any], paths: list[Path]) -> None:
    """Append one JSON line per file; an exclusive lock keeps concurrent runs' lines whole."""
    # strict JSON: NaN/Infinity are not JSON, so non-finite numbers are written as null
    line = json.dumps(_finite_or_null(record), default=_jsonable, allow_nan=False) + "\n"
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)


def _finite_or_null(x: Any) -> Any:
    """``x`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite_or_null(v) for v in x]
    return x


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    return repr(x)


def format_line(step: int, max_steps: int, m: dict[str, Any]) -> str:
    """The human-readable log line for one interval."""
    parts = [f"step {step}/{max_steps}", f"loss {m['loss/train']:.4f}", f"lr {m['optim/lr']:.2e}",
             f"{m['throughput/tokens_per_s']:,.0f} tok/s", f"step {m['time/step(ms)']:.0f}ms"]
    if "comm/share(%)" in m:
        parts.append(f"comm {m['comm/share(%)']:.0f}%")
    if "comm/compression_ratio" in m:
        parts.append(f"ratio {m['comm/compression_ratio']:.1f}x")
    if "loss/val" in m:
        parts.append(f"val {m['loss/val']:.4f} (ppl {m['loss/val_ppl']:.1f})")
    return " | ".join(parts)


class MetricLogger:
    """Every sink in one place; all methods are safe to call on every rank."""

    def __init__(self, run_dir: Path, rank: int, cfg: Any, *, total_steps: int,
                 start_step: int) -> None:
        self.rank = rank
        self.run_dir = run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "logs" / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115
        self.tb = None
        self.wandb = None
        self.bar = None
        if rank != 0:
            return
        if cfg.run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        if cfg.run.wandb:
            self.wandb = _init_wandb(run_dir, cfg)
        if cfg.run.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, leave=False)

    def info(self, msg: str) -> None:
        """A message in this rank's log file, and on the console from rank 0."""
        self.file.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
        if self.rank == 0:
            if self.bar is not None:
                self.bar.write(msg)
            else:
                print(msg, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def scalars(self, step: int, metrics: dict[str, Any]) -> None:
        """Numbers to TensorBoard / W&B (rank 0) and as JSON to this rank's log."""
        flat = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        self.file.write(json.dumps({"step": step, **flat}) + "\n")
        if self.tb is not None:
            for k, v in flat.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(flat, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.file.close()


def require_wandb() -> Any:
    """The wandb module, or a clear error (it is optional: not a gradzip dependency)."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError("--wandb needs the wandb package: pip install wandb") from None
    return wandb


WANDB_ID_FILE = "wandb_id.txt"


def _init_wandb(run_dir: Path, cfg: Any) -> Any:
    wandb = require_wandb()
    # Offline unless a key is configured: a run never blocks on a login prompt.
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file() and (
        "api.wandb.ai" in (Path.home() / ".netrc").read_text())
    # The W&B run id lives in the run directory, so ``--resume`` continues the same W&B
    # run (resume="allow" only resumes when it is given an id it has seen before).
    id_file = run_dir / WANDB_ID_FILE
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:16]
        atomic_write_bytes(id_file, (run_id + "\n").encode())
    return wandb.init(project=cfg.run.wandb_project, name=cfg.run.run_name or run_dir.name,
                      dir=str(run_dir), config=cfg.to_dict(), id=run_id, resume="allow",
                      mode="online" if has_key else "offline")
