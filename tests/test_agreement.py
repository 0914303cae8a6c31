"""The cross-rank agreement check: exact, cheap, and every rank gets the same verdict."""

import pytest
import torch

from gradzip.collectives import run_simulated
from gradzip.collectives.agreement import (
    CHECK_BYTES,
    StateDivergenceError,
    check_same_on_all_ranks,
    fingerprint,
)


def test_fingerprint_sees_every_bit_dtype_and_shape():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[57] = torch.nextafter(y[57], torch.tensor(float("inf")))  # one ulp
    assert fingerprint(x) == fingerprint(x.clone())
    assert fingerprint(x) != fingerprint(y)
    assert fingerprint(x) != fingerprint(x.view(10, 10))
    assert fingerprint(torch.arange(4)) != fingerprint(torch.arange(4, dtype=torch.int32))
    assert 0 <= fingerprint(x) < 2**62


def _check(values_by_rank):
    def work(rank, comm):
        try:
            check_same_on_all_ranks(comm, values_by_rank[rank], "demo", "thing", "k")
            return None, comm.counter.handed["all_reduce"]
        except StateDivergenceError as e:
            return str(e), comm.counter.handed["all_reduce"]

    return run_simulated(len(values_by_rank), work)


def test_identical_state_passes_for_sixteen_bytes():
    t = torch.arange(10)
    assert _check([t, t.clone(), t.clone()]) == [(None, CHECK_BYTES)] * 3


@pytest.mark.parametrize("odd", [0, 2])
def test_one_differing_rank_makes_every_rank_raise(odd):
    ts = [torch.arange(10) for _ in range(3)]
    ts[odd][4] = 99
    results = _check(ts)
    for message, nbytes in results:
        assert message is not None and "demo: the thing for key 'k' differs" in message
        assert nbytes == CHECK_BYTES


def test_one_rank_needs_no_check():
    assert _check([torch.arange(3)]) == [(None, 0)]
