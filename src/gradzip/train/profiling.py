"""``--profile``: torch.profiler traces of a few steps plus a comm-vs-compute table.

Traces go to ``<run>/profile/`` (one ``*.pt.trace.json`` per rank), which TensorBoard's
profiler plugin and https://ui.perfetto.dev open directly. The summary table splits the
profiled steps' time into communication and compute twice: from the profiler's own
events (collectives by name) and from the trainer's phase timers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Substrings of profiler event names that are communication (gloo, NCCL, c10d, gradzip).
COMM_MARKERS = ("gloo", "nccl", "c10d", "all_reduce", "allreduce", "all_gather", "allgather",
                "reduce_scatter", "all_to_all", "alltoall", "broadcast", "gradzip")


class StepProfiler:
    """Advance with ``step(number, phases)`` after every training step."""

    def __init__(self, prof: torch.profiler.profile | None, first: int, last: int) -> None:
        self.prof = prof
        self.first, self.last = first, last
        self.phases: list[dict[str, float]] = []
        self.step_ms: list[float] = []

    def step(self, number: int, phases: dict[str, float], step_ms: float) -> None:
        if self.prof is None:
            return
        if self.first <= number <= self.last:
            self.phases.append(phases)
            self.step_ms.append(step_ms)
        self.prof.step()


def summary_table(prof: torch.profiler.profile, sp: StepProfiler, on_cuda: bool) -> str:
    """Per profiled step: communication vs compute, from events and from phase timers."""
    n = max(len(sp.phases), 1)
    comm_us = compute_us = 0.0
    top_comm: list[tuple[str, float]] = []
    for ev in prof.key_averages():
        # Self time, so nested events are not counted twice; device time on GPU.
        t = ev.self_device_time_total if on_cuda else ev.self_cpu_time_total
        if any(m in ev.key.lower() for m in COMM_MARKERS):
            comm_us += t
            top_comm.append((ev.key, t))
        elif not ev.key.startswith("ProfilerStep"):
            compute_us += t
    lines = [f"profiled steps {sp.first}..{sp.last} ({n} steps), per step:",
             f"{'source':<10} {'what':<34} {'ms/step':>10} {'share':>7}"]
    total = comm_us + compute_us
    for what, us in (("communication", comm_us), ("compute + other ops", compute_us)):
        lines.append(f"{'profiler':<10} {what:<34} {us / 1e3 / n:>10.2f} "
                     f"{us / total if total else 0:>7.1%}")
    step_ms = sum(sp.step_ms) / n
    for phase in ("data", "forward", "backward", "comm", "optimizer"):
        ms = sum(p.get(phase, 0.0) for p in sp.phases) / n
        lines.append(f"{'timers':<10} {phase:<34} {ms:>10.2f} "
                     f"{ms / step_ms if step_ms else 0:>7.1%}")
    lines.append(f"{'timers':<10} {'step (comm overlaps backward)':<34} {step_ms:>10.2f}")
    for key, us in sorted(top_comm, key=lambda kv: -kv[1])[:8]:
        lines.append(f"{'  op':<10} {key[:34]:<34} {us / 1e3 / n:>10.2f}")
    return "\n".join(lines)


def _all_threads() -> Any:
    """Profiler config that records every thread, or None where torch cannot.

    By default only the thread that starts the profiler is recorded, and gradzip's codec
    collectives run on a communication thread of their own: without this the traces and
    the table would show almost no communication.
    """
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the training thread only
        return None


@contextlib.contextmanager
def maybe_enable_profiling(enabled: bool, steps: tuple[int, int], run_dir: Path, rank: int,
                           start_step: int, log: Any) -> Iterator[StepProfiler]:
    """A StepProfiler that records steps A..B (1-based) when enabled, else a no-op one."""
    first, last = steps
    if not enabled or start_step >= last:
        yield StepProfiler(None, first, last)
        return
    trace_dir = run_dir / "profile"
    trace_dir.mkdir(parents=True, exist_ok=True)
    # prof.step() is called after each training step, so the schedule counts steps
    # completed since start_step: skip up to step A-1, record A..B, then stop.
    skip = max(first - 1 - start_step, 0)
    warmup = 1 if skip >= 1 else 0  # one warm-up step lets the profiler settle, if there is room
    schedule = torch.profiler.schedule(wait=skip - warmup, warmup=warmup,
                                       active=last - max(first, start_step + 1) + 1, repeat=1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    handler = torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}")
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=handler, record_shapes=False,
                                profile_memory=False, with_stack=False,
                                experimental_config=_all_threads()) as prof:
        sp = StepProfiler(prof, max(first, start_step + 1), last)
        yield sp
    if sp.phases:
        table = summary_table(prof, sp, on_cuda)
        (trace_dir / f"summary_rank{rank}.txt").write_text(table + "\n")
        if rank == 0:
            log(f"profile: traces in {trace_dir} (TensorBoard or ui.perfetto.dev)\n{table}")
