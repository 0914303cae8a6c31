"""Bit and trit packing on the device: ``bitpack``'s pack and unpack, one kernel each.

The torch path packs with a pad, a cast, a multiply by the bit weights and a row sum,
and unpacks through a 256 x 8 table gather: four to six passes and launches, which
made ``signsgd``'s decode 42 GB/s on an H200 against 569 for a copy. Here a program
packs ``BLOCK`` bytes from their ``8 x BLOCK`` values (a sign bit, or a bool), or
writes each value from its byte's bit (a bool, or one of two floats). The layout is
``bitpack``'s: LSB first, the last byte zero-padded; the bytes are the same as the CPU
path's, bit for bit (``tests/test_kernels.py``). Trits (TernGrad's codes 0, 1, 2) go
five to a byte in base 3, first code least significant, as ``bitpack.pack_trits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: bytes per program when packing, values per program when unpacking
_BLOCK = 1024


@triton.jit
def _pack_kernel(src_ptr, n, out_ptr, nbytes, SIGNS: tl.constexpr, BLOCK: tl.constexpr):
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    idx = byte[:, None] * 8 + lane[None, :]
    live = idx < n
    if SIGNS:  # the IEEE sign bit of a float32: -0.0 counts as negative
        value = tl.load(src_ptr + idx, mask=live, other=0.0)
        bit = (value.to(tl.int32, bitcast=True) >> 31) & 1
    else:
        bit = tl.load(src_ptr + idx, mask=live, other=0).to(tl.int32)
    bit = tl.where(live, bit, 0)
    tl.store(out_ptr + byte, tl.sum(bit << lane[None, :], axis=1).to(tl.uint8),
             mask=byte < nbytes)


@triton.jit
def _unpack_kernel(packed_ptr, n, out_ptr, low, high, VALUES: tl.constexpr,
                   BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < n
    byte = tl.load(packed_ptr + (idx >> 3), mask=live, other=0).to(tl.int32)
    bit = (byte >> (idx & 7)) & 1
    if VALUES:
        tl.store(out_ptr + idx, tl.where(bit != 0, high, low), mask=live)
    else:
        tl.store(out_ptr + idx, bit != 0, mask=live)


def pack(src: torch.Tensor, signs: bool) -> torch.Tensor:
    """The LSB-first bytes of a flat bool tensor, or of a float32 tensor's sign bits."""
    n = src.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=src.device)
    if nbytes:
        _pack_kernel[(triton.cdiv(nbytes, _BLOCK),)](src.reshape(-1), n, out, nbytes,
                                                     SIGNS=signs, BLOCK=_BLOCK)
    return out


def unpack(packed: torch.Tensor, n: int, values: tuple[float, float] | None = None,
           ) -> torch.Tensor:
    """The first ``n`` bits of ``packed``: as bools, or as float32 ``values`` (the value
    for a 0 bit, the value for a 1 bit)."""
    dtype = torch.bool if values is None else torch.float32
    out = torch.empty(n, dtype=dtype, device=packed.device)
    low, high = values if values is not None else (0.0, 0.0)
    if n:
        _unpack_kernel[(triton.cdiv(n, _BLOCK),)](packed, n, out, float(low), float(high),
                                                  VALUES=values is not None, BLOCK=_BLOCK)
    return out


@triton.jit
def _trit_weight(lane):
    """3 ** lane for lanes 0..4."""
    return tl.where(lane == 0, 1, tl.where(lane == 1, 3, tl.where(lane == 2, 9, tl.where(
        lane == 3, 27, 81))))


@triton.jit
def _pack_trits_kernel(codes_ptr, n, out_ptr, nbytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    idx = byte[:, None] * 5 + lane[None, :]
    live = (lane[None, :] < 5) & (idx < n)
    code = tl.load(codes_ptr + idx, mask=live, other=0).to(tl.int32)
    packed = tl.sum(tl.where(live, code * _trit_weight(lane)[None, :], 0), axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)


@triton.jit
def _unpack_trits_kernel(packed_ptr, n, out_ptr, v0, v1, v2, VALUES: tl.constexpr,
                         BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < n
    byte = tl.load(packed_ptr + idx // 5, mask=live, other=0).to(tl.int32)
    code = (byte // _trit_weight(idx % 5)) % 3
    if VALUES:
        tl.store(out_ptr + idx, tl.where(code == 0, v0, tl.where(code == 1, v1, v2)),
                 mask=live)
    else:
        tl.store(out_ptr + idx, code.to(tl.uint8), mask=live)


def pack_trits(codes: torch.Tensor) -> torch.Tensor:
    """Flat uint8 codes in {0, 1, 2}, five to a byte (the last one zero-padded)."""
    n = codes.numel()
    nbytes = (n + 4) // 5
    out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if nbytes:
        _pack_trits_kernel[(triton.cdiv(nbytes, _BLOCK),)](codes.reshape(-1), n, out, nbytes,
                                                           BLOCK=_BLOCK)
    return out


def unpack_trits(packed: torch.Tensor, n: int,
                 values: tuple[float, float, float] | None = None) -> torch.Tensor:
    """The first ``n`` trits of ``packed`` (bytes below 243): uint8 codes, or the float32
    ``values[code]``."""
    dtype = torch.uint8 if values is None else torch.float32
    out = torch.empty(n, dtype=dtype, device=packed.device)
    v0, v1, v2 = values if values is not None else (0.0, 0.0, 0.0)
    if n:
        _unpack_trits_kernel[(triton.cdiv(n, _BLOCK),)](packed, n, out, float(v0), float(v1),
                                                        float(v2), VALUES=values is not None,
                                                        BLOCK=_BLOCK)
    return out
