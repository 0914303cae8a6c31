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
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
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

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.current: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.current[name] += (time.perf_counter() - t0) * 1e3

    def add(self, name: str, ms: float) -> None:
        self.current[name] += ms

    def end_step(self) -> dict[str, float]:
        """This step's milliseconds per phase (zero for phases that did not run)."""
        out = {p: self.current.get(p, 0.0) for p in PHASES}
        self.current = defaultdict(float)
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100).item())


class RunStats:
    """Running totals for the results record; the first ``warmup`` steps are excluded
    from the timing statistics (allocator and cache warm-up make them unrepresentative)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps_seen = 0
        self.step_ms: list[float] = []
        self.phase_ms: dict[str, float] = defaultdict(float)
        self.tokens = 0  # tokens (all ranks) in the timed steps
        self.comm_ms_total = 0.0  # over all steps, warm-up included: matches the byte totals
        self.train_time_s = 0.0  # every step, warm-up included (for time_to_target_s)

    def add_step(self, step_ms: float, phases: dict[str, float], tokens: int) -> None:
        self.steps_seen += 1
        self.train_time_s += step_ms / 1e3
        self.comm_ms_total += phases.get("comm", 0.0)
        if self.steps_seen <= self.warmup:
            return
        self.step_ms.append(step_ms)
        self.tokens += tokens
        for k, v in phases.items():
            self.phase_ms[k] += v

    def summary(self) -> dict[str, Any]:
        timed = sum(self.step_ms)
        n = len(self.step_ms)
        return {
            "timed_steps": n,
            "step_time_ms_mean": timed / n if n else float("nan"),
            "step_time_ms_p50": percentile(self.step_ms, 50),
            "step_time_ms_p90": percentile(self.step_ms, 90),
            "tokens_per_s": self.tokens / (timed / 1e3) if timed else float("nan"),
            "phase_ms_mean": {k: v / n for k, v in self.phase_ms.items()} if n else {},
            # Share of step time per phase; comm overlaps backward, so shares can sum > 1.
            "phase_share": {k: v / timed for k, v in self.phase_ms.items()} if timed else {},
            "comm_time_ms_total": self.comm_ms_total,
            "comm_ratio": self.phase_ms.get("comm", 0.0) / timed if timed else float("nan"),
        }


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory in bytes: allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return {"mem_peak": torch.cuda.max_memory_allocated(device), "mem_peak_kind": "cuda"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"mem_peak": rss if sys.platform == "darwin" else rss * 1024,
            "mem_peak_kind": "cpu_rss"}


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


def append_results(record: dict[str, Any], paths: list[Path]) -> None:
    """Append one JSON line per file; an exclusive lock keeps concurrent runs' lines whole."""
    line = json.dumps(record, default=_jsonable, allow_nan=True) + "\n"
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)


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
