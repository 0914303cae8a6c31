"""``lossless``: exact compression of raw fp32/bf16/fp16 gradients by byte planes.

Float bits are not equally compressible: the exponent of gradient values spans a
few dozen values (2-3 bits of entropy in an 8-bit field) while sign and mantissa
are nearly uniform. Following ZipNN (Hershcovitch et al. 2024, "ZipNN: Lossless
Compression for AI Models"), each value is split into byte planes with the exponent
rotated into a byte of its own (the sign moves to the mantissa side):

* bf16: ``[exponent] [sign + 7 mantissa bits]``
* fp16: ``[5-bit exponent, sign, 2 top mantissa bits] [8 mantissa bits]`` (payloads of
  the first fp16 layout, three planes ``[exponent] [sign + 2 bits] [8 bits]``, decode)
* fp32: ``[exponent] [sign + 7 mantissa bits] [mantissa 8] [mantissa 8]``
* fp64: the eight little-endian byte planes, most significant first

The exponent plane of bf16 and fp32 is coded by ``_huffman``: blocks of 16K symbols,
each coded with one of up to eight Huffman tables fitted to the plane's blocks (a
bucket's tensors differ in scale, so their exponents differ in distribution), decoded
several symbols a lookup. Where windows probed from the plane show repeats that zstd's
matches take (``_repeats_pay``: a tied embedding's rows for unseen tokens repeat one
exponent pattern), the plane goes to zstd set for one byte plane (``_zstd_plane``:
Huffman literals behind an accelerated match search) instead. fp16's first plane also
holds the sign and two mantissa bits (~5.6 bits of entropy against bf16's ~2.8), so a
lookup decodes fewer symbols, and zstd is faster on it. ``exponent=huff`` or
``exponent=zstd`` picks one coder for every dtype, and ``exponent=ans`` the ``ans``
stage. Every other plane takes that zstd when the histogram of a 1-in-8 sample of its
bytes promises a saving of 0.5%, else travels raw (a view, not a copy). The payload
format is the per-plane one of earlier versions (each plane names its coder), so their
payloads still decode. Every plane is exact and checksummed, and so is the whole
payload (dtype code, raw bytes of small tensors, the planes' checksums), so the codec is
lossless for any input, including inf/NaN bit patterns, any rank can decode any
payload, and a damaged one raises instead of decoding to other values.

On a CUDA device (``exponent=auto`` or ``ans``, ``rest=auto`` or ``raw``) the planes
are split and the exponent plane coded there (``floatcodec_device``: ``ans``'s lanes
kernel, the other planes raw), the payload staying on the device; either side decodes
either's payloads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from gradzip.codecs import kernels
from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.entropy import (
    _frame,
    _huffman,
    _kernels,
    _planes,
    _zstd_plane,
    ans,
    bytecoders,
    floatcodec_device,
)
from gradzip.codecs.payload import DTYPE_CODE, DTYPES, MetaValue, Payload, PayloadError
from gradzip.codecs.registry import Param, in_range, register

#: tensors smaller than this are sent raw (plane headers would outweigh any saving)
MIN_NUMEL = 128
#: code a non-exponent plane when its order-0 estimate saves at least this fraction
CODE_GAIN = 0.005


_SPLIT = {torch.float32: (_planes.split32, np.uint32, 4),
          torch.bfloat16: (_planes.split_bf16, np.uint16, 2),
          torch.float16: (_planes.split_fp16, np.uint16, 2)}
#: (kernel(*planes, words), word type): the kernels read each plane from its own array
_JOIN: dict[torch.dtype, tuple[Callable[..., None], type]] = {
    torch.float32: (_planes.join32, np.uint32), torch.bfloat16: (_planes.join_bf16, np.uint16),
    torch.float16: (_planes.join_fp16, np.uint16)}
_JOIN_FP16_V1: Callable[..., None] = _planes.join_fp16_v1


def split_with_counts(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(planes, counts): the byte planes of a float tensor as rows of one uint8 array
    (see the module docstring) and each plane's 256-bin histogram (the exponent's left
    zero but for fp64), in one pass."""
    a = _frame.to_numpy(x)
    if x.dtype == torch.float64:
        planes = np.ascontiguousarray(a.view(np.uint8).reshape(-1, 8)[:, ::-1].T)
        counts = np.stack([np.bincount(p, minlength=256) for p in planes])
        return planes, counts
    if x.dtype not in _SPLIT:
        raise TypeError(f"lossless codes floating-point tensors, got {x.dtype}")
    kernel, word, n = _SPLIT[x.dtype]
    planes = np.empty((n, a.size), np.uint8)
    counts = np.zeros((n, 256), np.int64)
    kernel(a.view(word), planes, counts)
    return planes, counts


def split_planes(x: torch.Tensor) -> list[np.ndarray]:
    """The byte planes of a float tensor (see the module docstring), each uint8."""
    return list(split_with_counts(x)[0])


def join_planes(planes: list[np.ndarray] | np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Inverse of ``split_planes``: the raw words (bf16 as uint16)."""
    if dtype == torch.float64:
        stacked = np.asarray(planes, dtype=np.uint8).reshape(len(planes), -1)
        return np.ascontiguousarray(stacked[::-1].T).reshape(-1).view(np.float64)
    if dtype not in _JOIN:
        raise TypeError(f"lossless cannot rebuild {dtype}")
    kernel, word = _JOIN[dtype]
    rows = [np.asarray(p, dtype=np.uint8).reshape(-1) for p in planes]
    if len({r.size for r in rows}) != 1:
        raise ValueError("lossless: byte planes of different lengths")
    out: np.ndarray = np.empty(rows[0].size, word)
    kernel(*rows, out)
    if dtype == torch.float32:
        return out.view(np.float32)
    return out.view(np.float16) if dtype == torch.float16 else out


_PLANES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}
_FP16_V1_PLANES = 3  # the first fp16 layout


_FAST_LEVEL = 1  # recorded in the plane's header
def plane_coders(dtype: torch.dtype) -> dict[str, tuple[Callable[..., bytes],
                                                        Callable[..., np.ndarray]]]:
    """The two exponent-plane coders ``lossless`` chooses between for ``dtype``:
    name -> (compress(plane), decompress(blob, n)), as the benchmarks compare them."""
    return {"zstd": (lambda plane: _zstd_plane.compress(plane, ACCELERATION[dtype]),
                     _zstd_plane.decompress),
            "huffman": (_huffman.compress, _huffman.decompress)}


#: zstd's match-search acceleration (``_zstd_plane.compress``) by dtype. The search finds
#: runs worth 0.1-1.1% of the exponent plane but takes half its encode time on planes
#: without runs (a ResNet's). In bf16/fp16 that plane is half the input, so the search
#: is accelerated: 1.3-2x faster to encode the whole tensor, 0.02-0.2% larger. In fp32
#: it is a quarter of the input and the full search stays (``gradzip bench entropy``).
ACCELERATION = {torch.bfloat16: 4, torch.float16: 4, torch.float32: 0, torch.float64: 0}
_UINT8 = DTYPE_CODE[torch.uint8]


@register("lossless")
class LosslessFloat(Compressor):
    """Exact float compression by byte planes: Huffman, zstd or ANS on the exponent plane."""

    summary = "exact: exponent byte plane Huffman-coded, mantissa planes raw (ZipNN-style)"
    unbiased = True
    keeps_dtype = True
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("exponent", str, "auto",
              "coder of the exponent plane: huff (Huffman, up to 8 tables fitted to its "
              "16K-symbol blocks), zstd (fast settings: Huffman literals and long runs), "
              "ans (order-0 rANS, closer to the entropy on i.i.d. planes), or auto (zstd "
              "for fp16's wider first plane and for planes where sampled windows show "
              "repeats that pay, else huff)",
              choices=("auto", "huff", "zstd", "ans")),
        Param("rest", str, "auto",
              "coding of the other planes: auto (fast zstd where the histogram promises a "
              "saving of 0.5%, else raw), zstd (at --level), or raw",
              choices=("auto", "zstd", "raw")),
        Param("level", int, 3, "zstd level of the other planes under rest=zstd",
              check=in_range(1, 22)),
    )

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        if x.dtype not in _PLANES:
            raise TypeError(f"lossless codes fp32/bf16/fp16/fp64 tensors, got {x.dtype}")
        meta: dict[str, MetaValue] = {"fl": DTYPE_CODE[x.dtype]}
        flat = x.detach().reshape(-1)
        if flat.numel() < MIN_NUMEL:
            return _frame.seal(Payload({"raw": _frame.stored(flat)["d"]}, meta))
        if self._on_device(flat):
            return _frame.seal(Payload(dict(floatcodec_device.encode_planes(flat)), meta))
        planes, counts = split_with_counts(flat)
        fields: dict[str, Payload] = {}
        coder = self.params["exponent"]
        if coder == "auto" and x.dtype == torch.float16:
            coder = "zstd"
        for i, plane in enumerate(planes):
            exponent = coder if i == 0 and x.dtype != torch.float64 else None
            fields[f"p{i}"] = self._code_plane(plane, counts[i], exponent,
                                               ACCELERATION[x.dtype])
        # the checksum covers the dtype code, raw bytes and each plane's own checksum
        return _frame.seal(Payload(dict(fields), meta))

    def _on_device(self, flat: torch.Tensor) -> bool:
        """Whether ``flat`` is coded where it is (``floatcodec_device``): on a device the
        ``ans`` kernel runs on, with settings that path keeps (the host's Huffman, zstd
        and sampled estimates stay on the host)."""
        return (flat.dtype in floatcodec_device.DTYPES and kernels.runs_on(flat)
                and self.params["exponent"] in ("auto", "ans")
                and self.params["rest"] in ("auto", "raw"))

    def _code_plane(self, plane: np.ndarray, counts: np.ndarray, exponent: str | None,
                    acceleration: int) -> Payload:
        """One plane's payload; ``exponent`` names the exponent plane's coder (None for
        the other planes)."""
        t = torch.from_numpy(plane)
        if exponent == "ans":
            return ans.encode(t)
        rest = self.params["rest"]
        if exponent:  # always coded: no estimate needed
            if exponent == "auto":
                exponent = "zstd" if _repeats_pay(plane) else "huff"
            coded = _huff(plane) if exponent == "huff" else _fast_zstd(plane, acceleration)
            return _smaller_of(coded, plane)
        if rest == "auto":
            gain = 1 - _kernels.entropy_bits(counts) / 8  # counts: a sample's
            if gain > CODE_GAIN:
                return _smaller_of(_fast_zstd(plane, acceleration), plane)
            return _raw_plane(plane)
        if rest == "raw":
            return _raw_plane(plane)
        return bytecoders.Zstd(level=self.params["level"]).encode_field(t)

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        _frame.check(p, "lossless")
        code = p.meta.get("fl")
        if not isinstance(code, int) or not 0 <= code < len(DTYPES) \
                or DTYPES[code] not in _PLANES:
            raise PayloadError(f"lossless: bad float dtype code {code!r}")
        dtype = DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        if "raw" in p.fields:
            raw = p.fields["raw"]
            size = torch.empty(0, dtype=dtype).element_size()
            if not isinstance(raw, bytes) or len(raw) != numel * size:
                raise PayloadError("lossless: raw field has the wrong size")
            stored = Payload({"d": raw}, {"m": _frame.STORED, "dt": code, "sh": tuple(shape)})
            return _frame.unstore(stored, "lossless", _frame.FLOAT_DTYPES)
        count = _PLANES[dtype]
        if dtype == torch.float16 and f"p{_FP16_V1_PLANES - 1}" in p.fields:
            count = _FP16_V1_PLANES
        if floatcodec_device.is_device_format(p, count):
            flat = floatcodec_device.decode_planes(p, dtype, numel, count)
            return flat.reshape(shape)
        planes = [_decode_plane(p.child(f"p{i}"), numel) for i in range(count)]
        if count == _FP16_V1_PLANES:
            words = np.empty(numel, np.uint16)
            _JOIN_FP16_V1(*planes, words)
            return _frame.from_numpy(words.view(np.float16), dtype, shape, owned=True)
        return _frame.from_numpy(join_planes(planes, dtype), dtype, shape, owned=True)


#: ``exponent=auto`` probes this many windows of ``PROBE`` symbols of an exponent plane of
#: at least ``PROBE_MIN`` symbols, spread over it, and codes the plane with zstd when
#: zstd's frames of the windows are ``PROBE_MARGIN`` smaller than what Huffman makes of
#: them: zstd's matches take repeats an order-0 coder cannot, such as the rows of a tied
#: embedding's gradient for tokens a batch did not contain (scalar multiples of one
#: vector, one exponent pattern). On a captured LM bucket late in training zstd's plane
#: was 10% smaller. The probe takes ~110-140 us (~10-15% of a ResNet bf16 encode).
PROBES, PROBE, PROBE_MIN, PROBE_MARGIN = 3, 8192, 1 << 16, 0.03
#: the probe's zstd search: accelerated (long repeats are what it looks for), 2.4x faster
PROBE_ACCELERATION = 4


def _repeats_pay(plane: np.ndarray) -> bool:
    """Whether zstd's matches pay on this exponent plane, by the probe windows."""
    if plane.size < PROBE_MIN:
        return False
    stride = plane.size // PROBES
    zstd = huff = 0
    for k in range(PROBES):
        start = k * stride + (stride - PROBE) // 2
        window = plane[start:start + PROBE]
        zstd += len(_zstd_plane.compress(window, PROBE_ACCELERATION))
        huff += _huffman.estimate(window)
    return zstd < (1 - PROBE_MARGIN) * huff


#: a Huffman-coded plane's mode: the layout of ``_huffman`` (the 1 versions it)
_HUFF = "huf1"


def _huff(plane: np.ndarray) -> Payload:
    return Payload({"d": _huffman.compress(plane)},
                   {"m": _HUFF, "dt": _UINT8, "sh": (plane.size,)})


def _fast_zstd(plane: np.ndarray, acceleration: int) -> Payload:
    data = _zstd_plane.compress(plane, acceleration)
    return Payload({"d": data}, {"m": "zstd", "dt": _UINT8, "sh": (plane.size,),
                                 "lvl": _FAST_LEVEL})


#: stored and zstd plane headers differ by a few bytes; data this much smaller than the
#: plane is smaller on the wire whatever the headers
_HEADER_SLACK = 64


def _smaller_of(coded: Payload, plane: np.ndarray) -> Payload:
    """``_frame.pick`` of a coded plane and the stored form, without sizing both headers
    when the coded data alone is clearly the smaller (it was ~5% of a ResNet's encode)."""
    if len(_frame.blob(coded, "d", "lossless")) + _HEADER_SLACK < plane.size:
        return _frame.seal(coded)
    return _frame.pick(coded, torch.from_numpy(plane))


def _raw_plane(plane: np.ndarray) -> Payload:
    """The plane's bytes as they are: a view of the codec's own array, not a copy."""
    meta: dict[str, MetaValue] = {"m": _frame.STORED, "dt": _UINT8, "sh": (plane.size,)}
    return _frame.seal(Payload({"d": _frame.byte_view(plane)}, meta))


def _decode_plane(p: Payload, numel: int) -> np.ndarray:
    mode = p.meta.get("m")
    if mode in ("zstd", _HUFF, _frame.STORED) and p.meta.get("dt") == _UINT8:
        _frame.check(p, "lossless")
        data = _frame.blob(p, "d", "lossless")
        if mode == "zstd":
            return _zstd_plane.decompress(data, numel)
        if mode == _HUFF:
            return _huffman.decompress(data, numel)
        if len(data) != numel:
            raise _frame.EntropyCodingError("lossless: a byte plane has the wrong size")
        return np.frombuffer(data, np.uint8)
    out = ans.decode(p)
    if out.dtype != torch.uint8 or out.numel() != numel:
        raise _frame.EntropyCodingError("lossless: a byte plane has the wrong size")
    return out.numpy()
