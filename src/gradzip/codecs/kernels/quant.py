"""Fused block quantizers: one read of each value, one write of its code.

One program handles ``ROWS`` blocks of the bucket's block table, each a row of
``WIDTH`` lanes (masked past the block's length): it reduces the row to its statistic
(abs-max for ``int8`` and ``fp8``, the L2 norm for ``qsgd``), forms the inverse scale
in float64 exactly as ``quantize.safe_inverse`` does, multiplies in float32, rounds
and writes the integers (or the fp8 bytes), and the statistic. Decode is one
multiply per value by its block's scale.

Bit for bit with the torch path: rounding to nearest even is ``floor`` plus a tie
rule (no magic constant a compiler could fold), the decode scale is divided in float64
(correctly rounded, as a CPU divides; torch on CUDA multiplies by the reciprocal), and
kernels launch with FMA contraction off (``x * inv + u`` fused would round once where
the torch path rounds twice). Stochastic rounding adds 16-bit draws as
``quantize.quantize_layout`` does: given draws (``rand``), or drawn on the device with
Philox from the slot's seed (what the codecs do; ``random_draws`` gives the same draws
to check against). fp8 bytes come from the device's own conversion where it has one
(compute capability 8.9+), elsewhere and in the interpreter from the float32 bits
with integer operations (round to nearest even, subnormals included); both equal
``torch.Tensor.to(torch.float8_*)`` on every input the encoder makes (clamped to the
format's largest value first). Sums differ: the L2 norm adds squares in float64 in
the tree order of the reduction, the torch path in float32 per piece, so ``qsgd``'s
norms agree to within a float32 ulp or two, not always bit for bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gradzip.codecs import kernels
from gradzip.codecs.kernels.blocks import BlockTable

_FP32_MAX = 3.4028234663852886e38
#: values per program (ROWS blocks of WIDTH lanes)
_TILE = 4096
#: fp8 formats: (mantissa bits, exponent bias, largest finite value)
FP8 = {"e4m3": (3, 7, 448.0), "e5m2": (2, 15, 57344.0)}
#: their Triton types (the device's own conversions)
_F8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


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
def _round_half_even(y):
    """``torch.round``: to the nearest integer, ties to even (exact for |y| < 2**23)."""
    low = tl.floor(y)
    frac = y - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, low + 1.0, low)


@triton.jit
def _draws(rand_ptr, seed, offs, mask, SOURCE: tl.constexpr):
    """The int16 draws of stochastic rounding, as float32: from ``rand_ptr`` (SOURCE 1)
    or Philox on the device, keyed by (seed, position) (SOURCE 2, ``random_draws``)."""
    if SOURCE == 1:
        return tl.load(rand_ptr + offs, mask=mask, other=0).to(tl.float32)
    bits = tl.randint(seed, offs.to(tl.int32))
    return (((bits >> 16) & 0xFFFF).to(tl.int32) - 32768).to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, starts_ptr, lens_ptr, rand_ptr, q_ptr, stat_ptr, nblocks, levels,
                     seed, ROWS: tl.constexpr, WIDTH: tl.constexpr, L2: tl.constexpr,
                     SOURCE: tl.constexpr, CLIP: tl.constexpr, AS_SCALE: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if L2:
        wide = x.to(tl.float64)
        stat = tl.minimum(tl.sqrt(tl.sum(wide * wide, axis=1)), 3.4028234663852886e38)
        stat = stat.to(tl.float32)
    else:
        stat = tl.max(tl.abs(x), axis=1)
    y = x * _inverse(stat, levels)[:, None]
    if SOURCE > 0:
        if CLIP:
            y = tl.minimum(tl.maximum(y, -levels), levels)
        y = y + _draws(rand_ptr, seed, offs, mask, SOURCE) * 1.52587890625e-05  # 2**-16
        y = tl.floor(y + 0.5000076293945312)  # 0.5 + 2**-17
    else:
        y = _round_half_even(y)
    y = tl.minimum(tl.maximum(y, -levels), levels)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    if AS_SCALE:  # the decode scale, divided in float64: correctly rounded, as on a CPU
        stat = (stat.to(tl.float64) / levels).to(tl.float32)
    tl.store(stat_ptr + rows, stat, mask=live)


@triton.jit
def _random_draws_kernel(out_ptr, seed, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _draws(out_ptr, seed, offs, mask, 2).to(tl.int16), mask=mask)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, starts_ptr, lens_ptr, out_ptr, nblocks,
                       ROWS: tl.constexpr, WIDTH: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=live, other=0.0)
    tl.store(out_ptr + offs, q * scale[:, None], mask=mask)


@triton.jit
def _fp8_encode_kernel(x_ptr, starts_ptr, lens_ptr, code_ptr, scale_ptr, nblocks, largest,
                       steps_per_unit, ROWS: tl.constexpr, WIDTH: tl.constexpr,
                       MANT: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr,
                       F8: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    amax = tl.max(tl.abs(x), axis=1)
    y = x * _inverse(amax, largest)[:, None]
    y = tl.minimum(tl.maximum(y, -largest), largest)
    if HW:  # the device converts (sm89+): to nearest even, as torch's cast
        code = y.to(F8).to(tl.uint8, bitcast=True)
    else:
        code = _fp8_bits(y, steps_per_unit, MANT, BIAS).to(tl.uint8)
    tl.store(code_ptr + offs, code, mask=mask)
    tl.store(scale_ptr + rows, (amax.to(tl.float64) / largest).to(tl.float32), mask=live)


@triton.jit
def _fp8_bits(y, steps_per_unit, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The fp8 byte of each float32 ``y`` within the format's range, from its bits."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal: round the float32 mantissa to MANT bits, half to even, and rebias
    up = mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)
    normal = (up >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # subnormal (below 2**(1 - BIAS)): an integer count of the smallest step, half to even
    sub = _round_half_even(tl.abs(y) * steps_per_unit).to(tl.int32)
    return tl.where(mag < ((128 - BIAS) << 23), sub, normal) | sign


@triton.jit
def _fp8_decode_kernel(code_ptr, scale_ptr, starts_ptr, lens_ptr, out_ptr, nblocks,
                       step, ROWS: tl.constexpr, WIDTH: tl.constexpr, MANT: tl.constexpr,
                       BIAS: tl.constexpr, HW: tl.constexpr, F8: tl.constexpr):
    offs, mask, rows, live = _rows(starts_ptr, lens_ptr, nblocks, ROWS, WIDTH)
    raw = tl.load(code_ptr + offs, mask=mask, other=0)
    if HW:
        value = raw.to(F8, bitcast=True).to(tl.float32)
    else:
        value = _fp8_value(raw.to(tl.int32), step, MANT, BIAS)
    scale = tl.load(scale_ptr + rows, mask=live, other=0.0)
    tl.store(out_ptr + offs, value * scale[:, None], mask=mask)


@triton.jit
def _fp8_value(code, step, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The float32 value of each fp8 byte (NaN and infinity included), from its bits."""
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
    return tl.where((code & 0x80) != 0, -value, value)


def _grid(table: BlockTable) -> tuple[tuple[int], int]:
    rows = max(1, _TILE // table.width)
    return (triton.cdiv(table.count, rows),), rows


def quantize(x: torch.Tensor, table: BlockTable, levels: float, dtype: torch.dtype,
             l2: bool = False, rand: torch.Tensor | None = None, seed: int | None = None,
             clip: bool = False, as_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers in [-levels, levels] of ``dtype``, a float32 per block):
    ``quantize.quantize_layout`` with the abs-max (or the L2 norm, ``l2``) as the
    statistic, which comes back as it is or divided by ``levels`` (``as_scale``: the
    decode scale). Rounding is to nearest even, or stochastic with the int16 draws
    ``rand`` (one per value) or Philox draws keyed by ``seed`` (``random_draws``)."""
    q = torch.empty(x.numel(), dtype=dtype, device=x.device)
    stat = torch.empty(table.count, dtype=torch.float32, device=x.device)
    source = 1 if rand is not None else 2 if seed is not None else 0
    if table.count:
        grid, rows = _grid(table)
        _quantize_kernel[grid](x, table.starts, table.lengths, q if rand is None else rand,
                               q, stat, table.count, float(levels), _seed(seed), ROWS=rows,
                               WIDTH=table.width, L2=l2, SOURCE=source, CLIP=clip,
                               AS_SCALE=as_scale, enable_fp_fusion=False)
    return q, stat


def _seed(seed: int | None) -> int:
    """A seed Philox takes (a non-negative int64)."""
    return 0 if seed is None else int(seed) & 0x7FFFFFFFFFFFFFFF


def random_draws(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """The int16 draws ``quantize(seed=seed)`` rounds with, value by value (for tests)."""
    out = torch.empty(n, dtype=torch.int16, device=device)
    if n:
        _random_draws_kernel[(triton.cdiv(n, _TILE),)](out, _seed(seed), n, BLOCK=_TILE)
    return out


def dequantize(q: torch.Tensor, table: BlockTable, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale[block]``."""
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    if table.count:
        grid, rows = _grid(table)
        _dequantize_kernel[grid](q, scale.float().contiguous(), table.starts, table.lengths,
                                 out, table.count, ROWS=rows, WIDTH=table.width,
                                 enable_fp_fusion=False)
    return out


@functools.cache
def hardware_fp8(device: torch.device) -> bool:
    """Whether ``device`` converts fp8 itself (compute capability 8.9 and up), where
    the kernels use its conversions; elsewhere, and in the interpreter, they convert
    with integer operations (the same bytes)."""
    if device.type != "cuda" or kernels.interpreter_on():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_encode(x: torch.Tensor, table: BlockTable,
               fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 bytes as uint8, float32 scale per block: its abs-max over the format's
    largest value): each value times the inverse, clamped, rounded to the format."""
    mant, bias, largest = FP8[fmt]
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    scale = torch.empty(table.count, dtype=torch.float32, device=x.device)
    if table.count:
        grid, rows = _grid(table)
        _fp8_encode_kernel[grid](x, table.starts, table.lengths, codes, scale, table.count,
                                 largest, 2.0 ** (bias - 1 + mant), ROWS=rows,
                                 WIDTH=table.width, MANT=mant, BIAS=bias,
                                 HW=hardware_fp8(x.device), F8=_F8[fmt],
                                 enable_fp_fusion=False)
    return codes, scale


def fp8_decode(codes: torch.Tensor, table: BlockTable, scale: torch.Tensor,
               fmt: str) -> torch.Tensor:
    """float32 value of each fp8 byte times its block's scale."""
    mant, bias, _ = FP8[fmt]
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    if table.count:
        grid, rows = _grid(table)
        _fp8_decode_kernel[grid](codes, scale.float().contiguous(), table.starts,
                                 table.lengths, out, table.count, 2.0 ** (1 - bias - mant),
                                 ROWS=rows, WIDTH=table.width, MANT=mant, BIAS=bias,
                                 HW=hardware_fp8(codes.device), F8=_F8[fmt],
                                 enable_fp_fusion=False)
    return out
