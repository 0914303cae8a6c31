"""``gradzip.attach(model, spec)``: compress a data-parallel model's gradient traffic.

Dispatches on the wrapper: DDP gets a comm hook, FSDP2 (``fully_shard``) modules a
compressed ``ReduceScatter`` each, FSDP1 a comm hook. The codec is built first, so
a bad spec raises ``SpecError`` here, before training starts.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from gradzip.codecs.chain import Codec
from gradzip.comm.ddp import (
    START_ITERATION,
    START_ITERATION_STATIC_GRAPH,
    DDPCommState,
    build_codec,
    gradzip_hook,
)
from gradzip.comm.fsdp import CommCache, CompressedReduceScatter, FSDP1CommState, fsdp1_hook
from gradzip.comm.reducer import Reducer
from gradzip.comm.stats import CommStats


class Handle:
    """What ``attach`` returns: the codec, its stats, checkpointable state."""

    def __init__(self, kind: str, codec: Codec, stats: CommStats,
                 ddp_state: DDPCommState | None = None) -> None:
        self.kind = kind  # "ddp", "fsdp2" or "fsdp1"
        self.codec = codec
        self.stats = stats
        self._ddp_state = ddp_state

    def state_dict(self) -> dict[str, Any]:
        """Codec state of this rank (EF residuals, PowerSGD Q, momentum)."""
        return {"kind": self.kind, "codec": self.codec.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != self.kind:
            raise ValueError(f"comm state was saved for {sd.get('kind')!r}, this is {self.kind!r}")
        self.codec.load_state_dict(sd["codec"])

    def close(self) -> None:
        """Stop the communication thread (DDP); the hook must not run afterwards."""
        if self._ddp_state is not None:
            self._ddp_state.close()

    def __repr__(self) -> str:
        return f"gradzip.comm.Handle({self.kind}, {str(self.codec)!r})"


def attach(
    model: nn.Module,
    spec: str | Codec,
    *,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
    diagnose: bool = False,
    nonfinite: str = "error",
) -> Handle:
    """Compress ``model``'s gradient communication with ``spec``; returns a ``Handle``.

    ``model`` is a ``DistributedDataParallel`` module, a ``fully_shard``-ed (FSDP2)
    module, or a ``FullyShardedDataParallel`` (FSDP1) root. Call on every rank.
    ``diagnose`` also computes the exact mean gradient each reduction (an extra fp32
    all-reduce, reported apart from ``bytes_wire``) for ``grad_rel_error``/``grad_cos_sim``.
    """
    codec = build_codec(spec, seed=seed, nonfinite=nonfinite)  # SpecError before anything
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gradzip.attach needs torch.distributed initialized")
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    group: dist.ProcessGroup | None  # None: the default group
    if isinstance(model, DistributedDataParallel):
        group = process_group if process_group is not None else model.process_group
        start = START_ITERATION_STATIC_GRAPH if model.static_graph else START_ITERATION
        state = DDPCommState(codec, group, diagnose=diagnose, start_iteration=start)
        model.register_comm_hook(state, gradzip_hook)
        return Handle("ddp", codec, state.stats, ddp_state=state)
    if isinstance(model, FullyShardedDataParallel):
        stats = CommStats()
        group = process_group if process_group is not None else model.process_group
        fstate = FSDP1CommState(Reducer(codec, stats, diagnose), group)
        model.register_comm_hook(fstate, fsdp1_hook)
        return Handle("fsdp1", codec, stats)
    if isinstance(model, FSDPModule):
        stats = CommStats()
        reducer = Reducer(codec, stats, diagnose)
        comms = CommCache()
        units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        for index, (name, module) in enumerate(units):
            try:
                module.set_custom_reduce_scatter(
                    CompressedReduceScatter(reducer, comms, key=f"fsdp2/{index}"))
            except ValueError as e:
                raise ValueError(
                    f"cannot compress FSDP2 module {name or '<root>'!r}: {e} "
                    "Use one param group per fully_shard call (no per-parameter "
                    "shard_placement_fn mesh), or wrap those parameters separately."
                ) from e
        return Handle("fsdp2", codec, stats)
    raise TypeError(
        f"gradzip.attach expects a DistributedDataParallel, fully_shard (FSDP2) or "
        f"FullyShardedDataParallel (FSDP1) model, got {type(model).__name__}"
    )
