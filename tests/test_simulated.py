import pytest
import torch

from gradzip.collectives import run_simulated


def test_collectives_and_byte_counts():
    def work(rank, comm):
        s = comm.all_reduce([torch.tensor([rank + 1.0, 2.0])])[0]
        m = comm.all_reduce([torch.tensor([float(rank)])], op="max")[0]
        g = comm.all_gather_bytes(torch.arange(rank + 1, dtype=torch.uint8))
        chunks = [torch.full((rank + dst,), dst, dtype=torch.uint8) for dst in range(3)]
        a = comm.all_to_all_bytes(chunks)
        return s, m, g, a, dict(comm.counter.handed)

    out = run_simulated(3, work)
    for rank, (s, m, g, a, counted) in enumerate(out):
        assert s.tolist() == [6.0, 6.0] and m.tolist() == [2.0]
        assert [x.tolist() for x in g] == [[0], [0, 1], [0, 1, 2]]
        assert [x.tolist() for x in a] == [[rank] * (src + rank) for src in range(3)]
        # all_reduce: 8 + 4 bytes; all_gather: sizes (8) + padded 3, then a2a sizes (24)
        assert counted["all_reduce"] == 12
        assert counted["all_gather"] == 8 + 3 + 24
        assert counted["all_to_all"] == 4 * 3  # padded to the longest chunk (2+2)


def test_worker_error_is_raised_not_hung():
    def work(rank, comm):
        if rank == 1:
            raise RuntimeError("boom")
        comm.all_reduce([torch.ones(1)])

    with pytest.raises(RuntimeError, match="boom"):
        run_simulated(2, work)
