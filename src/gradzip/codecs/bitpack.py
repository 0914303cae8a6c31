"""Fast bit and trit packing, and lookup-table decoding of packed codes.

Sign codecs send one bit per value and TernGrad one trit; sending those as whole
bytes (as GRACE does) wastes 8x / 5x on the wire. These helpers pack them densely
and unpack them at memory speed:

* bits are packed LSB-first: value ``i`` is bit ``i % 8`` of byte ``i // 8``; the
  last byte is zero-padded. ``n`` values take ``ceil(n / 8)`` bytes.
* trits (codes 0, 1, 2) are packed five to a byte in base 3
  (``c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4 <= 242``): 1.6 bits per value, 20% less than
  two-bit packing. ``n`` values take ``ceil(n / 5)`` bytes; padding trits are 0.

Decoding goes straight from packed bytes to float32 through a lookup table with one
row per byte value (256 x 8 floats for bits, 243 x 5 for trits), so a decoder never
materialises the unpacked codes: one gather writes the output.

On CPU the work is done by numpy (``packbits``, ``take``), which is several times
faster than the equivalent torch ops single-threaded; on CUDA with Triton, bits are
packed and unpacked by one kernel each (``kernels/bits.py``); elsewhere torch ops.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from gradzip.codecs import kernels
from gradzip.codecs.validation import codes_below
from gradzip.collectives.upload import device_tensor, upload

#: the five base-3 digit weights of a packed trit byte
TRIT_WEIGHTS = (1, 3, 9, 27, 81)
TRITS_PER_BYTE = 5


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).numpy()


def packed_bits_len(n: int) -> int:
    """Bytes that ``n`` packed bits take."""
    return (n + 7) // 8


def packed_trits_len(n: int) -> int:
    """Bytes that ``n`` packed trits take."""
    return (n + TRITS_PER_BYTE - 1) // TRITS_PER_BYTE


# ---------------------------------------------------------------- bits
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (any shape, read flat) into uint8, LSB-first."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits takes a bool tensor, got {mask.dtype}")
    n = mask.numel()
    if kernels.runs_on(mask):
        from gradzip.codecs.kernels import bits

        return bits.pack(mask.contiguous(), signs=False)
    if _on_cpu(mask):
        return torch.from_numpy(np.packbits(_np(mask), bitorder="little"))
    flat = mask.reshape(-1)
    pad = packed_bits_len(n) * 8 - n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = device_tensor([1 << i for i in range(8)], mask.device, torch.uint8)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the IEEE sign bits of ``x``: bit 1 for negative values (and -0.0), 0 otherwise.

    Using the float's own sign bit gives every value, zero included, a definite
    side (+0.0 positive, -0.0 negative) that ``torch.copysign`` agrees with.
    """
    if x.dtype == torch.float32 and kernels.runs_on(x):
        from gradzip.codecs.kernels import bits

        return bits.pack(x.contiguous(), signs=True)
    if _on_cpu(x):
        return torch.from_numpy(np.packbits(np.signbit(_np(x)), bitorder="little"))
    return pack_bits(torch.signbit(x))


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits of ``packed`` as a flat bool tensor."""
    _check_packed(packed, packed_bits_len(n), "bits")
    if kernels.runs_on(packed, numel=n):
        from gradzip.codecs.kernels import bits

        return bits.unpack(packed, n)
    if _on_cpu(packed):
        unpacked = np.unpackbits(_np(packed), count=n, bitorder="little")
        return torch.from_numpy(unpacked.view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    unpacked_bits = (packed.reshape(-1, 1) >> shifts) & 1
    return unpacked_bits.reshape(-1)[:n].bool()


def bits_to_values(
    packed: torch.Tensor, n: int, low: float, high: float
) -> torch.Tensor:
    """Decode packed bits straight to float32: ``high`` where a bit is 1, ``low`` where 0.

    For ``pack_signs`` output, ``low`` is the positive value and ``high`` the negative.
    """
    _check_packed(packed, packed_bits_len(n), "bits")
    if kernels.runs_on(packed, numel=n):
        from gradzip.codecs.kernels import bits

        return bits.unpack(packed, n, (low, high))
    table = np.where(_bit_table(), np.float32(high), np.float32(low))
    return lut_decode(packed, torch.from_numpy(table), n)


@lru_cache(maxsize=1)
def _bit_table() -> np.ndarray:
    """The 256 x 8 table of the LSB-first bits of every byte."""
    byte = np.arange(256, dtype=np.uint8)[:, None]
    return ((byte >> np.arange(8, dtype=np.uint8)) & 1).astype(bool)


# ---------------------------------------------------------------- trits
def pack_trits(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in {0, 1, 2} five to a byte (base 3, first code least significant).

    ``codes`` may already be padded to a multiple of five (padding 0s are free);
    values outside {0, 1, 2} are a ValueError.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_trits takes uint8 codes, got {codes.dtype}")
    flat = codes.reshape(-1)
    n = flat.numel()
    # checked on the host only: on a device the check would be a sync per call, and
    # the codecs that call this make their codes themselves
    if n and flat.device.type == "cpu" and int(flat.max()) > 2:
        raise ValueError("pack_trits: codes must be 0, 1 or 2")
    if kernels.runs_on(flat):
        from gradzip.codecs.kernels import bits

        return bits.pack_trits(flat.contiguous())
    pad = packed_trits_len(n) * TRITS_PER_BYTE - n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, TRITS_PER_BYTE)
    # Horner's rule on strided columns: one small pass per digit, all in uint8
    out = groups[:, 4].clone()
    for d in (3, 2, 1, 0):
        out.mul_(3).add_(groups[:, d])
    return out


@lru_cache(maxsize=1)
def trit_table() -> np.ndarray:
    """The 243 x 5 table of base-3 digits of every packed trit byte (read-only)."""
    v = np.arange(243)
    table = np.stack([(v // w) % 3 for w in TRIT_WEIGHTS], axis=1).astype(np.uint8)
    table.flags.writeable = False
    return table


def unpack_trits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` trits of ``packed`` as uint8 codes in {0, 1, 2}."""
    if kernels.runs_on(packed, numel=n):
        from gradzip.codecs.kernels import bits

        return bits.unpack_trits(_valid_trit_bytes(packed, n), n)
    table = torch.from_numpy(trit_table().copy())
    return lut_decode(packed, table, n, check=packed_trits_len(n))


def trits_to_values(
    packed: torch.Tensor, n: int, values: tuple[float, float, float]
) -> torch.Tensor:
    """Decode packed trits straight to float32: code ``k`` becomes ``values[k]``."""
    if kernels.runs_on(packed, numel=n):
        from gradzip.codecs.kernels import bits

        return bits.unpack_trits(_valid_trit_bytes(packed, n), n, values)
    table = np.asarray(values, dtype=np.float32)[trit_table()]
    return lut_decode(packed, torch.from_numpy(table), n, check=packed_trits_len(n))


def _valid_trit_bytes(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``packed``, checked as ``lut_decode`` checks it (one uint8 byte per five trits,
    each below 243): at once, or under deferred checks a flag on the device and the
    bytes clamped into range (``validation``)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError("packed trits must be a 1-D uint8 tensor")
    _check_packed(packed, packed_trits_len(n), "codes")
    return codes_below(packed, 243, "packed trits (243 table rows)")


# ---------------------------------------------------------------- tables
def lut_decode(
    packed: torch.Tensor, table: torch.Tensor, n: int, check: int | None = None
) -> torch.Tensor:
    """``table[packed]`` flattened and cut to ``n`` values.

    ``table`` has one row per possible byte (or is 1-D); each packed byte expands to
    its row. A byte with no row (a corrupt payload) raises instead of reading junk.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError("lut_decode takes a 1-D uint8 tensor")
    per = 1 if table.dim() == 1 else table.shape[1]
    if check is not None:
        _check_packed(packed, check, "codes")
    if packed.numel() * per < n:
        raise ValueError(f"packed codes hold {packed.numel() * per} values, need {n}")
    if table.shape[0] < 256 and packed.numel() and int(packed.max()) >= table.shape[0]:
        raise ValueError(f"packed code {int(packed.max())} has no table row ({table.shape[0]})")
    if _on_cpu(packed):
        codes = _np(packed)
        if table.dim() == 1 and codes.size >= _PAIR_MIN:
            out = _pair_take(table.numpy(), codes)
        else:
            out = torch.from_numpy(np.take(table.numpy(), codes, axis=0))
    else:
        out = upload(table, packed.device)[packed.long()]
    return out.reshape(-1)[:n]


#: below this many codes a 64K-row pair table costs more than it saves
_PAIR_MIN = 1 << 18


def _pair_take(table: np.ndarray, codes: np.ndarray) -> torch.Tensor:
    """1-D ``table[codes]`` two bytes at a time: a 65536 x 2 table indexed by uint16.

    Half as many gathers of twice the width: ~1.5x faster than one byte at a time.
    """
    i = np.arange(1 << 16)
    pairs = np.stack([table[i & 255], table[i >> 8]], axis=1)  # little-endian byte order
    even = codes.size & ~1
    out = np.empty(codes.size, dtype=table.dtype)
    # mode="clip" lets numpy write straight into ``out`` (every uint16 has a row)
    np.take(pairs, codes[:even].view(np.uint16), axis=0, out=out[:even].reshape(-1, 2),
            mode="clip")
    if even < codes.size:
        out[even:] = table[codes[even:]]
    return torch.from_numpy(out)


def _check_packed(packed: torch.Tensor, nbytes: int, what: str) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"packed {what} must be a 1-D uint8 tensor, got {packed.dtype}")
    if packed.numel() != nbytes:
        raise ValueError(f"packed {what}: expected {nbytes} bytes, got {packed.numel()}")


def count_ones(packed: torch.Tensor) -> int:
    """Number of 1 bits in a packed uint8 tensor (padding bits are 0)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"count_ones takes uint8, got {packed.dtype}")
    if _on_cpu(packed):
        return int(np.bitwise_count(_np(packed)).sum(dtype=np.int64))
    return int(unpack_bits(packed.reshape(-1), packed.numel() * 8).sum())
