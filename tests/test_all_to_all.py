"""``TorchCommunicator.all_to_all`` rides on ``all_to_all_single``, which every backend
has: gloo's list ``all_to_all`` is missing from torch 2.11 ("Backend gloo does not
support alltoall", found on an H200), so it must not be needed."""

from __future__ import annotations

import pytest
import torch

from gradzip.comm.launch import run_ranks

pytestmark = pytest.mark.dist


def _exchange(rank: int, world: int) -> list[list[float]]:
    import torch.distributed as dist

    from gradzip.comm.communicator import TorchCommunicator

    def missing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Backend gloo does not support alltoall")

    dist.all_to_all = missing  # as on torch 2.11's gloo
    comm = TorchCommunicator()
    with pytest.raises(ValueError, match="one shape and dtype"):  # refused before sending
        comm.all_to_all([torch.zeros(j + 1) for j in range(world)])
    # chunk j goes to rank j: its values say who sent it to whom
    chunks = [torch.full((3, 2), float(10 * rank + j)) for j in range(world)]
    got = comm.all_to_all(chunks)
    assert [tuple(t.shape) for t in got] == [(3, 2)] * world
    return [t.reshape(-1).tolist() for t in got]


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_works_without_the_list_collective(world: int) -> None:
    received = run_ranks(_exchange, world, world, timeout=120.0)
    for rank, parts in enumerate(received):
        assert parts == [[float(10 * j + rank)] * 6 for j in range(world)]
