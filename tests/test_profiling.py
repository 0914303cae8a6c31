"""``--profile``'s comm/compute split: interval arithmetic, and agreement with the timers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from train_helpers import flags, launch

from gradzip.train.profiling import comm_compute_ms

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def ev(name: str, start: float, end: float, device: object = CPU,
       annotation: bool = False) -> SimpleNamespace:
    """A stand-in for a profiler FunctionEvent (times in microseconds)."""
    kind = "user_annotation" if device == CPU else "gpu_user_annotation"
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=device, is_user_annotation=annotation and device == CPU,
                           activity_type=kind if annotation else "cpu_op")


def steps(*bounds: float) -> list[SimpleNamespace]:
    """Back-to-back ``ProfilerStep#`` ranges between consecutive bounds."""
    return [ev(f"ProfilerStep#{i}", a, b, annotation=True)
            for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]


def test_cpu_comm_is_the_union_of_collective_spans_on_any_thread() -> None:
    events = [*steps(0, 10_000, 20_000),
              ev("aten::mm", 0, 4_000), ev("aten::add", 1_000, 2_000),  # nested: once
              ev("c10d::allreduce_", 4_000, 4_500),  # launch on the training thread
              ev("gloo:all_reduce", 4_200, 9_000, annotation=True),  # worker thread, async
              ev("gloo:all_reduce", 8_000, 11_000, annotation=True),  # overlaps the previous
              ev("Optimizer.step#AdamW.step", 12_000, 14_000, annotation=True),  # region
              ev("aten::mul", 10_000, 13_000),
              ev("gloo:all_reduce", 19_000, 25_000, annotation=True)]  # clipped at 20 ms
    got = comm_compute_ms(events, on_cuda=False)
    assert got["steps"] == 2 and got["step_ms"] == 10.0
    assert got["comm_ms"] == (7_000 + 1_000) / 2e3  # 4.0-11.0 and 19.0-20.0 ms
    assert got["compute_ms"] == (4_000 + 3_000) / 2e3
    assert got["overlap_ms"] == 1_000 / 2e3  # 10.0-11.0 ms
    assert got["idle_ms"] == 20 / 2 - 4.0 - 3.5 + 0.5
    assert got["comm_ms_by_op"] == {"c10d::allreduce_": 0.25, "gloo:all_reduce": 3.9}


def test_cuda_counts_device_time_of_nccl_kernels_only() -> None:
    events = [*steps(0, 10_000),
              ev("nccl:all_reduce", 0, 9_000, annotation=True),  # CPU side: ignored
              ev("aten::mm", 0, 1_000),  # CPU side: ignored
              ev("ProfilerStep#0", 0, 10_000, CUDA, annotation=True),  # device ranges
              ev("nccl:all_reduce", 1_000, 9_000, CUDA, annotation=True),  # are not work
              ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2_000, 6_000, CUDA),
              ev("ampere_sgemm_128x64_nn", 1_000, 3_000, CUDA)]
    got = comm_compute_ms(events, on_cuda=True)
    assert (got["comm_ms"], got["compute_ms"], got["overlap_ms"]) == (4.0, 2.0, 1.0)
    assert list(got["comm_ms_by_op"]) == ["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]


@pytest.mark.dist
@pytest.mark.parametrize("codec, bucket_mb", [("none", "0.1"), ("fp16", "25")])
def test_profiler_and_timers_both_measure_communication(cache: Path, tmp_path: Path, codec: str,
                                                bucket_mb: str) -> None:
    """2 gloo ranks, 9 profiled steps: both measures of communication are there, per
    rank, and the profiler finds it in gloo's worker ranges.

    How closely the two agree is a benchmark bar, not a test: ``gradzip bench train
    --ranks 2 --profile`` holds the profiler to the timers (0.5x-1.5x or +5 ms for
    comm, 10% or 2 ms for the step) and reports it (docs/benchmarks/trainer.md). On 2
    busy cores scheduling delays move them apart by a few ms.

    ``none`` runs 4 buckets a step (their all-reduces overlap, so both sides must take
    the union). ``fp16`` runs one: the codec's stats sum each bucket's launch-to-completion
    time, which counts buckets in flight together more than once.
    """
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # No logging or eval inside steps 6-14 (their all-reduces would be profiled but not
    # timed); DDP's bucket rebuild is over by step 6.
    cmd = [*launch(2), "-m", "gradzip", "train",
           *flags(cache, out, "--parallel", "ddp", "--codec", codec, "--bucket-cap-mb",
                  bucket_mb, "--max-steps", "14", "--log-every", "100", "--eval-every", "0",
                  "--profile", "--profile-steps", "6:14")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    for rank in (0, 1):
        summary = json.loads((out / "profile" / f"summary_rank{rank}.json").read_text())
        prof, timers = summary["profiler"], summary["timers"]
        assert prof["steps"] == 9
        assert timers["comm"] > 0 and prof["comm_ms"] > 0, summary
        assert prof["step_ms"] > 0 and timers["step"] > 0, summary
        # the time is in gloo's worker ranges (the largest op), not the c10d launch ops
        by_op = prof["comm_ms_by_op"]
        assert max(by_op, key=by_op.get) == "gloo:all_reduce", by_op
