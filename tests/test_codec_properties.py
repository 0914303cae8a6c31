"""Per-codec property tests: an error bound for every deterministic codec, a statistical
unbiasedness check for every unbiased one, and a guard that no registered codec has
neither.

Bounds are checked on the public API (``gradzip.codec``) for random shapes, scales and
input dtypes. The decoded tensor is rounded to the input dtype, so every bound also
allows that final rounding (``_out_tol``). Unbiasedness: the mean of K independent
decodes must lie within 5 worst-case standard errors of x for every element, the
worst-case per-element standard deviation coming from each codec's paper.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import Compressor, Payload, registered
from gradzip.codecs.sparse import keep_count

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_TINY = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}


def heavy_tailed(shape, seed, scale, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.randn(shape, generator=g).exp() * scale
    limit = torch.finfo(dtype).max  # a finite input in every dtype
    return x.clamp(-limit, limit).to(dtype)


def _out_tol(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What rounding the decoded float32 to the input dtype may add, per element."""
    return _EPS[dtype] * y.abs() + _TINY[dtype]


def _check_within(y, x, bound, dtype, what):
    y64, x64 = y.double(), x.double()
    err = (y64 - x64).abs()
    ok = err <= bound.double() * (1 + 1e-6) + _out_tol(y64, dtype)
    assert bool(ok.all()), f"{what}: worst error {float((err - bound).max()):.3g} over the bound"


def _norm_bound(y, x, dtype, what, factor=1.0):
    """||y - x|| <= factor * ||x|| (a projection or a least-squares fit never does worse
    than sending zeros), up to rounding."""
    y64, x64 = y.double(), x.double()
    slack = float(_out_tol(y64, dtype).norm()) + 1e-300
    gap = float((y64 - x64).norm())
    assert gap <= factor * float(x64.norm()) * (1 + 1e-5) + slack, what


def _kept_or_zero(y, x, what):
    """Every decoded entry is the input's value or zero (sparsifiers send exact values)."""
    xf = x.float()
    assert bool(((y.float() == xf) | (y == 0)).all()), what


def _largest_kept(y, x):
    """No dropped entry is larger than a kept one (top-k and DGC's threshold)."""
    sent, dropped = y != 0, (y == 0) & (x != 0)
    if sent.any() and dropped.any():
        assert float(x[sent].float().abs().min()) >= float(x[dropped].float().abs().max())


# ---------------------------------------------------------------- deterministic bounds
def _exact(c, x, dtype):
    y = c.decode(Payload.deserialize(c.encode(x, "w").serialize()))
    assert torch.equal(y.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))


def _cast(target):
    def check(c, x, dtype):
        y = c.decode(c.encode(x, "w"))
        limit = torch.finfo(target).max
        clamped = x.double().clamp(-limit, limit)
        bound = _EPS[target] * clamped.abs() + _TINY[target]
        _check_within(y, clamped, bound, dtype, str(c))
    return check


def _int8(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    # half a step of the tensor's largest block scale bounds every block's error
    half_step = x.float().abs().amax() / 127 / 2 if x.numel() else torch.tensor(0.0)
    _check_within(y, x, half_step.expand_as(x), dtype, str(c))


def _fp8(c, x, dtype):
    """Half an ulp of e4m3 (2**-4 relative), or half the smallest subnormal step of the
    largest block's scale where a value is below the normal range."""
    y = c.decode(c.encode(x, "w"))
    amax = x.float().abs().amax() if x.numel() else torch.tensor(0.0)
    bound = x.double().abs() * 2.0**-4 * (1 + 1e-6) + float(amax) / 448 * 2.0**-10 * 1.01
    _check_within(y, x, bound, dtype, str(c))


def _signsgd(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    assert torch.equal(y, torch.where(torch.signbit(x), -1.0, 1.0).to(dtype))


def _efsignsgd(c, x, dtype):
    y = c.decode(c.encode(x, "w"))  # a fresh codec: the memory is zero
    mean = x.float().abs().mean() if x.numel() else torch.tensor(0.0)
    _check_within(y.abs(), mean.expand_as(x), 1e-6 * mean.expand_as(x), dtype, str(c))
    assert torch.equal(torch.signbit(y), torch.signbit(x) & (mean > 0))


def _onebit(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    # each side decodes to its own mean: the sum survives, and it is a least-squares fit
    total = x.double().sum(0) if x.dim() == 2 and x.shape[0] >= 256 else x.double().sum()
    got = y.double().sum(0) if total.dim() else y.double().sum()
    slack = 1e-4 * float(x.double().abs().sum()) + float(_out_tol(y.double(), dtype).sum())
    assert float((got - total).abs().max()) <= slack, str(c)
    _norm_bound(y, x, dtype, str(c))


def _centroid(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    # signs kept; every bin decodes to the mean of its magnitudes: the L1 mass survives,
    # each magnitude stays within the range of the input's, and it fits least-squares
    assert bool(((torch.sign(y) == torch.sign(x.float())) | (y == 0)).all()), str(c)
    l1, got = float(x.double().abs().sum()), float(y.double().abs().sum())
    assert abs(got - l1) <= 1e-4 * l1 + float(_out_tol(y.double(), dtype).sum()), str(c)
    if x.numel():
        top = float(x.double().abs().max())
        assert float(y.double().abs().max()) <= top * (1 + 1e-6) + _TINY[dtype], str(c)
    _norm_bound(y, x, dtype, str(c))


def _stdbins(c, x, dtype):
    """Every bin decodes to the mean of its values: the sum survives, there are at most
    ``bins`` levels, and each lies within the input's range."""
    y = c.decode(c.encode(x, "w"))
    x64, y64 = x.double(), y.double()
    slack = 1e-5 * float(x64.abs().sum()) + float(_out_tol(y64, dtype).sum())
    assert abs(float(y64.sum()) - float(x64.sum())) <= slack, str(c)
    assert y.unique().numel() <= 4, str(c)
    if x.numel():
        margin = 1e-5 * float(x64.abs().max()) + _TINY[dtype]
        assert float(y64.min()) >= float(x64.min()) - margin, str(c)
        assert float(y64.max()) <= float(x64.max()) + margin, str(c)


def _topk(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    _kept_or_zero(y, x, str(c))
    _largest_kept(y, x)
    if x.numel():
        assert int((y != 0).sum()) <= keep_count(x.numel(), 0.01, None)


def _sharedtopk(c, x, dtype):
    """Alone it keeps the top 64 of every 4,096 entries, their values in fp16 (saturated)."""
    y = c.decode(c.encode(x, "w")).float().reshape(-1)
    flat = x.float().reshape(-1)
    sent = flat.clamp(-65504, 65504).half().float()
    assert bool(((y == sent) | (y == 0)).all()), str(c)
    for start in range(0, flat.numel(), 4096):
        part, got = flat[start:start + 4096], y[start:start + 4096]
        assert int((got != 0).sum()) <= 64
        _largest_kept(got, part)


def _threshold(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    xf = x.float()
    assert torch.equal(y, torch.where(xf.abs() >= 0.01, xf, 0.0).to(dtype))


def _randomk(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    _kept_or_zero(y, x, str(c))
    assert int((y != 0).sum()) <= keep_count(x.numel(), 0.01, None)


def _dgc(c, x, dtype):
    y = c.decode(c.encode(x, "w"))  # first step: v = u = g, so it sends entries of x
    _kept_or_zero(y, x, str(c))
    _largest_kept(y, x)


def _projection(c, x, dtype):
    """PowerSGD and GradiVeQ decode an orthogonal projection of the input (after one
    step that fits GradiVeQ's basis): never farther from x than zero is."""
    c.decode(c.encode(x, "w"))
    y = c.decode(c.encode(x, "w"))
    _norm_bound(y, x, dtype, str(c))


def _demo(c, x, dtype):
    """DeMo's first step sends the kept coefficients of x in an orthonormal DCT basis per
    tile: an orthogonal projection, never farther from x than zero is."""
    y = c.decode(c.encode(x, "w"))
    _norm_bound(y, x, dtype, str(c))


def _sketch(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    k = max(1, math.ceil(0.001 * x.numel()))
    if int((y != x).sum()):  # compressed (else it was sent uncompressed, exactly)
        assert int((y != 0).sum()) <= k, "unsketch keeps at most k heavy hitters"


def _natural(c, x, dtype):
    y = c.decode(c.encode(x, "w")).double()
    a = x.double().abs()
    low = torch.exp2(torch.floor(torch.log2(a.clamp(min=1e-300))))
    ok = (y == 0) | (y.abs() == low) | (y.abs() == 2 * low)  # a neighbouring power of two
    ok |= y.abs() == torch.finfo(dtype).max  # 2^16 does not fit fp16: saturated
    assert bool((ok | (a < 2.0**-120)).all()), str(c)
    assert torch.equal(torch.signbit(y[y != 0]), torch.signbit(x.double()[y != 0]))


def _qsgd(c, x, dtype):
    y = c.decode(c.encode(x, "w"))
    # |y| is at most one bucket's L2 norm, so at most the tensor's
    bound = x.double().norm().expand_as(x.double()) + x.double().abs()
    _check_within(y, x, bound, dtype, str(c))


def _terngrad(c, x, dtype):
    y = c.decode(c.encode(x, "w")).float()
    s = float(x.float().abs().max()) if x.numel() else 0.0
    values = y.unique().tolist()
    assert all(v == 0 or abs(abs(v) - s) <= 1e-6 * s + _EPS[dtype] * s for v in values), values


BOUNDS = {
    "none": _exact, "lossless": _exact, "fp16": _cast(torch.float16), "bf16": _cast(torch.bfloat16),
    "int8": _int8, "fp8": _fp8, "signsgd": _signsgd, "efsignsgd": _efsignsgd, "onebit": _onebit,
    "topk": _topk, "threshold": _threshold, "randomk": _randomk, "dgc": _dgc,
    "powersgd": _projection, "gradiveq": _projection, "sketch": _sketch, "demo": _demo,
    # stochastic codecs: the support of the output (their mean is checked below)
    "natural": _natural, "qsgd": _qsgd, "terngrad": _terngrad, "centroid": _centroid,
    "stdbins": _stdbins, "sharedtopk": _sharedtopk,
}

SHAPES = st.sampled_from([(), (0,), (1,), (7,), (3, 5), (24, 20), (300, 40), (2, 3, 64)])


@pytest.mark.parametrize("name", sorted(BOUNDS))
@given(shape=SHAPES, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-6, 1.0, 1e3]))
def test_error_bound(name, shape, dtype, seed, scale):
    x = heavy_tailed(shape, seed, scale, dtype)
    BOUNDS[name](gradzip.codec(name), x, dtype)


# ---------------------------------------------------------------- unbiasedness
def _assert_unbiased(samples, x, max_std):
    k = samples.shape[0]
    err = (samples.double().mean(0) - x.double()).abs()
    bound = 5 * max_std.double() / math.sqrt(k) + 1e-6 * x.double().abs() + 1e-30
    worst = float((err / bound).max())
    assert worst <= 1, f"bias: worst element off by {worst:.2f} of its 5-sigma bound"


#: spec -> worst-case per-element standard deviation of one decode of x
UNBIASED = {
    # QSGD Lemma 3.1: one of two levels ||v||/s apart, so std <= ||v|| / (2 s)
    "qsgd": lambda x: x.norm().expand_as(x) / (2 * 16),
    # natural compression: variance <= x^2 / 8
    "natural": lambda x: x.abs() / math.sqrt(8),
    # TernGrad: 0 or +-max|x|
    "terngrad": lambda x: x.abs().max().expand_as(x) / 2,
    # stochastic int8: one of two levels a step (max|block| / 127) apart
    "int8(stochastic=true)": lambda x: x.abs().max().expand_as(x) / 254,
    # random-k with d/k scaling: x d/k w.p. k/d, so std = |x| sqrt(d/k - 1) (= |x| here)
    "randomk(ratio=0.5, scale=true)": lambda x: x.abs(),
    # exact codecs
    "none": lambda x: torch.zeros_like(x),
    "lossless": lambda x: torch.zeros_like(x),
}


@pytest.mark.parametrize("spec", sorted(UNBIASED))
@settings(max_examples=4)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_unbiased_codecs_are_unbiased(spec, seed, scale):
    c = gradzip.codec(spec)
    assert c.unbiased, spec
    x = heavy_tailed((8, 8), seed, scale, torch.float32)
    samples = torch.stack([c.decode(c.encode(x, key="w")) for _ in range(400)])
    _assert_unbiased(samples, x, UNBIASED[spec](x))


def test_the_unbiasedness_check_catches_a_biased_codec():
    x = heavy_tailed((8, 8), 0, 1.0, torch.float32)
    c = gradzip.codec("randomk(ratio=0.5)")  # no d/k scaling: E = x / 2
    samples = torch.stack([c.decode(c.encode(x, key="w")) for _ in range(400)])
    with pytest.raises(AssertionError, match="bias"):
        _assert_unbiased(samples, x, x.abs())


# ---------------------------------------------------------------- coverage
def test_every_codec_has_a_bound_or_an_unbiasedness_check():
    compressors = {n for n, c in registered().items() if issubclass(c, Compressor)}
    assert compressors <= set(BOUNDS), f"no error-bound test for {compressors - set(BOUNDS)}"
    for name in compressors:
        if gradzip.codec(name).unbiased:  # default parameters
            assert name in UNBIASED, f"{name} claims to be unbiased but is not checked"
