"""Sketched-SGD (Ivkin et al. 2019): linear sketches, exact two-round heavy hitters."""

import pytest
import torch

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import Payload, PayloadError, SpecError
from gradzip.codecs.sketch import _median, _top, count_sketch, estimate
from gradzip.collectives import run_simulated
from gradzip.collectives.agreement import CHECK_BYTES, StateDivergenceError

N = 20_000
SPEC = "sketch(ratio=0.0005)"  # k = 10, a 5 x 120 sketch, 40 candidates
HEAVY = torch.tensor([3, 150, 2024, 4999, 7777, 10_000, 12_345, 15_000, 18_181, 19_999])


def noisy(seed, n=N, scale=0.01):
    return scale * torch.randn(n, generator=torch.Generator().manual_seed(seed))


def planted(seed):
    x = noisy(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    x[HEAVY] = (20 + 10 * torch.rand(len(HEAVY), generator=g)) * torch.where(
        torch.arange(len(HEAVY)) % 2 == 0, 1.0, -1.0)
    return x


def test_count_sketch_is_linear():
    a, b = noisy(1, 5000, 1.0), noisy(2, 5000, 1.0)
    sa, sb = count_sketch(a, 5, 64, seed=9), count_sketch(b, 5, 64, seed=9)
    torch.testing.assert_close(sa + sb, count_sketch(a + b, 5, 64, seed=9), rtol=1e-5, atol=1e-4)
    # and a lone coordinate is estimated exactly (no collisions)
    e = torch.zeros(5000)
    e[1234] = -3.5
    assert float(estimate(count_sketch(e, 3, 16, seed=4), 5000, seed=4)[1234]) == -3.5


def test_payload_sketches_from_different_ranks_sum():
    """Shared seed: every rank hashes alike, so the payload tables of two ranks sum."""
    a, b = planted(1), planted(2)
    pa = gradzip.codec(SPEC, rank=0).encode(a, key="w")
    pb = gradzip.codec(SPEC, rank=1).encode(b, key="w")
    assert pa.int("seed") == pb.int("seed")
    pab = gradzip.codec(SPEC, rank=2).encode(a + b, key="w")
    torch.testing.assert_close(pa.tensor("table") + pb.tensor("table"), pab.tensor("table"),
                               rtol=1e-5, atol=1e-4)


def test_standalone_decode_unsketches_the_heavy_hitters():
    """A sketch wide enough for one round alone: top-k of the median estimates."""
    c = gradzip.codec("sketch(ratio=0.0005, rows=7, width=32)")
    x = planted(3)
    p = c.encode(x, key="w")
    assert p.tensor("table").shape == (7, 320)
    assert 7 * 320 * 4 <= p.wire_bytes < 7 * 320 * 4 + 64  # table + seed + headers
    y = c.decode(Payload.deserialize(p.serialize()))
    assert torch.equal(y.nonzero().flatten(), HEAVY)
    torch.testing.assert_close(y[HEAVY], x[HEAVY], rtol=0, atol=0.5)  # estimates, not exact


def test_one_round_top_k_is_fooled_where_the_candidate_round_is_not():
    """Why the paper queries P·k candidates: at the default width, coordinates that meet
    heavy hitters in most rows get large estimates and displace true ones from the top k,
    but the true ones are still among the top P·k, which the exact round then sorts out."""
    c = gradzip.codec(SPEC)
    x = planted(3)
    p = c.encode(x, key="w")
    one_round = set(c.decode(p).nonzero().flatten().tolist())
    assert one_round != set(HEAVY.tolist())
    est = estimate(p.tensor("table"), N, p.int("seed"))
    candidates = set(torch.topk(est.abs(), 40).indices.tolist())
    assert set(HEAVY.tolist()) <= candidates


def _reduce_all(spec, xs_by_step, world):
    def work(rank, comm):
        c = gradzip.codec(spec, rank=rank)
        out = []
        for xs in xs_by_step:
            before = comm.counter.handed["all_reduce"]
            mean, local = reduce(c, xs[rank], "w", comm, want_local=True)
            out.append((mean, local, comm.counter.handed["all_reduce"] - before))
        return out, c

    return run_simulated(world, work)


def test_two_round_reduce_recovers_planted_heavy_hitters_exactly():
    xs = [planted(r) for r in range(3)]
    # a coordinate that is heavy on two ranks but cancels in the sum must not win
    xs[0][6000], xs[1][6000] = 80.0, -80.0
    results = _reduce_all(SPEC, [xs], 3)
    exact = (xs[0][HEAVY] + xs[1][HEAVY] + xs[2][HEAVY]) / 3
    for rank, (out, _) in enumerate(results):
        mean, local, nbytes = out[0]
        assert torch.equal(mean.nonzero().flatten(), HEAVY)
        torch.testing.assert_close(mean[HEAVY], exact, rtol=1e-6, atol=0)
        # the local estimate: this rank's exact values where the update was applied
        want = torch.zeros(N)
        want[HEAVY] = xs[rank][HEAVY]
        assert torch.equal(local, want)
        # the sketch, the candidate set's fingerprint check, the candidates' values
        assert nbytes == (5 * 120 + 40) * 4 + CHECK_BYTES


def test_error_feedback_accumulates_what_was_not_sent():
    """``ef | sketch``: coordinates not selected build up until they are heavy, none lost."""
    steps = [[noisy(10 * t + r, 4000, 1.0) for r in range(2)] for t in range(8)]

    def work(rank, comm):
        c = gradzip.codec("ef | sketch(ratio=0.01, width=4)", rank=rank)
        sent = torch.zeros(4000)
        for xs in steps:
            sent += reduce(c, xs[rank], "w", comm)[0]
        return sent, c.state.slot(0, "w").data["residual"]

    results = run_simulated(2, work)
    total = sum(sum(xs) for xs in steps) / 2
    mean_residual = sum(r for _, r in results) / 2
    torch.testing.assert_close(results[0][0] + mean_residual, total, rtol=1e-5, atol=1e-4)
    assert int((results[0][0] != 0).sum()) <= 8 * 40


@pytest.mark.parametrize("shape", [(), (0,), (5,), (7, 8)])
def test_small_tensors_go_uncompressed(shape):
    x = torch.randn(shape)
    c = gradzip.codec("sketch")
    p = c.encode(x, key="w")
    assert set(p.fields) == {"values"} and torch.equal(c.decode(p), x)
    results = _reduce_all("sketch", [[x, 2 * x]], 2)
    torch.testing.assert_close(results[0][0][0][0], 1.5 * x)


@pytest.mark.parametrize("spec", ["sketch(ratio=0)", "sketch(ratio=1.5)", "sketch(rows=0)",
                                  "sketch(width=0)", "sketch(width=inf)", "sketch(candidates=0)",
                                  "sketch(cols=3)"])
def test_bad_params_are_spec_errors(spec):
    with pytest.raises(SpecError, match="sketch"):
        gradzip.codec(spec)


def test_flags_spec_and_bad_payload():
    c = gradzip.codec("sketch(ratio=0.001, rows=3, width=8.0, candidates=2)")
    assert c.multi_round and not c.summable and not c.unbiased
    assert str(gradzip.codec(str(c))) == str(c)
    p = gradzip.codec(SPEC).encode(planted(0), key="w")
    with pytest.raises(PayloadError, match="sketch"):
        c.decode(p)  # a table of another configuration


@pytest.mark.parametrize("kind", ["heavy", "sorted", "ties"])
def test_fast_top_k_selection_is_exact(kind):
    """The sampled-threshold top-k picks the same magnitudes as a full ``torch.topk``."""
    n, k = (1 << 20) + 3, 500
    g = torch.Generator().manual_seed(0)
    v = {"heavy": torch.randn(n, generator=g) * torch.randn(n, generator=g).exp(),
         "sorted": -torch.arange(n, dtype=torch.float32),
         "ties": torch.ones(n).index_fill_(0, torch.arange(0, n, 7), 2.0)}[kind]
    got = _top(v, k)
    want = torch.topk(v.abs(), k).indices
    assert got.numel() == k and torch.equal(got, got.unique())  # sorted, distinct
    assert torch.equal(v.abs()[got].sort().values, v.abs()[want].sort().values)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7])
def test_pruned_median_network_matches_torch_median(rows):
    x = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows)).round(decimals=1)
    assert torch.equal(_median(list(x)), x.median(dim=0).values)


# ---------------------------------------------------------------- ranks must agree
def test_ranks_whose_candidate_sets_differ_fail_loudly():
    """A rank with another hash seed estimates other candidates: an error, not wrong sums."""
    xs = [planted(r) for r in range(2)]

    def work(rank, comm):
        c = gradzip.codec(SPEC, rank=rank, seed=rank)  # misconfigured: seeds differ
        return reduce(c, xs[rank], "w", comm)

    with pytest.raises(StateDivergenceError, match="sketch.*candidate set for key 'w'"):
        run_simulated(2, work)


def test_agreeing_ranks_pass_the_check_every_step():
    xs = [planted(r) for r in range(2)]
    results = _reduce_all(SPEC, [xs, xs], 2)  # two steps, same seed on both ranks
    for out, _ in results:
        assert [torch.equal(out[t][0], results[0][0][t][0]) for t in (0, 1)] == [True, True]
