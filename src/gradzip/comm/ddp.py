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

Codecs that exploit tensor shape — the multi-round ones, PowerSGD's low-rank
matrices above all — get each parameter's gradient as its own tensor (a view of
the bucket, key ``bucket{i}/p{j}``), as PyTorch's ``powerSGD_hook`` does; a flat
bucket has no matrix structure to compress. Every other codec sees the whole flat
bucket (one payload, one collective per bucket).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from gradzip.codecs.chain import Codec
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.reducer import Reducer
from gradzip.comm.stats import CommStats
from gradzip.comm.worker import CommWorker

#: synchronized iterations run uncompressed before DDP's bucket layout is final
START_ITERATION = 1
#: the same with ``static_graph=True`` (DDP records the ready order in iteration 2)
START_ITERATION_STATIC_GRAPH = 2


def private_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group with the ranks of ``process_group`` (None = world).

    Collective over the default group: every rank must call it, in the same order.
    When ranks belong to different subgroups, all subgroups are created on every
    rank (``new_group`` requires that) and this rank's one is returned.
    """
    world = dist.get_world_size()
    mine = list(range(world)) if process_group is None else sorted(
        dist.get_process_group_ranks(process_group))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    found = None
    for ranks in dict.fromkeys(tuple(r) for r in everyone):
        group = dist.new_group(ranks=list(ranks))
        if list(ranks) == mine:
            found = group
    assert found is not None
    return found


class DDPCommState:
    """Everything the hook needs: codec, stats, communicator, worker thread.

    ``iteration`` counts synchronized backward passes seen by this process;
    compression starts at ``start_iteration`` (``START_ITERATION``, or
    ``START_ITERATION_STATIC_GRAPH`` for a ``static_graph=True`` model).
    ``per_tensor`` reduces each parameter's gradient separately (default: for
    multi-round codecs, whose compression depends on the tensor's shape).
    """

    def __init__(self, codec: Codec, process_group: dist.ProcessGroup | None = None,
                 diagnose: bool = False, per_tensor: bool | None = None,
                 start_iteration: int = START_ITERATION) -> None:
        self.codec = codec
        self.start_iteration = start_iteration
        self.per_tensor = codec.multi_round if per_tensor is None else per_tensor
        self.stats = CommStats()
        self.group = private_group(process_group)
        self.comm = TorchCommunicator(self.group)
        self.reducer = Reducer(codec, self.stats, diagnose=diagnose)
        self.worker = CommWorker()
        self.iteration = 0
        # bucket index -> identities of its parameters when it was last compressed
        self._layouts: dict[int, tuple[int, ...]] = {}

    def check_layout(self, index: int, layout: tuple[int, ...]) -> None:
        """Drop bucket ``index``'s codec state if it now holds other parameters.

        Runs on the communication thread, in order with the jobs that use the state.
        """
        old = self._layouts.get(index)
        self._layouts[index] = layout
        if old is None or old == layout:
            return
        self.codec.drop(f"bucket{index}")
        warnings.warn(
            f"gradzip: DDP bucket {index} changed its parameters (bucket rebuild after "
            f"compression started); its codec state was reset", RuntimeWarning, stacklevel=1)

    def state_dict(self) -> dict[str, Any]:
        """Codec state (EF residuals, PowerSGD Q, momentum) keyed by bucket index."""
        return {"codec": self.codec.state_dict(), "iteration": self.iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # ``iteration`` is informational: a new DDP instance rebuilds its buckets
        # again, so this process still runs its first synchronized step uncompressed.
        self.codec.load_state_dict(sd["codec"])

    def close(self) -> None:
        self.worker.close()


def gradzip_hook(state: DDPCommState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: mean of ``bucket`` over ranks through ``state.codec``."""
    buffer = bucket.buffer()
    index = bucket.index()
    key = f"bucket{index}"
    compress = state.iteration >= state.start_iteration
    params = bucket.parameters()
    layout = tuple(id(p) for p in params)
    bucket_shapes = [p.shape for p in params]
    shapes = bucket_shapes if state.per_tensor else []
    if bucket.is_last():
        state.iteration += 1

    def job() -> torch.Tensor:
        if not compress:
            return state.reducer.reduce_plain(buffer, state.comm)
        state.check_layout(index, layout)
        if shapes:  # a bucket is its parameters' gradients back to back
            return state.reducer.reduce_each(buffer, shapes, key, state.comm)
        mean = state.reducer.reduce_mean(buffer, key, state.comm, shapes=bucket_shapes)
        buffer.copy_(mean.reshape(buffer.shape))
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


def build_codec(spec: str | Codec, *, seed: int, nonfinite: str) -> Codec:
    """The codec for this rank (spec errors raise here, before any training)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    text = str(spec) if isinstance(spec, Codec) else spec
    return Codec.from_spec(text, seed=seed, rank=rank, nonfinite=nonfinite)
