"""Process groups and data parallelism: one ``apply_*`` function per strategy.

* ``apply_ddp`` — DistributedDataParallel; without a codec a timing comm hook that does
  exactly what DDP's default all-reduce does, so the uncompressed baseline reports its
  communication time and bytes like every codec does;
* ``apply_fsdp`` — FSDP2: ``fully_shard`` on every transformer block, then the root, so
  each block's parameters are gathered just before it runs and freed after;
* ``attach_codec`` — hands the wrapped model to ``gradzip.attach`` (the comm layer).

``--parallel ddp`` also works as one process without torchrun (a 1-rank group), which
is handy for checking a codec end to end.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradzip.codecs.linkmodel import backend_model, link_bytes
from gradzip.train.model import GPT


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(parallel: str, device: str) -> DistInfo:
    """Join the torchrun group (or make a 1-rank one for ddp/fsdp) and pick the device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and parallel == "none":
        raise ValueError(f"{world_size} processes were started but --parallel is none; "
                         f"use --parallel ddp or fsdp under torchrun")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but CUDA is not available")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if parallel != "none" and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:  # under torchrun: env:// rendezvous
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
        else:  # a single process asked for ddp/fsdp: a private 1-rank group
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    return DistInfo(rank, world_size, local_rank, dev)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class AllReduceTimer:
    """A DDP comm hook equal to the built-in all-reduce, that times and counts it.

    Communication runs inside backward, overlapped with it, so it cannot be timed by
    wrapping a phase; instead each bucket records when its all-reduce was launched and
    when it completed, and a step's comm time is the union of those intervals.
    Bytes are the link bytes of each bucket's ring all-reduce (``gradzip.codecs.linkmodel``;
    raw == wire: no codec).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.link_model = backend_model(dist.get_backend()) if dist.is_initialized() else "ideal"
        self._lock = threading.Lock()  # completion callbacks run on the backend's thread
        self._spans: list[tuple[float, float]] = []
        self._bytes = 0
        self.bytes_total = 0
        self.calls_total = 0  # bucket all-reduces
        self.comm_ms_total = 0.0

    # No annotations on purpose: DDP checks them against the real classes, and with
    # ``from __future__ import annotations`` they would be strings.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001
        buf = bucket.buffer()
        buf.div_(self.world_size)  # what DDP's default hook does: average, not sum
        t0 = time.perf_counter()
        with self._lock:
            self.calls_total += 1
            self._bytes += link_bytes("all_reduce", buf.numel() * buf.element_size(),
                                      self.world_size, self.link_model)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            t1 = time.perf_counter()
            with self._lock:
                self._spans.append((t0, t1))
            return f.value()[0]

        return fut.then(done)

    def end_step(self) -> dict[str, float]:
        """This step's comm time (ms) and bytes; resets for the next step."""
        with self._lock:
            spans, nbytes = sorted(self._spans), self._bytes
            self._spans, self._bytes = [], 0
        busy, covered_to = 0.0, float("-inf")
        for s, e in spans:  # length of the union of the intervals, sorted by start
            if e > covered_to:
                busy += e - max(s, covered_to)
                covered_to = e
        self.bytes_total += nbytes
        self.comm_ms_total += busy * 1e3
        return {"comm_ms": busy * 1e3, "bytes_raw": nbytes, "bytes_wire": nbytes}


def apply_ddp(model: nn.Module, info: DistInfo, *, bucket_cap_mb: float,
              timed: bool) -> tuple[nn.Module, AllReduceTimer | None]:
    """Wrap in DDP; with ``timed`` register the timing all-reduce hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [info.device.index] if info.device.type == "cuda" else None
    # No buffer sync before each forward: the model's only buffer is the RoPE table, a
    # pure function of the config and identical on every rank. DDP would otherwise
    # broadcast it before every forward: an extra collective per micro-batch (64 KiB for
    # `small`) that no comm statistic counts. (Recent torch names the option
    # forward_sync_buffers and deprecates broadcast_buffers.)
    no_sync_buffers: dict[str, Any] = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP).parameters
        else {"broadcast_buffers": False})
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb, **no_sync_buffers)
    timer = None
    if timed:
        timer = AllReduceTimer(info.world_size)
        ddp.register_comm_hook(None, timer.hook)
    return ddp, timer


def settle_ddp_buckets(ddp: nn.Module, sample: torch.Tensor) -> None:
    """One synchronized forward/backward on a dummy batch, its gradients thrown away.

    DDP rebuilds its gradient buckets after the first synchronized backward of a
    process, and gradzip's hook therefore sends that first step uncompressed and
    starts compressing with the second (codec state is keyed by bucket index). A run
    that resumes from a checkpoint calls this first, so its first real step is already
    compressed on the final bucket layout — as the same step was in the uninterrupted
    run, which makes the resume exact. Weights, optimizer, data and RNG are untouched.
    """
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    _, loss = ddp(sample, sample)
    loss.backward()
    ddp.zero_grad(set_to_none=True)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


def apply_fsdp(model: GPT, info: DistInfo) -> nn.Module:
    """FSDP2: shard every block, then the root (embeddings, final norm, head).

    Sharding block by block lets FSDP all-gather one block's parameters at a time
    (and prefetch the next), instead of the whole model at once.
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def attach_codec(model: nn.Module, spec: Any, *, seed: int, diagnose: bool) -> Any:
    """Install the gradient codec on a DDP or FSDP2 module; returns gradzip's handle."""
    import gradzip

    attach = getattr(gradzip, "attach", None)
    if attach is None:
        raise RuntimeError("this gradzip has no gradzip.attach (the comm layer is missing); "
                           "--codec needs it")
    return attach(model, spec, seed=seed, diagnose=diagnose, nonfinite="error")


@contextlib.contextmanager
def no_sync(model: nn.Module, parallel: str, enabled: bool) -> Iterator[None]:
    """Skip gradient synchronization for a micro-batch that is not the last one.

    Gradients accumulate locally and are reduced once, on the last micro-batch: the
    communication of one step, not grad_accum steps.
    """
    if not enabled or parallel == "none":
        yield
    elif parallel == "ddp":
        with cast(Any, model).no_sync():
            yield
    else:  # FSDP2
        cast(Any, model).set_requires_gradient_sync(False)
        try:
            yield
        finally:
            cast(Any, model).set_requires_gradient_sync(True)


def all_reduce_mean(values: list[float], device: torch.device) -> list[float]:
    """Average a few numbers over ranks (one collective); identity without a group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any (ranks must agree on when to stop)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
