"""Payload: what a codec puts on the wire, and its exact binary form.

A payload is a small tree: scalar metadata (ints, floats, strings, int tuples) and
named fields, each a tensor, a raw byte blob, or a nested payload (a quantizer that
follows a sparsifier nests inside the sparsifier's ``values`` field).

``wire_bytes`` is computed from the same layout ``serialize`` writes, and a test
holds the two equal for every codec, so byte counts cannot drift from what is sent.

Layout (all integers are LEB128 varints unless noted)::

    top-level   := b"GZ" version:u8 node digest:u32le        (version 2)
    node        := n_meta {name meta_value} n_fields {name field}
    meta_value  := 0 zigzag-int | 1 f64 | 2 str | 3 n {zigzag-int}
    field       := 0 dtype:u8 ndim {dim} raw-bytes | 1 len raw-bytes | 2 node

``digest`` is XXH3 (low 32 bits) of every byte before it except tensor data: the
structure, all meta (shapes, counts, modes) and byte blobs. A flipped bit there
raises instead of decoding to another shape. Tensor data is not covered (coded
fields carry their own checksum). Version 1 (no digest) still decodes.

Bytes from another rank or from disk are untrusted: parsing allocates only what the
bytes hold, nests at most ``MAX_DEPTH`` nodes, and raises ``PayloadError`` (never
another exception) on anything malformed.
"""

from __future__ import annotations

import builtins
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Union

import torch
import xxhash

from gradzip.collectives.upload import upload, upload_all

MAGIC = b"GZ"
VERSION = 2
#: versions ``deserialize`` reads (1: no digest)
READABLE = (1, 2)
#: nested payloads deeper than this are refused (real chains nest 3 or 4 deep)
MAX_DEPTH = 32
_DIGEST_BYTES = 4

MetaValue = int | float | str | tuple[int, ...]
Field = Union[torch.Tensor, bytes, "Payload"]  # noqa: UP007 (forward reference)

DTYPES: list[torch.dtype] = [
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
]
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}


class PayloadError(ValueError):
    """A byte string is not a valid gradzip payload (truncated, corrupt, or foreign)."""


# ---------------------------------------------------------------- varints
def varint_len(n: int) -> int:
    length = 1
    while n >= 0x80:
        n >>= 7
        length += 1
    return length


def _put_varint(out: bytearray, n: int) -> None:
    if n < 0:
        raise ValueError("varint must be non-negative")
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int) -> int:
    return (n << 1) if n >= 0 else ((-n << 1) - 1)


def _unzigzag(n: int) -> int:
    return (n >> 1) if not n & 1 else -((n + 1) >> 1)


def _str_len(s: str) -> int:
    b = len(s.encode())
    return varint_len(b) + b


def _meta_len(v: MetaValue) -> int:
    if isinstance(v, bool | int):
        return 1 + varint_len(_zigzag(int(v)))
    if isinstance(v, float):
        return 1 + 8
    if isinstance(v, str):
        return 1 + _str_len(v)
    return 1 + varint_len(len(v)) + sum(varint_len(_zigzag(int(x))) for x in v)


@dataclass
class Payload:
    """Named tensors plus small metadata: one codec's message for one tensor."""

    fields: dict[str, Field] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)

    # ------------------------------------------------------------ access
    def __getitem__(self, name: str) -> Field:
        try:
            return self.fields[name]
        except KeyError:
            raise PayloadError(
                f"payload has no field {name!r} (fields: {sorted(self.fields)})"
            ) from None

    def tensor(self, name: str) -> torch.Tensor:
        """The field ``name``, which must be a tensor."""
        value = self[name]
        if not isinstance(value, torch.Tensor):
            raise PayloadError(f"field {name!r} is {type(value).__name__}, not a tensor")
        return value

    def child(self, name: str) -> Payload:
        """The field ``name``, which must be a nested payload."""
        value = self[name]
        if not isinstance(value, Payload):
            raise PayloadError(f"field {name!r} is {type(value).__name__}, not a payload")
        return value

    def int(self, name: str) -> int:
        value = self.meta.get(name)
        if not isinstance(value, int):
            raise PayloadError(f"payload meta {name!r} missing or not an int: {value!r}")
        return value

    def float(self, name: str) -> float:
        value = self.meta.get(name)
        if not isinstance(value, float | int):
            raise PayloadError(f"payload meta {name!r} missing or not a float: {value!r}")
        return float(value)

    def shape(self, name: str = "shape") -> torch.Size:
        value = self.meta.get(name)
        if not isinstance(value, tuple) or len(value) > 16 or any(
                not 0 <= d < 1 << 62 for d in value) or math.prod(value) >= 1 << 62:
            raise PayloadError(f"payload meta {name!r} missing or not a shape: {value!r}")
        return torch.Size(value)

    # ------------------------------------------------------------ leaves
    def leaves(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor in the tree, depth first, with a dotted path.

        Summable codecs are aggregated by all-reducing exactly these tensors.
        """
        for name, value in self.fields.items():
            if isinstance(value, torch.Tensor):
                yield name, value
            elif isinstance(value, Payload):
                for sub, t in value.leaves():
                    yield f"{name}.{sub}", t

    def with_leaves(self, tensors: list[torch.Tensor]) -> Payload:
        """A copy of this payload whose tensors are replaced, in ``leaves()`` order."""
        it = iter(tensors)

        def rebuild(p: Payload) -> Payload:
            out: dict[str, Field] = {}
            for name, value in p.fields.items():
                if isinstance(value, torch.Tensor):
                    out[name] = next(it)
                elif isinstance(value, Payload):
                    out[name] = rebuild(value)
                else:
                    out[name] = value
            return Payload(out, dict(p.meta))

        result = rebuild(self)
        if next(it, None) is not None:
            raise ValueError("with_leaves got more tensors than the payload has leaves")
        return result

    def to(self, device: torch.device | str) -> Payload:
        """This payload with every tensor on ``device`` (a received payload is rebuilt
        on the host; its decoder should run where the result is needed)."""
        return self.with_leaves(upload_all([t for _, t in self.leaves()],
                                           torch.device(device)))

    def tensor_bytes(self) -> builtins.int:
        """Bytes of tensor and blob data alone (no headers)."""
        total = 0
        for value in self.fields.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, bytes | bytearray | memoryview):
                total += len(value)
            else:
                total += value.tensor_bytes()
        return total

    # ------------------------------------------------------------ size
    def _node_len(self) -> builtins.int:
        n = varint_len(len(self.meta)) + varint_len(len(self.fields))
        for k, v in self.meta.items():
            n += _str_len(k) + _meta_len(v)
        for k, f in self.fields.items():
            n += _str_len(k) + 1
            if isinstance(f, torch.Tensor):
                n += 1 + varint_len(f.dim()) + sum(varint_len(d) for d in f.shape)
                n += f.numel() * f.element_size()
            elif isinstance(f, bytes | bytearray | memoryview):
                n += varint_len(len(f)) + len(f)
            else:
                n += f._node_len()
        return n

    @property
    def wire_bytes(self) -> builtins.int:
        """Exact length of ``serialize()``, computed without serializing."""
        return len(MAGIC) + 1 + self._node_len() + _DIGEST_BYTES

    # ------------------------------------------------------------ encode
    def _write_header(self, out: bytearray, chunks: list[bytes | torch.Tensor]) -> bytearray:
        """Append this node; tensor data goes to ``chunks`` between header pieces."""
        _put_varint(out, len(self.meta))
        for k, v in self.meta.items():
            _put_str(out, k)
            if isinstance(v, bool | int):
                out.append(0)
                _put_varint(out, _zigzag(int(v)))
            elif isinstance(v, float):
                out.append(1)
                out += struct.pack("<d", v)
            elif isinstance(v, str):
                out.append(2)
                _put_str(out, v)
            elif isinstance(v, tuple):
                out.append(3)
                _put_varint(out, len(v))
                for x in v:
                    _put_varint(out, _zigzag(int(x)))
            else:
                raise TypeError(f"meta {k!r} has unsupported type {type(v).__name__}")
        _put_varint(out, len(self.fields))
        for k, f in self.fields.items():
            _put_str(out, k)
            if isinstance(f, torch.Tensor):
                if f.dtype not in DTYPE_CODE:
                    raise TypeError(f"field {k!r} has unsupported dtype {f.dtype}")
                out.append(0)
                out.append(DTYPE_CODE[f.dtype])
                _put_varint(out, f.dim())
                for d in f.shape:
                    _put_varint(out, d)
                chunks.append(bytes(out))
                out = bytearray()
                chunks.append(f)
            elif isinstance(f, bytes | bytearray | memoryview):
                out.append(1)
                _put_varint(out, len(f))
                out += f
            elif isinstance(f, Payload):
                out.append(2)
                out = f._write_header(out, chunks)
            else:
                raise TypeError(f"field {k!r} has unsupported type {type(f).__name__}")
        return out

    def _chunks(self) -> list[bytes | torch.Tensor]:
        chunks: list[bytes | torch.Tensor] = []
        head = bytearray(MAGIC)
        head.append(VERSION)
        tail = self._write_header(head, chunks)
        chunks.append(bytes(tail))
        h = xxhash.xxh3_64()
        for c in chunks:
            if isinstance(c, bytes):
                h.update(c)
        chunks.append((h.intdigest() & 0xFFFFFFFF).to_bytes(_DIGEST_BYTES, "little"))
        return chunks

    def serialize(self) -> bytes:
        """The payload as bytes; ``len(serialize()) == wire_bytes``."""
        parts = []
        for c in self._chunks():
            parts.append(c if isinstance(c, bytes) else _tensor_to_bytes(c))
        return b"".join(parts)

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The serialized payload as a flat uint8 tensor (for collectives), on
        ``device`` (default: its tensors' device).

        On a GPU the frame's host parts (headers, lengths, the digest) go up in one
        upload, staged in pinned memory and not blocking the host; its device tensors
        are copied into place on the device (not one host copy per part)."""
        chunks = [c if isinstance(c, bytes) else c.detach().contiguous().reshape(-1)
                  .view(torch.uint8) for c in self._chunks()]
        found = next((c.device for c in chunks if isinstance(c, torch.Tensor)), None)
        dev = torch.device(device) if device is not None else found or torch.device("cpu")
        if dev.type == "cpu":
            parts = [torch.frombuffer(bytearray(c), dtype=torch.uint8) if isinstance(c, bytes)
                     else c.to(dev) for c in chunks if len(c)]
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        sizes = [len(c) if isinstance(c, bytes) else c.numel() for c in chunks]
        frame = torch.zeros(sum(sizes), dtype=torch.uint8)
        on_device: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for c, n in zip(chunks, sizes, strict=True):
            if isinstance(c, bytes):
                if n:
                    frame[offset:offset + n] = torch.frombuffer(bytearray(c),
                                                                dtype=torch.uint8)
            elif c.device == dev:
                on_device.append((offset, c))
            else:
                frame[offset:offset + n] = c.cpu()
            offset += n
        out = upload(frame, dev)
        for start, c in on_device:
            out[start:start + c.numel()].copy_(c)
        return out

    # ------------------------------------------------------------ decode
    @classmethod
    def deserialize(cls, data: bytes | bytearray | memoryview | torch.Tensor) -> Payload:
        """Inverse of ``serialize``/``to_tensor``; raises PayloadError on bad input."""
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8 or data.dim() != 1:
                raise PayloadError("a serialized payload tensor must be 1-D uint8")
            data = (data if data.device.type == "cpu" else data.cpu()).numpy().tobytes()
        buf = memoryview(bytes(data)) if not isinstance(data, bytes) else memoryview(data)
        if len(buf) < 3 or bytes(buf[:2]) != MAGIC:
            raise PayloadError("not a gradzip payload (bad magic bytes)")
        version = buf[2]
        if version not in READABLE:
            raise PayloadError(f"payload format version {version} is not supported "
                               f"(this gradzip reads {READABLE})")
        end = len(buf) - (_DIGEST_BYTES if version >= 2 else 0)
        if end < 3:
            raise PayloadError("payload truncated: no room for its digest")
        reader = _Reader(buf[:end], 3)
        try:
            payload = reader.node(0)
        except PayloadError:
            raise
        except (ValueError, TypeError, OverflowError, RuntimeError) as e:
            raise PayloadError(f"payload corrupt: {type(e).__name__}: {e}") from e
        if reader.pos != end:
            raise PayloadError(f"{end - reader.pos} trailing bytes after payload")
        if version >= 2 and reader.digest() != int.from_bytes(buf[end:], "little"):
            raise PayloadError("payload corrupt: its digest does not match its structure, "
                               "meta and byte fields (a flipped bit, or a truncated payload)")
        return payload


def _put_str(out: bytearray, s: str) -> None:
    b = s.encode()
    _put_varint(out, len(b))
    out += b


def _tensor_to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.view(torch.uint8).numpy().tobytes()


class _Reader:
    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.tensor_spans: list[tuple[int, int]] = []  # raw tensor data: not digested

    def digest(self) -> int:
        """XXH3 (low 32 bits) of everything read except tensor data (``_chunks``)."""
        h = xxhash.xxh3_64()
        start = 0
        for lo, hi in self.tensor_spans:
            h.update(self.buf[start:lo])
            start = hi
        h.update(self.buf[start:self.pos])
        return h.intdigest() & 0xFFFFFFFF

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise PayloadError(
                f"payload truncated: need {n} bytes at offset {self.pos}, have {len(self.buf)}"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self._take(1)[0]

    def varint(self) -> int:
        result = shift = 0
        while True:
            b = self.u8()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise PayloadError("payload corrupt: varint too long")

    def string(self) -> str:
        raw = self._take(self.varint())
        try:
            return bytes(raw).decode()
        except UnicodeDecodeError as e:
            raise PayloadError("payload corrupt: invalid name") from e

    def node(self, depth: int) -> Payload:
        if depth > MAX_DEPTH:
            raise PayloadError(f"payload corrupt: nested deeper than {MAX_DEPTH} nodes")
        meta: dict[str, MetaValue] = {}
        for _ in range(self.varint()):
            k = self.string()
            kind = self.u8()
            if kind == 0:
                meta[k] = _unzigzag(self.varint())
            elif kind == 1:
                meta[k] = struct.unpack("<d", self._take(8))[0]
            elif kind == 2:
                meta[k] = self.string()
            elif kind == 3:
                meta[k] = tuple(_unzigzag(self.varint()) for _ in range(self.varint()))
            else:
                raise PayloadError(f"payload corrupt: unknown meta kind {kind}")
        fields: dict[str, Field] = {}
        for _ in range(self.varint()):
            k = self.string()
            kind = self.u8()
            if kind == 0:
                code = self.u8()
                if code >= len(DTYPES):
                    raise PayloadError(f"payload corrupt: unknown dtype code {code}")
                dtype = DTYPES[code]
                shape = [self.varint() for _ in range(self.varint())]
                numel = 1
                for d in shape:
                    numel *= d
                start = self.pos
                raw = self._take(numel * torch.empty(0, dtype=dtype).element_size())
                self.tensor_spans.append((start, self.pos))
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if numel else None
                fields[k] = (
                    t.view(dtype).reshape(shape) if t is not None
                    else torch.empty(shape, dtype=dtype)
                )
            elif kind == 1:
                fields[k] = bytes(self._take(self.varint()))
            elif kind == 2:
                fields[k] = self.node(depth + 1)
            else:
                raise PayloadError(f"payload corrupt: unknown field kind {kind}")
        return Payload(fields, meta)
