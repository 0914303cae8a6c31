"""topk, randomk, threshold and the shared sparse wire form (gradzip.codecs.indices)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import Payload, PayloadError, SpecError, indices, sparse
from gradzip.codecs.indices import Selection, index_dtype, sparse_decode, sparse_payload
from gradzip.codecs.sparse import EXACT_BELOW, random_positions, topk_positions
from gradzip.collectives import run_simulated


def heavy_tailed(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.randn(n, generator=g).exp()


def wire(c, x, key="w"):
    """Encode, serialize, deserialize, decode: what a peer would rebuild."""
    p = c.encode(x, key=key)
    return c.decode(Payload.deserialize(p.serialize())), p


@pytest.fixture(params=["numpy", "torch"])
def path(request, monkeypatch):
    """Run a test on the NumPy fast path and on the torch path other devices use."""
    monkeypatch.setattr(indices, "NUMPY_FAST", request.param == "numpy")
    return request.param


def assert_exact_topk(x, y, k):
    """y keeps exactly k entries of x, unchanged, and none dropped is larger."""
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    kept[flat_y != 0] = True
    assert torch.equal(flat_y[kept], flat_x[kept])
    # sort magnitudes: the k-th largest is the boundary
    mags = flat_x.abs().sort(descending=True).values
    boundary = mags[k - 1]
    assert int((flat_y != 0).sum()) == min(k, int((flat_x != 0).sum()))
    assert bool((flat_x.abs()[flat_y != 0] >= boundary).all())
    dropped = flat_x.abs()[flat_y == 0]
    if dropped.numel():
        assert float(dropped.max()) <= float(boundary)


# ---------------------------------------------------------------- topk
@given(
    n=st.integers(1, 3000),
    k=st.integers(1, 3000),
    levels=st.sampled_from([3, 50, 0]),
    seed=st.integers(0, 2**16),
)
def test_topk_keeps_exactly_the_k_largest(n, k, levels, seed):
    x = heavy_tailed(n, seed)
    if levels:  # few distinct magnitudes: many ties at the k-th value
        x = torch.round(x.clamp(-2, 2) * levels / 2) + 0.5
    c = gradzip.codec(f"topk(k={k})")
    y, p = wire(c, x)
    k_eff = min(k, n)
    assert p.tensor("values").numel() == (n if p.meta["sel"] == "dense" else k_eff)
    assert_exact_topk(x, y, k_eff)
    # ties at the boundary go to the lowest positions
    nz = (y != 0).nonzero().reshape(-1)
    boundary = float(x.abs().sort(descending=True).values[k_eff - 1])
    tie_pos = (x.abs() == boundary).nonzero().reshape(-1)
    kept_ties = [int(i) for i in tie_pos if int(i) in set(nz.tolist())]
    assert kept_ties == [int(i) for i in tie_pos[: len(kept_ties)]]


def test_topk_sampled_path_is_exact(path):
    """Above EXACT_BELOW entries the threshold comes from a sample; the result is still exact."""
    n = 3 * EXACT_BELOW + 17
    for ratio, seed in [(0.01, 1), (0.2, 2), (0.001, 3)]:
        x = heavy_tailed(n, seed)
        x[::7] = x[5]  # a big block of equal magnitudes
        k = round(ratio * n)
        positions = topk_positions(x, k, torch.Generator().manual_seed(seed))
        assert positions.numel() == k
        assert bool((positions[1:] > positions[:-1]).all())
        ref = torch.topk(x.abs(), k).values
        torch.testing.assert_close(x[positions].abs().sort().values, ref.sort().values)


def test_topk_fallback_when_estimate_too_high(monkeypatch):
    """If the sampled threshold selects too few candidates, topk still returns exact k."""
    monkeypatch.setattr(sparse, "SAMPLE", 64)  # a tiny sample: the estimate is often high
    n = EXACT_BELOW + 1000
    x = heavy_tailed(n, 5)
    for seed in range(20):
        positions = sparse.topk_positions(x, 5000, torch.Generator().manual_seed(seed))
        assert positions.numel() == 5000
        assert float(x[positions].abs().min()) >= float(x.abs().topk(5000).values.min())


def test_topk_delta_and_bitmap_forms_decode_exactly(path):
    x = heavy_tailed(4000, 7)
    sparse_y, sparse_p = wire(gradzip.codec("topk(ratio=0.01)"), x)
    dense_y, dense_p = wire(gradzip.codec("topk(ratio=0.3)"), x)
    assert sparse_p.meta["sel"] == "delta" and "deltas" in sparse_p.fields
    assert dense_p.meta["sel"] == "bitmap" and "bitmap" in dense_p.fields
    assert sparse_p.tensor("deltas").dtype == torch.int32
    assert dense_p.tensor("bitmap").numel() == math.ceil(4000 / 8)
    assert_exact_topk(x, sparse_y, 40)
    assert_exact_topk(x, dense_y, 1200)


@given(n=st.integers(0, 2000), density=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_every_form_decodes_the_same_selection(n, density, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) < density
    expected = torch.where(mask, x, torch.zeros(()))
    sizes = {}
    for form in ("delta", "bitmap", "dense"):
        p = sparse_payload(x, Selection(n, mask=mask.clone()), form=form)
        assert p.meta["sel"] == form
        sizes[form] = p.wire_bytes
        q = Payload.deserialize(p.serialize())
        assert torch.equal(sparse_decode(q, torch.Size([n])), expected), form
    # the encoder's own choice is the smallest on the wire
    auto = sparse_payload(x, Selection(n, mask=mask.clone()))
    assert auto.wire_bytes == min(sizes.values())


def test_dense_form_above_31_of_32():
    x = heavy_tailed(3200, 1)
    p = gradzip.codec("threshold(v=1e-9)").encode(x)  # keeps everything
    assert p.meta["sel"] == "dense" and set(p.fields) == {"values"}
    assert p.wire_bytes < 4 * 3200 + 64
    y, p = wire(gradzip.codec("topk(k=3150)"), x)  # 50 dropped: still dense
    assert p.meta["sel"] == "dense"
    assert_exact_topk(x, y, 3150)
    assert gradzip.codec("topk(k=3000)").encode(x).meta["sel"] == "bitmap"


def test_deltas_are_gaps_of_sorted_positions():
    x = torch.zeros(1000)  # 4 positions: 16 bytes of gaps beat 125 of bitmap
    x[[3, 4, 50, 99]] = torch.tensor([1.0, -2.0, 3.0, 4.0])
    p = gradzip.codec("topk(k=4)").encode(x)
    assert p.tensor("deltas").tolist() == [3, 1, 46, 49]
    assert p.tensor("values").tolist() == [1.0, -2.0, 3.0, 4.0]


@pytest.mark.parametrize("n", [0, 1, 1000, 3 * (1 << 16) + 5])
def test_scans_agree_with_plain_torch(path, n):
    x = heavy_tailed(n, n)
    for t in (0.0, 0.5, 3.0, 1e9):
        expected = (x.abs() >= t).nonzero().reshape(-1)
        assert torch.equal(indices.abs_ge(x, t), x.abs() >= t)
        assert torch.equal(indices.abs_ge_positions(x, t), expected)
        assert torch.equal(indices.flatnonzero(indices.abs_ge(x, t)), expected)
        mask = x.abs() >= t
        assert torch.equal(indices.unpackbits(indices.packbits(mask), n), mask)


def test_index_dtype_widens_only_past_int32():
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64


def test_corrupt_positions_are_payload_errors():
    x = heavy_tailed(1000, 3)
    p = gradzip.codec("topk(k=10)").encode(x)
    shape = torch.Size([1000])
    bad = Payload(dict(p.fields), dict(p.meta))
    bad.fields["deltas"] = p.tensor("deltas").clone()
    bad.fields["deltas"][-1] += 1000
    with pytest.raises(PayloadError, match="ascending positions"):
        sparse_decode(bad, shape)
    bad.fields["deltas"] = p.tensor("deltas")[:5]
    with pytest.raises(PayloadError, match="deltas must be"):
        sparse_decode(bad, shape)
    dense = sparse_payload(x, Selection(1000, indices=torch.arange(10)), form="bitmap")
    dense.fields["values"] = dense.tensor("values")[:9]
    with pytest.raises(PayloadError, match="bitmap marks 10"):
        sparse_decode(dense, shape)
    dense.meta["sel"] = "nope"
    with pytest.raises(PayloadError, match="'sel'"):
        sparse_decode(dense, shape)


def test_ef_topk_error_stays_bounded_and_sent_sum_tracks_input():
    """With error feedback nothing is lost, only delayed: sent + residual == inputs."""
    c = gradzip.codec("ef | topk(ratio=0.05)")
    sent, total = torch.zeros(500), torch.zeros(500)
    norms = []
    for step in range(200):
        g = heavy_tailed(500, step) + 0.1  # a bias that topk alone would never send
        total += g
        sent += c.decode(c.encode(g, key="w"))
        residual = c.state.slot(0, "w").data["residual"]
        torch.testing.assert_close(sent + residual, total, rtol=1e-4, atol=1e-3)
        norms.append(float(residual.norm()))
    # bounded: the residual does not grow with the number of steps, while the sum does
    assert max(norms[100:]) < 1.5 * max(norms[:100])
    assert norms[-1] < 0.1 * float(total.norm())


# ---------------------------------------------------------------- randomk
@given(n=st.integers(0, 5000), k=st.integers(0, 5000), seed=st.integers(0, 2**62))
def test_random_positions_are_k_distinct_sorted(n, k, seed):
    pos = random_positions(n, min(k, n), seed)
    assert pos.dtype == torch.int64 and pos.numel() == min(k, n)
    assert bool((pos[1:] > pos[:-1]).all()) and (pos.numel() == 0 or int(pos[-1]) < n)
    # regenerated from scratch (not the recent-positions cache): the same subset
    assert torch.equal(pos, sparse._random_positions(n, min(k, n), seed))


@pytest.mark.parametrize("n,k", [(20, 3), (20, 15), (300_000, 100_000)])
def test_random_positions_are_uniform(n, k):
    """Every position is picked with probability k/n.

    Covers the sparse path, the dense path (choose the n - k left out) and the large
    path whose surplus draws are dropped by drawing again instead of ``randperm``.
    """
    trials = 4000 if n < 1000 else 40
    counts = torch.zeros(n)
    for seed in range(trials):
        counts[random_positions(n, k, seed)] += 1
    if n < 1000:
        p = k / n
        sd = math.sqrt(trials * p * (1 - p))
        assert float((counts - trials * p).abs().max()) < 5 * sd
    else:  # too many cells for per-position counts: check a coarse histogram
        blocks = counts.view(100, -1).sum(1)
        expect = trials * k / 100
        assert float((blocks - expect).abs().max()) < 5 * math.sqrt(expect)


def test_randomk_indices_identical_across_ranks_and_summable():
    xs = [heavy_tailed(1000, r) for r in range(3)]

    def work(rank, comm):
        c = gradzip.codec("randomk(ratio=0.05)", rank=rank)
        p = c.encode(xs[rank], key="w")
        positions = (c.decode(p) != 0).nonzero().reshape(-1)
        c2 = gradzip.codec("randomk(ratio=0.05)", rank=rank)
        mean, _ = reduce(c2, xs[rank], "w", comm)
        return p.meta["seed"], positions, mean, comm.counter.total_handed

    out = run_simulated(3, work)
    assert len({seed for seed, *_ in out}) == 1
    for _, positions, _, _ in out[1:]:
        assert torch.equal(positions, out[0][1])
    positions = out[0][1]
    expected = torch.zeros(1000)
    expected[positions] = sum(x[positions] for x in xs) / 3
    for _, _, mean, nbytes in out:
        torch.testing.assert_close(mean, expected)
        assert nbytes == 4 * 50  # all-reduce of the values only: no indices travel


def test_randomk_decodes_in_a_fresh_process():
    """The decoder regenerates positions from the seed alone (no cache, no encoder state)."""
    x = heavy_tailed(5000, 8)
    c = gradzip.codec("randomk(ratio=0.02)")
    p = Payload.deserialize(c.encode(x, key="w").serialize())
    sparse._RECENT.clear()
    y = gradzip.codec("randomk(ratio=0.02)").decode(p)
    kept = y != 0
    assert int(kept.sum()) == 100 and torch.equal(y[kept], x[kept])


def test_randomk_refuses_a_payload_with_another_value_count():
    """Positions are regenerated for the number of values: a payload cut short, or one
    from another ratio, must not scatter its values to other places."""
    x = heavy_tailed(1000, 2)
    p = gradzip.codec("randomk(ratio=0.1)").encode(x, key="w")
    short = Payload({"values": p.tensor("values")[:-1]}, p.meta)
    with pytest.raises(PayloadError, match="keeps 100 of 1000"):
        gradzip.codec("randomk(ratio=0.1)").decode(short)
    with pytest.raises(PayloadError):
        gradzip.codec("randomk(ratio=0.2)").decode(p)


def test_randomk_changes_positions_every_step():
    c = gradzip.codec("randomk(ratio=0.1)")
    x = heavy_tailed(1000, 1)
    a = c.decode(c.encode(x, key="w")) != 0
    b = c.decode(c.encode(x, key="w")) != 0
    assert int(a.sum()) == int(b.sum()) == 100 and not torch.equal(a, b)


def test_randomk_scaled_is_unbiased_and_plain_is_not():
    scaled = gradzip.codec("randomk(ratio=0.2, scale=true)")
    plain = gradzip.codec("randomk(ratio=0.2)")
    assert scaled.unbiased and not plain.unbiased
    x = heavy_tailed(50, 4)
    trials = 1000
    mean_s, mean_p = torch.zeros(50), torch.zeros(50)
    for _ in range(trials):
        mean_s += scaled.decode(scaled.encode(x, key="w")) / trials
        mean_p += plain.decode(plain.encode(x, key="w")) / trials
    # per-entry std of the scaled estimator is |x| sqrt(d/k - 1) = 2|x|
    sd = 2 * x.abs() / math.sqrt(trials)
    assert bool(((mean_s - x).abs() <= 5 * sd + 1e-6).all())
    torch.testing.assert_close(mean_p, 0.2 * x, rtol=0.2, atol=0.2 * float(sd.max()) * 5)


# ---------------------------------------------------------------- threshold
@given(
    shape=st.lists(st.integers(0, 30), min_size=0, max_size=3),
    v=st.floats(0.01, 5.0),
    seed=st.integers(0, 2**16),
)
def test_threshold_keeps_exactly_at_least_v(shape, v, seed):
    n = math.prod(shape)
    x = heavy_tailed(n, seed).reshape(shape)
    if n:
        x.reshape(-1)[0] = v  # exactly v is kept
        x.reshape(-1)[-1] = -math.nextafter(v, 0)  # just below is not
    y, _ = wire(gradzip.codec(f"threshold(v={v!r})"), x)
    assert torch.equal(y, torch.where(x.abs() >= v, x, torch.zeros(())))


def test_threshold_paths_agree(monkeypatch):
    x = heavy_tailed(EXACT_BELOW * 2, 9)
    outs = []
    for fast in (True, False):
        monkeypatch.setattr(indices, "NUMPY_FAST", fast)
        for v in (0.5, 20.0):
            p = gradzip.codec(f"threshold(v={v})").encode(x)
            outs.append((p.meta["sel"], [t.clone() for _, t in p.leaves()]))
    for (sel_a, a), (sel_b, b) in zip(outs[:2], outs[2:], strict=True):
        assert sel_a == sel_b and all(torch.equal(s, t) for s, t in zip(a, b, strict=True))


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "spec, message",
    [
        ("topk(ratio=0)", r"topk: parameter 'ratio' must be in \(0.0, 1.0\]"),
        ("topk(ratio=1.5)", r"topk: parameter 'ratio' must be in \(0.0, 1.0\]"),
        ("topk(ratio=-0.1)", r"must be in \(0.0, 1.0\]"),
        ("topk(k=0)", r"topk: parameter 'k' must be >= 1"),
        ("topk(ratio=0.1, k=5)", r"topk: give ratio or k, not both"),
        ("randomk(ratio=2)", r"randomk: parameter 'ratio' must be in \(0.0, 1.0\]"),
        ("randomk(k=-3)", r"randomk: parameter 'k' must be >= 1"),
        ("randomk(scale=maybe)", r"randomk: parameter 'scale' must be bool"),
        ("threshold(v=0)", r"threshold: parameter 'v' must be > 0"),
        ("topk(density=0.1)", r"topk: unknown parameter 'density'"),
    ],
)
def test_bad_parameters_are_spec_errors(spec, message):
    with pytest.raises(SpecError, match=message):
        gradzip.codec(spec)


def test_flags_and_spec_round_trip():
    for spec in ("topk(k=7)", "randomk(ratio=0.1, scale=true)", "threshold(v=0.5)"):
        assert str(gradzip.codec(spec)) == spec
    assert not gradzip.codec("topk").summable and gradzip.codec("randomk").summable
    assert not gradzip.codec("threshold").summable and not gradzip.codec("topk").unbiased


def test_topk_values_can_be_compressed_further():
    """``values`` is the field a following stage compresses (``topk | fp16``)."""
    x = heavy_tailed(2000, 2)
    y, p = wire(gradzip.codec("topk(ratio=0.05) | fp16"), x)
    assert p.child("values").tensor("values").dtype == torch.float16
    kept = y != 0
    assert int(kept.sum()) == 100
    torch.testing.assert_close(y[kept], x[kept], rtol=1e-3, atol=1e-3)


@given(n=st.integers(1, 3000), chunk=st.integers(1, 700), k=st.integers(1, 40),
       seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_chunked_topk_keeps_the_k_largest_of_every_chunk(n, chunk, k, seed):
    """SparseLoCo's selection: top k of every chunk, the short last chunk included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    y, _ = wire(gradzip.codec(f"topk(k={k}, chunk={chunk})"), x)
    if chunk >= n:  # one chunk: the whole-tensor top-k, exactly
        assert_exact_topk(x, y, min(k, n))
        return
    for start in range(0, n, chunk):
        xs, ys = x[start:start + chunk], y[start:start + chunk]
        kept = ys != 0
        assert int(kept.count_nonzero()) == min(k, xs.numel())
        torch.testing.assert_close(ys[kept], xs[kept], rtol=0, atol=0)
        if (~kept).any():
            assert float(xs[kept].abs().min()) >= float(xs[~kept].abs().max())


def test_chunked_topk_takes_a_ratio_per_chunk_and_round_trips_its_spec():
    c = gradzip.codec("ef | topk(ratio=0.015625, chunk=4096)")
    x = torch.randn(3 * 4096)
    y, p = wire(c, x)
    assert int((y != 0).count_nonzero()) == 3 * 64
    assert gradzip.codec(str(c)).stages[-1].params["chunk"] == 4096


def test_hash_positions_are_a_uniform_random_subset():
    """The device's generator of randomk positions (the k largest keyed hashes), on the
    CPU: k distinct ascending positions; over many seeds every position is kept about
    k/n of the time, and neighbours are kept together as often as independent draws."""
    from gradzip.codecs.sparse import hash_positions

    n, k, seeds = 1000, 50, 400
    like = torch.empty(0)
    counts = torch.zeros(n)
    together = 0
    for seed in range(seeds):
        pos = hash_positions(n, k, seed * 0x9E3779B97F4A7C15 % 2**63, like)
        assert pos.numel() == k and bool((pos[1:] > pos[:-1]).all())
        assert int(pos.min()) >= 0 and int(pos.max()) < n
        counts[pos] += 1
        together += int((pos[1:] - pos[:-1] == 1).sum())
    expected = seeds * k / n  # 20 per position
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < n + 5 * (2 * n) ** 0.5, chi2  # n - 1 degrees of freedom, 5 sigma
    pairs = seeds * (n - 1) * k * (k - 1) / (n * (n - 1))  # 49 expected
    assert 0.5 * pairs < together < 1.6 * pairs, (together, pairs)


def test_a_randomk_payload_names_its_generator():
    """A payload whose positions came from the device's hash decodes on the CPU to
    those positions; an unknown generator is refused, not guessed."""
    from gradzip.codecs.sparse import hash_positions

    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    stage = gradzip.codec("randomk(ratio=0.01)").compressors[0][1]
    seed = 123456789012345
    pos = hash_positions(5000, 50, seed, x)
    y = stage.decode(Payload({"values": x[pos]}, {"seed": seed, "gen": "hash"}),
                     torch.Size((5000,)), None)
    assert torch.equal(y[pos], x[pos]) and int((y != 0).sum()) == 50
    with pytest.raises(PayloadError, match="unknown generator"):
        stage.decode(Payload({"values": x[pos]}, {"seed": seed, "gen": "mt19937"}),
                     torch.Size((5000,)), None)
