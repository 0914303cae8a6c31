"""HSDP on FSDP2 with the replicate link compressed: shard within a node, replicate across.

Nodes of several GPUs shard within a node (fast links) and replicate across nodes (the
slow network). FSDP2's native HSDP (``fully_shard(mesh=2-D mesh)``) runs the replicate
all-reduce itself, after its reduce-scatter: uncompressed, and out of gradzip's sight.
gradzip's HSDP instead shards every unit over the shard dimension only
(``fully_shard(mesh=mesh["shard"])``) and runs the replicate reduction in FSDP2's
all-reduce hook (``set_all_reduce_hook``). With a 1-D mesh FSDP2 calls that hook with
the reduce-scatter's output: this rank's shard, already averaged over its shard group.
``ReplicateReduce`` averages it over the replicate group through the replicate codec,
in place, so every rank ends with the mean over all ranks, as native HSDP does; with
``none`` the two are bit-identical (an average of two fp32 values is exact in either
order). Error feedback and other codec state live here, keyed per unit
(``hsdp/{unit}``), and travel in the handle's checkpoint state.

Both links are counted: the reduce-scatter (``link="shard"``: FSDP2's own where the
shard spec is ``none``, the default, counted from its output, ``NativeShard``; else
gradzip's compressed reduce-scatter) and the replicate reduction (``link="replicate"``),
each against PyTorch's uncompressed collective for the same gradient, so
``compression_ratio`` covers every link and ``CommStats`` reports each
(``totals()["links"]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.codecs.base import Shapes
from gradzip.codecs.nonfinite import (
    NonFiniteGradientError,
    agreed_nonfinite_error,
    nonfinite_flag,
)
from gradzip.collectives.linkmodel import backend_model, link_bytes
from gradzip.comm.chained import reduce_async
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.eventtimes import EventTimings
from gradzip.comm.fsdp import layout_or_none
from gradzip.comm.pending import AtBackwardEnd, steps_in_backward
from gradzip.comm.reducer import Reducer
from gradzip.comm.stats import Reduction

#: the mesh dimensions a per-dimension spec names
DIMENSIONS = ("replicate", "shard")


@dataclass(frozen=True)
class NativeShard:
    """FSDP2's own reduce-scatter on the shard link (a unit whose shard spec is
    ``none``): gradzip neither runs nor times it, and counts the bytes it moved from the
    shard it produced (``world`` chunks of the output's size, in its dtype)."""

    world: int
    backend: str  # the link model (``linkmodel.backend_model``)

    def reduction(self, output: torch.Tensor) -> Reduction:
        numel = output.numel() * self.world
        handed = numel * output.element_size()
        wire = link_bytes("reduce_scatter", handed, self.world, self.backend)
        return Reduction(numel=numel, sent_values=numel, bytes_raw=wire, bytes_handed=handed,
                         bytes_by_op={"reduce_scatter": wire},
                         calls_by_op={"reduce_scatter": 1}, paths=["native"], link="shard")


@dataclass
class OnDevice:
    """The replicate reductions of a summable one-stage codec (``none``, ``fp16``,
    ``bf16``, ``randomk``) with no host read on the autograd thread: the future-chained
    all-reduce of DDP (``chained.reduce_async``), its non-finite flags read once, when
    backward ends (``pending.AtBackwardEnd``, before any optimizer step), its times
    from CUDA events as the step closes. One per handle, shared by every unit; its
    ``end`` also reads the flags of the other codecs' device-only exchanges
    (``aggregation.fixed``)."""

    end: AtBackwardEnd = field(default_factory=AtBackwardEnd)
    timings: EventTimings = field(default_factory=EventTimings)

    def reduce(self, reducer: Reducer, comm: TorchCommunicator, x: torch.Tensor, key: str,
               shapes: Shapes | None, plain: bool) -> None:
        """``x`` averaged over ``comm``'s ranks through ``reducer``'s codec, in place
        (queued on the current stream on CUDA; done on return on the CPU)."""
        self.end.arm()
        future = reduce_async(reducer, comm, x, key,
                              list(shapes) if shapes is not None else None,
                              plain=plain, checks=self.end.checks, timings=self.timings)
        try:
            future.wait()
        except RuntimeError as e:  # the callback's error arrives wrapped: say it plainly
            if NonFiniteGradientError.__name__ in str(e):
                raise agreed_nonfinite_error(key) from e
            raise


class ReplicateReduce:
    """FSDP2's all-reduce hook of one ``fully_shard`` unit: this rank's shard, averaged
    over the replicate group through the replicate codec, in place; with ``native``,
    the unit's own reduce-scatter before it is counted here too."""

    def __init__(self, reducer: Reducer, comm: TorchCommunicator, key: str, *,
                 start_step: int = 0, shapes: Shapes | None = None,
                 native: NativeShard | None = None, on_device: OnDevice | None = None,
                 chained: bool = False, shards: Any = None) -> None:
        self.native = native
        #: ``on_device``'s chained all-reduce runs the reductions (summable codecs); else
        #: the reducer does, its deferred flags read at ``on_device.end``
        self.chained = chained and on_device is not None
        #: the unit's shard group, where a non-finite shard must be agreed first
        #: (``spread_nonfinite``); None: nothing to agree (one shard, or 'propagate')
        self.shards = shards
        self.on_device = on_device
        self.reducer = reducer
        self.comm = comm
        self.key = key
        #: reductions before compression starts (the policy's start step): plain mean
        self.start_step = start_step
        #: the padded shard shapes of the unit's parameters (per-tensor codecs)
        self.shapes = shapes
        self.calls = 0
        #: the unit's own parameters (an optimizer stepping in backward reads them)
        self.params: list[nn.Parameter] = []

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if self.native is not None:
            self.reducer.stats.record(self.native.reduction(reduce_output))
        compress = self.calls >= self.start_step
        self.calls += 1
        shapes = layout_or_none(self.shapes, reduce_output.numel())
        if self.shards is not None:
            self.reducer.stats.record(spread_nonfinite(reduce_output, self.shards))
        if self.on_device is not None and self.chained:
            self.on_device.reduce(self.reducer, self.comm, reduce_output, self.key, shapes,
                                  plain=not compress)
        else:
            if self.on_device is not None:
                self.on_device.end.arm()
            if not compress:
                self.reducer.reduce_plain(reduce_output, self.comm)
            else:
                mean = self.reducer.reduce_mean(reduce_output, self.key, self.comm,
                                                shapes=shapes)
                reduce_output.copy_(mean.reshape(reduce_output.shape))
        if self.on_device is not None and steps_in_backward(self.params):
            self.on_device.end.checks.raise_ready()  # before FSDP2 runs that step


def _mesh_info(module: nn.Module) -> Any:
    """A ``fully_shard`` unit's mesh info (FSDP2's private state; None if this torch
    lays it out otherwise)."""
    try:
        return module._get_fsdp_state()._fsdp_param_group.mesh_info  # type: ignore[operator]
    except (AttributeError, TypeError, AssertionError):
        return None


def native_hsdp(module: nn.Module) -> bool:
    """Whether a ``fully_shard`` unit replicates over a 2-D mesh itself (native HSDP),
    whose replicate all-reduce gradzip cannot compress or count."""
    return getattr(_mesh_info(module), "replicate_mesh_size", 1) > 1


def shard_group(module: nn.Module) -> Any:
    """The process group a ``fully_shard`` unit reduce-scatters over (None: unknown)."""
    return getattr(_mesh_info(module), "shard_process_group", None)


def spread_nonfinite(x: torch.Tensor, group: Any) -> Reduction:
    """Make ``x`` non-finite on every rank of ``group`` if it is on any: NaN in its
    first value, set on the device (one one-value all-reduce, no host read).

    A reduce-scatter's output is only this rank's chunk: a NaN in another rank's chunk
    (this one may be padding) leaves this rank finite, so its replicate group would go
    on while the other replicate group raises, and the shard group's next collective
    would hang. With the news spread over the shard group first, every replicate group
    sees a non-finite rank and every rank raises in the same unit. Returns what the
    flag's all-reduce cost the shard link (no gradient values: ``bytes_raw`` 0)."""
    flag = (nonfinite_flag(x) if x.numel() else torch.zeros((), dtype=torch.bool,
                                                            device=x.device))
    news = flag.to(torch.float32).reshape(1)
    dist.all_reduce(news, op=dist.ReduceOp.MAX, group=group)
    if x.numel():
        head = x.view(-1)[:1]
        head.copy_(torch.where(news > 0, torch.full_like(head, float("nan")), head))
    world, nbytes = dist.get_world_size(group), news.element_size()
    wire = link_bytes("all_reduce", nbytes, world, backend_model(dist.get_backend(group)))
    return Reduction(numel=0, sent_values=0, bytes_raw=0, bytes_handed=nbytes,
                     bytes_by_op={"all_reduce": wire}, calls_by_op={"all_reduce": 1},
                     link="shard")


def split_spec(spec: Any) -> tuple[Any, Any]:
    """``(replicate spec, shard spec)``: a per-dimension dict names either or both
    (``{"replicate": "ef | topk(ratio=0.01)", "shard": "none"}``); any other spec is
    the replicate link's, and the shard link runs ``none``."""
    if isinstance(spec, dict) and spec and set(spec) <= set(DIMENSIONS):
        return spec.get("replicate", "none"), spec.get("shard", "none")
    return spec, "none"
