"""The one-pass kernels of ``gradzip analyze`` against plain numpy definitions."""

from __future__ import annotations

import io
import math

import h5py
import numpy as np
import pytest
import torch

from gradzip.analyze import _kernels as K
from gradzip.analyze import measures as M
from gradzip.codecs.entropy import ans
from gradzip.codecs.entropy import measures as em


def _grads(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 1.5) * 1e-3)
    x[rng.random(n) < 0.05] = 0.0
    return x.astype(np.float32)


def test_moments_match_float64_numpy() -> None:
    x = _grads(100_003)
    sums, zeros, absmax = K.moments(x)
    d = x.astype(np.float64)
    want = [np.abs(d).sum(), d.sum(), (d * d).sum(), (d ** 3).sum(), (d ** 4).sum()]
    np.testing.assert_allclose(sums, want, rtol=1e-12, atol=1e-300)
    assert zeros == int((x == 0).sum()) and absmax == np.abs(x).max()


def _numpy_int8(x: np.ndarray) -> np.ndarray:
    pad = (-x.size) % M.INT8_BLOCK
    blocks = np.pad(x, (0, pad)).reshape(-1, M.INT8_BLOCK)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127.0)
    scale[scale == 0] = 1.0
    return np.rint(blocks / scale).astype(np.int8).reshape(-1)[:x.size]


@pytest.mark.parametrize("n", [1, 255, 256, 257, 10_000])
def test_quantizers_match_their_numpy_definitions(n: int) -> None:
    x = _grads(n, seed=n)
    ints, (values, counts) = M.quantize_with_histogram(x, "int8")
    assert np.array_equal(ints, _numpy_int8(x))
    for a, b in zip((values, counts), em.histogram(ints), strict=True):
        assert np.array_equal(a, b)
    fixed, hist = M.quantize_with_histogram(x, "fixed")
    want = np.rint(x * np.float32(M.FIXED_SCALE)).astype(np.int64)
    assert np.array_equal(fixed.astype(np.int64), want)
    for a, b in zip(hist, em.histogram(want), strict=True):
        assert np.array_equal(a, b)


def test_quantizers_survive_huge_and_non_finite_values() -> None:
    x = _grads(1000)
    x[3], x[10], x[600] = np.nan, np.inf, 5e4  # 5e4 * 1e6 does not fit int32
    ints, (values, counts) = M.quantize_with_histogram(x, "int8")
    assert counts.sum() == x.size and ints.min() >= -127 and ints.max() <= 127
    wide, (values, counts) = M.quantize_with_histogram(np.nan_to_num(x, posinf=0), "fixed")
    assert wide.dtype == np.int64 and counts.sum() == x.size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_field_histograms_match_a_numpy_split(dtype: str) -> None:
    x = torch.from_numpy(_grads(5000)).to(getattr(torch, dtype))
    words = x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    u = words.numpy().astype(np.int64).view(np.uint64) & np.uint64((1 << 8 * x.element_size()) - 1)
    e, m = {"float32": (8, 23), "float16": (5, 10), "bfloat16": (8, 7), "float64": (11, 52)}[dtype]
    stored = words.numpy().view({2: np.uint16, 4: np.float32, 8: np.float64}[x.element_size()])
    if dtype == "float16":
        stored = x.numpy()
    got = M._field_counts(stored, dtype)
    assert np.array_equal(got["sign"], np.bincount((u >> np.uint64(e + m)).astype(np.int64),
                                                   minlength=2))
    assert np.array_equal(got["exponent"], np.bincount(
        ((u >> np.uint64(m)) & np.uint64((1 << e) - 1)).astype(np.int64), minlength=1 << e))
    mant = u & np.uint64((1 << m) - 1)
    if m <= 16:
        assert np.array_equal(got["mantissa"], np.bincount(mant.astype(np.int64),
                                                           minlength=1 << m))
    else:
        for p in range((m + 7) // 8):
            plane = ((mant >> np.uint64(8 * p)) & np.uint64(0xFF)).astype(np.int64)
            assert np.array_equal(got[f"mantissa{p}"], np.bincount(plane, minlength=256))


def test_eg_bits_at_every_order_equal_the_code_lengths() -> None:
    values, counts = em.histogram(np.rint(_grads(20_000) * 1e6).astype(np.int64))
    u = np.abs(values)
    by_k = em._kernels.eg_bits_by_k(u, counts, 30)
    for k in (0, 1, 7, 30):
        assert by_k[k] == int((em.eg_lengths(u, k) * counts).sum())


_STREAMS = {
    "int8 gauss": lambda r: np.clip(np.rint(r.standard_normal(300_000) * 20), -127, 127)
    .astype(np.int8),
    "int32 wide alphabet": lambda r: np.rint(r.laplace(size=250_000) * 3000).astype(np.int32),
    "int16 narrow": lambda r: np.rint(r.laplace(size=100_000) * 30).astype(np.int16),
    "int32 span > 2**16": lambda r: np.rint(r.laplace(size=100_000) * 1e6).astype(np.int32),
    "constant": lambda r: np.zeros(1000, np.int32),
    "three values": lambda r: np.array([1, 2, 3], np.int32),
    "uniform bytes (stored)": lambda r: r.integers(-128, 128, size=10_000).astype(np.int8),
}


@pytest.mark.parametrize("name", list(_STREAMS))
def test_ans_size_from_the_histogram_is_within_a_tenth_of_a_percent(name: str) -> None:
    v = _STREAMS[name](np.random.default_rng(1))
    real = ans.encode(torch.from_numpy(v)).wire_bytes
    values, counts = em.histogram(v)
    est = ans.size_from_histogram(values, counts, torch.from_numpy(v).dtype, chunk=1 << 17)
    est_one_chunk = ans.size_from_histogram(values, counts, torch.from_numpy(v).dtype)
    real_chunked = ans.encode(torch.from_numpy(v), chunk=1 << 17).wire_bytes
    assert abs(est_one_chunk - real) <= max(8, 1e-3 * real)
    assert abs(est - real_chunked) <= max(8, 1e-3 * real_chunked)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zip_of_the_h5_equals_compressing_a_real_file(dtype: str) -> None:
    x = torch.from_numpy(_grads(300_000)).to(getattr(torch, dtype))
    stored = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else x.numpy()
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.create_dataset("bucket", data=stored)
    real = M.compressed_sizes(buf.getvalue())
    row = M.analyze_values(stored, dtype)
    raw_bytes = stored.nbytes
    for coder, size in real.items():
        derived = raw_bytes / row[f"h5_{coder}_ratio"]
        assert math.isclose(derived, size, rel_tol=1e-3), coder
