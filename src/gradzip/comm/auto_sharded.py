"""``auto`` on FSDP2 and on HSDP's replicate link (``comm/auto.py`` says how it decides).

FSDP2 reduces each ``fully_shard`` unit on its own, through the unit's custom
reduce-scatter (``fsdp.CompressedReduceScatter``) and, under gradzip's HSDP, its
all-reduce hook (``hsdp.ReplicateReduce``). Under ``auto`` the link it chooses for hands
each unit's reduction to a ``RoutedReducer``: the reducer of the candidate the controller
runs this step. FSDP2 reduces every unit once per synchronized step, so a step begins
when a unit reduces again; that moves the controller on.

Which link is chosen for: on FSDP2 the reduce-scatter (the only link); on HSDP the
replicate link between nodes, the shard link inside a node staying plain (``none``).

A switch adds what the codec left behind holds for a unit to that unit's next
gradient: the reduce-scatter's residual of each destination chunk (``{key}/to{j}``,
scaled back to FSDP's input) or the replicate reduction's (``{key}``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradzip.codecs.base import Shapes
from gradzip.comm.auto import AutoCore, AutoOptions
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.fsdp import CommCache, CompressedReduceScatter, shard_shapes, unit_parameters
from gradzip.comm.hsdp import ReplicateReduce
from gradzip.comm.reducer import Reducer
from gradzip.comm.stats import CommStats


class ShardedAuto(AutoCore):
    """``auto``'s state on an FSDP2 model: the core, the stats, and the key of each
    reduction seen in the step that runs (a key seen again begins the next step)."""

    def __init__(self, options: AutoOptions, process_group: dist.ProcessGroup | None,
                 *, seed: int, nonfinite: str, hsdp: bool) -> None:
        links: dict[str, str | None] = ({"shard": "none", "replicate": None} if hsdp
                                        else {"all": None})
        super().__init__(options, process_group, seed=seed, nonfinite=nonfinite,
                         links=links)
        self.stats = CommStats()
        self._keys: set[str] = set()

    def enter(self, key: str) -> int:
        """The candidate that reduces ``key`` now (a repeated key begins a step)."""
        if not self._keys or key in self._keys:
            self._keys = set()
            self.next_step()
        self._keys.add(key)
        return self.current

    def close(self) -> None:
        """Nothing runs apart from FSDP's own reductions."""


class RoutedReducer:
    """A ``Reducer`` to FSDP2's callers: each reduction through the reducer of the
    candidate running this step, after the residual a switch left behind."""

    def __init__(self, auto: ShardedAuto, reducers: list[Reducer]) -> None:
        self.auto = auto
        self.reducers = reducers

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, comm: TorchCommunicator,
                       key: str, divisor: float = 1.0, factor: float = 1.0,
                       plain: bool = False, shapes: Shapes | None = None) -> None:
        index = self.auto.enter(key)
        world, n = comm.world_size, out.numel()
        chunks = inp.detach().view(world, n)
        for j in range(world):  # the residual was taken after FSDP's scaling
            residual = self.auto.take_residual(f"{key}/to{j}", n)
            if residual is not None:
                chunks[j].add_(residual.to(chunks) * (divisor / factor))
        self.reducers[index].reduce_scatter(inp, out, comm, key, divisor=divisor,
                                            factor=factor, plain=plain, shapes=shapes)

    def reduce_mean(self, x: torch.Tensor, key: str, comm: TorchCommunicator,
                    shapes: Shapes | None = None) -> torch.Tensor:
        index = self.auto.enter(key)
        residual = self.auto.take_residual(key, x.numel())
        if residual is not None:
            x.view(-1).add_(residual.to(x))
        return self.reducers[index].reduce_mean(x, key, comm, shapes=shapes)

    def reduce_plain(self, x: torch.Tensor, comm: TorchCommunicator) -> torch.Tensor:
        return self.reducers[self.auto.current].reduce_plain(x, comm)


def attach_sharded(model: nn.Module, options: AutoOptions, *, seed: int, nonfinite: str,
                   diagnose: bool, replicate_group: dist.ProcessGroup | None) -> Any:
    """Install ``auto`` on every ``fully_shard`` unit of ``model``: on its reduce-scatter
    (FSDP2), or on its replicate reduction with the shard link plain (HSDP, given
    ``replicate_group``); the ``AutoHandle``."""
    from torch.distributed.fsdp import FSDPModule

    from gradzip.comm.attach import refuse_flat, refuse_native_hsdp
    from gradzip.comm.auto import AutoHandle
    from gradzip.comm.ddp import build_codec

    hsdp = replicate_group is not None
    # agreed over every rank: the ranks of a replicate group and of a shard group alike
    auto = ShardedAuto(options, None, seed=seed, nonfinite=nonfinite, hsdp=hsdp)
    refuse_flat(auto.codecs, "FSDP2")
    link = "replicate" if hsdp else ""
    routed = RoutedReducer(auto, [Reducer(c, auto.stats, diagnose, link=link)
                                  for c in auto.codecs])
    plain = Reducer(build_codec("none", seed=seed, nonfinite=nonfinite), auto.stats,
                    diagnose, link="shard")
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    refuse_native_hsdp([cast(nn.Module, unit) for _, unit in units])
    comms, replicate_comm = CommCache(), TorchCommunicator(replicate_group)
    names = {id(p): name for name, p in model.named_parameters()}
    for index, (_, unit) in enumerate(units):
        module = cast(nn.Module, unit)
        shapes = shard_shapes(module)
        unit.set_custom_reduce_scatter(CompressedReduceScatter(
            plain if hsdp else cast(Reducer, routed), comms, key=f"fsdp2/{index}",
            shapes=shapes, index=index,
            names=[names[id(p)] for p in unit_parameters(module)]))
        if hsdp:
            unit.set_all_reduce_hook(ReplicateReduce(cast(Reducer, routed), replicate_comm,
                                                     key=f"hsdp/{index}", shapes=shapes))
    return AutoHandle(auto, kind="fsdp2")
