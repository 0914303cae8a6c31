"""Hierarchical mean for nodes of several ranks: compress only between nodes.

Inside a node the links are fast (NVLink, or one host's memory); between nodes the
network is slow. Every rank's tensor is cut into one chunk per rank of its node:

1. within the node, a reduce-scatter (uncompressed) gives each local rank its chunk's
   mean over the node;
2. across nodes, each local rank averages its chunk with the same local rank of every
   other node through the codec (``reduce``: the codec's own path, its error feedback
   keyed per chunk, ``{key}/chunk{j}``), so only 1/L of the tensor crosses per rank;
3. within the node, an all-gather of the chunks gives every rank the whole mean.

The node mean (divided by L) and the cross-node mean (divided by N) make the mean over
all N x L ranks. ``node`` and ``cross`` are the two communicators (each counts its own
bytes: the intra-node and the inter-node link).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradzip.aggregation.layout import chunk_bounds, piece_shapes
from gradzip.aggregation.reduce import reduce
from gradzip.codecs.base import Shapes
from gradzip.codecs.chain import Codec
from gradzip.collectives.communicator import Communicator


def scatter_within(x: torch.Tensor, node: Communicator) -> tuple[torch.Tensor, list[int]]:
    """Step 1: this local rank's chunk of the node mean of flat ``x``, and the chunk
    bounds (the chunks are padded to the largest for the collective)."""
    flat = x.reshape(-1)
    local = node.world_size
    bounds = chunk_bounds(flat.numel(), local)
    width = bounds[1] - bounds[0]
    rows = torch.zeros(local, width, dtype=flat.dtype, device=flat.device)
    for j in range(local):
        rows[j, :bounds[j + 1] - bounds[j]] = flat[bounds[j]:bounds[j + 1]]
    mine = node.reduce_scatter_sum(rows.div_(local)) if local > 1 else rows[0]
    size = bounds[node.rank + 1] - bounds[node.rank]
    return mine[:size], bounds


def gather_within(chunk: torch.Tensor, bounds: list[int], node: Communicator,
                  like: torch.Tensor) -> torch.Tensor:
    """Step 3: every local rank's chunk, back in one tensor shaped like ``like``."""
    if node.world_size == 1:
        return chunk.reshape(like.shape).to(like.dtype)
    width = bounds[1] - bounds[0]
    padded = torch.zeros(width, dtype=chunk.dtype, device=chunk.device)
    padded[:chunk.numel()] = chunk
    parts = node.all_gather(padded)
    flat = torch.cat([p[:bounds[j + 1] - bounds[j]] for j, p in enumerate(parts)])
    return flat.reshape(like.shape).to(like.dtype)


#: the reduction across nodes of one chunk: (chunk, key, shapes) -> its mean
Across = Callable[[torch.Tensor, str, Shapes | None], torch.Tensor]


def hierarchical_mean(codec: Codec, x: torch.Tensor, key: str, node: Communicator,
                      cross: Communicator, shapes: Shapes | None = None,
                      across: Across | None = None) -> torch.Tensor:
    """The mean of ``x`` over every rank of every node, compressed between nodes only.

    ``across`` replaces step 2's ``reduce`` through ``codec`` over ``cross`` (the hooks
    pass their reducer's, which also records what the step cost)."""
    piece, bounds = scatter_within(x, node)
    mine = piece_shapes(shapes, bounds[node.rank], bounds[node.rank + 1])
    chunk_key = f"{key}/chunk{node.rank}"
    if across is None:
        mean = reduce(codec, piece, chunk_key, cross, shapes=mine)[0]
    else:
        mean = across(piece, chunk_key, mine)
    return gather_within(mean, bounds, node, x)
