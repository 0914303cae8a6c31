"""Fused block quantizers: one read of each value, one write of its code.

One program handles ``ROWS`` blocks of the bucket's block table, each a row of
``WIDTH`` lanes (masked past the block's length): it reduces the row to its statistic
(abs-max for ``int8`` and ``fp8``, the L2 norm for ``qsgd``), forms the inverse scale
in float64 exactly as ``quantize.safe_inverse`` does, multiplies in float32, rounds
and writes the integers (or the fp8 bytes), and the statistic. Decode is one
multiply per value by its block's scale.

Bit for bit with the torch path: rounding to nearest even is ``(y + 1.5 * 2**23) -
1.5 * 2**23`` (exact for ``|y| < 2**22``), stochastic rounding adds the same 16-bit
draws as ``quantize.quantize_layout``, and kernels launch with FMA contraction off
(``x * inv + u`` fused would round once where the torch path rounds twice). fp8 bytes
are made from the float32 bits with integer operations (round to nearest even,
subnormals included), which equals ``torch.Tensor.to(torch.float8_*)`` on every input
the encoder makes (clamped to the format's largest value first), on any device and in
the interpreter alike. Sums differ: the L2 norm adds squares in float64 in the tree
order of the reduction, the torch path in float32 per piece, so ``qsgd``'s norms agree
to within a float32 ulp or two, not always bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gradzip.codecs.kernels.blocks import BlockTable

_FP32_MAX = 3.4028234663852886e38
#: values per program (ROWS blocks of WIDTH lanes)
_TILE = 4096
#: fp8 formats: (mantissa bits, exponent bias, largest finite value)
FP8 = {"e4m3": (3, 7, 448.0), "e5m2": (2, 15, 57344.0)}


@triton.jit
def _rows(starts_ptr, lens_ptr, nblocks, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Offsets, mask and row indices of this program's ``ROWS`` blocks."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < nblocks
    start = tl.load(starts_ptr + rows, mask=live, other=0)
    length = tl.load(lens_ptr + rows, mask=live, other=0)
    cols = tl.arange(0, WIDTH)
    mask = cols[None, :] < length[:, None]
    return start[:, None] + cols[None, :], mask, rows, live


@triton.jit
def _inverse(stat, levels):
    """``quantize.safe_inverse``: float32(min(levels / float64(stat), FP32_MAX)), 0 at 0."""
    inv = levels / stat.to(tl.float64)
    inv = tl.minimum(inv, 3.4028234663852886e38).to(tl.float32)
    return tl.where(stat > 0, inv, 0.0)


@triton.jit
def _quantize_kernel(x_ptr, starts_ptr, lens_ptr, rand_ptr, q_ptr, stat_ptr, nblocks, levels,
                     ROWS: tl.constexpr, WIDTH: tl.constexpr, L2: tl.constexpr,
                     STOCHASTIC: tl.constexpr, CLIP: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if L2:
        wide = x.to(tl.float64)
        stat = tl.minimum(tl.sqrt(tl.sum(wide * wide, axis=1)), 3.4028234663852886e38)
        stat = stat.to(tl.float32)
    else:
        stat = tl.max(tl.abs(x), axis=1)
    y = x * _inverse(stat, levels)[:, None]
    if STOCHASTIC:
        if CLIP:
            y = tl.minimum(tl.maximum(y, -levels), levels)
        r = tl.load(rand_ptr + offs, mask=mask, other=0).to(tl.float32)
        y = y + r * 1.52587890625e-05  # 2**-16, exact
        y = tl.floor(y + 0.5000076293945312)  # 0.5 + 2**-17
    else:
        y = (y + 12582912.0) - 12582912.0  # round half to even
    y = tl.minimum(tl.maximum(y, -levels), levels)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(stat_ptr + rows, stat, mask=live)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, starts_ptr, lens_ptr, out_ptr, nblocks,
                       ROWS: tl.constexpr, WIDTH: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=live, other=0.0)
    tl.store(out_ptr + offs, q * scale[:, None], mask=mask)


@triton.jit
def _fp8_encode_kernel(x_ptr, starts_ptr, lens_ptr, code_ptr, amax_ptr, nblocks, largest,
                       steps_per_unit, ROWS: tl.constexpr, WIDTH: tl.constexpr, MANT: tl.constexpr,
                       BIAS: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    amax = tl.max(tl.abs(x), axis=1)
    y = x * _inverse(amax, largest)[:, None]
    y = tl.minimum(tl.maximum(y, -largest), largest)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal: round the float32 mantissa to MANT bits, half to even, and rebias
    up = mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)
    normal = (up >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # subnormal (below 2**(1 - BIAS)): an integer count of the smallest step, half to even
    steps = tl.abs(y) * steps_per_unit
    sub = ((steps + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < ((128 - BIAS) << 23), sub, normal) | sign
    tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)
    tl.store(amax_ptr + rows, amax, mask=live)


@triton.jit
def _fp8_decode_kernel(code_ptr, scale_ptr, starts_ptr, lens_ptr, out_ptr, nblocks,
                       step, ROWS: tl.constexpr, WIDTH: tl.constexpr, MANT: tl.constexpr,
                       BIAS: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    code = tl.load(code_ptr + offs, mask=mask, other=0).to(tl.int32)
    mag = code & 0x7F
    expo = mag >> MANT
    value = tl.where(expo == 0, mag.to(tl.float32) * step,
                     ((mag << (23 - MANT)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True))
    nan = tl.full(code.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if MANT == 3:  # e4m3fn: S.1111.111 is NaN, there is no infinity
        value = tl.where(mag == 0x7F, nan, value)
    else:  # e5m2: exponent 31 is infinity (mantissa 0) or NaN
        inf = tl.full(code.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
        value = tl.where(expo == 31, tl.where((mag & 3) == 0, inf, nan), value)
    value = tl.where((code & 0x80) != 0, -value, value)
    scale = tl.load(scale_ptr + rows, mask=live, other=0.0)
    tl.store(out_ptr + offs, value * scale[:, None], mask=mask)


def _grid(table: BlockTable) -> tuple[tuple[int], int]:
    rows = max(1, _TILE // table.width)
    return (triton.cdiv(table.count, rows),), rows


def quantize(x: torch.Tensor, table: BlockTable, levels: float, dtype: torch.dtype,
             l2: bool = False, rand: torch.Tensor | None = None,
             clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers in [-levels, levels] of ``dtype``, the float32 statistic per block):
    ``quantize.quantize_layout`` with the abs-max (or the L2 norm, ``l2``) as the
    statistic; ``rand``: the int16 draws of stochastic rounding, one per value."""
    q = torch.empty(x.numel(), dtype=dtype, device=x.device)
    stat = torch.empty(table.count, dtype=torch.float32, device=x.device)
    if table.count:
        grid, rows = _grid(table)
        _quantize_kernel[grid](x, table.starts, table.lengths, q if rand is None else rand,
                               q, stat, table.count, float(levels), ROWS=rows,
                               WIDTH=table.width, L2=l2, STOCHASTIC=rand is not None,
                               CLIP=clip, enable_fp_fusion=False)
    return q, stat


def dequantize(q: torch.Tensor, table: BlockTable, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale[block]``."""
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    if table.count:
        grid, rows = _grid(table)
        _dequantize_kernel[grid](q, scale.float().contiguous(), table.starts, table.lengths,
                                 out, table.count, ROWS=rows, WIDTH=table.width,
                                 enable_fp_fusion=False)
    return out


def fp8_encode(x: torch.Tensor, table: BlockTable,
               fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 bytes as uint8, float32 abs-max per block): each value times
    ``largest / amax`` of its block, clamped, rounded to the format."""
    mant, bias, largest = FP8[fmt]
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    amax = torch.empty(table.count, dtype=torch.float32, device=x.device)
    if table.count:
        grid, rows = _grid(table)
        _fp8_encode_kernel[grid](x, table.starts, table.lengths, codes, amax, table.count,
                                 largest, 2.0 ** (bias - 1 + mant), ROWS=rows,
                                 WIDTH=table.width, MANT=mant, BIAS=bias,
                                 enable_fp_fusion=False)
    return codes, amax


def fp8_decode(codes: torch.Tensor, table: BlockTable, scale: torch.Tensor,
               fmt: str) -> torch.Tensor:
    """float32 value of each fp8 byte times its block's scale."""
    mant, bias, _ = FP8[fmt]
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    if table.count:
        grid, rows = _grid(table)
        _fp8_decode_kernel[grid](codes, scale.float().contiguous(), table.starts,
                                 table.lengths, out, table.count, 2.0 ** (1 - bias - mant),
                                 ROWS=rows,
                                 WIDTH=table.width, MANT=mant, BIAS=bias,
                                 enable_fp_fusion=False)
    return out
