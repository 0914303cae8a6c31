"""``eg``: Exp-Golomb coding of integer fields (a real bitstream, bit-exact round trip).

Exp-Golomb codes (Teuhola 1978; order k as in H.264/AVC) are prefix codes for
geometric-like distributions: ``u`` is written as ``u + 2**k`` in binary, preceded by
as many zeros as that number has bits beyond ``k + 1``. They need no table, decode
one symbol at a time, and come close to the entropy of the peaked, two-sided
distributions quantized gradients have — as long as the values are mapped to
non-negative integers well (see ``measures.MAPPINGS``).

``k=auto`` and ``mapping=auto`` choose the order and mapping with the fewest exact
bits, computed from the stream's histogram before anything is written (the encoder
then checks that it wrote exactly that many bits). The chosen k and mapping travel in
the header; ``rank`` also sends its symbol table, counted in the payload's bytes.
Streams where coding does not pay are stored raw.

Streams of at least ``SPLIT_MIN`` symbols are coded as two bitstreams, the first and
second half of the symbols (their byte lengths in the header, ``cw``), so the decoder
can read both at once: each symbol's length decides where the next one starts, a chain
one stream cannot shorten. Payloads of one stream (no ``cw``) decode as before.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np
import torch

from gradzip.codecs.base import LosslessCoder, Slot
from gradzip.codecs.entropy import _eg_choice, _frame, _kernels, measures
from gradzip.codecs.payload import MetaValue, Payload
from gradzip.codecs.registry import Param, in_range, register

_MODES = {name: i for i, name in enumerate(measures.MAPPINGS)}
_NO_TABLE = np.zeros(1, np.int64)
#: the rank mapping needs a lookup table over [min, max]; wider streams skip it
_RANK_SPAN = 1 << 20
#: alphabets narrower than this get precomputed per-symbol codes
_TABLE_SPAN = 1 << 16
#: streams of at least this many symbols are coded as two halves (two bitstreams)
SPLIT_MIN = 1 << 14
#: tables whose codes all fit in this many bits are encoded two symbols at a time
SHORT_CODE = 16


def _choose(values: np.ndarray, counts: np.ndarray, k: int | str, mapping: str
            ) -> measures.EgChoice | None:
    """The cheapest allowed (mapping, k) by exact bits, or None if no mapping applies."""
    lo, hi = int(values[0]), int(values[-1])
    fits = {
        "sign": max(-lo, hi) < measures.MAX_MAPPED,
        "sign_always": max(-lo, hi) < measures.MAX_MAPPED,
        "zigzag": max(-lo, hi) < measures.MAX_MAPPED // 2,
        "offset": hi - lo < measures.MAX_MAPPED,
        "rank": hi - lo < _RANK_SPAN,
    }
    allowed = [fits[m] and mapping in ("auto", m) for m in measures.MAPPINGS]
    return _eg_choice.choose(values, counts, allowed, None if k == "auto" else int(k))


@register("eg")
class ExpGolomb(LosslessCoder):
    """Exp-Golomb order-k codes of integer fields, k and mapping chosen by exact size."""

    summary = "Exp-Golomb bitstream for integer fields (k and signed mapping auto-chosen)"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("k", int, "auto", "code order k (auto: the fewest exact bits)",
              check=in_range(0, measures.MAX_K), allow_auto=True),
        Param("mapping", str, "auto",
              "signed -> unsigned map: sign (sign bit for non-zero), sign_always, zigzag, "
              "offset (v - min), rank (by frequency, BackSlash); auto: the fewest bits",
              choices=("auto", *measures.MAPPINGS)),
    )

    def encode_field(self, t: torch.Tensor, slot: Slot | None = None) -> Payload:
        return encode(t, self.params["k"], self.params["mapping"])

    def decode_field(self, p: Payload, device: torch.device | None = None) -> torch.Tensor:
        return decode(p)


def _code_table(values: np.ndarray, counts: np.ndarray, choice: measures.EgChoice,
                lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Every symbol's complete code (prefix, value, sign bit) and length, indexed by
    v - lo, when the alphabet is narrow and every code fits in 32 bits; else None."""
    if hi - lo >= _TABLE_SPAN:
        return None
    u, extra = measures.map_values(values, choice.mapping, counts)
    n = u + (1 << choice.k)
    lengths = 2 * measures.bit_length(n) - 1 - choice.k + extra
    if int(lengths.max()) > 32:
        return None
    codes = np.where(extra > 0, (n << 1) | (values < 0), n).astype(np.uint64)
    code_of = np.zeros(hi - lo + 1, np.uint64)
    len_of = np.zeros(hi - lo + 1, np.uint64)
    code_of[values - lo] = codes
    len_of[values - lo] = lengths
    return code_of, len_of


def _peek_table(table: np.ndarray, k: int, mapping: str, lo: int) -> np.ndarray:
    """The decoder's PEEK-bit lookup of all codes short enough to fit in it. Tables of
    the mappings that do not depend on the data (all but ``rank``) are kept: building
    one took 0.34 ms, 13% of decoding a 875K-symbol stream."""
    if mapping == "rank":
        return _build_peek_table(table, k, mapping, lo)
    return _cached_peek_table(k, mapping, lo)


@functools.lru_cache(maxsize=64)
def _cached_peek_table(k: int, mapping: str, lo: int) -> np.ndarray:
    peek = _build_peek_table(_NO_TABLE, k, mapping, lo)
    peek.setflags(write=False)  # shared by every decode: nothing may change it
    return peek


def _build_peek_table(table: np.ndarray, k: int, mapping: str, lo: int) -> np.ndarray:
    short = (1 << _kernels.PEEK)  # every u whose code can fit in PEEK bits
    u = np.arange(short, dtype=np.int64)
    n = u + (1 << k)
    lengths = 2 * measures.bit_length(n) - 1 - k
    if mapping == "sign":  # zero has no sign bit
        values = np.concatenate([u[:1], u[1:], -u[1:]])
        codes = np.concatenate([n[:1], n[1:] << 1, (n[1:] << 1) | 1])
        lengths = np.concatenate([lengths[:1], lengths[1:] + 1, lengths[1:] + 1])
    elif mapping == "sign_always":
        values = np.concatenate([u, -u])
        codes = np.concatenate([n << 1, (n << 1) | 1])
        lengths = np.concatenate([lengths + 1, lengths + 1])
    elif mapping == "zigzag":
        values = np.where(u % 2 == 0, u // 2, -(u + 1) // 2)
        codes = n
    elif mapping == "offset":
        values = u + lo
        codes = n
    else:
        keep = u < table.size
        values, codes, lengths = table[u[keep]], n[keep], lengths[keep]
    return _kernels.peek_table(codes.astype(np.uint64), lengths.astype(np.int64),
                               values.astype(np.int64))


def encode(t: torch.Tensor, k: int | str = "auto", mapping: str = "auto") -> Payload:
    """Exp-Golomb code one integer tensor; the stored form if coding does not pay."""
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"eg codes integer tensors, got {t.dtype}")
    v = _frame.to_numpy(t)
    if v.size == 0:
        return _frame.pick(None, t)
    values, counts = _histogram(v)
    lo, hi = int(values[0]), int(values[-1])
    choice = _choose(values, counts, k, mapping)
    if choice is None or choice.payload_bits >= 8 * v.nbytes:
        return _frame.pick(None, t)
    meta: dict[str, MetaValue] = {"m": "eg", "dt": _frame.dtype_code(t), "sh": tuple(t.shape),
                                  "k": choice.k, "map": choice.mapping}
    fields: dict[str, bytes] = {}
    lut = _NO_TABLE
    if choice.mapping == "rank":
        ranked = measures.rank_order(values, counts)
        lut = np.zeros(hi - lo + 1, np.int64)
        lut[ranked - lo] = np.arange(ranked.size)
        fields["t"] = _kernels.varint_pack(ranked - lo).tobytes()
        meta["v"] = int(ranked.size)
    if choice.mapping in ("offset", "rank"):
        meta["lo"] = int(lo)
    nbytes = (choice.payload_bits + 7) // 8
    # narrow alphabets: every code precomputed (the table encoder); wide ones: the
    # generic encoder. Both write the same big-endian bitstream (tested)
    table = _code_table(values, counts, choice, lo, hi)
    halves = [v] if v.size < SPLIT_MIN else [v[:(v.size + 1) // 2], v[(v.size + 1) // 2:]]
    sizes, written = [], 0
    if table is not None:  # both halves into one buffer: no copies
        data = np.empty(nbytes + 8, np.uint8)  # each half rounds up by one byte at most
        short = int(table[1].max()) <= SHORT_CODE
        end = 0
        for part in halves:
            stop, n = _kernels.eg_encode_lut(part, lo, table[0], table[1], data, end, short)
            sizes.append(stop - end)
            end, written = stop, written + n
        data = data[:end]
    else:
        streams = []
        for part in halves:  # nbytes bounds each half's bytes too
            bits, n = _kernels.eg_encode(part, _MODES[choice.mapping], choice.k, lo, lut,
                                         nbytes, _kernels.BL8)
            streams.append(bits)
            sizes.append(bits.size)
            written += n
        data = np.concatenate(streams) if len(streams) > 1 else streams[0]
    if written != choice.payload_bits:  # the formula and the bitstream must agree
        raise AssertionError(f"eg wrote {written} bits, expected {choice.payload_bits}")
    if len(sizes) > 1:
        meta["cw"] = tuple(int(n) for n in sizes)
    fields["d"] = _frame.byte_view(data)
    return _frame.pick(Payload(dict(fields), meta), t)


def _histogram(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values present, ascending; their counts): one pass for narrow streams (bytes
    need no min/max pass), a sort for wide ones."""
    if v.dtype.itemsize == 1:
        base = -128 if v.dtype == np.int8 else 0
        counts = _kernels.byte_hist(v)
    else:
        base, hi = _kernels.minmax(v)
        if hi - base >= (1 << 24):
            return measures.histogram(v)
        counts = _kernels.hist(v, base, hi - base + 1)
    present = np.nonzero(counts)[0]
    return present.astype(np.int64) + base, counts[present]


def decode(p: Payload) -> torch.Tensor:
    """Rebuild the exact tensor from an ``eg`` coded field; raises on corruption."""
    _frame.check(p, "eg")
    if p.meta.get("m") == _frame.STORED:
        return _frame.unstore(p, "eg")
    if p.meta.get("m") != "eg":
        raise _frame.EntropyCodingError(f"eg: unknown coding mode {p.meta.get('m')!r}")
    dtype, shape, numel = _frame.header(p)
    k, mapping = p.meta.get("k"), p.meta.get("map")
    if not isinstance(k, int) or not 0 <= k <= measures.MAX_K or mapping not in _MODES:
        raise _frame.EntropyCodingError(f"eg: bad header k={k!r} mapping={mapping!r}")
    lo = _frame.meta_int(p, "lo", "eg", default=0)
    table = _NO_TABLE
    if mapping == "rank":
        raw = np.frombuffer(_frame.blob(p, "t", "eg"), np.uint8)
        ranks = _frame.meta_int(p, "v", "eg", default=0)
        if not 0 <= ranks <= raw.size:  # each rank takes a byte or more: check, then allocate
            raise _frame.EntropyCodingError(f"eg: rank table of {ranks} values in {raw.size} "
                                            "bytes")
        table, used = _kernels.varint_unpack(raw, ranks)
        if used != raw.size:
            raise _frame.EntropyCodingError("eg: malformed rank table")
        table = table + lo
    data = _frame.blob(p, "d", "eg")
    buf = np.zeros(len(data) + 16, np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    np_dtype = _frame.NP_DTYPES[dtype]
    out: np.ndarray = np.empty(numel, np_dtype)
    peek = _peek_table(table, k, mapping, lo)
    args = (out, _MODES[mapping], k, lo, table, _kernels.LZ8, peek)
    sizes = p.meta.get("cw", (len(data),))
    if (not isinstance(sizes, tuple) or len(sizes) not in (1, 2)
            or any(not isinstance(n, int) or n < 0 for n in sizes) or sum(sizes) != len(data)):
        raise _frame.EntropyCodingError(f"eg: stream sizes {sizes!r} do not match the data")
    if len(sizes) == 1:
        read: tuple[int, ...] = (_kernels.eg_decode_lut(buf, len(data), *args),)
    else:
        read = _kernels.eg_decode_pair(buf, sizes[0], len(data), *args)
    if any(r < 0 or (r + 7) // 8 != size for r, size in zip(read, sizes, strict=True)):
        raise _frame.EntropyCodingError("eg: bitstream is truncated or malformed")
    return _frame.from_numpy(out, dtype, shape, owned=True)
