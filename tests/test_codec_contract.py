"""The contract every registered stage keeps, checked for all of them.

A new codec gets these tests for free by registering itself: shapes and dtypes
round-trip through the serialized form, wire bytes are honest, state pickles,
non-finite input fails clearly, summable codecs really sum, and every codec
aggregates over a simulated group.
"""

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import Compressor, LosslessCoder, Payload, registered, run_simulated

COMPRESSORS = sorted(n for n, c in registered().items() if issubclass(c, Compressor))
CODERS = sorted(n for n, c in registered().items() if issubclass(c, LosslessCoder))
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (64, 33), (1, 1, 1, 9)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def heavy_tailed(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.randn(shape, generator=g).exp()
    return x.to(dtype)


def roundtrip(c, x, key="k"):
    p = c.encode(x, key=key)
    data = p.serialize()
    assert len(data) == p.wire_bytes, "wire_bytes must equal the serialized length"
    return c.decode(Payload.deserialize(data)), p


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_dtypes_roundtrip(name, dtype):
    c = gradzip.codec(name)
    for step in range(2):  # a second step exercises warm-started state
        for i, shape in enumerate(SHAPES):
            x = heavy_tailed(shape, seed=i + 10 * step, dtype=dtype)
            y, _ = roundtrip(c, x, key=f"t{i}")
            assert y.shape == x.shape and y.dtype == x.dtype, (name, shape)
            assert torch.isfinite(y.float()).all(), (name, shape)


@pytest.mark.parametrize("name", COMPRESSORS)
@given(data=st.data())
def test_property_roundtrip_is_honest(name, data):
    shape = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    scale = data.draw(st.sampled_from([1e-6, 1.0, 1e4]))
    seed = data.draw(st.integers(0, 2**16))
    c = gradzip.codec(name)
    x = heavy_tailed(shape, seed) * scale
    y, p = roundtrip(c, x)
    assert y.shape == x.shape
    assert torch.isfinite(y).all()
    # a codec never sends more than raw fp32 plus a small, bounded header
    assert p.wire_bytes <= 2 * (4 * x.numel()) + 256, (name, p.wire_bytes, x.numel())


@pytest.mark.parametrize("name", COMPRESSORS)
def test_state_pickles_and_restores(name):
    c = gradzip.codec(name)
    for i in range(3):
        c.encode(heavy_tailed((16, 8), i), key="w")
    sd = pickle.loads(pickle.dumps(c.state_dict()))
    d = gradzip.codec(name)
    d.load_state_dict(sd)
    x = heavy_tailed((16, 8), 99)
    assert torch.equal(c.decode(c.encode(x, "w")), d.decode(d.encode(x, "w")))


@pytest.mark.parametrize("name", COMPRESSORS)
def test_nonfinite_input_is_an_error(name):
    x = heavy_tailed((10,))
    x[3] = float("nan")
    with pytest.raises(gradzip.NonFiniteGradientError, match="non-finite"):
        gradzip.codec(name).encode(x, key="bad")
    nan = gradzip.codec(name, nonfinite="propagate")
    assert torch.isnan(nan.decode(nan.encode(x))).all()


@pytest.mark.parametrize("name", COMPRESSORS)
def test_reduce_over_simulated_group(name):
    """Every codec aggregates over 3 virtual workers; all agree on the result."""

    def work(rank, comm):
        c = gradzip.codec(name, rank=rank)
        outs = []
        for step in range(3):
            x = heavy_tailed((24, 10), seed=100 * step + rank)
            mean, local = c.reduce(x, "w", comm, want_local=True)
            assert mean.shape == x.shape and local is not None and local.shape == x.shape
            outs.append(mean)
        return outs, comm.counter.total_bytes

    results = run_simulated(3, work)
    for step in range(3):
        for rank in range(1, 3):
            assert torch.allclose(results[rank][0][step], results[0][0][step]), name
    assert all(nbytes > 0 for _, nbytes in results)


@pytest.mark.parametrize("name", [n for n in COMPRESSORS if registered()[n].summable])
def test_summable_codecs_sum(name):
    """decode(sum of payloads) == sum of decodes, through the simulated all-reduce."""
    xs = [heavy_tailed((50, 4), seed=r) for r in range(3)]

    def work(rank, comm):
        c = gradzip.codec(name, rank=rank)
        own = c.decode(c.encode(xs[rank] / 3, key="w"))
        c2 = gradzip.codec(name, rank=rank)
        mean, _ = c2.reduce(xs[rank], "w", comm)
        return own, mean

    out = run_simulated(3, work)
    expected = sum(o for o, _ in out)
    for _, mean in out:
        atol = 1e-3 * float(expected.abs().max())
        torch.testing.assert_close(mean, expected, rtol=1e-2, atol=atol)


@pytest.mark.parametrize("name", CODERS)
def test_lossless_stage_is_exact_after_a_quantizer(name):
    base = gradzip.codec("none")
    chained = gradzip.codec(f"none | {name}")
    x = heavy_tailed((300,))
    y, _ = roundtrip(chained, x)
    assert torch.equal(y, base.decode(base.encode(x)))
