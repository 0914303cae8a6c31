"""The hierarchical mean over simulated nodes: 2 nodes x 2 ranks and 3 x 2, one process.

Rank r = node * L + local. Node groups hold a node's ranks, cross groups the same local
rank of every node; each counts its own bytes, the intra-node and the inter-node link.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import gradzip
from gradzip.aggregation.hierarchical import hierarchical_mean
from gradzip.collectives import simulated_group


def _run(nodes: int, local: int, spec: str, xs: list[torch.Tensor], steps: int = 1
         ) -> list[tuple[torch.Tensor, int, int]]:
    node_groups = [simulated_group(local) for _ in range(nodes)]
    cross_groups = [simulated_group(nodes) for _ in range(local)]
    codecs = [gradzip.codec(spec, rank=r) for r in range(nodes * local)]

    def work(rank: int) -> tuple[torch.Tensor, int, int]:
        n, j = divmod(rank, local)
        node, cross = node_groups[n][j], cross_groups[j][n]
        out = xs[rank]
        for _ in range(steps):
            out = hierarchical_mean(codecs[rank], xs[rank], "b", node, cross)
        return out, node.counter.total_wire, cross.counter.total_wire

    with ThreadPoolExecutor(nodes * local) as pool:
        return list(pool.map(work, range(nodes * local)))


def _inputs(world: int, n: int = 1001) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]


@pytest.mark.parametrize("nodes, local", [(2, 2), (3, 2), (2, 3)])
def test_the_uncompressed_hierarchy_is_the_mean(nodes: int, local: int) -> None:
    xs = _inputs(nodes * local)
    truth = torch.stack(xs).mean(0)
    for out, _, _ in _run(nodes, local, "none", xs):
        torch.testing.assert_close(out, truth, rtol=0, atol=1e-6)


def test_only_the_chunk_crosses_nodes_and_through_the_codec() -> None:
    """Each rank sends 1/L of the tensor between nodes: int8 cuts the inter-node bytes
    about 4x against none, and the intra-node bytes stay those of none."""
    xs = _inputs(4, 4096)
    plain = _run(2, 2, "none", xs)
    int8 = _run(2, 2, "int8", xs)
    truth = torch.stack(xs).mean(0)
    for (out, node_b, cross_b), (_, node_plain, cross_plain) in zip(int8, plain, strict=True):
        assert node_b == node_plain > 0
        assert cross_plain / cross_b > 3.5
        assert float((out - truth).norm() / truth.norm()) < 0.02
        # a ring over all 4 ranks would send 2 (W-1)/W x 16 KiB per rank; the chunk
        # between 2 nodes is 2 (N-1)/N x 8 KiB
        assert cross_plain == 4096 * 4 // 2


def test_error_feedback_lives_with_each_chunk() -> None:
    xs = _inputs(4, 512)
    outs = _run(2, 2, "ef | topk(ratio=0.1)", xs, steps=2)
    truth = torch.stack(xs).mean(0)
    assert all(torch.isfinite(o).all() for o, _, _ in outs)
    # every rank ends with the same mean (the all-gather shares the chunks)
    for o, _, _ in outs[1:]:
        assert torch.equal(o, outs[0][0])
    assert float((outs[0][0] - truth).norm() / truth.norm()) < 1.0
