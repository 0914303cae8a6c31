"""Shared framing for the entropy stages: dtype/shape header, checksum, stored mode.

Every coded field is a small nested ``Payload`` whose meta carries what the decoder
needs to restore the tensor exactly (``dt`` dtype code, ``sh`` shape, ``m`` mode) and a
32-bit checksum over those header values and every coded byte: ``xh``, the low half of
XXH3-64 (36 GB/s here, 3x ISA-L's CRC-32, which was the biggest cost of decoding a
float after the entropy coder itself). Payloads sealed with CRC-32 (``crc``, earlier
versions) are still checked and decoded. A flipped or truncated byte therefore raises
``EntropyCodingError`` instead of decoding to a wrong tensor.

"Stored" mode (the raw little-endian bytes) is the fallback whenever coding would not
pay, so a lossless stage costs at most a few header bytes more than raw.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import numpy as np
import torch
import xxhash
from isal.isal_zlib import crc32  # zlib's CRC-32 (ISA-L): the checksum of earlier payloads

from gradzip.codecs.limits import check_declared
from gradzip.codecs.payload import (
    DTYPE_CODE,
    DTYPES,
    MetaValue,
    Payload,
    PayloadError,
    varint_len,
)

STORED = "raw"
_CHECKED_META = ("m", "dt", "sh", "k", "map", "lo", "cw", "ck", "np", "lvl", "v", "fl")
NP_DTYPES = {
    torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_,
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
}


class EntropyCodingError(PayloadError):
    """A coded field is corrupt, truncated, or was not written by this stage."""


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of ``t`` (bf16 is viewed as its uint16 bits)."""
    t = t.detach().contiguous().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype, shape: Iterable[int],
               owned: bool = False) -> torch.Tensor:
    """The inverse of ``to_numpy``: a tensor of ``dtype`` and ``shape`` owning its data.

    ``owned``: ``a`` is a fresh, writable array nothing else refers to (a decoder's own
    output), so the tensor may take its memory instead of a copy."""
    if a.size == 0:  # torch.from_numpy gives empty arrays stride 0, which cannot be viewed
        return torch.empty(tuple(shape), dtype=dtype)
    a = np.ascontiguousarray(a)
    take = owned and a.flags.writeable
    if dtype == torch.bfloat16:
        bits = a.view(np.int16)
        t = torch.from_numpy(bits if take else bits.copy()).view(torch.bfloat16)
    else:
        typed: np.ndarray = a.astype(NP_DTYPES[dtype], copy=False)
        t = torch.from_numpy(typed if take and typed is a else typed.copy())
    return t.reshape(tuple(shape))


def dtype_code(t: torch.Tensor) -> int:
    if t.dtype not in DTYPE_CODE:
        raise TypeError(f"dtype {t.dtype} cannot be put on the wire")
    return DTYPE_CODE[t.dtype]


#: the dtypes an integer coder writes, and so the only ones it reads: a payload cannot
#: make the receiver compile kernels for a dtype it names
INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
#: every dtype the wire carries (the byte coders code any field's raw bytes)
WIRE_DTYPES = frozenset(DTYPES)
#: the floating dtypes the lossless float codec writes
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def header(p: Payload, allowed: frozenset[torch.dtype] = INTEGER_DTYPES
           ) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, numel) from a coded field's meta, validated: the dtype is one the
    coder writes, and the size fits the decode budget (``limits.py``)."""
    code = p.meta.get("dt")
    shape = p.meta.get("sh")
    if not isinstance(code, int) or not 0 <= code < len(DTYPES) \
            or DTYPES[code] not in allowed:
        raise EntropyCodingError(f"coded field has a bad dtype code {code!r}")
    if not isinstance(shape, tuple) or len(shape) > 8 or any(
            not isinstance(d, int) or d < 0 for d in shape):
        raise EntropyCodingError(f"coded field has a bad shape {shape!r}")
    numel = 1
    for d in shape:
        numel *= d
    return DTYPES[code], shape, check_declared(numel, "a coded field")


def meta_int(p: Payload, name: str, stage: str, default: int | None = None) -> int:
    """The integer header value ``name`` (``default`` when absent); raises if malformed."""
    value = p.meta.get(name, default)
    if not isinstance(value, int):
        raise EntropyCodingError(f"{stage}: header value {name!r} missing or not an int: "
                                 f"{value!r}")
    return value


#: the meta key of the checksum: XXH3 (written) and CRC-32 (earlier payloads, read)
DIGEST, CRC = "xh", "crc"


class _Crc32:
    """CRC-32 with the ``update``/``intdigest`` interface of an xxhash state."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.value = crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _digest(p: Payload, key: str) -> int:
    """The checksum ``key`` of the header values, every field's bytes and every nested
    field's own checksum, 32 bits."""
    h = xxhash.xxh3_64() if key == DIGEST else _Crc32()
    h.update(repr([(k, p.meta[k]) for k in _CHECKED_META if k in p.meta]).encode())
    for name in sorted(p.fields):
        value = p.fields[name]
        h.update(name.encode())
        if isinstance(value, bytes | bytearray | memoryview):
            h.update(value)
        elif isinstance(value, torch.Tensor):
            h.update(to_numpy(value).view(np.uint8).data)
        else:  # a nested coded field: its own checksum covers its content
            child = value.meta.get(DIGEST, value.meta.get(CRC, 0))
            if not isinstance(child, int) or not 0 <= child < 1 << 32:
                raise EntropyCodingError(f"nested coded field {name!r} has a bad checksum")
            h.update(child.to_bytes(4, "little"))
    return h.intdigest() & 0xFFFFFFFF


def seal(p: Payload) -> Payload:
    """Add the checksum to a finished coded field (call last)."""
    p.meta[DIGEST] = _digest(p, DIGEST)
    return p


def check(p: Payload, stage: str) -> None:
    """Raise EntropyCodingError unless ``p``'s checksum matches its content."""
    key = DIGEST if DIGEST in p.meta else CRC
    want = p.meta.get(key)
    if not isinstance(want, int):
        raise EntropyCodingError(f"{stage}: coded field has no checksum; not written by {stage}")
    if _digest(p, key) != want:
        raise EntropyCodingError(
            f"{stage}: checksum mismatch: the coded field is corrupt or truncated"
        )


def byte_view(a: np.ndarray) -> bytes:
    """The bytes of a contiguous array as a field value without a copy: a memoryview,
    typed as bytes because the payload serializes any bytes-like field as bytes."""
    return cast(bytes, np.ascontiguousarray(a).view(np.uint8).data)


def blob(p: Payload, name: str, stage: str) -> bytes | bytearray | memoryview:
    """The bytes-like field ``name`` as it is (a view is not copied: decoders only read)."""
    value = p.fields.get(name)
    if not isinstance(value, bytes | bytearray | memoryview):
        raise EntropyCodingError(f"{stage}: coded field lacks its {name!r} bytes")
    return value


def stored(t: torch.Tensor) -> Payload:
    """The raw bytes of ``t`` (the 'coding does not pay' fallback)."""
    meta: dict[str, MetaValue] = {"m": STORED, "dt": dtype_code(t), "sh": tuple(t.shape)}
    return Payload({"d": to_numpy(t).view(np.uint8).tobytes()}, meta)


def unstore(p: Payload, stage: str,
            allowed: frozenset[torch.dtype] = INTEGER_DTYPES) -> torch.Tensor:
    dtype, shape, numel = header(p, allowed)
    data = blob(p, "d", stage)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(data) != numel * itemsize:
        raise EntropyCodingError(f"{stage}: stored field has {len(data)} bytes, expected "
                                 f"{numel * itemsize}")
    a = np.frombuffer(data, dtype=np.uint8)
    np_dtype = np.uint16 if dtype == torch.bfloat16 else NP_DTYPES[dtype]
    return from_numpy(a.view(np_dtype), dtype, shape)


def stored_wire_bytes(t: torch.Tensor) -> int:
    """``stored(t).wire_bytes`` without copying the data."""
    nbytes = t.numel() * t.element_size()
    meta: dict[str, MetaValue] = {"m": STORED, "dt": dtype_code(t), "sh": tuple(t.shape)}
    empty = Payload({"d": b""}, meta)
    return empty.wire_bytes + nbytes + varint_len(nbytes) - 1


def pick(coded: Payload | None, t: torch.Tensor) -> Payload:
    """The coded field if it is smaller than storing ``t`` raw, else the stored form."""
    if coded is None or coded.wire_bytes >= stored_wire_bytes(t):
        return seal(stored(t))
    return seal(coded)
