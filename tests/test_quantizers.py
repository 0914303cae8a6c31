"""The quantizers: int8 (incl. shared-scale reduce), qsgd, natural, terngrad; trit packing.

Unbiasedness is checked statistically: the mean of K independent decodes must lie
within 5 standard errors of x for every element, using each codec's worst-case
per-element variance (so the bound is loose only in the safe direction), and the
same check is shown to catch a biased rounding.
"""

import math
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import Payload, SpecError, bitpack
from gradzip.codecs.quantize import int_dtype
from gradzip.collectives import run_simulated


def heavy(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.randn(shape, generator=g).exp()


def roundtrip(c, x, key="k"):
    p = c.encode(x, key=key)
    assert p.wire_bytes == len(p.serialize())
    return c.decode(Payload.deserialize(p.serialize())), p


def decodes(spec, x, k):
    """``k`` decodes of ``x``, each with fresh randomness (the step advances the seed)."""
    c = gradzip.codec(spec)
    return torch.stack([c.decode(c.encode(x, key="w")) for _ in range(k)])


def assert_unbiased(samples, x, max_std):
    """Every element's sample mean is within 5 worst-case standard errors of x."""
    k = samples.shape[0]
    err = (samples.mean(0) - x).abs()
    bound = 5 * max_std / math.sqrt(k) + 1e-6 * x.abs()
    worst = float((err / bound.clamp(min=1e-30)).max())
    assert worst <= 1, f"bias: worst element off by {worst:.2f} of its 5-sigma bound"


# ---------------------------------------------------------------- trits
@pytest.fixture(params=["numpy", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(bitpack, "_on_cpu", lambda t: False)
    return request.param


@given(codes=st.lists(st.integers(0, 2), max_size=60))
def test_trits_round_trip_every_length(codes):
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = bitpack.pack_trits(t)
    assert packed.numel() == (len(codes) + 4) // 5
    assert not packed.numel() or int(packed.max()) <= 242
    assert torch.equal(bitpack.unpack_trits(packed, len(codes)), t)


@pytest.mark.parametrize("n", [0, 1, 4, 5, 6, 243, 1001])
def test_trit_decoding_on_both_backends(backend, n):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 3, (n,), dtype=torch.uint8, generator=g)
    packed = bitpack.pack_trits(codes)
    assert torch.equal(bitpack.unpack_trits(packed, n), codes)
    values = bitpack.trits_to_values(packed, n, (-2.0, 0.0, 3.0))
    assert torch.equal(values, torch.tensor([-2.0, 0.0, 3.0])[codes.long()])


def test_trits_reject_bad_codes():
    with pytest.raises(ValueError, match="0, 1 or 2"):
        bitpack.pack_trits(torch.tensor([0, 3], dtype=torch.uint8))


# ---------------------------------------------------------------- int8
@given(
    n=st.integers(0, 300),
    block=st.sampled_from([1, 7, 64, 256, 1000]),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]),
    seed=st.integers(0, 1000),
)
def test_int8_nearest_error_is_at_most_half_a_step(n, block, scale, seed):
    x = heavy((n,), seed) * scale
    y, p = roundtrip(gradzip.codec(f"int8(block={block})"), x)
    q, s = p.tensor("q"), p.tensor("scale")
    assert q.dtype == torch.int8 and (q != -128).all()
    assert s.numel() == -(-n // block)
    step = s.repeat_interleave(block)[:n]
    assert ((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-45).all()


def test_int8_block_max_is_exact():
    x = torch.tensor([0.5, -2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0])
    y, p = roundtrip(gradzip.codec("int8(block=4)"), x)
    assert p.tensor("q").tolist() == [32, -127, 64, 0, 0, 0, 0, 127]
    assert y[1] == -2.0 and y[7] == 3.0 and (y[3:7] == 0).all()


def test_int8_stochastic_is_unbiased_and_nearest_is_not():
    # values a third of a step off the grid: nearest rounding errs by a third every time
    step = 2.0 / 127
    x = (torch.arange(-60, 60) + 1 / 3) * step
    x[0] = 2.0  # pins the block max, so the step is exactly 2/127
    assert_unbiased(decodes("int8(stochastic=true, block=1024)", x, 800), x, step / 2)
    with pytest.raises(AssertionError, match="bias"):
        assert_unbiased(decodes("int8(block=1024)", x, 800), x, step / 2)


def test_int8_follows_a_sparsifier_values_field():
    c = gradzip.codec("none | int8(block=16)")
    x = heavy((10, 9), 3)
    y, p = roundtrip(c, x)
    assert y.shape == x.shape
    inner = p.child("values")
    assert inner.tensor("q").dtype == torch.int8 and inner.tensor("q").numel() == 90
    torch.testing.assert_close(y, x, atol=float(x.abs().max()) / 127, rtol=0)


def test_topk_then_int8_quantizes_the_kept_values():
    x = heavy((40, 25), 4)
    y, p = roundtrip(gradzip.codec("topk(ratio=0.1) | int8(block=32)"), x)
    kept = y != 0
    assert int(kept.sum()) <= 100 and p.child("values").tensor("q").dtype == torch.int8
    step = float(x.abs().max()) / 127
    assert ((y - x)[kept].abs() <= step / 2 * 1.0001).all()


@pytest.mark.parametrize("mode,dtype,levels", [("narrow", torch.int8, 42),
                                               ("wide", torch.int32, 127)])
def test_int8_shared_scale_reduce_is_close_to_exact_mean(mode, dtype, levels):
    world, n, block = 3, 1000, 128
    xs = [heavy((n,), seed=r) * (r + 1) for r in range(world)]
    exact = sum(xs) / world

    def work(rank, comm):
        c = gradzip.codec(f"int8(block={block}, shared={mode})", rank=rank)
        assert c.multi_round and not c.summable
        mean, local = reduce(c, xs[rank], "w", comm, want_local=True)
        return mean, local, dict(comm.counter.handed)

    out = run_simulated(world, work)
    blocks = -(-n // block)
    gmax = torch.stack([x.abs().reshape(-1) for x in xs]).amax(0)
    gmax = torch.stack([gmax[i * block:(i + 1) * block].max() for i in range(blocks)])
    step = (gmax / levels).repeat_interleave(block)[:n]
    for rank, (mean, local, nbytes) in enumerate(out):
        assert torch.equal(mean, out[0][0])
        # each rank errs by at most half a common step, so the mean does too
        assert ((mean - exact).abs() <= step / 2 * 1.0001).all()
        assert ((local - xs[rank]).abs() <= step / 2 * 1.0001).all()
        # round 1: fp32 block maxima; round 2: one integer per value
        assert nbytes["all_reduce"] == 4 * blocks + n * torch.empty(0, dtype=dtype).element_size()


def test_int8_narrow_sum_cannot_overflow():
    """All ranks at the block maximum: the int8 sum is 3 * 42 = 126, not a wrap-around."""
    x = torch.full((64,), 5.0)

    def work(rank, comm):
        return reduce(gradzip.codec("int8(shared=narrow)"), x, "w", comm)[0]

    for mean in run_simulated(3, work):
        torch.testing.assert_close(mean, x)


def test_int8_narrow_refuses_more_than_127_ranks():
    stage = gradzip.codec("int8(shared=narrow)").compressors[0][1]
    comm = types.SimpleNamespace(world_size=128, rank=0)
    with pytest.raises(SpecError, match="int8.*at most 127 ranks"):
        stage.reduce(torch.ones(4), None, comm, False)


# ---------------------------------------------------------------- qsgd
@pytest.mark.parametrize("levels,dtype", [(1, torch.int8), (127, torch.int8),
                                          (128, torch.int16), (40000, torch.int32)])
def test_qsgd_level_dtype_and_range(levels, dtype):
    assert int_dtype(levels) == dtype
    x = heavy((700,), 2)
    y, p = roundtrip(gradzip.codec(f"qsgd(levels={levels}, bucket=100)"), x)
    q = p.tensor("q")
    assert q.dtype == dtype and int(q.abs().max()) <= levels
    assert p.tensor("norm").shape == (7,) and p.tensor("norm").dtype == torch.float32
    # every decoded value is a level of its bucket's norm / s, with x's sign or zero
    norm = p.tensor("norm").repeat_interleave(100)
    torch.testing.assert_close(y, q.float() * norm / levels)
    assert ((torch.sign(y) == torch.sign(x)) | (y == 0)).all()


@pytest.mark.parametrize("levels", [1, 4, 16])
def test_qsgd_is_unbiased(levels):
    x = heavy((96,), 7)
    bucket = 32
    norms = x.reshape(-1, bucket).norm(dim=1).repeat_interleave(bucket)
    assert_unbiased(decodes(f"qsgd(levels={levels}, bucket={bucket})", x, 1000), x,
                    norms / levels / 2)


@pytest.mark.parametrize("spec", ["int8", "int8(stochastic=true)", "qsgd", "terngrad",
                                  "natural"])
def test_denormal_and_zero_blocks_stay_finite(spec):
    x = torch.tensor([1e-40, -3e-42, 0.0, 0.0] * 8)
    y, _ = roundtrip(gradzip.codec(spec), x)
    assert torch.isfinite(y).all() and (y.abs() <= 2 * 2.0**-126).all()
    z, _ = roundtrip(gradzip.codec(spec), torch.zeros(9))
    assert torch.equal(z, torch.zeros(9))


def test_qsgd_zero_bucket_and_huge_values_stay_finite():
    x = torch.zeros(20)
    x[10:] = 3e38  # the L2 norm overflows fp32
    y, _ = roundtrip(gradzip.codec("qsgd(bucket=10)"), x)
    assert torch.isfinite(y).all() and (y[:10] == 0).all()


# ---------------------------------------------------------------- natural
@given(seed=st.integers(0, 10_000), scale=st.sampled_from([1e-38, 1e-20, 1.0, 1e20, 1e30]))
def test_natural_rounds_to_a_neighbouring_power_of_two(seed, scale):
    x = heavy((200,), seed) * scale
    y, p = roundtrip(gradzip.codec("natural"), x)
    assert p.tensor("codes").dtype == torch.uint8 and p.tensor("codes").numel() == 200
    nz = y != 0
    mant, _ = torch.frexp(y[nz])
    assert (mant.abs() == 0.5).all(), "decoded values are powers of two"
    assert (torch.signbit(y[nz]) == torch.signbit(x[nz])).all()
    ax, ay = x.double().abs(), y.double().abs()
    normal = ax >= 2.0**-126
    lo = torch.exp2(torch.floor(torch.log2(ax[normal])))
    assert ((ay[normal] >= lo) & (ay[normal] <= 2 * lo)).all()
    # fp32 denormals round to 0 or the smallest normal power
    assert set(ay[~normal].tolist()) <= {0.0, 2.0**-126}


def test_natural_is_unbiased():
    x = heavy((128,), 8)
    assert_unbiased(decodes("natural", x, 1000), x, x.abs() / math.sqrt(8))


def test_natural_tiny_and_denormal_values_stay_unbiased():
    # 1e30 puts the smallest kept power at m = 2^-26: smaller values are "tiny" and
    # go to m or 0 (sending everything tiny to 0, or to m, would fail the check)
    m = 2.0**-26
    x = torch.tensor([1e30, 0.4 * m, -0.25 * m, 0.0, 1e-3 * m, 1.5 * m])
    samples = decodes("natural", x, 1500)
    assert set(samples[:, 1].unique().tolist()) == {0.0, m}
    assert (samples[:, 3] == 0).all()
    assert_unbiased(samples, x, torch.tensor([1e30, m / 2, m / 2, 0.0, m / 2, m / 2]))
    # fp32 denormals go to 0 or 2^-126 with the right odds
    d = torch.tensor([0.5 * 2.0**-126, -0.25 * 2.0**-126, 3e-38])
    assert d[0] < 2.0**-126 and d[0] > 0
    assert_unbiased(decodes("natural", d, 1500), d, torch.full((3,), 2.0**-126))


def test_natural_detects_bias():
    """The statistical check has power: always rounding down is caught."""
    x = heavy((128,), 8)
    floor = torch.sign(x) * torch.exp2(torch.floor(torch.log2(x.abs())))
    with pytest.raises(AssertionError, match="bias"):
        assert_unbiased(floor.expand(1000, -1), x, x.abs() / math.sqrt(8))


# ---------------------------------------------------------------- terngrad
def test_terngrad_values_and_wire():
    x = heavy((1000,), 9)
    y, p = roundtrip(gradzip.codec("terngrad"), x)
    s = float(x.abs().max())
    assert set(y.unique().tolist()) <= {-s, 0.0, s}
    assert ((torch.sign(y) == torch.sign(x)) | (y == 0)).all()
    assert p.tensor("trits").numel() == 200  # 1.6 bits per value
    assert gradzip.codec("terngrad").unbiased


def test_terngrad_is_unbiased():
    x = heavy((100,), 10)
    assert_unbiased(decodes("terngrad", x, 1000), x, float(x.abs().max()) / 2)


def test_terngrad_clipping():
    x = heavy((200,), 11)
    c = gradzip.codec("terngrad(clip=2.5)")
    assert not c.unbiased
    y, _ = roundtrip(c, x)
    s = min(float(x.abs().max()), 2.5 * float(x.std()))
    assert s < float(x.abs().max()), "want values that get clipped"
    torch.testing.assert_close(y.abs().max(), torch.tensor(s))
    # the codec is unbiased for the clipped values clamp(x, -s, s)
    assert_unbiased(decodes("terngrad(clip=2.5)", x, 800), x.clamp(-s, s), s / 2)


# ---------------------------------------------------------------- flags, params
def test_flags():
    reg = gradzip.registered()
    assert reg["qsgd"].unbiased and reg["natural"].unbiased and reg["terngrad"].unbiased
    assert not any(reg[n].summable for n in ("int8", "qsgd", "natural", "terngrad"))
    assert not gradzip.codec("int8").unbiased and gradzip.codec("int8(stochastic=true)").unbiased
    assert not gradzip.codec("int8").multi_round


@pytest.mark.parametrize("spec,stage", [
    ("int8(block=0)", "int8"),
    ("int8(shared=sometimes)", "int8"),
    ("int8(stochastic=maybe)", "int8"),
    ("qsgd(levels=0)", "qsgd"),
    ("qsgd(bucket=0)", "qsgd"),
    ("qsgd(levels=2.5)", "qsgd"),
    ("terngrad(clip=-1)", "terngrad"),
    ("natural(levels=3)", "natural"),
])
def test_bad_parameters_name_the_stage(spec, stage):
    with pytest.raises(SpecError, match=stage):
        gradzip.codec(spec)


def test_spec_round_trips():
    for spec in ["int8(block=64, stochastic=true, shared=narrow)", "qsgd(levels=4, bucket=128)",
                 "terngrad(clip=2.5)", "natural"]:
        assert str(gradzip.codec(spec)) == spec
