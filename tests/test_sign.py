"""Bit packing and the sign codecs: signsgd (majority vote), efsignsgd, onebit."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import Payload, SpecError, bitpack
from gradzip.collectives import run_simulated


def heavy(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.randn(shape, generator=g).exp()


@pytest.fixture(params=["numpy", "torch"])
def backend(request, monkeypatch):
    """Run bitpack through numpy (CPU) and through its torch path (other devices)."""
    if request.param == "torch":
        monkeypatch.setattr(bitpack, "_on_cpu", lambda t: False)
    return request.param


# ---------------------------------------------------------------- bitpack
@given(bits=st.lists(st.booleans(), max_size=100))
def test_bits_round_trip_every_length(bits):
    mask = torch.tensor(bits, dtype=torch.bool)
    packed = bitpack.pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(bits) + 7) // 8
    assert torch.equal(bitpack.unpack_bits(packed, len(bits)), mask)
    assert bitpack.count_ones(packed) == sum(bits)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1001])
def test_bit_helpers_agree_on_both_backends(backend, n):
    x = heavy((n,), seed=n)
    mask = x < 0
    packed = bitpack.pack_bits(mask)
    assert torch.equal(packed, bitpack.pack_signs(x))
    assert torch.equal(bitpack.unpack_bits(packed, n), mask)
    values = bitpack.bits_to_values(packed, n, 2.5, -0.5)
    assert torch.equal(values, torch.where(mask, -0.5, 2.5))
    assert bitpack.count_ones(packed) == int(mask.sum())


def test_bits_are_lsb_first_and_padding_is_zero():
    packed = bitpack.pack_bits(torch.tensor([True, False, False, True, True]))
    assert packed.tolist() == [0b11001]


def test_sign_bit_decides_zero():
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45])
    assert bitpack.unpack_bits(bitpack.pack_signs(x), 6).tolist() == [
        False, True, False, True, False, True
    ]


def test_unpack_rejects_wrong_length():
    with pytest.raises(ValueError, match="expected 2 bytes"):
        bitpack.unpack_bits(torch.zeros(1, dtype=torch.uint8), 9)


# ---------------------------------------------------------------- signsgd
def roundtrip(c, x, key="k"):
    p = c.encode(x, key=key)
    return c.decode(Payload.deserialize(p.serialize())), p


@pytest.mark.parametrize("shape", [(), (0,), (5,), (13, 7)])
def test_signsgd_decodes_exact_signs(shape):
    x = heavy(shape, seed=3)
    y, _ = roundtrip(gradzip.codec("signsgd"), x)
    assert torch.equal(y, torch.where(torch.signbit(x), -1.0, 1.0))


def test_signsgd_l1_scale_is_mean_magnitude():
    x = heavy((1000,), seed=4)
    y, _ = roundtrip(gradzip.codec("signsgd(scale=l1)"), x)
    torch.testing.assert_close(y.abs(), torch.full_like(x, float(x.abs().mean())))
    assert torch.equal(torch.signbit(y), torch.signbit(x))


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "onebit"])
def test_one_bit_codecs_compress_over_30x(name):
    n = 1 << 20
    p = gradzip.codec(name).encode(heavy((n,), seed=1), key="w")
    assert p.wire_bytes == len(p.serialize())
    assert 4 * n / p.wire_bytes >= 30, p.wire_bytes


@pytest.mark.parametrize("world", [3, 4])
def test_majority_vote(world):
    n = 50
    xs = [heavy((n,), seed=10 + r) for r in range(world)]
    signs = torch.stack([torch.where(torch.signbit(x), -1.0, 1.0) for x in xs])
    expected = torch.sign(signs.sum(0))  # ties (even world) give 0
    if world % 2 == 0:
        assert (expected == 0).any(), "want a tie in the test data"

    def work(rank, comm):
        c = gradzip.codec("signsgd", rank=rank)
        mean, local = reduce(c, xs[rank], "w", comm, want_local=True)
        return mean, local, comm.counter.handed["all_gather"]

    out = run_simulated(world, work)
    one_payload = gradzip.codec("signsgd").compressors[0][1].encode(xs[0], None).wire_bytes
    for rank, (mean, local, nbytes) in enumerate(out):
        assert torch.equal(mean, expected)
        assert torch.equal(local, signs[rank])
        # the packed bits and a header, and one byte: the non-finite flag every rank
        # reads (carried on the vote's all-gather, Communicator.carry_flag)
        assert nbytes == one_payload + 1


def test_majority_vote_l1_scale_is_mean_of_scales():
    xs = [heavy((40,), seed=r) * (r + 1) for r in range(3)]

    def work(rank, comm):
        return reduce(gradzip.codec("signsgd(scale=l1)"), xs[rank], "w", comm)[0]

    votes = torch.sign(sum(torch.where(torch.signbit(x), -1.0, 1.0) for x in xs))
    scale = sum(float(x.abs().mean()) for x in xs) / 3
    for mean in run_simulated(3, work):
        torch.testing.assert_close(mean, votes * scale)


def test_signsgd_without_vote_averages_signs():
    xs = [heavy((30,), seed=r) for r in range(3)]

    def work(rank, comm):
        c = gradzip.codec("signsgd(vote=false)", rank=rank)
        assert not c.multi_round
        return reduce(c, xs[rank], "w", comm)[0]

    expected = sum(torch.where(torch.signbit(x), -1.0, 1.0) for x in xs) / 3
    for mean in run_simulated(3, work):
        torch.testing.assert_close(mean, expected)


# ---------------------------------------------------------------- efsignsgd
def test_efsignsgd_memory_is_exact_and_bounded():
    c = gradzip.codec("efsignsgd")
    slot_key = "w"
    sent = torch.zeros(500)
    total = torch.zeros(500)
    norms = []
    for step in range(300):
        g = heavy((500,), seed=step)
        before = c.state.records.get((0, slot_key), {"data": {}})["data"].get("residual")
        before = before.clone() if before is not None else torch.zeros(500)
        p = c.encode(g, key=slot_key)
        decoded = c.decode(p)
        residual = c.state.records[(0, slot_key)]["data"]["residual"]
        # error feedback identity: what is sent plus what is kept is what came in
        torch.testing.assert_close(decoded + residual, g + before)
        # the scale is ||p||_1 / d of the compensated vector
        torch.testing.assert_close(decoded.abs()[0], (g + before).abs().mean())
        sent += decoded
        total += g
        norms.append(float(residual.norm()))
    # nothing is lost: everything not yet sent is in the memory
    torch.testing.assert_close(sent + residual, total, rtol=1e-4, atol=1e-3)
    # and the memory does not grow: late residuals are no larger than early ones
    g_norm = float(heavy((500,), seed=0).norm())
    assert max(norms[-100:]) < 1.5 * max(norms[:100]) and max(norms) < 20 * g_norm


def test_efsignsgd_state_checkpoints():
    c = gradzip.codec("efsignsgd")
    for step in range(3):
        c.encode(heavy((64,), seed=step), key="w")
    import pickle

    d = gradzip.codec("efsignsgd")
    d.load_state_dict(pickle.loads(pickle.dumps(c.state_dict())))
    x = heavy((64,), seed=9)
    assert torch.equal(c.decode(c.encode(x, "w")), d.decode(d.encode(x, "w")))


def test_efsignsgd_rejects_a_key_changing_shape():
    c = gradzip.codec("efsignsgd")
    c.encode(torch.ones(4), key="w")
    with pytest.raises(ValueError, match="changed shape"):
        c.encode(torch.ones(5), key="w")


# ---------------------------------------------------------------- onebit
def test_onebit_per_tensor_means_and_sum():
    x = heavy((1000,), seed=5)
    y, p = roundtrip(gradzip.codec("onebit"), x)
    neg = torch.signbit(x)
    assert torch.equal(torch.signbit(y), neg)
    torch.testing.assert_close(y[~neg], torch.full_like(y[~neg], float(x[~neg].mean())))
    torch.testing.assert_close(y[neg], torch.full_like(y[neg], float(x[neg].mean())))
    # side means preserve the sum exactly (up to rounding)
    torch.testing.assert_close(y.sum(), x.sum(), rtol=1e-4, atol=1e-3)
    assert p.tensor("recon").shape == (2,)


def test_onebit_per_column_for_tall_matrices():
    x = heavy((300, 6), seed=6)
    x[:, 2] = -x[:, 2].abs()  # a column with no positive values
    x[0, 0], x[1, 1] = -0.0, 0.0  # signed zeros count on their sign bit's side
    y, p = roundtrip(gradzip.codec("onebit"), x)
    assert p.tensor("recon").shape == (2, 6)
    torch.testing.assert_close(y.sum(0), x.sum(0), rtol=1e-4, atol=1e-3)
    for j in range(6):
        neg = torch.signbit(x[:, j])
        if (~neg).any():
            assert torch.allclose(y[~neg, j], x[~neg, j].mean())
        assert torch.allclose(y[neg, j], x[neg, j].mean())
    # short matrices and scope=tensor use one pair
    assert gradzip.codec("onebit").encode(heavy((8, 6)), "s").tensor("recon").shape == (2,)
    assert gradzip.codec("onebit(scope=tensor)").encode(x, "t").tensor("recon").shape == (2,)


def test_ef_onebit_is_one_bit_sgd():
    """Seide et al.: with error feedback the running sum of decodes tracks the gradients."""
    c = gradzip.codec("ef | onebit")
    sent, total = torch.zeros(400), torch.zeros(400)
    for step in range(100):
        g = heavy((400,), seed=step)
        sent += c.decode(c.encode(g, key="w"))
        total += g
    # the gap is exactly the residual, which stays about one gradient in size
    gap = float((total - sent).norm())
    assert gap < 5 * float(heavy((400,)).norm())


# ---------------------------------------------------------------- parameters
@pytest.mark.parametrize("spec,stage", [
    ("signsgd(scale=two)", "signsgd"),
    ("signsgd(vote=maybe)", "signsgd"),
    ("onebit(scope=row)", "onebit"),
    ("efsignsgd(scale=1)", "efsignsgd"),
])
def test_bad_parameters_name_the_stage(spec, stage):
    with pytest.raises(SpecError, match=stage):
        gradzip.codec(spec)


def test_vote_flag_controls_multi_round():
    assert gradzip.registered()["signsgd"].multi_round  # the class flag shows the default
    assert gradzip.codec("signsgd").multi_round
    assert not gradzip.codec("signsgd(vote=false)").multi_round
    assert str(gradzip.codec("signsgd(scale=l1, vote=false)")) == "signsgd(scale=l1, vote=false)"


def test_corrupt_payload_is_a_payload_error():
    c = gradzip.codec("signsgd")
    p = c.encode(torch.ones(20))
    p.fields["bits"] = p.tensor("bits")[:1]
    with pytest.raises(gradzip.PayloadError):
        c.decode(p)


def test_majority_vote_of_one_rank_is_its_own_sign():
    stage = gradzip.codec("signsgd").compressors[0][1]

    class Solo:
        world_size, rank = 1, 0

        def all_gather(self, t):
            return [t]

    mean, local = stage.reduce(torch.tensor([1.0, -2.0, 0.0]), None, Solo(), True)
    assert mean.tolist() == [1.0, -1.0, 1.0] and local.tolist() == [1.0, -1.0, 1.0]


@pytest.mark.parametrize("spec,shape", [
    ("efsignsgd", (64, 300)), ("signsgd(scale=l1)", (64, 300)),
    ("onebit", (300, 64)), ("onebit(scope=tensor)", (64, 300)),
])
def test_magnitudes_near_the_float32_limit_stay_finite(spec, shape):
    """Sums of |x| near float32's limit overflow in float32; the codecs must not send inf/NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(shape, generator=g).add_(0.5) * 2e38 * torch.randn(shape, generator=g).sign()
    y = gradzip.codec(spec).decode(gradzip.codec(spec).encode(x, key="w"))
    assert torch.isfinite(y).all(), spec
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    mean = x.abs().double().mean()  # every decoded magnitude is some side's mean of |x|
    assert float(y.abs().double().mean()) == pytest.approx(float(mean), rel=0.2)
