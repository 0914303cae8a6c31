"""Nodes of several ranks: the process groups of a hierarchical reduction.

torchrun numbers the ranks of a node consecutively (``LOCAL_WORLD_SIZE`` per node), so
with ``node_size`` ranks per node, node n holds ranks ``[n * L, (n + 1) * L)`` and the
cross-node group of local rank j holds ranks ``j, j + L, j + 2L, ...``: one rank of every
node. ``node_groups`` makes all of them (``new_group`` is collective over the world, in
the same order on every rank) and returns this rank's two.
"""

from __future__ import annotations

import torch.distributed as dist


def node_layout(world: int, node_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ranks of each node, the ranks of each cross-node group)."""
    if node_size < 1 or world % node_size:
        raise ValueError(f"node_size {node_size} must divide the world size {world} "
                         "(ranks per node, as torchrun's LOCAL_WORLD_SIZE)")
    nodes = [list(range(n * node_size, (n + 1) * node_size)) for n in range(world // node_size)]
    cross = [list(range(j, world, node_size)) for j in range(node_size)]
    return nodes, cross


def node_groups(node_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's node group and cross-node group (collective: every rank calls it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes, cross = node_layout(world, node_size)
    mine_node = [dist.new_group(ranks) for ranks in nodes][rank // node_size]
    mine_cross = [dist.new_group(ranks) for ranks in cross][rank % node_size]
    return mine_node, mine_cross
