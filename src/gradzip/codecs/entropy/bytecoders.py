"""``zstd`` and ``lz4``: general-purpose byte compressors as lossless baselines.

They see a field's raw little-endian bytes, so unlike ``eg``/``ans`` they also accept
float fields (``zstd`` alone means zstd on the raw gradient bytes). Zstandard (Collet,
RFC 8878) and LZ4 model repeated byte strings rather than symbol frequencies, which is
why they trail an entropy coder on quantized gradients; they are here to show that.
Both frames carry their own content checksum, so corruption raises.
"""

from __future__ import annotations

from typing import ClassVar

import lz4.frame
import numpy as np
import torch
import zstandard

from gradzip.codecs.base import LosslessCoder, Slot
from gradzip.codecs.entropy import _frame
from gradzip.codecs.payload import DTYPE_CODE, Payload
from gradzip.codecs.registry import Param, in_range, register


class _ByteCoder(LosslessCoder):
    mode: ClassVar[str]

    def accepts(self, t: torch.Tensor) -> bool:
        return t.dtype in DTYPE_CODE

    def compress(self, data: bytes) -> bytes:
        raise TypeError("abstract")  # pragma: no cover - every subclass overrides

    def decompress(self, data: bytes | bytearray | memoryview, size: int) -> bytes:
        raise TypeError("abstract")  # pragma: no cover

    def encode_field(self, t: torch.Tensor, slot: Slot | None = None) -> Payload:
        raw = _frame.to_numpy(t).view(np.uint8)
        if raw.size == 0:
            return _frame.pick(None, t)
        coded = Payload({"d": self.compress(raw.tobytes())},
                        {"m": self.mode, "dt": _frame.dtype_code(t), "sh": tuple(t.shape),
                         "lvl": int(self.params["level"])})
        return _frame.pick(coded, t)

    def decode_field(self, p: Payload, device: torch.device | None = None) -> torch.Tensor:
        _frame.check(p, self.name)
        if p.meta.get("m") == _frame.STORED:
            return _frame.unstore(p, self.name, _frame.WIRE_DTYPES)
        if p.meta.get("m") != self.mode:
            raise _frame.EntropyCodingError(f"{self.name}: unknown coding mode {p.meta.get('m')!r}")
        dtype, shape, numel = _frame.header(p, _frame.WIRE_DTYPES)
        size = numel * torch.empty(0, dtype=dtype).element_size()
        try:
            data = self.decompress(_frame.blob(p, "d", self.name), size)
        except (RuntimeError, ValueError, zstandard.ZstdError) as e:
            raise _frame.EntropyCodingError(f"{self.name}: corrupt data ({e})") from e
        if len(data) != size:
            raise _frame.EntropyCodingError(f"{self.name}: {len(data)} bytes decoded, "
                                            f"expected {size}")
        return _frame.unstore(Payload({"d": data}, {**p.meta, "m": _frame.STORED}), self.name,
                              _frame.WIRE_DTYPES)


@register("zstd")
class Zstd(_ByteCoder):
    """Zstandard on a field's raw bytes (any dtype); level 3 is zstd's default."""

    summary = "zstandard on the raw bytes of every field (baseline)"
    mode = "zstd"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("level", int, 3, "zstd compression level (1 fast .. 22 small)",
              check=in_range(-7, 22)),
    )

    def compress(self, data: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=self.params["level"], write_checksum=True,
                                        write_content_size=False).compress(data)

    def decompress(self, data: bytes | bytearray | memoryview, size: int) -> bytes:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


@register("lz4")
class Lz4(_ByteCoder):
    """LZ4 frame on a field's raw bytes (any dtype): very fast, modest ratio."""

    summary = "lz4 on the raw bytes of every field (fast baseline)"
    mode = "lz4"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("level", int, 0, "lz4 level (0 fast; 3..16 high-compression mode)",
              check=in_range(0, 16)),
    )

    def compress(self, data: bytes) -> bytes:
        return lz4.frame.compress(data, compression_level=self.params["level"],
                                  content_checksum=True, store_size=False)

    def decompress(self, data: bytes | bytearray | memoryview, size: int) -> bytes:
        # at most size + 1 bytes: a frame that inflates past its declared size stops
        # there (and fails the size check) instead of filling memory
        out = lz4.frame.LZ4FrameDecompressor().decompress(bytes(data), max_length=size + 1)
        return bytes(out)
