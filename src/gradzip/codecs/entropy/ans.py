"""``ans``: asymmetric numeral systems coding of integer fields with an empirical model.

ANS (Duda 2013, "Asymmetric numeral systems: entropy coding combining speed of Huffman
coding with compression rate of arithmetic coding") codes a stream to within a
fraction of a percent of its order-0 entropy. The coder is ``constriction``'s
``stack.AnsCoder`` (Bamler 2022) with a ``Categorical`` model built from the stream's
own histogram; the exact counts of the symbols present travel with the payload (LEB128
varints of gaps and counts, a few bytes per used symbol) and count in its bytes, so the
decoder rebuilds the identical model. Large streams are coded in chunks of ``chunk``
symbols (one model, a word count per chunk in the header) to bound working memory.

Alphabets wider than 2**16 (topk indices, int32/int64 fields) are split into byte
planes of ``v - min``, each coded with its own table. A stream of one repeated value
costs only its header; streams where coding does not pay are stored raw.
"""

from __future__ import annotations

from typing import ClassVar

import constriction
import numpy as np
import torch

from gradzip.codecs.base import LosslessCoder, Slot
from gradzip.codecs.entropy import _frame, _kernels
from gradzip.codecs.payload import Payload
from gradzip.codecs.registry import Param, in_range, register

#: alphabets up to this span are coded directly; wider ones by byte planes
ALPHABET_SPAN = 1 << 16
DEFAULT_CHUNK = 1 << 20


def _model(counts: np.ndarray):  # noqa: ANN202 - constriction has no type stubs
    # perfect=False is deterministic and fast; encoder and decoder build it the same way
    return constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)


def _table_bytes(present: np.ndarray, counts: np.ndarray) -> bytes:
    gaps = np.diff(present, prepend=-1) - 1
    return _kernels.varint_pack(np.concatenate([gaps, counts]).astype(np.int64)).tobytes()


def _read_table(raw: bytes, used: int) -> tuple[np.ndarray, np.ndarray]:
    buf = np.frombuffer(raw, np.uint8)
    vals, read = _kernels.varint_unpack(buf, 2 * used)
    if read != buf.size or used < 1:
        raise _frame.EntropyCodingError("ans: malformed frequency table")
    present = np.cumsum(vals[:used] + 1) - 1
    counts = vals[used:]
    if (counts <= 0).any():
        raise _frame.EntropyCodingError("ans: frequency table has a zero count")
    return present, counts


@register("ans")
class Ans(LosslessCoder):
    """rANS coding (constriction) of integer fields with the stream's own histogram."""

    summary = "ANS entropy coder for integer fields (empirical table sent with the data)"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("chunk", int, DEFAULT_CHUNK, "symbols per independently coded chunk",
              check=in_range(1024, 1 << 30)),
    )

    def encode_field(self, t: torch.Tensor, slot: Slot) -> Payload:
        return encode(t, self.params["chunk"])

    def decode_field(self, p: Payload) -> torch.Tensor:
        return decode(p)


def encode(t: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> Payload:
    """ANS-code one integer tensor; the stored form if coding does not pay."""
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"ans codes integer tensors, got {t.dtype}")
    return _frame.pick(_code(_frame.to_numpy(t), t, chunk), t)


def _code(v: np.ndarray, t: torch.Tensor, chunk: int) -> Payload | None:
    if v.size == 0:
        return None
    meta = {"dt": _frame.dtype_code(t), "sh": tuple(t.shape)}
    lo, hi = _kernels.minmax(v)
    if lo == hi:
        return Payload({}, {"m": "const", **meta, "lo": int(lo)})
    if hi - lo >= ALPHABET_SPAN:
        return _code_planes(v, t, lo, hi, chunk, meta)
    counts = _kernels.hist(v, lo, hi - lo + 1)
    present = np.nonzero(counts)[0]
    lut = np.zeros(hi - lo + 1, np.int32)
    lut[present] = np.arange(present.size, dtype=np.int32)
    symbols = np.empty(v.size, np.int32)
    _kernels.apply_lut(v, lo, lut, symbols)
    model = _model(counts[present])
    words, sizes = [], []
    for start in range(0, v.size, chunk):
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(symbols[start:start + chunk], model)
        w = coder.get_compressed()
        words.append(w)
        sizes.append(int(w.size))
    data = np.concatenate(words).astype("<u4").tobytes()
    meta.update({"m": "ans", "lo": int(lo), "v": int(present.size), "cw": tuple(sizes),
                 "ck": int(chunk)})
    return Payload({"t": _table_bytes(present, counts[present]), "d": data}, meta)


def _code_planes(v: np.ndarray, t: torch.Tensor, lo: int, hi: int, chunk: int,
                 meta: dict) -> Payload:
    """Byte planes of v - lo, each ANS-coded (or stored) on its own."""
    u = (v.astype(np.int64) - lo).view(np.uint64)
    nplanes = (int(hi - lo).bit_length() + 7) // 8
    fields: dict[str, Payload] = {}
    for i in range(nplanes):
        plane = torch.from_numpy(((u >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.uint8))
        fields[f"p{i}"] = encode(plane, chunk)
    return Payload(dict(fields), {"m": "planes", **meta, "lo": int(lo), "np": nplanes})


def decode(p: Payload) -> torch.Tensor:
    """Rebuild the exact tensor from an ``ans`` coded field; raises on corruption."""
    _frame.check(p, "ans")
    mode = p.meta.get("m")
    if mode == _frame.STORED:
        return _frame.unstore(p, "ans")
    dtype, shape, numel = _frame.header(p)
    np_dtype = _frame._NP_DTYPES[dtype]
    lo = p.meta.get("lo")
    if not isinstance(lo, int):
        raise _frame.EntropyCodingError("ans: header lacks the minimum value")
    if mode == "const":
        return _frame.from_numpy(np.full(numel, lo, dtype=np_dtype), dtype, shape)
    if mode == "planes":
        nplanes = p.meta.get("np")
        if not isinstance(nplanes, int) or not 1 <= nplanes <= 8:
            raise _frame.EntropyCodingError(f"ans: bad plane count {nplanes!r}")
        u = np.zeros(numel, np.uint64)
        for i in range(nplanes):
            plane = decode(p.child(f"p{i}")).numpy()
            if plane.size != numel:
                raise _frame.EntropyCodingError("ans: byte plane has the wrong length")
            u |= plane.astype(np.uint64) << np.uint64(8 * i)
        out = (u.view(np.int64) + np.int64(lo)).astype(np_dtype)
        return _frame.from_numpy(out, dtype, shape)
    if mode != "ans":
        raise _frame.EntropyCodingError(f"ans: unknown coding mode {mode!r}")
    present, counts = _read_table(_frame.blob(p, "t", "ans"), int(p.meta.get("v", 0)))
    sizes = p.meta.get("cw")
    data = _frame.blob(p, "d", "ans")
    if not isinstance(sizes, tuple) or 4 * sum(sizes) != len(data) or int(counts.sum()) != numel:
        raise _frame.EntropyCodingError("ans: chunk sizes do not match the data")
    words = np.frombuffer(data, "<u4").astype(np.uint32)
    model = _model(counts)
    chunk = p.meta.get("ck")
    if not isinstance(chunk, int) or chunk < 1 or len(sizes) != -(-numel // chunk):
        raise _frame.EntropyCodingError("ans: bad chunk header")
    symbols = np.empty(numel, np.int32)
    offset = 0
    try:
        for i, size in enumerate(sizes):
            start = i * chunk
            count = min(chunk, numel - start)
            coder = constriction.stream.stack.AnsCoder(words[offset:offset + size])
            symbols[start:start + count] = coder.decode(model, count)
            offset += size
    except (ValueError, RuntimeError, AssertionError) as e:
        raise _frame.EntropyCodingError(f"ans: corrupt data ({e})") from e
    out = np.empty(numel, np_dtype)
    if _kernels.take((present + lo).astype(np_dtype), symbols, out) < 0:
        raise _frame.EntropyCodingError("ans: decoded symbol outside the table")
    return _frame.from_numpy(out, dtype, shape)
