"""Compressibility measures: entropy, exact Exp-Golomb lengths, coding efficiency.

Pure, vectorized numpy functions shared by the ``eg``/``ans`` stages (to choose
parameters from exact sizes) and by the benchmarks (``gradzip bench entropy``: how
close a coder gets to the order-0 entropy).

* Order-0 (empirical) entropy ``H = -sum p_i log2 p_i`` of an integer stream, and of
  the sign, exponent and mantissa fields of fp32/bf16/fp16 values.
* Exp-Golomb code lengths (Teuhola 1978, "A compression method for clustered
  bit-vectors"; order k as in H.264): a non-negative ``u`` costs
  ``2*floor(log2(u + 2**k)) - k + 1`` bits. Signed values need a mapping first:

  - ``sign``: EG(|v|) plus a sign bit only for non-zero values;
  - ``sign_always``: EG(|v|) plus a sign bit for every value (the cal_compression
    setting, kept for comparison);
  - ``zigzag``: 0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ...;
  - ``offset``: v - min (the minimum travels in the header; right for indices);
  - ``rank``: symbols renumbered by descending frequency, the most common symbol
    coded as 0 (BackSlash, Wu et al. 2025, "Rate-constrained optimized training of
    LLMs"); the rank table travels with the payload and its bytes are counted.

* Coding efficiency ``eta = entropy bits / (payload + table + header bits)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradzip.codecs.entropy import _kernels

MAPPINGS = ("sign", "sign_always", "zigzag", "offset", "rank")
#: codes are built for mapped values below this (longer codes never beat raw int64)
MAX_MAPPED = 1 << 52
#: orders tried when choosing k
MAX_K = 40


# ---------------------------------------------------------------- histograms
def histogram(x: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values ascending as int64, their counts) of an integer stream."""
    a = _ints(x)
    if a.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if a.dtype in (np.int8, np.uint8):
        counts = np.bincount(a.view(np.uint8), minlength=256)
        values = np.arange(256, dtype=np.int64)
        if a.dtype == np.int8:
            values = values.astype(np.uint8).view(np.int8).astype(np.int64)
            order = np.argsort(values)
            values, counts = values[order], counts[order]
        keep = counts > 0
        return values[keep], counts[keep].astype(np.int64)
    lo, hi = int(a.min()), int(a.max())
    if hi - lo < (1 << 24):
        counts = np.bincount((a.astype(np.int64) - lo), minlength=hi - lo + 1)
        present = np.nonzero(counts)[0]
        return present.astype(np.int64) + lo, counts[present].astype(np.int64)
    values, counts = np.unique(a.astype(np.int64), return_counts=True)
    return values, counts.astype(np.int64)


def range_histogram(v: np.ndarray, lo: int, size: int) -> np.ndarray:
    """Counts of ``v - lo`` over an alphabet of ``size`` symbols (every value of ``v``
    must lie in ``[lo, lo + size)``): the compiled kernel the coders use, ~4x numpy's."""
    return _kernels.hist(v, lo, size)


def entropy_of_counts(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a histogram (0 for an empty one)."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    n = c.sum()
    if n == 0:
        return 0.0
    p = c / n
    return float(-(p * np.log2(p)).sum())


def entropy(x: np.ndarray | torch.Tensor) -> float:
    """Empirical order-0 entropy of an integer symbol stream, bits per symbol."""
    return entropy_of_counts(histogram(x)[1])


def entropy_bits(x: np.ndarray | torch.Tensor) -> float:
    """Total order-0 information of the stream in bits (entropy x length)."""
    values, counts = histogram(x)
    return entropy_of_counts(counts) * float(counts.sum())


_FLOAT_LAYOUT = {  # dtype -> (total bits, exponent bits, mantissa bits)
    torch.float32: (32, 8, 23),
    torch.bfloat16: (16, 8, 7),
    torch.float16: (16, 5, 10),
}


def float_fields(x: torch.Tensor) -> dict[str, np.ndarray]:
    """The sign, exponent and mantissa bit fields of an fp32/bf16/fp16 tensor."""
    if x.dtype not in _FLOAT_LAYOUT:
        raise TypeError(f"float_fields needs fp32, bf16 or fp16 values, got {x.dtype}")
    bits, ebits, mbits = _FLOAT_LAYOUT[x.dtype]
    as_int = {32: torch.int32, 16: torch.int16}[bits]
    w = x.detach().contiguous().reshape(-1).cpu().view(as_int).numpy().astype(np.int64)
    w &= (1 << bits) - 1
    return {
        "sign": (w >> (bits - 1)) & 1,
        "exponent": (w >> mbits) & ((1 << ebits) - 1),
        "mantissa": w & ((1 << mbits) - 1),
    }


def float_field_entropy(x: torch.Tensor) -> dict[str, float]:
    """Order-0 entropy (bits per value) of each float field, their sum, and the width."""
    fields = float_fields(x)
    out = {name: entropy(v) for name, v in fields.items()}
    out["total"] = sum(out.values())
    out["bits"] = float(_FLOAT_LAYOUT[x.dtype][0])
    return out


# ---------------------------------------------------------------- Exp-Golomb
def bit_length(n: np.ndarray) -> np.ndarray:
    """Exact number of binary digits of each non-negative integer (0 -> 0)."""
    n = np.asarray(n).astype(np.uint64)
    hi = (n >> np.uint64(32)).astype(np.float64)
    lo = (n & np.uint64(0xFFFFFFFF)).astype(np.float64)  # both exact in float64
    return np.where(hi > 0, 32 + np.frexp(hi)[1], np.frexp(lo)[1]).astype(np.int64)


def eg_lengths(u: np.ndarray, k: int) -> np.ndarray:
    """Exp-Golomb order-k code length in bits of each non-negative ``u`` (< 2**52)."""
    u = np.asarray(u, dtype=np.int64)
    if u.size and (int(u.min()) < 0 or int(u.max()) >= MAX_MAPPED):
        raise ValueError(f"Exp-Golomb lengths need 0 <= u < 2**52, got range "
                         f"[{int(u.min())}, {int(u.max())}]")
    if not 0 <= k <= MAX_K:
        raise ValueError(f"Exp-Golomb order k must be in [0, {MAX_K}], got {k}")
    return 2 * bit_length(u + (1 << k)) - k - 1


def rank_order(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Distinct values sorted by descending count (ties: smaller value first)."""
    order = np.lexsort((values, -counts))
    return np.asarray(values)[order]


def map_values(values: np.ndarray, mapping: str, counts: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Map signed values to (non-negative EG input u, extra sign bits per value).

    ``values`` may be a stream or the distinct values of a histogram; ``rank`` and
    ``offset`` are defined relative to the histogram (``counts`` is required for rank).
    """
    v = np.asarray(values, dtype=np.int64)
    if mapping in ("sign", "sign_always"):
        if v.size and int(v.min()) <= -MAX_MAPPED:
            raise ValueError("values too negative for a sign mapping")
        u = np.abs(v)
        extra = (v != 0).astype(np.int64) if mapping == "sign" else np.ones_like(v)
        return u, extra
    if mapping == "zigzag":
        if v.size and (int(v.min()) <= -MAX_MAPPED or int(v.max()) >= MAX_MAPPED):
            raise ValueError("values too large for zigzag mapping")
        return np.where(v >= 0, 2 * v, -2 * v - 1), np.zeros_like(v)
    if mapping == "offset":
        lo = int(v.min()) if v.size else 0
        return v - lo, np.zeros_like(v)
    if mapping == "rank":
        if counts is None:
            distinct, counts = np.unique(v, return_counts=True)
        else:
            distinct = v
        ranked = rank_order(distinct, np.asarray(counts))
        order = np.argsort(ranked, kind="stable")
        return order[np.searchsorted(ranked[order], v)].astype(np.int64), np.zeros_like(v)
    raise ValueError(f"unknown mapping {mapping!r}; choose from {', '.join(MAPPINGS)}")


def eg_code_lengths(x: np.ndarray | torch.Tensor, k: int, mapping: str) -> np.ndarray:
    """Per-symbol code length in bits of a stream under order ``k`` and ``mapping``."""
    v = _ints(x).astype(np.int64)
    u, extra = map_values(v, mapping)
    return eg_lengths(u, k) + extra


def rank_table_bits(values: np.ndarray, counts: np.ndarray) -> int:
    """Bits the ``rank`` mapping's table takes on the wire (varints of value - min)."""
    if len(values) == 0:
        return 0
    ranked = rank_order(values, counts) - int(np.min(values))
    return 8 * int(varint_sizes(ranked).sum())


def varint_sizes(n: np.ndarray) -> np.ndarray:
    """LEB128 bytes of each non-negative integer."""
    return np.maximum(1, (bit_length(n) + 6) // 7)


def eg_bits(values: np.ndarray, counts: np.ndarray, k: int, mapping: str) -> int:
    """Exact payload bits of a stream given by its histogram (no table, no header)."""
    if len(values) == 0:
        return 0
    u, extra = map_values(values, mapping, counts)
    return int(((eg_lengths(u, k) + extra) * counts).sum())


@dataclass(frozen=True)
class EgChoice:
    """The best Exp-Golomb order for a stream and mapping, with exact sizes in bits."""

    mapping: str
    k: int
    payload_bits: int
    table_bits: int

    @property
    def total_bits(self) -> int:
        return self.payload_bits + self.table_bits


def best_k(values: np.ndarray, counts: np.ndarray, mapping: str,
           ks: range | None = None) -> EgChoice:
    """The order k with the fewest exact payload bits (smallest k on ties)."""
    if len(values) == 0:
        return EgChoice(mapping, 0, 0, 0)
    u, extra = map_values(values, mapping, counts)
    extra_bits = int((extra * counts).sum())
    top = int(u.max())
    if top >= MAX_MAPPED:
        raise ValueError("values too large for Exp-Golomb coding")
    ks = ks if ks is not None else range(0, min(MAX_K, max(1, top.bit_length())) + 1)
    by_k = _kernels.eg_bits_by_k(np.ascontiguousarray(u, np.int64),
                                 np.ascontiguousarray(counts, np.int64), max(ks))
    best = min(((k, int(by_k[k]) + extra_bits) for k in ks), key=lambda kb: kb[1])
    table = rank_table_bits(values, counts) if mapping == "rank" else 0
    return EgChoice(mapping, best[0], best[1], table)


def efficiency(entropy_bits: float, payload_bits: float, table_bits: float = 0.0,
               header_bits: float = 0.0) -> float:
    """eta = entropy bits / everything sent (payload + table + header); 1.0 is ideal."""
    total = payload_bits + table_bits + header_bits
    if total <= 0:
        return 1.0 if entropy_bits <= 0 else 0.0
    return float(entropy_bits) / float(total)


def _ints(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise TypeError(f"expected an integer tensor, got {x.dtype}")
        x = x.detach().contiguous().reshape(-1).cpu().numpy()
    a = np.asarray(x).reshape(-1)
    if a.dtype.kind not in "iu":
        raise TypeError(f"expected integers, got {a.dtype}")
    return a
