"""Per-bucket compressibility measures, accumulated over slices of the bucket.

A bucket is read in slices (``analyze_bucket(..., slice_elems=)``) so that no worker
needs more than a bounded amount of memory; every measure merges across slices: moments
add, symbol histograms add (entropies, Exp-Golomb and rank-mapped sizes are arithmetic
over the merged histogram, never a loop over values), compressed sizes add (each slice
compressed on its own, as a streaming compressor would flush). Every pass over the values
is a one-loop numba kernel (``_kernels``); what remains is the real compressors.

Columns (one row per bucket; savings are labelled vs fp32 and vs the captured dtype):

* statistics: mean, std, abs-max, excess kurtosis, fraction of zeros, the shape of a
  generalized Gaussian fitted by moments (2 = Gaussian, 1 = Laplace, smaller = heavier);
* lossless on the raw values: deflate (``isal`` when installed — ISA-L, zlib-compatible,
  level 2 ~ zlib 6's ratio here — else the standard library's zlib level 6; the column
  ``deflate_impl`` says which), zstd level 1, lz4; the same three on an HDF5 file holding
  the bucket as one dataset ("zip of the h5": the values' sizes plus those of the file's
  metadata compressed on its own, which is what the file is; within 0.1% of compressing
  the file, tested); gradzip's ``lossless`` float codec; the
  order-0 entropies of the sign, exponent and mantissa fields, whose sum bounds any coder
  that codes the fields independently (fp32 mantissas: the sum over its 3 byte planes,
  an upper bound of their joint entropy);
* after quantization (``int8``: abs-max per block of 256; ``fixed``: round(x * 1e6) in
  float32): order-0 entropy, Exp-Golomb bits for k = 0..40 with each signed mapping (sign
  bit, always-sign-bit, zigzag) and with frequency-rank mapping, the best of them and its
  efficiency eta = entropy / bits, the ``ans`` stage's payload (sized from the histogram
  with the stage's own quantized table: ``ans.size_from_histogram``, within 0.1% of
  coding), zstd level 1 of the integers (narrowed to the smallest integer type);
* the first study's exact column (``first_study_*``): q = round(float32(x) * 1e6) over the
  bucket, each value coded as the order-0 Exp-Golomb codeword of |q| (2 floor(log2(|q|+1))
  + 1 bits) plus one sign bit for every value, zero included; bytes = bits // 8;
  saving = 1 - bytes / (2 * values) (vs fp16, as published);
* ``fixed_misordered``: the rank-mapped Exp-Golomb code beats the sign-mapped one by more
  than 10%: the symbols are not ordered by probability, and plain EG is far from the limit.
"""

from __future__ import annotations

import functools
import io
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import lz4.frame
import numpy as np
import torch
import zstandard

from gradzip.analyze import _kernels as _k
from gradzip.analyze.sources import as_float32
from gradzip.capture.packs import storage_dtype
from gradzip.codecs.entropy import ans
from gradzip.codecs.entropy import measures as em

QUANTIZERS = ("int8", "fixed")
FIXED_SCALE = 1e6
INT8_BLOCK = 256
EG_MAPPINGS = ("sign", "sign_always", "zigzag", "rank")

try:  # ISA-L's deflate: the same format as zlib, ~15x faster here
    from isal import isal_zlib as _isal

    DEFLATE_IMPL = "isal-2"
except ImportError:  # pragma: no cover - isal is a dependency
    _isal = None  # type: ignore[assignment]
    DEFLATE_IMPL = "zlib-6"


def deflate_size(data: bytes | memoryview) -> int:
    if _isal is not None:
        return len(_isal.compress(data, 2))
    return len(zlib.compress(data, 6))  # pragma: no cover


_ZSTD = zstandard.ZstdCompressor(level=1)


def compressed_sizes(data: bytes | memoryview) -> dict[str, int]:
    """deflate, zstd and lz4 sizes of ``data``."""
    return {"deflate": deflate_size(data), "zstd": len(_ZSTD.compress(data)),
            "lz4": len(lz4.frame.compress(data))}


def _merge_hist(a: tuple[np.ndarray, np.ndarray] | None,
                b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    if a is None:
        return b
    values = np.concatenate([a[0], b[0]])
    counts = np.concatenate([a[1], b[1]])
    merged, inverse = np.unique(values, return_inverse=True)
    return merged, np.bincount(inverse, weights=counts).astype(np.int64)


@dataclass
class Accumulator:
    """Everything measured so far over the slices of one bucket."""

    dtype: str
    n: int = 0
    moments: np.ndarray = field(default_factory=lambda: np.zeros(5))  # |x|, x, x^2, x^3, x^4
    zeros: int = 0
    absmax: float = 0.0
    raw: dict[str, int] = field(default_factory=dict)
    lossless: int = 0
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    hists: dict[str, tuple[np.ndarray, np.ndarray] | None] = field(default_factory=dict)
    ans: dict[str, int] = field(default_factory=dict)
    zstd_q: dict[str, int] = field(default_factory=dict)

    def add(self, stored: np.ndarray) -> None:
        """Measure one slice (stored dtype: bfloat16 as uint16 bits)."""
        x32 = np.ascontiguousarray(as_float32(stored, self.dtype))
        sums, zeros, absmax = _k.moments(x32)
        self.n += x32.size
        self.moments += sums
        self.zeros += int(zeros)
        self.absmax = max(self.absmax, float(absmax))
        _add(self.raw, compressed_sizes(stored.data))
        self.lossless += _lossless_bytes(stored, self.dtype)
        for name, counts in _field_counts(stored, self.dtype).items():
            prev = self.fields.get(name)
            self.fields[name] = counts if prev is None else prev + counts
        for q in QUANTIZERS:
            ints, hist = quantize_with_histogram(x32, q)
            self.hists[q] = _merge_hist(self.hists.get(q), hist)
            self.zstd_q[q] = self.zstd_q.get(q, 0) + len(_ZSTD.compress(_narrow(ints).data))
            self.ans[q] = self.ans.get(q, 0) + ans.size_from_histogram(
                *hist, torch.from_numpy(_narrow(hist[0][[0, -1]])).dtype)

    def row(self) -> dict[str, Any]:
        """The bucket's columns (see the module docstring)."""
        n, itemsize = self.n, storage_dtype(self.dtype).itemsize
        raw_bytes = n * itemsize
        out: dict[str, Any] = {"values": n, "dtype": self.dtype, **self._stats()}
        out["deflate_impl"] = DEFLATE_IMPL
        h5 = {coder: size + _h5_metadata_sizes(n, self.dtype)[coder]
              for coder, size in self.raw.items()}
        for where, sizes in (("raw", self.raw), ("h5", h5)):
            for coder, size in sizes.items():
                out[f"{where}_{coder}_ratio"] = raw_bytes / size if size else math.nan
        out["lossless_ratio"] = raw_bytes / self.lossless if self.lossless else math.nan
        bound = 0.0
        for name, counts in self.fields.items():
            h = em.entropy_of_counts(counts[counts > 0])
            out[f"{name}_entropy_bits"] = h
            bound += h
        out["field_entropy_bits_per_value"] = bound
        out["field_entropy_ratio"] = itemsize * 8 / bound if bound else math.nan
        for q in QUANTIZERS:
            out.update(self._quantized(q))
        out.update(self._first_study())
        out["bits_per_value_fp32"] = 32
        out["bits_per_value_captured"] = itemsize * 8
        return out

    def _stats(self) -> dict[str, float]:
        n = max(self.n, 1)
        m_abs, m1, m2, m3, m4 = self.moments / n
        var = max(m2 - m1 * m1, 0.0)
        central4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1 ** 4
        return {"mean": m1, "std": math.sqrt(var), "absmax": self.absmax,
                "kurtosis": central4 / var ** 2 - 3 if var > 0 else math.nan,
                "zero_fraction": self.zeros / n, "ggd_shape": ggd_shape(m_abs, m2)}

    def _quantized(self, q: str) -> dict[str, Any]:
        values, counts = self.hists[q]  # type: ignore[misc]
        n = int(counts.sum())
        h = em.entropy_of_counts(counts)
        out: dict[str, Any] = {f"{q}_entropy_bits": h, f"{q}_symbols": int(values.size)}
        best = (math.inf, "", 0)
        for mapping in EG_MAPPINGS:
            choice = em.best_k(values, counts, mapping)  # rank: its table counted
            out[f"{q}_eg_{mapping}_bits"] = choice.total_bits / n
            out[f"{q}_eg_{mapping}_k"] = choice.k
            best = min(best, (choice.total_bits, mapping, choice.k))
        out[f"{q}_eg_best_bits"] = best[0] / n
        out[f"{q}_eg_best"] = f"{best[1]},k={best[2]}"
        out[f"{q}_eg_eta"] = h * n / best[0] if best[0] else math.nan
        out[f"{q}_ans_bits"] = self.ans[q] * 8 / n
        out[f"{q}_ans_eta"] = h * n / (self.ans[q] * 8) if self.ans[q] else math.nan
        out[f"{q}_zstd_bits"] = self.zstd_q[q] * 8 / n
        out[f"{q}_misordered"] = bool(out[f"{q}_eg_rank_bits"] < 0.9 * out[f"{q}_eg_sign_bits"])
        return out

    def _first_study(self) -> dict[str, Any]:
        """The published method, exactly (see the module docstring)."""
        values, counts = self.hists["fixed"]  # type: ignore[misc]
        n = int(counts.sum())
        lengths = 2 * em.bit_length(np.abs(values) + 1) - 1  # 2 floor(log2(|q|+1)) + 1
        bits = int((lengths * counts).sum()) + n  # a sign bit for every value
        nbytes = bits // 8
        return {"first_study_bytes": nbytes, "first_study_saving_vs_fp16": 1 - nbytes / (2 * n)}


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


def quantize(x: np.ndarray, q: str) -> np.ndarray:
    """Integer symbols of ``x`` (float32 values) under quantizer ``q``."""
    return quantize_with_histogram(np.ascontiguousarray(x, np.float32), q)[0]


def quantize_with_histogram(x: np.ndarray, q: str
                            ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """(symbols, (values present ascending, their counts)) of float32 ``x`` under ``q``:
    ``int8``, abs-max per block of 256 (float32 ``rint(x / (max / 127))``); ``fixed``,
    the first study's float32 ``rint(x * 1e6)``."""
    if q == "int8":
        ints = np.empty(x.size, np.int8)
        counts = np.zeros(256, np.int64)
        _k.quantize_int8(x, INT8_BLOCK, ints, counts)
        present = np.nonzero(counts)[0]
        return ints, (present.astype(np.int64) - 128, counts[present])
    ints = np.empty(x.size, np.int32)
    lo, hi = _k.quantize_fixed(x, np.float32(FIXED_SCALE), ints)
    if x.size and 0 <= hi - lo < (1 << 24):  # (1, 0): a value does not fit int32
        counts = em.range_histogram(ints, lo, hi - lo + 1)
        present = np.nonzero(counts)[0]
        return ints, (present.astype(np.int64) + lo, counts[present])
    # beyond int32 or a very wide alphabet: numpy in int64 (rare: abs-max > 2,147)
    wide = np.rint(x * np.float32(FIXED_SCALE)).astype(np.int64)
    return wide, em.histogram(wide)


def _narrow(ints: np.ndarray) -> np.ndarray:
    """The smallest signed integer dtype that holds ``ints``."""
    if ints.size == 0:
        return ints.astype(np.int8)
    lo, hi = int(ints.min()), int(ints.max())
    for dt in (np.int8, np.int16, np.int32):
        if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
            return ints.astype(dt)
    return ints.astype(np.int64)


@functools.lru_cache(maxsize=1)
def _lossless_codec() -> Any:
    import gradzip

    return gradzip.codec("lossless", nonfinite="propagate")  # NaN/inf bits coded exactly


def _lossless_bytes(stored: np.ndarray, dtype: str) -> int:
    """Bytes of the ``lossless`` codec's payload of the values (as sent: ``wire_bytes``)."""
    t = torch.from_numpy(np.ascontiguousarray(stored))
    t = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return _lossless_codec().encode(t, key="analyze").wire_bytes


def _field_counts(stored: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """Histograms of the sign, exponent and mantissa fields (fp32 mantissa: 3 planes)."""
    bits = {"float32": (8, 23), "float16": (5, 10), "bfloat16": (8, 7), "float64": (11, 52)}
    e, m = bits[dtype]
    u = stored.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[stored.dtype.itemsize])
    sign, exponent = np.zeros(2, np.int64), np.zeros(1 << e, np.int64)
    mantissa = np.zeros(1 << m if m <= 16 else 1, np.int64)
    planes = np.zeros(((m + 7) // 8, 256), np.int64)
    if dtype == "float32":
        _k.float32_fields(np.ascontiguousarray(u), sign, exponent, planes)
    else:
        _k.float_fields(np.ascontiguousarray(u), e, m, sign, exponent, mantissa, planes)
    out = {"sign": sign, "exponent": exponent}
    if m <= 16:
        out["mantissa"] = mantissa
    else:  # byte planes: the sum of their entropies bounds the joint one from above
        out.update({f"mantissa{i}": planes[i] for i in range(len(planes))})
    return out


@functools.lru_cache(maxsize=64)
def _h5_metadata_sizes(n: int, dtype: str) -> dict[str, int]:
    """Compressed sizes of everything in an HDF5 file of the bucket but its values.

    The file holding the bucket as one contiguous dataset is this metadata followed by
    the values' raw bytes, so a stream compressor spends on it what it spends on the
    values plus what it spends on the metadata: "zip of the h5" without compressing the
    values a second time (tested against compressing a real file, within 0.1%)."""
    import h5py

    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:  # contiguous, allocated late: the values not written
        f.create_dataset("bucket", shape=(n,), dtype=storage_dtype(dtype))
    return compressed_sizes(buf.getvalue())


def ggd_shape(mean_abs: float, mean_sq: float) -> float:
    """The shape beta of a zero-mean generalized Gaussian with these moments.

    E|x|^2 / (E|x|)^2 = Gamma(1/b) Gamma(3/b) / Gamma(2/b)^2, decreasing in b; solved by
    bisection on log b (2: Gaussian, 1: Laplace)."""
    if mean_abs <= 0 or mean_sq <= 0:
        return math.nan
    target = mean_sq / mean_abs ** 2

    def ratio(b: float) -> float:
        return math.exp(math.lgamma(1 / b) + math.lgamma(3 / b) - 2 * math.lgamma(2 / b))

    lo, hi = 0.05, 20.0
    if target >= ratio(lo):
        return lo
    if target <= ratio(hi):
        return hi
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ratio(mid) > target else (lo, mid)
    return math.sqrt(lo * hi)


def analyze_values(stored: np.ndarray, dtype: str, slice_elems: int = 1 << 22
                   ) -> dict[str, Any]:
    """All columns of one flat array of values, read ``slice_elems`` at a time."""
    acc = Accumulator(dtype)
    step = max(INT8_BLOCK, slice_elems - slice_elems % INT8_BLOCK)
    for start in range(0, max(stored.size, 1), step):
        part = np.ascontiguousarray(stored[start:start + step])
        if part.size:
            acc.add(part)
    if acc.n == 0:
        raise ValueError("an empty bucket")
    return acc.row()
