"""The process groups gradzip makes for itself: a private copy of a DDP model's group,
and the node and cross-node groups of a hierarchical reduction inside it.

``new_group`` is collective over the world and every rank must create every group in
the same order, even groups it is not in. When a DDP model's group is a subgroup (several
DDP replicas side by side), no rank knows the other replicas' groups, so one exchange
(``rank_sets``) tells every rank every replica's ranks; a group spanning the world needs
no exchange. All of a rank's groups are made inside that rank's DDP group: a
hierarchical reduction never averages over, or waits on, ranks outside it.

Nodes inside a group: torchrun numbers the ranks of a node consecutively, so with
``node_size`` ranks per node, the group's sorted ranks ``g`` form nodes
``g[n*L:(n+1)*L]``, and the cross-node group of local rank j is ``g[j::L]``: one rank of
every node. The ranks' host names are exchanged once (``node_groups``), and a node whose
ranks sit on two machines is refused (``check_hosts``): its uncompressed "intra-node" link
would cross the network.

Every group gradzip makes waits as long as the world's group (``new_group``): torch's own
``new_group`` takes its 30-minute default instead, so a run started with a 3 s timeout hung
for 30 minutes in the private group's collective when its link went down.

NCCL's object collectives stage through ``torch.cuda.current_device()``; a script that
never calls ``torch.cuda.set_device`` would run every rank's exchange on cuda:0.
``on_device`` makes the model's device current while attaching.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def world_timeout() -> timedelta | None:
    """How long a collective of the world's group may take before it fails (the
    ``timeout`` it was started with), or None where the backend does not say."""
    world = dist.group.WORLD
    if world is None:
        return None
    for device in ("cuda", "cpu"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):  # no backend for that device here
            continue
    return None


def new_group(ranks: list[int], backend: str | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` with the world's timeout (torch's gives every new group its
    30-minute default, whatever the world was started with). Collective over the world."""
    return dist.new_group(ranks=ranks, backend=backend, timeout=world_timeout())


def ranks_of(process_group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The sorted global ranks of ``process_group`` (None: the world)."""
    if process_group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(process_group)))


def rank_sets(process_group: dist.ProcessGroup | None) -> list[tuple[int, ...]]:
    """Every distinct rank set that the ranks' ``process_group`` arguments name, in one
    order on every rank (collective over the world: every rank must call it).

    The groups of DDP replicas partition the world, so a group of the whole world is
    every rank's group and needs no exchange; a subgroup is exchanged with
    ``all_gather_object`` (on NCCL, on the current device: see ``on_device``).
    """
    mine = ranks_of(process_group)
    if len(mine) == dist.get_world_size():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return list(dict.fromkeys(tuple(r) for r in everyone))


def private_group(process_group: dist.ProcessGroup | None,
                  backend: str | None = None,
                  sets: list[tuple[int, ...]] | None = None) -> dist.ProcessGroup:
    """A new process group with the ranks of ``process_group`` (None = world), on
    ``backend`` (default: the default group's); ``sets``: ``rank_sets`` already
    exchanged. Collective over the world, in the same order on every rank."""
    mine = ranks_of(process_group)
    found = None
    for ranks in sets if sets is not None else rank_sets(process_group):
        group = new_group(list(ranks), backend)
        if ranks == mine:
            found = group
    assert found is not None
    return found


def node_layout(ranks: int | tuple[int, ...],
                node_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ranks of each node, the ranks of each cross-node group) of a group's ranks
    (an int n: ranks 0..n-1)."""
    members = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
    if node_size < 1 or len(members) % node_size:
        raise ValueError(f"node_size {node_size} must divide the group's size "
                         f"{len(members)} (ranks per node, as torchrun's "
                         "LOCAL_WORLD_SIZE)")
    nodes = [members[n:n + node_size] for n in range(0, len(members), node_size)]
    cross = [members[j::node_size] for j in range(node_size)]
    return nodes, cross


def check_hosts(nodes: list[list[int]], hosts: list[str], node_size: int) -> None:
    """Refuse a layout that puts ranks of two machines in one node (``hosts[r]``: rank
    r's host name): its "intra-node" link would cross the network uncompressed. Ranks
    numbered otherwise than torchrun numbers them, or a ``node_size`` that is not the
    ranks per machine, would do that."""
    for members in nodes:
        names = sorted({hosts[r] for r in members})
        if len(names) > 1:
            raise ValueError(
                f"node_size={node_size} puts ranks {members} in one node, but they run on "
                f"{', '.join(names)}: pass the number of this group's ranks on each "
                "machine (torchrun's LOCAL_WORLD_SIZE for a group of the whole world), "
                "with ranks numbered machine by machine as torchrun does")


def node_groups(node_size: int, process_group: dist.ProcessGroup | None = None,
                sets: list[tuple[int, ...]] | None = None,
                ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's node group and cross-node group inside ``process_group`` (None: the
    world); ``sets``: ``rank_sets`` already exchanged. Collective over the world; the
    ranks' host names are exchanged once and every node must sit on one host."""
    rank = dist.get_rank()
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    mine_node = mine_cross = None
    for ranks in sets if sets is not None else rank_sets(process_group):
        nodes, cross = node_layout(ranks, node_size)
        check_hosts(nodes, hosts, node_size)
        for members in nodes:
            group = new_group(members)
            mine_node = group if rank in members else mine_node
        for members in cross:
            group = new_group(members)
            mine_cross = group if rank in members else mine_cross
    assert mine_node is not None and mine_cross is not None
    return mine_node, mine_cross


@contextlib.contextmanager
def on_device(model: nn.Module) -> Iterator[None]:
    """Make the CUDA device of ``model``'s parameters current for the block (NCCL's
    object collectives and barriers use the current device); elsewhere nothing."""
    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield
