"""``--profile``: torch.profiler traces of a few steps plus a comm-vs-compute table.

Traces go to ``<run>/profile/`` (one ``*.pt.trace.json`` per rank), which TensorBoard's
profiler plugin and https://ui.perfetto.dev open directly. Next to them,
``summary_rank<r>.txt`` (the table) and ``summary_rank<r>.json`` (its numbers) split the
profiled steps' time into communication and compute twice: from the profiler's events
(``comm_compute_ms``) and from the trainer's phase timers (``timer_ms``).

The profiler's figures are lengths of unions of event intervals (wall clock), never
sums of event self times: gloo runs a collective on a worker thread of its own as an
async range whose self time is zero, and nested or concurrent events would otherwise be
counted twice.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

# Substrings of profiler event names that are communication (gloo, NCCL, c10d, gradzip).
COMM_MARKERS = ("gloo", "nccl", "c10d", "all_reduce", "allreduce", "all_gather", "allgather",
                "reduce_scatter", "all_to_all", "alltoall", "broadcast", "gradzip")

Span = tuple[float, float]  # (start, end) in microseconds


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


def _merge(spans: Iterable[Span]) -> list[Span]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[Span] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """The intersection of two sorted, disjoint interval lists (a two-pointer walk)."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[Span]) -> float:
    return sum(e - s for s, e in spans)


def _is_comm(name: str) -> bool:
    return any(m in name.lower() for m in COMM_MARKERS)


def _kind(ev: Any, on_cuda: bool) -> str | None:
    """'comm', 'compute', or None for events that are not work of the measured side.

    On CUDA only device kernels and copies count (NCCL kernels are the communication,
    all others the compute): the CPU side only launches them. On CPU only CPU events
    count. Annotations (``ProfilerStep#``, ``Optimizer.step#...``) mark regions rather than
    do work, except on CPU those named for a collective: gloo's ``gloo:all_reduce`` is an
    async range on its worker thread, the only event spanning the collective.
    """
    on_device = ev.device_type != torch.autograd.DeviceType.CPU
    if on_device != on_cuda or ev.name.startswith("ProfilerStep"):
        return None
    annotation = ev.is_user_annotation or "annotation" in str(getattr(ev, "activity_type", ""))
    if _is_comm(ev.name) and not (annotation and on_device):
        return "comm"
    return None if annotation else "compute"


def _step_windows(events: list[Any]) -> list[Span]:
    """The profiled steps' ``ProfilerStep#`` ranges (CPU side), sorted."""
    return sorted((ev.time_range.start, ev.time_range.end) for ev in events
                  if ev.name.startswith("ProfilerStep")
                  and ev.device_type == torch.autograd.DeviceType.CPU)


def _spans_by_kind(events: list[Any], on_cuda: bool) -> dict[str, list[Span]]:
    """Intervals of 'comm' and 'compute' events, and of each comm event name ('op:NAME')."""
    spans: dict[str, list[Span]] = defaultdict(list)
    for ev in events:
        kind = _kind(ev, on_cuda)
        if kind is not None:
            span = (ev.time_range.start, ev.time_range.end)
            spans[kind].append(span)
            if kind == "comm":
                spans["op:" + ev.name].append(span)
    return spans


def comm_compute_ms(events: Iterable[Any], on_cuda: bool) -> dict[str, Any]:
    """Per profiled step (ms): wall time, and how much of it ran communication or compute.

    ``events`` are the profiler's FunctionEvents (``prof.events()``); the steps are its
    ``ProfilerStep#`` ranges, and every event is clipped to them. Each figure is the
    length of a union of intervals, so overlapping or nested events count once:

    * ``step_ms``: wall time of a profiled step.
    * ``comm_ms``: time in which at least one collective was running: on CPU any thread's
      collective events (gloo's worker-thread ``gloo:all_reduce`` spans, ``c10d::`` launch
      ops), on CUDA NCCL kernels' device time. Every collective counts, also ones outside
      gradient sync (e.g. the trainer's loss all-reduce on a logging step).
    * ``compute_ms``: time in which at least one other op ran (CPU: any thread, including
      ops that enclose a collective call; CUDA: other kernels and copies on the device).
    * ``overlap_ms``: both at once; ``idle_ms``: neither (waiting, Python between ops).
    * ``comm_ms_by_op``: ``comm_ms`` of each collective event name on its own.
    """
    events = list(events)
    steps = _step_windows(events)
    windows = _merge(steps)
    spans = _spans_by_kind(events, on_cuda)
    per_step = 1e3 * max(len(steps), 1)  # us per profile -> ms per step

    def busy(key: str) -> list[Span]:
        return _intersect(_merge(spans.get(key, [])), windows)

    comm, compute = busy("comm"), busy("compute")
    wall, overlap = _length(windows), _length(_intersect(comm, compute))
    return {
        "steps": len(steps),
        "step_ms": wall / per_step,
        "comm_ms": _length(comm) / per_step,
        "compute_ms": _length(compute) / per_step,
        "overlap_ms": overlap / per_step,
        "idle_ms": (wall - _length(comm) - _length(compute) + overlap) / per_step,
        "comm_ms_by_op": {k[3:]: _length(busy(k)) / per_step
                          for k in sorted(spans) if k.startswith("op:")},
    }


PHASES = ("data", "forward", "backward", "comm", "optimizer")


def timer_ms(sp: StepProfiler) -> dict[str, float]:
    """The phase timers' mean ms per profiled step, and the step's (``step``).

    ``comm`` overlaps ``backward``. For ``--codec none`` it is the union of the DDP
    buckets' launch-to-completion intervals, comparable to the profiler's ``comm_ms``;
    with a codec it is the sum of each collective's wall time, which counts buckets in
    flight together more than once.
    """
    n = max(len(sp.phases), 1)
    out = {phase: sum(p.get(phase, 0.0) for p in sp.phases) / n for phase in PHASES}
    out["step"] = sum(sp.step_ms) / n
    return out


def summarize(prof: torch.profiler.profile, sp: StepProfiler, on_cuda: bool) -> dict[str, Any]:
    """What ``summary_rank<r>.json`` holds: both measurements of the profiled steps.

    The device side is measured only if the profile holds device events: a CPU run on a
    machine with a GPU has none, and its collectives are CPU events.
    """
    events = list(prof.events())
    on_cuda = on_cuda and any(ev.device_type != torch.autograd.DeviceType.CPU for ev in events)
    return {"first": sp.first, "last": sp.last, "device": "cuda" if on_cuda else "cpu",
            "profiler": comm_compute_ms(events, on_cuda), "timers": timer_ms(sp)}


def _row(source: str, what: str, ms: float, of: float | None = None) -> str:
    share = f"{ms / of if of else 0:>7.1%}" if of is not None else ""
    return f"{source:<10} {what:<40} {ms:>9.2f} {share}".rstrip()


def summary_table(summary: dict[str, Any]) -> str:
    """The table of ``summarize``: profiler rows share its step, timer rows theirs."""
    p, t = summary["profiler"], summary["timers"]
    where = "the device" if summary["device"] == "cuda" else "any thread"
    lines = [f"profiled steps {summary['first']}..{summary['last']} ({p['steps']} steps), "
             f"ms per step; profiler: wall time in which, on {where}, ...",
             f"{'source':<10} {'what':<40} {'ms/step':>9} {'share':>7}",
             _row("profiler", "step (ProfilerStep# ranges)", p["step_ms"], p["step_ms"])]
    for key, what in (("comm_ms", "communication: a collective runs"),
                      ("compute_ms", "compute: another op runs"),
                      ("overlap_ms", "both at once"),
                      ("idle_ms", "neither (waiting, Python)")):
        lines.append(_row("profiler", what, p[key], p["step_ms"]))
    for phase in PHASES:
        lines.append(_row("timers", phase, t[phase], t["step"]))
    lines.append(_row("timers", "step (comm overlaps backward)", t["step"]))
    for op, ms in sorted(p["comm_ms_by_op"].items(), key=lambda kv: -kv[1])[:8]:
        lines.append(_row("  op", op[:40], ms))
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
        summary = summarize(prof, sp, on_cuda)
        table = summary_table(summary)
        (trace_dir / f"summary_rank{rank}.txt").write_text(table + "\n")
        (trace_dir / f"summary_rank{rank}.json").write_text(json.dumps(summary, indent=2) + "\n")
        if rank == 0:
            log(f"profile: traces in {trace_dir} (TensorBoard or ui.perfetto.dev)\n{table}")
