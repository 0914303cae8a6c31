"""FSDP integration: a compressed FSDP2 ``ReduceScatter`` and an FSDP1 comm hook.

FSDP2 (``fully_shard``) calls ``ReduceScatter.__call__(output, input, group, op)``
with ``input`` laid out as ``world_size`` contiguous chunks. The compressed version
encodes one payload per destination chunk (codec state keyed per FSDP module and
destination), then reduce-scatters summable payloads leaf by leaf, or exchanges
the serialized payloads with ``all_to_all`` and sums the decoded ones.
It honours the op FSDP passes: ``AVG`` divides by the world size, ``SUM`` does
not, ``PREMUL_SUM(f)`` multiplies each input by ``f`` first (FSDP uses it for a
custom gradient divide factor). Multi-round codecs (PowerSGD) reduce the whole
flat gradient with their own protocol and keep this rank's chunk.

FSDP1 (``FullyShardedDataParallel.register_comm_hook``) calls
``hook(state, padded_unsharded_grad, sharded_output)`` — or ``hook(state, grad)``
for ``NO_SHARD`` — and expects the *mean* gradient (its default path pre/post
divides by the world size around a SUM); the same reducer does the work.

Both run synchronously inside FSDP's own reduction step (on CUDA FSDP already
issues it on its reduce-scatter stream), on FSDP's process group. On FSDP2 the
fixed-layout codecs (``int8``, ``ef | topk``, ...) exchange equal-length device
buffers (``aggregation.fixed``) whose flags are read once, when backward ends
(``CommCache(end=...)``), and whose times come from CUDA events: no host read on the
autograd thread; summable ones reduce-scatter their leaves likewise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.pending import AtBackwardEnd, steps_in_backward
from gradzip.comm.reducer import Reducer


class CommCache:
    """One ``TorchCommunicator`` per process group FSDP hands us; with ``end``, their
    flags are read when backward ends (``Communicator.deferred``), not in the hook."""

    def __init__(self, end: AtBackwardEnd | None = None) -> None:
        self._comms: dict[int, TorchCommunicator] = {}
        self.end = end

    def get(self, group: dist.ProcessGroup | None) -> TorchCommunicator:
        k = id(group)
        if k not in self._comms:
            comm = TorchCommunicator(group)
            if self.end is not None:
                comm.deferred = self.end.checks.watch
            self._comms[k] = comm
        return self._comms[k]


def scaling(op: Any, world_size: int) -> tuple[float, float]:
    """(divisor, factor) for FSDP's reduce op: AVG, SUM or PREMUL_SUM(factor)."""
    R = dist.ReduceOp
    kind = getattr(op, "op", op)  # a PREMUL_SUM ReduceOp object carries .op and .factor
    if kind == R.AVG:
        return float(world_size), 1.0
    if kind == R.SUM:
        return 1.0, 1.0
    if kind == R.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("PREMUL_SUM reduce op without a factor")
        return 1.0, float(factor)
    raise ValueError(
        f"gradzip's compressed reduce-scatter supports AVG, SUM and PREMUL_SUM, got {op}"
    )


def unit_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a ``fully_shard`` unit reduces itself (not its child units')."""
    from torch.distributed.fsdp import FSDPModule

    inner = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule)
             for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in inner]


def shard_shapes(module: nn.Module) -> list[torch.Size] | None:
    """The padded shard shapes of a unit's parameters, in reduce-scatter order.

    FSDP2 lays chunk j of its reduce-scatter input out as every parameter's dim-0
    shard j, padded, back to back; per-tensor codecs keep that granularity. Read from
    FSDP2's parameter group (a private structure): None if this torch lays it out
    otherwise, and the codec then sees one flat chunk.
    """
    try:
        group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        return [torch.Size(fp.padded_sharded_param_size) for fp in group.fsdp_params]
    except (AttributeError, TypeError, AssertionError):  # several param groups: refused
        return None                                       # when the reduce-scatter is set


def layout_or_none(shapes: Sequence[torch.Size] | None,
                   numel: int) -> Sequence[torch.Size] | None:
    """A unit's shard shapes if they still tile ``numel`` values; None when some
    parameters got no gradient this step (the layout is then unknown)."""
    if shapes is not None and sum(s.numel() for s in shapes) != numel:
        return None
    return shapes


class CompressedReduceScatter(ReduceScatter):
    """FSDP2 custom reduce-scatter for one FSDP module (``set_custom_reduce_scatter``)."""

    def __init__(self, reducer: Reducer, comms: CommCache, key: str, *,
                 start_step: int = 0, shapes: list[torch.Size] | None = None,
                 index: int = 0, names: list[str] | None = None) -> None:
        self.reducer = reducer
        self.comms = comms
        self.key = key
        #: reductions of this module before compression starts (the policy's start step)
        self.start_step = start_step
        #: the padded shard shapes of the module's parameters inside each chunk
        self.shapes = shapes
        self.calls = 0
        #: the unit's position among the model's units, and its parameters' names
        self.index = index
        self.names = names or []
        #: a ``gradzip.capture.Capture`` recording each reduction (set by ``attach``)
        self.capture: Any = None
        #: the unit's own parameters (an optimizer stepping in backward reads them)
        self.params: list[nn.Parameter] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        comm = self.comms.get(group)
        if self.comms.end is not None:
            self.comms.end.arm()
        divisor, factor = scaling(op, comm.world_size)
        compress = self.calls >= self.start_step
        self.calls += 1
        shapes = layout_or_none(self.shapes, output_tensor.numel())
        capture = self.capture
        if capture is not None and capture.active:
            self._record(capture, input_tensor, shapes, comm.world_size, "local")
        self.reducer.reduce_scatter(input_tensor, output_tensor, comm, self.key,
                                    divisor=divisor, factor=factor, plain=not compress,
                                    shapes=shapes)
        if capture is not None and capture.active and capture.aggregated:
            self._record(capture, output_tensor, shapes, 1, "aggregated", comm.rank)
        if self.comms.end is not None and steps_in_backward(self.params):
            self.comms.end.checks.raise_ready()  # before FSDP2 runs that step
        if not async_op:
            return None
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([output_tensor])
        # a completed Work; torch's stubs lack this private helper (FSDP2 itself calls
        # the reduce-scatter synchronously, so this path serves other callers only)
        return torch._C._distributed_c10d._create_work_from_future(done)  # type: ignore[attr-defined]


    def _record(self, capture: Any, flat: torch.Tensor, shapes: Sequence[torch.Size] | None,
                chunks: int, kind: str, first_chunk: int = 0) -> None:
        """Hand ``flat`` (``chunks`` destination chunks, each every parameter's padded
        dim-0 shard back to back) to the capture: one entry ``{name}@shard{j}`` per
        parameter and chunk, or one flat entry when the layout is unknown."""
        if shapes is None or len(shapes) != len(self.names):
            capture.record(self.index, [f"unit{self.index}.flat"], [tuple(flat.shape)], flat,
                           kind=kind)
            return
        names, entry_shapes, offsets = [], [], []
        offset = 0
        for j in range(first_chunk, first_chunk + chunks):
            for name, shape in zip(self.names, shapes, strict=True):
                names.append(f"{name}@shard{j}")
                entry_shapes.append(tuple(shape))
                offsets.append(offset)
                offset += shape.numel()
        capture.record(self.index, names, entry_shapes, flat, offsets=offsets, kind=kind)


class FSDP1CommState:
    """State of the FSDP1 hook: reducer, communicator, per-backward call counter.

    FSDP1 registers one hook and one state for all its units, so units are told
    apart by the order in which they reduce within a backward pass (the same on
    every rank); the counter resets when the backward pass ends.
    """

    def __init__(self, reducer: Reducer, process_group: dist.ProcessGroup | None) -> None:
        self.reducer = reducer
        self.comm = TorchCommunicator(process_group)
        self._calls = 0
        self._reset_queued = False

    def next_key(self) -> str:
        if not self._reset_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._reset)
            self._reset_queued = True
        key = f"fsdp1/unit{self._calls}"
        self._calls += 1
        return key

    def _reset(self) -> None:
        self._calls = 0
        self._reset_queued = False


def fsdp1_hook(state: FSDP1CommState, grad: torch.Tensor,
               output: torch.Tensor | None = None) -> None:
    """FSDP1 comm hook: mean gradient, reduce-scattered into ``output`` when sharded."""
    key = state.next_key()
    if output is None:  # NO_SHARD: all-reduce in place
        grad.copy_(state.reducer.reduce_mean(grad, key, state.comm))
        return
    state.reducer.reduce_scatter(grad, output, state.comm, key,
                                 divisor=float(state.comm.world_size))
