"""``ans``: asymmetric numeral systems coding of integer fields with an empirical model.

ANS (Duda 2013, "Asymmetric numeral systems: entropy coding combining speed of Huffman
coding with compression rate of arithmetic coding") codes a stream to within a
fraction of a percent of its order-0 entropy. The model is the stream's own histogram;
its table (LEB128 varints of the gaps between the symbols present and their
frequencies) travels with the payload and counts in its bytes, so the decoder rebuilds
the identical model. Two backends, both exact, chosen by ``backend``:

* ``rans`` (default): a numba rANS with frequencies quantized to 2**15 and eight
  interleaved states (``_rans.py``) — the fast path (``gradzip bench entropy``).
* ``constriction``: ``constriction``'s ``stack.AnsCoder`` (Bamler 2022) with a
  ``Categorical`` model of the exact counts — the reference implementation, about
  half the speed. Both spend within ~0.1% of the entropy on large streams.
* ``lanes``: the device format (``ans_lanes.py``): blocks of 16,384 symbols, each
  coded by 32 interleaved rANS states in lock step, as DietGPU codes on a GPU. A field
  on a CUDA device is coded this way by the ``rans`` backend too (a Triton kernel, the
  payload staying on the device); ``lanes`` asks for the format everywhere (on a CPU,
  a vectorised torch reference at 12-20 MB/s). Either side decodes either's payloads.

Large streams are coded in chunks of ``chunk`` symbols (one model, a word count per
chunk in the header), which bounds working memory and lets a decoder stop early; the
chunks' independent states let the vector decoder step four chunks at once. The
default, 2**16 symbols, costs 35 bytes a chunk (its final states and word count): 0.05%
of a one-byte stream.

Alphabets wider than 2**16 (topk indices, int32/int64 fields) are split into byte
planes of ``v - min``, each coded with its own table. A stream of one repeated value
costs only its header; streams where coding does not pay are stored raw.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import ClassVar

import constriction
import numpy as np
import torch

from gradzip.codecs import kernels
from gradzip.codecs.base import LosslessCoder, Slot
from gradzip.codecs.entropy import (
    _frame,
    _kernels,
    _rans,
    _rans_vector,
    _rans_vector_decode,
    ans_lanes,
)
from gradzip.codecs.payload import MetaValue, Payload
from gradzip.codecs.registry import Param, in_range, register

#: alphabets up to this span are coded directly; wider ones by byte planes
ALPHABET_SPAN = 1 << 16
#: the rANS backend codes directly at most this many distinct symbols
RANS_SYMBOLS = 4096
DEFAULT_CHUNK = 1 << 16
BACKENDS = ("rans", "constriction", "lanes")
#: the rANS coders: eight states in one SIMD register where the host has AVX2 (the
#: decoder four chunks at a time), else one state after another; the same words either way
RANS_ENCODER = _rans_vector if _rans_vector.AVAILABLE else _rans
RANS_DECODER = _rans_vector_decode if _rans_vector_decode.AVAILABLE else _rans
#: mode of the rans backend's payloads: eight interleaved states (``_rans.encode``);
#: ``rans`` payloads of the first format (two states) still decode
RANS = "rans8"


def _little_endian_bytes(words: np.ndarray) -> bytes:
    """16-bit words as little-endian bytes (a view, not a copy, on little-endian hosts)."""
    return _frame.byte_view(words) if sys.byteorder == "little" else words.astype("<u2").tobytes()


def _model(counts: np.ndarray):  # noqa: ANN202 - constriction has no type stubs
    # perfect=False is deterministic and fast; encoder and decoder build it the same way
    return constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)


def _table_bytes(present: np.ndarray, counts: np.ndarray) -> bytes:
    gaps = np.diff(present, prepend=-1) - 1
    return _kernels.varint_pack(np.concatenate([gaps, counts]).astype(np.int64)).tobytes()


def _read_table(raw: bytes | bytearray | memoryview, used: int) -> tuple[np.ndarray, np.ndarray]:
    buf = np.frombuffer(raw, np.uint8)
    if not 1 <= used <= buf.size // 2:  # each of the 2 x used varints takes a byte or more
        raise _frame.EntropyCodingError(f"ans: table of {used} symbols in {buf.size} bytes")
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
        Param("backend", str, "rans",
              "rans (numba on a host, a Triton kernel on a GPU), constriction (reference) "
              "or lanes (the GPU's format everywhere)", choices=BACKENDS),
    )

    def encode_field(self, t: torch.Tensor, slot: Slot | None = None) -> Payload:
        return encode(t, self.params["chunk"], self.params["backend"])

    def decode_field(self, p: Payload, device: torch.device | None = None) -> torch.Tensor:
        return decode(p, device)


def encode(t: torch.Tensor, chunk: int = DEFAULT_CHUNK, backend: str = "rans") -> Payload:
    """ANS-code one integer tensor; the stored form if coding does not pay."""
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"ans codes integer tensors, got {t.dtype}")
    if backend not in BACKENDS:
        raise ValueError(f"ans backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "lanes" or (backend == "rans" and kernels.runs_on(t)):
        return ans_lanes.encode(t)
    return _frame.pick(_code(_frame.to_numpy(t), t, chunk, backend), t)


def _code(v: np.ndarray, t: torch.Tensor, chunk: int, backend: str) -> Payload | None:
    if v.size == 0:
        return None
    meta: dict[str, MetaValue] = {"dt": _frame.dtype_code(t), "sh": tuple(t.shape)}
    if v.dtype.itemsize == 1:  # histogram over the whole byte range, no min/max pass
        base = -128 if v.dtype == np.int8 else 0
        counts = _kernels.byte_hist(v)
    else:
        lo, hi = _kernels.minmax(v)
        if hi - lo >= ALPHABET_SPAN:
            return _code_planes(v, t, lo, hi, chunk, backend, meta)
        base = lo
        counts = _kernels.hist(v, base, hi - lo + 1)
    present = np.nonzero(counts)[0]
    if present.size == 1:
        return Payload({}, {"m": "const", **meta, "lo": int(base + present[0])})
    if backend == "rans" and present.size > RANS_SYMBOLS:
        lo, hi = base + int(present[0]), base + int(present[-1])
        return _code_planes(v, t, lo, hi, chunk, backend, meta)
    words: list[np.ndarray] = []
    sizes: list[int] = []
    if backend == "rans":
        freq = _rans.quantize(counts[present])
        v, row_base, rows = _rans_rows(v, base, present, freq, counts.size)
        out = np.empty(v.size + 2 * _rans.STATES * -(-v.size // chunk), np.uint16)
        end, sizes = RANS_ENCODER.encode_chunks(v, row_base, rows, chunk, out)
        data = _little_endian_bytes(out[end:])
        table = _table_bytes(present, freq)
    else:
        lut = np.zeros(counts.size, np.int32)
        lut[present] = np.arange(present.size, dtype=np.int32)
        symbols = np.empty(v.size, np.int32)
        _kernels.apply_lut(v, base, lut, symbols)
        model = _model(counts[present])
        for first in range(0, v.size, chunk):
            coder = constriction.stream.stack.AnsCoder()
            coder.encode_reverse(symbols[first:first + chunk], model)
            w = coder.get_compressed()
            words.append(w)
            sizes.append(int(w.size))
        data = np.concatenate(words).astype("<u4").tobytes()
        table = _table_bytes(present, counts[present])
    mode = RANS if backend == "rans" else "ans"
    meta.update({"m": mode, "lo": int(base), "v": int(present.size), "cw": tuple(sizes),
                 "ck": int(chunk)})
    return Payload({"t": table, "d": data}, meta)


def _rans_rows(v: np.ndarray, base: int, present: np.ndarray, freq: np.ndarray,
               span: int, encoder: ModuleType | None = None
               ) -> tuple[np.ndarray, int | None, np.ndarray]:
    """The input, row base and flattened table of ``encoder`` (``RANS_ENCODER`` if
    None). One-byte streams index the table by their raw bytes (no subtraction a
    symbol); wider ones by ``v - base``."""
    rows = (encoder or RANS_ENCODER).encoder_table(freq)
    if v.dtype.itemsize == 1:
        table = np.zeros((256, rows.shape[1]), rows.dtype)
        table[(present + base) & 0xFF] = rows
        return v.view(np.uint8), None, table.ravel()
    table = np.zeros((span, rows.shape[1]), rows.dtype)
    table[present] = rows
    return v, base, table.ravel()


def _code_planes(v: np.ndarray, t: torch.Tensor, lo: int, hi: int, chunk: int,
                 backend: str, meta: dict[str, MetaValue]) -> Payload:
    """Byte planes of v - lo, each ANS-coded (or stored) on its own."""
    u = (v.astype(np.int64) - lo).view(np.uint64)
    nplanes = (int(hi - lo).bit_length() + 7) // 8
    fields: dict[str, Payload] = {}
    for i in range(nplanes):
        plane = torch.from_numpy(((u >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.uint8))
        fields[f"p{i}"] = encode(plane, chunk, backend)
    return Payload(dict(fields), {"m": "planes", **meta, "lo": int(lo), "np": nplanes})


def size_from_histogram(values: np.ndarray, counts: np.ndarray, dtype: torch.dtype,
                        chunk: int = DEFAULT_CHUNK) -> int:
    """The bytes ``encode`` (rans backend) would emit for a stream of ``dtype`` with this
    histogram (``values`` ascending), computed from the histogram alone: the same
    choices (constant, direct, byte planes of ``v - min``, stored when coding does not
    pay), the data as the quantized table's exact cost ``sum(count * log2(2**15 / freq))``
    plus each chunk's flushed states, the real table and header. ``gradzip analyze``
    sizes its ANS columns with it; a test holds it within 0.1% of real payloads.
    """
    return _shaped(np.asarray(values, np.int64), np.asarray(counts, np.int64), dtype,
                   chunk).wire_bytes


def _shaped(values: np.ndarray, counts: np.ndarray, dtype: torch.dtype, chunk: int
            ) -> Payload:
    """A payload shaped as ``encode``'s would be, its data zero bytes of the modelled
    length (``bytes(n)`` is a lazily zeroed allocation: nothing is coded or copied)."""
    n = int(counts.sum())
    t = torch.empty(n, dtype=dtype)  # uninitialized: only its size and dtype are used
    meta: dict[str, MetaValue] = {"dt": _frame.dtype_code(t), "sh": (n,)}
    if n == 0:
        return _like_pick(None, t)
    lo, hi = int(values[0]), int(values[-1])
    if values.size == 1:
        return _like_pick(Payload({}, {"m": "const", **meta, "lo": lo}), t)
    if (t.element_size() > 1 and hi - lo >= ALPHABET_SPAN) or values.size > RANS_SYMBOLS:
        u = values - lo
        nplanes = (int(hi - lo).bit_length() + 7) // 8
        fields: dict[str, Payload] = {}
        for i in range(nplanes):
            plane = np.bincount((u >> (8 * i)) & 0xFF, weights=counts, minlength=256)
            present = np.nonzero(plane)[0]
            fields[f"p{i}"] = _shaped(present, plane[present].astype(np.int64),
                                      torch.uint8, chunk)
        return Payload(dict(fields), {"m": "planes", **meta, "lo": lo, "np": nplanes})
    freq = _rans.quantize(counts)
    bits = float((counts * (_rans.SCALE_BITS - np.log2(freq))).sum())
    words = tuple(round(bits / 16 * min(chunk, n - start) / n) + 2 * _rans.STATES
                  for start in range(0, n, chunk))
    base = lo if t.element_size() > 1 else (-128 if dtype == torch.int8 else 0)
    coded = Payload({"t": _table_bytes(values - base, freq), "d": bytes(2 * sum(words))},
                    {"m": RANS, **meta, "lo": base, "v": int(values.size), "cw": words,
                     "ck": int(chunk)})
    return _like_pick(coded, t)


def _like_pick(coded: Payload | None, t: torch.Tensor) -> Payload:
    """``_frame.pick`` without touching data: a checksum of the usual width."""
    if coded is None or coded.wire_bytes >= _frame.stored_wire_bytes(t):
        coded = Payload({"d": bytes(t.numel() * t.element_size())},
                        {"m": _frame.STORED, "dt": _frame.dtype_code(t), "sh": tuple(t.shape)})
    coded.meta[_frame.DIGEST] = 1 << 31
    return coded


def _decode_rans(mode: str, words: np.ndarray, freq: np.ndarray, values: np.ndarray,
                 sizes: tuple, chunk: int, out: np.ndarray) -> None:
    """Decode every chunk of a rans-backend stream into ``out`` (either format)."""
    if mode == RANS:
        table, slot_values = _rans.decoder_table(freq, values)
        if RANS_DECODER.decode_chunks(words, sizes, chunk, table, slot_values, out) < 0:
            raise _frame.EntropyCodingError("ans: rANS stream is corrupt or truncated")
        return
    freq64 = freq.astype(np.uint64)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    slot_sym = np.repeat(np.arange(freq.size, dtype=np.int32), freq)
    offset = 0
    for i, size in enumerate(sizes):
        part, stream = out[i * chunk:(i + 1) * chunk], words[offset:offset + size]
        if _rans.decode_v1(stream.astype(np.uint16), freq64, cum, slot_sym, values, part) < 0:
            raise _frame.EntropyCodingError("ans: rANS stream is corrupt or truncated")
        offset += size


def decode(p: Payload, device: torch.device | None = None) -> torch.Tensor:
    """Rebuild the exact tensor from an ``ans`` coded field; raises on corruption.

    ``device``: where the tensor is wanted. A lanes-format field decodes there (the
    kernel on a GPU); the host formats decode on the host."""
    if p.meta.get("m") in ans_lanes.MODES:
        return ans_lanes.decode(p, device)
    _frame.check(p, "ans")
    mode = p.meta.get("m")
    if mode == _frame.STORED:
        return _frame.unstore(p, "ans")
    dtype, shape, numel = _frame.header(p)
    np_dtype = _frame.NP_DTYPES[dtype]
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
        joined: np.ndarray = (u.view(np.int64) + np.int64(lo)).astype(np_dtype)
        return _frame.from_numpy(joined, dtype, shape)
    if mode not in ("ans", "rans", RANS):
        raise _frame.EntropyCodingError(f"ans: unknown coding mode {mode!r}")
    used = _frame.meta_int(p, "v", "ans", default=0)
    present, counts = _read_table(_frame.blob(p, "t", "ans"), used)
    sizes = p.meta.get("cw")
    chunk = p.meta.get("ck")
    data = _frame.blob(p, "d", "ans")
    word = 4 if mode == "ans" else 2
    total = numel if mode == "ans" else _rans.M
    if (not isinstance(sizes, tuple) or word * sum(sizes) != len(data)
            or int(counts.sum()) != total or not isinstance(chunk, int) or chunk < 1
            or len(sizes) != -(-numel // chunk)):
        raise _frame.EntropyCodingError("ans: header does not match the data")
    values: np.ndarray = (present + lo).astype(np_dtype)
    out: np.ndarray = np.empty(numel, np_dtype)
    if mode != "ans":
        _decode_rans(mode, np.frombuffer(data, "<u2"), counts, values, sizes, chunk, out)
        return _frame.from_numpy(out, dtype, shape, owned=True)
    words32 = np.frombuffer(data, "<u4").astype(np.uint32)
    model = _model(counts)
    symbols = np.empty(numel, np.int32)
    offset = 0
    try:
        for i, size in enumerate(sizes):
            start = i * chunk
            count = min(chunk, numel - start)
            coder = constriction.stream.stack.AnsCoder(words32[offset:offset + size])
            symbols[start:start + count] = coder.decode(model, count)
            if not coder.is_empty():  # a sound stream is used up exactly
                raise ValueError("words left over after the last symbol")
            offset += size
    except (ValueError, RuntimeError, AssertionError) as e:
        raise _frame.EntropyCodingError(f"ans: corrupt data ({e})") from e
    if _kernels.take(values, symbols, out) < 0:
        raise _frame.EntropyCodingError("ans: decoded symbol outside the table")
    return _frame.from_numpy(out, dtype, shape)
