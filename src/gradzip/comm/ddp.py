"""The DDP communication hook: every bucket through a gradzip codec.

``state, hook = ddp_hook(spec)`` then ``ddp_model.register_comm_hook(state, hook)``
(or just ``gradzip.attach(ddp_model, spec)``). The hook returns at once with a
future that the communication thread completes (overlap with backward, like
PyTorch's ``allreduce_hook``), holding the bucket buffer overwritten with the
mean gradient.

State is keyed by bucket index. DDP rebuilds its buckets once, after the first
synchronized backward (after the second with ``static_graph=True``), so the same
index may then hold other parameters; as in PyTorch's ``powerSGD_hook``, the
synchronized iterations before the rebuild use the plain fp32 all-reduce (counted
in the stats like any other traffic) and compression starts on the final bucket
layout. ``attach`` reads ``static_graph`` from the model; as a safety net the hook
also remembers which parameters each bucket index held when it compressed it, and
if that ever changes it drops that bucket's codec state (with a warning) instead
of applying a residual to the wrong parameters.

Every codec sees the whole flat bucket with the shapes of the tensors inside it (one
payload, one collective per bucket; ``per_tensor`` codecs keep per-tensor statistics
in that one call). Multi-round codecs that reduce a bucket of tensors at once do so
(PowerSGD: every matrix's P in one all-reduce, every Q in another, as PyTorch's
``powerSGD_hook``); the other multi-round protocols run once per parameter (a view of
the bucket, key ``bucket{i}/p{j}``).

A policy (``policy.py``) may give some parameters another codec: a bucket holding
parameters of several groups reduces each group's gradients through its own codec
(key ``bucket{i}/g{g}``), gathering non-adjacent ones into one flat tensor first.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradzip.codecs.base import Compressor
from gradzip.codecs.chain import Codec
from gradzip.codecs.nonfinite import NonFiniteGradientError
from gradzip.comm.chained import chainable, reduce_async
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.eventtimes import EventTimings
from gradzip.comm.groups import node_groups, private_group, rank_sets
from gradzip.comm.pending import PendingChecks
from gradzip.comm.reducer import HierarchicalReducer, Reducer
from gradzip.comm.stats import CommStats
from gradzip.comm.worker import CommWorker

#: synchronized iterations run uncompressed before DDP's bucket layout is final
START_ITERATION = 1
#: the same with ``static_graph=True`` (DDP records the ready order in iteration 2)
START_ITERATION_STATIC_GRAPH = 2


class DDPCommState:
    """Everything the hook needs: codecs, stats, communicator, worker thread.

    ``codecs[0]`` is the default codec; ``codecs[g]`` (g >= 1) serves the parameters
    that ``groups`` (parameter identity -> g) assigns to policy group g.
    ``iteration`` counts synchronized backward passes seen by this process;
    compression starts at ``start_iteration`` (``START_ITERATION``, or
    ``START_ITERATION_STATIC_GRAPH`` for a ``static_graph=True`` model, or a later
    policy start step). Multi-round codecs reduce each parameter's gradient
    separately (their compression depends on the tensor's shape).
    """

    def __init__(self, codec: Codec, process_group: dist.ProcessGroup | None = None,
                 diagnose: bool = False, start_iteration: int = START_ITERATION,
                 group_codecs: Sequence[Codec] = (),
                 groups: dict[int, int] | None = None, node_size: int = 0,
                 stats: CommStats | None = None) -> None:
        self.codecs = [codec, *group_codecs]
        self.start_iteration = start_iteration
        self.stats = stats if stats is not None else CommStats()
        sets = rank_sets(process_group)
        self.group = private_group(process_group, sets=sets)
        self.comm = TorchCommunicator(self.group)
        self.reducers = [Reducer(c, self.stats, diagnose=diagnose) for c in self.codecs]
        #: nodes of ``node_size`` ranks: each policy group's codec compresses only
        #: between nodes (``HierarchicalReducer``); None for a group that sends ``none``
        #: (uncompressed, the hierarchy saves nothing, and DDP's flat all-reduce keeps
        #: its summation order: bit-identical); empty without nodes
        self.hierarchical: list[HierarchicalReducer | None] = []
        if node_size:
            node, cross = (TorchCommunicator(g)
                           for g in node_groups(node_size, process_group, sets))
            self.hierarchical = [
                None if sends_plain(c) else
                HierarchicalReducer(c, self.stats, node, cross, diagnose)
                for c in self.codecs]
        self.groups = groups or {}
        self.worker = CommWorker()
        #: one summable single-stage codec for every parameter: PyTorch's future-chained
        #: all-reduce, no communication thread (``chained.py``)
        self.chained = (not self.groups and not diagnose and not node_size
                        and chainable(codec))
        #: the chained path's non-finite flags still on a GPU (``chained.PendingChecks``)
        self.checks = PendingChecks()
        #: its reductions' CUDA event times, recorded as the step closes
        self.timings = EventTimings()
        self.stats.add_settler(self.timings.settle)
        self.checked = 0  # the iteration whose first bucket was seen last
        self.iteration = 0
        #: a ``gradzip.capture.Capture`` recording each bucket as it is communicated,
        #: and parameter identity -> name for its records (set by ``attach``)
        self.capture: Any = None
        self.names: dict[int, str] = {}
        # bucket index -> identities of its parameters when it was last compressed
        self._layouts: dict[int, tuple[int, ...]] = {}
        self._splits: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}

    @property
    def codec(self) -> Codec:
        """The default codec (policy groups have their own in ``codecs``)."""
        return self.codecs[0]

    def split(self, layout: tuple[int, ...]) -> list[tuple[int, list[int]]]:
        """(group, positions of its parameters in the bucket) for each group present."""
        if layout not in self._splits:
            by_group: dict[int, list[int]] = {}
            for pos, pid in enumerate(layout):
                by_group.setdefault(self.groups.get(pid, 0), []).append(pos)
            self._splits[layout] = sorted(by_group.items())
        return self._splits[layout]

    def check_layout(self, index: int, layout: tuple[int, ...]) -> None:
        """Drop bucket ``index``'s codec state if it now holds other parameters.

        Runs on the communication thread, in order with the jobs that use the state.
        """
        old = self._layouts.get(index)
        self._layouts[index] = layout
        if old is None or old == layout:
            return
        for codec in self.codecs:
            codec.drop(f"bucket{index}")
        warnings.warn(
            f"gradzip: DDP bucket {index} changed its parameters (bucket rebuild after "
            f"compression started); its codec state was reset", RuntimeWarning, stacklevel=1)

    def state_dict(self) -> dict[str, Any]:
        """Codec state (EF residuals, PowerSGD Q, momentum) keyed by bucket index."""
        return {"codec": self.codec.state_dict(), "iteration": self.iteration,
                "groups": [c.state_dict() for c in self.codecs[1:]]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # ``iteration`` is informational: a new DDP instance rebuilds its buckets
        # again, so this process still runs its first synchronized step uncompressed.
        load_codec_states(self.codecs, sd)

    def close(self) -> None:
        self.worker.close()
        if self.capture is not None:
            self.capture.close()


def load_codec_states(codecs: list[Codec], sd: dict[str, Any]) -> None:
    """Restore the default codec's and each policy group's codec state."""
    groups = sd.get("groups", [])
    if len(groups) != len(codecs) - 1:
        raise ValueError(f"comm state holds {len(groups)} policy group codecs, this "
                         f"policy has {len(codecs) - 1}; resume with the same policy")
    for codec, state in zip(codecs, [sd["codec"], *groups], strict=True):
        codec.load_state_dict(state)


def _reduces_buckets(codec: Codec) -> bool:
    """A multi-round compressor that reduces a whole bucket of tensors at once
    (``reduce_tensors``: PowerSGD's two all-reduces per bucket, TernGrad's shared
    scales); the others run their protocol once per parameter."""
    comp = codec.compressors[0][1]
    return type(comp).reduce_tensors is not Compressor.reduce_tensors


def _reduce_group(state: DDPCommState, g: int, buffer: torch.Tensor, key: str,
                  offsets: list[int], shapes: list[torch.Size]) -> None:
    """Reduce the parameters at ``offsets`` of ``buffer`` through group ``g``'s codec."""
    reducer = state.reducers[g]
    sizes = [s.numel() for s in shapes]
    hierarchical = state.hierarchical[g] if state.hierarchical else None
    if hierarchical is not None:  # compressed between nodes only
        _reduce_hierarchical(hierarchical, buffer, key, offsets, shapes)
        return
    contiguous = all(offsets[k] + sizes[k] == offsets[k + 1] for k in range(len(sizes) - 1))
    start, end = offsets[0], offsets[-1] + sizes[-1]
    flat = buffer[start:end] if contiguous else torch.cat(
        [buffer[o:o + n] for o, n in zip(offsets, sizes, strict=True)])
    if reducer.codec.multi_round and not _reduces_buckets(reducer.codec):
        reducer.reduce_each(flat, shapes, key, state.comm)  # one protocol per matrix
    else:
        flat.copy_(reducer.reduce_mean(flat, key, state.comm, shapes=shapes).reshape(-1))
    if not contiguous:
        for o, n, part in zip(offsets, sizes, flat.split(sizes), strict=True):
            buffer[o:o + n].copy_(part)


def sends_plain(codec: Codec) -> bool:
    """``none`` and nothing else: the bucket crosses uncompressed."""
    return codec.wrapper is None and all(s.name == "none" for s in codec.stages)


def _reduce_hierarchical(reducer: HierarchicalReducer, buffer: torch.Tensor, key: str,
                         offsets: list[int], shapes: list[torch.Size]) -> None:
    """The parameters at ``offsets`` of ``buffer``, averaged over nodes of ranks."""
    sizes = [s.numel() for s in shapes]
    flat = torch.cat([buffer[o:o + n] for o, n in zip(offsets, sizes, strict=True)])
    mean = reducer.reduce_mean(flat, key, shapes=shapes).reshape(-1)
    for o, n, part in zip(offsets, sizes, mean.split(sizes), strict=True):
        buffer[o:o + n].copy_(part)


def gradzip_hook(state: DDPCommState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: mean of ``bucket`` over ranks through the policy's codecs (and the
    bucket recorded by the capture, when one is attached and this step is on its
    schedule: what this rank sends, before the reduction overwrites it)."""
    if isinstance(bucket, tuple):  # (grad, param): compiled autograd's Python reducer
        raise TypeError("gradzip's DDP hook got a (grad, param) pair: compiled autograd's "
                        "Python reducer (optimize_ddp='python_reducer') is not supported; "
                        "use the default optimize_ddp")
    capture = state.capture
    if capture is None or not capture.active:
        return reduce_bucket(state, bucket)
    index, params = bucket.index(), bucket.parameters()
    names = [state.names.get(id(p), f"param{k}") for k, p in enumerate(params)]
    shapes = [tuple(p.shape) for p in params]
    capture.record(index, names, shapes, bucket.buffer())
    fut = reduce_bucket(state, bucket)
    if not capture.aggregated:
        return fut

    def record_mean(done: torch.futures.Future) -> Any:
        value = done.value()
        mean = value[0] if isinstance(value, list | tuple) else value
        capture.record(index, names, shapes, mean, kind="aggregated")
        return value

    return fut.then(record_mean)


def reduce_bucket(state: DDPCommState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The mean of ``bucket`` over ranks, through the policy's codecs."""
    buffer = bucket.buffer()
    index = bucket.index()
    key = f"bucket{index}"
    compress = state.iteration >= state.start_iteration
    params = bucket.parameters()
    layout = tuple(id(p) for p in params)
    shapes = [p.shape for p in params]
    first = state.checked != state.iteration
    state.checked = state.iteration
    if bucket.is_last():
        state.iteration += 1
    if first:  # flags a failed step left unread (normally none: its last bucket reads
        try:   # them); every rank fails here together, before any collective of this step
            state.checks.raise_ready()
        except NonFiniteGradientError as e:
            failed: torch.futures.Future = torch.futures.Future()
            failed.set_exception(e)
            return failed
    if state.chained:
        if compress:
            state.check_layout(index, layout)
        return reduce_async(state.reducers[0], state.comm, buffer, key, shapes,
                            plain=not compress, checks=state.checks, timings=state.timings,
                            last=bucket.is_last())

    def job() -> torch.Tensor:
        if not compress:
            return state.reducers[0].reduce_plain(buffer, state.comm)
        state.check_layout(index, layout)
        offsets = [0]  # a bucket is its parameters' gradients back to back
        for shape in shapes[:-1]:
            offsets.append(offsets[-1] + shape.numel())
        parts = state.split(layout)
        for g, positions in parts:
            sub = key if len(parts) == 1 and g == 0 else f"{key}/g{g}"
            _reduce_group(state, g, buffer, sub, [offsets[p] for p in positions],
                          [shapes[p] for p in positions])
        return buffer

    return state.worker.submit(job, buffer)


# DDP inspects the hook's annotations and rejects the strings that
# ``from __future__ import annotations`` leaves there: give it the real objects.
gradzip_hook.__annotations__.update(bucket=dist.GradBucket,
                                    **{"return": torch.futures.Future[torch.Tensor]})


def ddp_hook(
    spec: str | Codec,
    process_group: dist.ProcessGroup | None = None,
    *,
    seed: int = 0,
    diagnose: bool = False,
    nonfinite: str = "error",
    static_graph: bool = False,
) -> tuple[DDPCommState, Any]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Collective: call on every rank (it creates gradzip's own process group).
    ``process_group`` must hold the same ranks as the DDP model's group;
    ``static_graph`` must say whether the model was built with ``static_graph=True``
    (its buckets are rebuilt one iteration later, so compression starts later).
    """
    codec = build_codec(spec, seed=seed, nonfinite=nonfinite)
    start = START_ITERATION_STATIC_GRAPH if static_graph else START_ITERATION
    return DDPCommState(codec, process_group, diagnose=diagnose,
                        start_iteration=start), gradzip_hook


def build_codec(spec: str | Codec, *, seed: int, nonfinite: str, **options: Any) -> Codec:
    """The codec for this rank (spec errors raise here, before any training). A ``Codec``
    is a prototype, copied with empty state (its spec is not parsed again)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if isinstance(spec, Codec):
        return spec.fresh(seed=seed, rank=rank, nonfinite=nonfinite, **options)
    return Codec.from_spec(spec, seed=seed, rank=rank, nonfinite=nonfinite, **options)
