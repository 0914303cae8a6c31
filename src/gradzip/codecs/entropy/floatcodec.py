"""``lossless``: exact compression of raw fp32/bf16/fp16 gradients by byte planes.

Float bits are not equally compressible: the exponent of gradient values spans a
few dozen values (2-3 bits of entropy in an 8-bit field) while sign and mantissa
are nearly uniform. Following ZipNN (Hershcovitch et al. 2024, "ZipNN: Lossless
Compression for AI Models"), each value is split into byte planes with the exponent
rotated into a byte of its own (the sign moves to the mantissa side):

* bf16: ``[exponent] [sign + 7 mantissa bits]``
* fp16: ``[5-bit exponent] [sign + 2 top mantissa bits] [8 mantissa bits]``
* fp32: ``[exponent] [sign + 7 mantissa bits] [mantissa 8] [mantissa 8]``
* fp64: the eight little-endian byte planes, most significant first

The exponent plane (and any plane whose histogram promises a saving) is ANS-coded
with its own frequency table; the others are zstd-coded when that is smaller, else
sent raw. Every plane is exact and checksummed, and so is the whole payload (dtype code,
raw bytes of small tensors, the planes' checksums), so the codec is lossless for any
input, including inf/NaN bit patterns, any rank can decode any payload, and a damaged
one raises instead of decoding to other values.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.entropy import _frame, ans, bytecoders, measures
from gradzip.codecs.payload import _DTYPE_CODE, _DTYPES, MetaValue, Payload, PayloadError
from gradzip.codecs.registry import Param, in_range, register

#: tensors smaller than this are sent raw (plane headers would outweigh any saving)
MIN_NUMEL = 128
#: ANS a plane when its order-0 estimate saves at least this fraction
ANS_GAIN = 0.03


def split_planes(x: torch.Tensor) -> list[np.ndarray]:
    """The byte planes of a float tensor (see the module docstring), each uint8."""
    a = _frame.to_numpy(x)
    if x.dtype in (torch.bfloat16, torch.float16):
        h = a.view(np.uint16)
        if x.dtype == torch.bfloat16:
            return [((h >> 7) & 0xFF).astype(np.uint8),
                    (((h >> 8) & 0x80) | (h & 0x7F)).astype(np.uint8)]
        return [((h >> 10) & 0x1F).astype(np.uint8),
                (((h >> 13) & 0x4) | ((h >> 8) & 0x3)).astype(np.uint8),
                (h & 0xFF).astype(np.uint8)]
    if x.dtype == torch.float32:
        w = a.view(np.uint32)
        return [((w >> 23) & 0xFF).astype(np.uint8),
                (((w >> 24) & 0x80) | ((w >> 16) & 0x7F)).astype(np.uint8),
                ((w >> 8) & 0xFF).astype(np.uint8),
                (w & 0xFF).astype(np.uint8)]
    if x.dtype == torch.float64:
        b = a.view(np.uint8).reshape(-1, 8)
        return [np.ascontiguousarray(b[:, i]) for i in range(7, -1, -1)]
    raise TypeError(f"lossless codes floating-point tensors, got {x.dtype}")


def join_planes(planes: list[np.ndarray], dtype: torch.dtype) -> np.ndarray:
    """Inverse of ``split_planes``: the raw words (bf16 as uint16)."""
    e: np.ndarray  # the exponent and sign+mantissa planes, widened to the word size
    sm: np.ndarray
    if dtype == torch.bfloat16:
        e, sm = (p.astype(np.uint16) for p in planes)
        return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    if dtype == torch.float16:
        e, s2, m = (p.astype(np.uint16) for p in planes)
        return (((s2 & 0x4) << 13) | (e << 10) | ((s2 & 0x3) << 8) | m).view(np.float16)
    if dtype == torch.float32:
        e, sm, m1, m0 = (p.astype(np.uint32) for p in planes)
        w = ((sm & 0x80) << 24) | (e << 23) | ((sm & 0x7F) << 16) | (m1 << 8) | m0
        return w.view(np.float32)
    if dtype == torch.float64:
        return np.stack(planes[::-1], axis=1).reshape(-1).view(np.float64)
    raise TypeError(f"lossless cannot rebuild {dtype}")


_PLANES = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4, torch.float64: 8}


@register("lossless")
class LosslessFloat(Compressor):
    """Exact float compression: ANS on the exponent plane, zstd or raw on the rest."""

    summary = "exact: exponent byte plane ANS-coded, mantissa planes zstd or raw (ZipNN-style)"
    unbiased = True
    keeps_dtype = True
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("rest", str, "auto",
              "coding of the non-exponent planes: auto (ans, zstd or raw, whichever the "
              "histogram and a trial say is smallest), zstd, or raw",
              choices=("auto", "zstd", "raw")),
        Param("level", int, 3, "zstd level for the non-exponent planes", check=in_range(1, 22)),
    )

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        if x.dtype not in _PLANES:
            raise TypeError(f"lossless codes fp32/bf16/fp16/fp64 tensors, got {x.dtype}")
        meta: dict[str, MetaValue] = {"fl": _DTYPE_CODE[x.dtype]}
        flat = x.detach().reshape(-1)
        if flat.numel() < MIN_NUMEL:
            return _frame.seal(Payload({"raw": _frame.stored(flat)["d"]}, meta))
        fields: dict[str, Payload] = {}
        for i, plane in enumerate(split_planes(flat)):
            exponent = i == 0 and x.dtype != torch.float64
            fields[f"p{i}"] = self._code_plane(plane, exponent)
        # the checksum covers the dtype code, raw bytes and each plane's own checksum
        return _frame.seal(Payload(dict(fields), meta))

    def _code_plane(self, plane: np.ndarray, exponent: bool) -> Payload:
        t = torch.from_numpy(plane)
        rest = self.params["rest"]
        if exponent or rest == "auto":
            counts = np.bincount(plane, minlength=256)
            estimate = measures.entropy_of_counts(counts) * plane.size / 8 + 3 * (counts > 0).sum()
            if exponent or estimate < (1 - ANS_GAIN) * plane.size:
                return ans.encode(t)
        if rest == "raw":
            return _frame.pick(None, t)
        return bytecoders.Zstd(level=self.params["level"]).encode_field(t)

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        _frame.check(p, "lossless")
        code = p.meta.get("fl")
        if not isinstance(code, int) or not 0 <= code < len(_DTYPES) \
                or _DTYPES[code] not in _PLANES:
            raise PayloadError(f"lossless: bad float dtype code {code!r}")
        dtype = _DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        if "raw" in p.fields:
            raw = p.fields["raw"]
            size = torch.empty(0, dtype=dtype).element_size()
            if not isinstance(raw, bytes) or len(raw) != numel * size:
                raise PayloadError("lossless: raw field has the wrong size")
            stored = Payload({"d": raw}, {"m": _frame.STORED, "dt": code, "sh": tuple(shape)})
            return _frame.unstore(stored, "lossless")
        planes = []
        for i in range(_PLANES[dtype]):
            planes.append(_decode_plane(p.child(f"p{i}"), numel))
        return _frame.from_numpy(join_planes(planes, dtype), dtype, shape)


def _decode_plane(p: Payload, numel: int) -> np.ndarray:
    if p.meta.get("m") == "zstd":
        out = bytecoders.Zstd().decode_field(p)
    else:
        out = ans.decode(p)
    if out.dtype != torch.uint8 or out.numel() != numel:
        raise _frame.EntropyCodingError("lossless: a byte plane has the wrong size")
    return out.numpy()
