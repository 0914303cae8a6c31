"""Process groups and data parallelism: one ``apply_*`` function per strategy, and
``parallelize``, the one entry the training loop calls.

* ``apply_ddp`` — DistributedDataParallel (no buffer broadcast before each forward);
* ``apply_fsdp`` — FSDP2: ``fully_shard`` on every transformer block, then the root, so
  each block's parameters are gathered just before it runs and freed after;
* ``attach_codec`` — hands the wrapped model to ``gradzip.attach`` (the comm layer).

``parallelize`` applies the strategy of ``--parallel`` and the run's ``Method``
(``gradzip.comm.method``: a codec policy, PyTorch's own hook, or local updates) and
returns a ``Parallelism``
that answers everything the loop asks (the model to run, gradient sync on or off for
a micro-batch, the communication stats, what a checkpoint holds, how a resume
settles), so the loop has no branch on the strategy. Under DDP every run, ``--codec
none`` included, communicates through gradzip's hook: ``none`` is PyTorch's own
all-reduce arithmetic (bit-identical, tested) and all runs report the same
``CommStats``.

``--parallel ddp`` also works as one process without torchrun (a 1-rank group), which
is handy for checking a codec end to end.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradzip.comm import replicas
from gradzip.comm.method import (
    AutoMethod,
    CodecMethod,
    LocalUpdateMethod,
    Method,
    SnooMethod,
    TorchHookMethod,
)
from gradzip.comm.native import NativeCollectives
from gradzip.train.model import GPT
from gradzip.train.restart import attempt_store


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


def init_distributed(parallel: str, device: str, timeout_s: float = 600.0) -> DistInfo:
    """Join the torchrun group (or make a 1-rank one for ddp/fsdp) and pick the device;
    a collective that takes longer than ``timeout_s`` fails on its rank. A replica thread
    (``--replicas``) is the rank of the threaded world it has joined, on the CPU."""
    replica = replicas.current()
    if replica is not None:
        return DistInfo(replica.rank, replica.world_size, replica.rank, torch.device("cpu"))
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
        if "MASTER_ADDR" in os.environ:  # under torchrun: env:// rendezvous, or the
            store = attempt_store()      # agent's store with a prefix per restart
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None,
                                    timeout=timedelta(seconds=timeout_s),
                                    **({} if store is None else {"store": store, "rank": rank,
                                                                 "world_size": world_size}))
        else:  # a single process asked for ddp/fsdp: a private 1-rank group
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world_size, local_rank, dev)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def apply_ddp(model: nn.Module, info: DistInfo, *, bucket_cap_mb: float) -> nn.Module:
    """Wrap in DDP, without the buffer broadcast before every forward."""
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
    return DDP(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb, **no_sync_buffers)


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


def apply_fsdp(model: GPT, info: DistInfo, mesh: Any = None) -> nn.Module:
    """FSDP2: shard every block, then the root (embeddings, final norm, head), over
    ``mesh`` (default: every rank; a 2-D mesh is native HSDP).

    Sharding block by block lets FSDP all-gather one block's parameters at a time
    (and prefetch the next), instead of the whole model at once.
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def ranks_per_node(info: DistInfo, node_size: int) -> int:
    """``--node-size``, else torchrun's LOCAL_WORLD_SIZE; it must divide the world."""
    size = node_size or int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    if size < 1 or info.world_size % size:
        raise ValueError(f"--node-size {size} must divide the world size "
                         f"{info.world_size} (ranks per node)")
    return size


def hsdp_mesh(info: DistInfo, node_size: int) -> Any:
    """The ``("replicate", "shard")`` device mesh of HSDP: a node's ranks per shard
    group (``ranks_per_node``), the world in replicas of it."""
    from torch.distributed.device_mesh import init_device_mesh

    shard = ranks_per_node(info, node_size)
    return init_device_mesh(info.device.type, (info.world_size // shard, shard),
                            mesh_dim_names=("replicate", "shard"))


def attach_codec(model: nn.Module, method: CodecMethod | AutoMethod, *, seed: int, diagnose: bool,
                 nonfinite: str = "error", capture: Any = None,
                 replicate_group: Any = None, node_size: int = 0) -> Any:
    """Install the gradient codec (and the capture, if any) on a DDP or FSDP2 module
    (HSDP: on the replicate link of ``replicate_group``; DDP with ``node_size``:
    hierarchical); returns gradzip's handle."""
    from gradzip.comm.attach import attach

    return attach(model, method, seed=seed, diagnose=diagnose, nonfinite=nonfinite,
                  capture=capture, replicate_group=replicate_group, node_size=node_size)


class Parallelism:
    """The loop's view of a data-parallel strategy; this base class is one process."""

    #: checkpoints hold per-rank shards written from the wrapped model (DCP)
    sharded = False

    def __init__(self, raw: nn.Module, model: nn.Module, handle: Any = None) -> None:
        self.raw = raw  # the unwrapped model: parameter counts, replicated checkpoints
        self.model = model  # what forward and backward run on
        self.handle = handle  # gradzip's handle when a codec is attached

    @property
    def comm_stats(self) -> Any:
        """The attached codec's ``CommStats``, or None (no gradzip communication)."""
        return self.handle.stats if self.handle is not None else None

    @property
    def checkpoint_model(self) -> nn.Module:
        return self.model if self.sharded else self.raw

    def no_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Skip gradient synchronization for a micro-batch that is not the last one."""
        return contextlib.nullcontext()

    def codec_state(self) -> Any:
        return self.handle.state_dict() if self.handle is not None else None

    def resume_codec(self, state: Any, sample: torch.Tensor) -> None:
        """Restore the codec's state from a checkpoint (see ``DataParallel``)."""
        if self.handle is not None:
            self.handle.load_state_dict(state)

    def bind_optimizer(self, optimizer: torch.optim.Optimizer,
                       cleanup: contextlib.ExitStack) -> None:
        """Called once the optimizer is built (``LocalUpdates`` checkpoints its state and
        ends its exchanges in flight on ``cleanup``)."""

    def after_optimizer_step(self) -> None:
        """Called after every optimizer step (``LocalUpdates`` synchronizes here)."""

    def evaluation_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights validation runs on (``LocalUpdates``: the synchronized ones)."""
        return contextlib.nullcontext()

    def join(self) -> None:
        """Before the first step: a torchft replica group joins its peers (healing from
        one when it comes back; ``LocalUpdates``)."""

    def share_job_progress(self, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        """Under torchft: what a healing replica group takes from its peer beyond the
        model (``get`` there, ``put`` here): the trainer's clock and evaluations, so a
        group that comes back carries the job's, not a clock restarted at zero."""

    def current_step(self, step: int) -> int:
        """The step this process is at after ``step``: a torchft replica group that
        healed from a peer takes the peer's step."""
        return step

    def ft_report(self) -> dict[str, Any] | None:
        """What torchft's rounds did on this replica group; None without --ft."""
        return None

    def new_rounds(self) -> list[dict[str, Any]]:
        """torchft's rounds since the last call (each with its digests), to log."""
        return []

    def not_a_step(self) -> None:
        """The time from now to the next step (an evaluation, a checkpoint) is no
        step's: ``auto`` leaves it out of what it measures."""
        restart = getattr(self.handle, "restart_clock", None)
        if callable(restart):
            restart()

    def auto_report(self) -> dict[str, Any] | None:
        """What ``auto`` chose, from which step, on which costs; None for other methods."""
        report = getattr(self.handle, "report", None)
        return report() if callable(report) else None

    def replica_digest(self) -> str | None:
        """A digest of the weights every rank must hold bit for bit (the synchronized
        ones), or None where ranks hold different shards (FSDP)."""
        if self.sharded:
            return None
        with self.evaluation_weights():
            return weights_digest(self.raw)


def weights_digest(module: nn.Module) -> str:
    """A digest of every parameter's bytes, in order (one host copy of the weights)."""
    from gradzip.comm.outer import tensor_digest

    return tensor_digest(list(module.parameters()))


def replicas_identical(digest: str | None) -> bool | None:
    """Whether every rank's ``digest`` is the same (collective; None when sharded)."""
    if digest is None:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    return len(set(everyone)) == 1


class LocalUpdates(Parallelism):
    """DiLoCo / post-local SGD: no DDP; ``handle`` is the ``DiLoCo`` (its ``CommStats``
    and checkpointable state), which synchronizes every H optimizer steps.

    Between syncs every rank has its own weights and its own inner optimizer state, so
    both travel in this rank's checkpoint state (a replicated checkpoint holds rank 0's).
    """

    #: the trainer's (inner) optimizer, set once it is built
    inner_optimizer: Any = None

    def bind_optimizer(self, optimizer: torch.optim.Optimizer,
                       cleanup: contextlib.ExitStack) -> None:
        self.inner_optimizer = optimizer  # per-rank inner state in checkpoints
        self.handle.inner_optimizer = optimizer  # a healing peer's copy includes it
        cleanup.callback(self.handle.close)  # exchanges in flight end first

    def codec_state(self) -> Any:
        state = self.handle.state_dict()
        if self.inner_optimizer is not None:
            state["inner_optimizer"] = self.inner_optimizer.state_dict()
        return state

    def resume_codec(self, state: Any, sample: torch.Tensor) -> None:
        self.handle.load_state_dict(state)
        if self.inner_optimizer is not None and "inner_optimizer" in state:
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])

    def after_optimizer_step(self) -> None:
        self.handle.step()

    def evaluation_weights(self) -> contextlib.AbstractContextManager[None]:
        return cast(contextlib.AbstractContextManager[None],
                    self.handle.synchronized_weights())

    def join(self) -> None:
        self.handle.join()

    def share_job_progress(self, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self.handle.job_progress = (get, put)

    def current_step(self, step: int) -> int:
        return int(self.handle.inner_steps) if self.handle.replicas is not None else step

    def new_rounds(self) -> list[dict[str, Any]]:
        rounds = self.handle.rounds
        start, self._logged_rounds = getattr(self, "_logged_rounds", 0), len(rounds)
        return list(rounds[start:])

    def ft_report(self) -> dict[str, Any] | None:
        outer = self.handle
        if outer.replicas is None:
            return None
        rounds = outer.rounds
        failed = [r for r in rounds if not r["committed"]]
        return {"replica": outer.replicas.job.replica, "replicas": outer.replicas.job.replicas,
                "rounds": len(rounds), "committed": len(rounds) - len(failed),
                "failed": len(failed), "failed_s": round(sum(r["seconds"] for r in failed), 3),
                "quorum_s": round(outer.replicas.quorum_s, 3),
                "heals": sum(1 for r in rounds if r.get("healed"))}


class DataParallel(Parallelism):
    """DDP; the codec (``none`` included) is gradzip's comm hook."""

    @contextlib.contextmanager
    def no_sync(self, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        with cast(Any, self.model).no_sync():
            yield

    def resume_codec(self, state: Any, sample: torch.Tensor) -> None:
        """Restore the codec state, then settle DDP's buckets (``settle_ddp_buckets``)."""
        super().resume_codec(state, sample)
        settle_ddp_buckets(self.model, sample)
        self.handle.stats.end_step()  # the settling all-reduce is a step of its own


class OuterStepped(DataParallel):
    """DDP plus SNOO's outer step (``gradzip.train.snoo``) after every optimizer step;
    checkpoints hold the codec's state and the outer step's."""

    def __init__(self, ddp: DataParallel, outer: Any) -> None:
        super().__init__(ddp.raw, ddp.model, ddp.handle)
        self.outer = outer

    def after_optimizer_step(self) -> None:
        self.outer.step()

    def codec_state(self) -> Any:
        return {"codec": super().codec_state(), "snoo": self.outer.state_dict()}

    def resume_codec(self, state: Any, sample: torch.Tensor) -> None:
        if not isinstance(state, dict) or "snoo" not in state:
            raise ValueError("this checkpoint has no SNOO state: resume with its --outer")
        self.outer.load_state_dict(state["snoo"])
        super().resume_codec(state["codec"], sample)


class FullyShard(Parallelism):
    """FSDP2; without a codec FSDP's own reduce-scatter runs, counted from outside
    (``gradzip.comm.native``)."""

    sharded = True

    def __init__(self, raw: nn.Module, model: nn.Module, handle: Any = None,
                 native: Any = None) -> None:
        super().__init__(raw, model, handle)
        self.native = native  # a NativeCollectives when FSDP2 reduces by itself

    @property
    def comm_stats(self) -> Any:
        if self.handle is None and self.native is not None:
            return self.native.stats
        return super().comm_stats

    def bind_optimizer(self, optimizer: torch.optim.Optimizer,
                       cleanup: contextlib.ExitStack) -> None:
        if self.native is not None:
            cleanup.callback(self.native.close)

    @contextlib.contextmanager
    def no_sync(self, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        module = cast(Any, self.model)
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)


def parallelize(raw: nn.Module, info: DistInfo, *, parallel: str, method: Method,
                bucket_cap_mb: float, seed: int, diagnose: bool, nonfinite: str,
                capture: Any = None, node_size: int = 0,
                hierarchical: bool = False) -> Parallelism:
    """Apply ``parallel`` (none, ddp, fsdp, hsdp) and ``method``: a codec policy through
    gradzip's hook, PyTorch's own hook (DDP), or local updates (DiLoCo: no DDP).
    ``capture`` (a ``gradzip.capture.Capture``) records the communicated buckets: FSDP
    then reduces through gradzip's ``none`` when no codec is given. HSDP without a codec
    is FSDP2's native HSDP; with one, gradzip reduces the replicate link
    (``gradzip.comm.hsdp``). ``hierarchical`` DDP compresses between nodes only."""
    if parallel == "none":
        return Parallelism(raw, raw)
    if isinstance(method, LocalUpdateMethod):
        from gradzip.comm.ft import replicas_from_env
        from gradzip.comm.outer import DiLoCo

        return LocalUpdates(raw, raw, DiLoCo(raw, seed=seed, nonfinite=nonfinite,
                                             replicas=replicas_from_env(),
                                             **method.options()))
    if isinstance(method, TorchHookMethod):
        return _torch_hook_ddp(raw, info, method, bucket_cap_mb)
    if isinstance(method, AutoMethod) and capture is not None:
        raise ValueError(f"--codec {method} changes codec during the run; --capture "
                         "records one codec's buckets: name a codec")
    if isinstance(method, SnooMethod):
        from gradzip.train.snoo import NesterovOuterStep

        ddp = parallelize(raw, info, parallel=parallel, method=method.step_method,
                          bucket_cap_mb=bucket_cap_mb, seed=seed, diagnose=diagnose,
                          nonfinite=nonfinite, capture=capture, node_size=node_size,
                          hierarchical=hierarchical)
        return OuterStepped(cast(DataParallel, ddp), NesterovOuterStep(
            raw, sync_every=method.sync_every, lr=method.lr, momentum=method.momentum))
    if parallel == "ddp":
        model = apply_ddp(raw, info, bucket_cap_mb=bucket_cap_mb)
        nodes = ranks_per_node(info, node_size) if hierarchical else 0
        return DataParallel(raw, model, attach_codec(model, method, seed=seed,
                                                     diagnose=diagnose, nonfinite=nonfinite,
                                                     capture=capture, node_size=nodes))
    if parallel == "hsdp":
        return _hsdp(raw, info, cast(CodecMethod | AutoMethod, method), node_size,
                     seed=seed, diagnose=diagnose, nonfinite=nonfinite)
    model = apply_fsdp(cast(GPT, raw), info)
    if isinstance(method, CodecMethod) and method.plain and capture is None:
        return FullyShard(raw, model, native=NativeCollectives())
    return FullyShard(raw, model, attach_codec(
        model, method, seed=seed, diagnose=diagnose, nonfinite=nonfinite, capture=capture))


def _hsdp(raw: nn.Module, info: DistInfo, method: CodecMethod | AutoMethod, node_size: int,
          *, seed: int, diagnose: bool, nonfinite: str) -> FullyShard:
    """FSDP2 within a node, replicated across: native HSDP for ``none``, else sharded over
    the shard dimension with gradzip reducing the replicate link."""
    mesh = hsdp_mesh(info, node_size)
    if isinstance(method, CodecMethod) and method.plain:
        return FullyShard(raw, apply_fsdp(cast(GPT, raw), info, mesh),
                          native=NativeCollectives(mesh.get_group("replicate")))
    model = apply_fsdp(cast(GPT, raw), info, mesh["shard"])
    return FullyShard(raw, model, attach_codec(
        model, method, seed=seed, diagnose=diagnose, nonfinite=nonfinite,
        replicate_group=mesh.get_group("replicate")))


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


def _torch_hook_ddp(raw: nn.Module, info: DistInfo, method: TorchHookMethod,
                    bucket_cap_mb: float) -> DataParallel:
    """DDP with PyTorch's own comm hook (measured); powerSGD gets one bucket on gloo."""
    from gradzip.comm.torch_hooks import attach_torch, gradient_bytes

    if method.hook == "powersgd" and dist.get_backend() == "gloo":
        bucket_cap_mb = max(bucket_cap_mb, gradient_bytes(raw) / 2**20 + 1.0)
    model = apply_ddp(raw, info, bucket_cap_mb=bucket_cap_mb)
    return DataParallel(raw, model, attach_torch(model, str(method)))

