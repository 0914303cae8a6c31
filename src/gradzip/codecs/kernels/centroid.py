"""``centroid`` in one pass: equal-count bins, bin means and Lloyd steps per bucket.

The torch path (``codecs/centroid.py``) ranks each bucket's magnitudes with a batched
``argsort``, then forms every (bucket, bin) mean with two float64 ``index_add`` passes
and repeats that per Lloyd step, a loop over the edges in between: 151 torch operators
per encode for 2-bit codes and 271 for 4-bit (4 Lloyd steps; counted by the profiler),
most of them full passes over the bucket, float64 atomics among them on a GPU, and 17
per decode. Here one program holds ``ROWS`` buckets in registers and does it all
there: the bucket is read once and its codes and bin means written once; decode is
one launch and a reduction of its flags.

The same numbers as the torch path:

- **Equal-count bins without ranks.** A value's rank among its bucket's magnitudes
  (ties to the lower position, as a stable sort) is the rank of the key
  ``bits(|x|) * BLOCK + position``: the float32 bits of a non-negative float order as
  integers, and the position makes every key distinct. ``bin = rank * L // size`` is at
  least ``j`` exactly when the rank is at least ``c_j = ceil(j * size / L)``, that is
  when the key is at least the ``c_j``-th smallest key, which one sort of the keys
  (``tl.sort``) gives. No rank is scattered back to its value.
- **Means** in float64: the sum of the bin's magnitudes over the count of its nonzero
  ones, 0 for an empty bin, then the Lloyd edges halfway between neighbouring means
  (an empty bin's taken from the running maximum below it) compared in float64.
- **Sums in another order.** The torch path adds a bin's magnitudes one by one, a
  reduction here in a tree. In float64 both are exact while every partial sum fits 53
  bits: a bucket of B float32 magnitudes whose largest is below ``2**(29 - log2 B)``
  times its smallest (2**21 at the default 256, 2**17 at 4,096). Past that a sum may
  round in either order, by a float64 ulp, which reaches the output only where it
  decides a float32 rounding of a mean (a tie: about 2**-21 of means) or an edge lands
  on a magnitude. So the kernel equals the torch path bit for bit on the test data and
  almost always on gradients, not on every input (``bench gpu`` counts what differs).
  On a GPU the kernel is deterministic, where the torch path's float64 atomics are not.
  NaN never reaches the stage (a chain's non-finite check stops it first); given one
  directly, the kernel's ``max`` and ``minimum`` skip it where ``cummax`` and
  ``clamp`` keep it.

Decode is one gather per value from its bucket's table; the codes are checked in the
same pass (``|q| <= L``, -128 refused), a flag per program the caller reads or defers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: values per program: ``ROWS`` buckets of ``BLOCK`` lanes
_TILE = 1024


@triton.jit
def _bin_means(mag, bins, live, ROWS: tl.constexpr, LEVELS: tl.constexpr):
    """[ROWS, LEVELS] float64: each bin's mean nonzero magnitude per row, 0 where empty."""
    lv = tl.arange(0, LEVELS)
    means = tl.zeros([ROWS, LEVELS], dtype=tl.float64)
    for j in tl.static_range(LEVELS):
        inside = live & (bins == j)
        total = tl.sum(tl.where(inside, mag, 0.0), axis=1)
        hits = tl.sum(tl.where(inside & (mag > 0), 1, 0), axis=1).to(tl.float64)
        mean = tl.where(hits > 0, total / tl.maximum(hits, 1.0), 0.0)
        means = tl.where(lv[None, :] == j, mean[:, None], means)
    return means


@triton.jit
def _nearest_bins(mag, means, LEVELS: tl.constexpr):
    """Each magnitude's bin under edges halfway between neighbouring bin means, an empty
    (0) bin's mean replaced by the largest below it (``torch.cummax``; means are >= 0)."""
    lv = tl.arange(0, LEVELS)
    bins = tl.zeros(mag.shape, dtype=tl.int32)
    for j in tl.static_range(LEVELS - 1):
        low = tl.max(tl.where(lv[None, :] <= j, means, 0.0), axis=1)
        high = tl.max(tl.where(lv[None, :] <= j + 1, means, 0.0), axis=1)
        edge = (high + low) / 2
        bins += (mag > edge[:, None]).to(tl.int32)
    return bins


@triton.jit
def _encode_kernel(x_ptr, q_ptr, c_ptr, n, nbuckets, bucket, lloyd, ROWS: tl.constexpr,
                   BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, LEVELS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    start = rows * bucket
    size = tl.where(rows < nbuckets, tl.minimum(n - start, bucket), 0)
    live = cols[None, :] < size[:, None]
    offs = start[:, None] + cols[None, :]
    x = tl.load(x_ptr + offs, mask=live, other=0.0)
    mag32 = tl.abs(x)
    bits = mag32.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(live, (bits << LOG_BLOCK) | cols[None, :], 0x7FFFFFFFFFFFFFFF)
    ordered = tl.sort(key, dim=1)
    bins = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    for j in tl.static_range(1, LEVELS):
        first = (j * size + LEVELS - 1) // LEVELS  # the smallest rank in bin j or above
        above = tl.where(cols[None, :] >= first[:, None], ordered, 0x7FFFFFFFFFFFFFFF)
        edge = tl.min(above, axis=1)
        bins += (key >= edge[:, None]).to(tl.int32)
    mag = mag32.to(tl.float64)
    means = _bin_means(mag, bins, live, ROWS, LEVELS)
    for _ in range(lloyd):
        bins = _nearest_bins(mag, means, LEVELS)
        means = _bin_means(mag, bins, live, ROWS, LEVELS)
    sign = tl.where(x > 0, 1, tl.where(x < 0, -1, 0))
    tl.store(q_ptr + offs, (sign * (bins + 1)).to(tl.int8), mask=live)
    lv = tl.arange(0, LEVELS)
    table = tl.minimum(means, 3.4028234663852886e38).to(tl.float32)
    tl.store(c_ptr + rows[:, None] * LEVELS + lv[None, :], table,
             mask=(rows < nbuckets)[:, None])


@triton.jit
def _decode_kernel(q_ptr, c_ptr, out_ptr, bad_ptr, n, bucket, BLOCK: tl.constexpr,
                   LEVELS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    q = tl.load(q_ptr + offs, mask=live, other=0).to(tl.int32)
    code = tl.abs(q)
    bad = live & (code > LEVELS)
    cell = (offs // bucket) * LEVELS + tl.minimum(tl.maximum(code - 1, 0), LEVELS - 1)
    mean = tl.load(c_ptr + cell, mask=live, other=0.0)
    sign = tl.where(q > 0, 1.0, tl.where(q < 0, -1.0, 0.0))
    tl.store(out_ptr + offs, mean * sign, mask=live)
    tl.store(bad_ptr + tl.program_id(0), tl.max(bad.to(tl.int32), axis=0))


def _layout(bucket: int) -> tuple[int, int, int]:
    """(lanes per bucket: a power of two, its log2, buckets per program)."""
    block = triton.next_power_of_2(max(bucket, 2))
    return block, block.bit_length() - 1, max(1, _TILE // block)


def _warps(block: int) -> int:
    """Warps for one program of ``block`` lanes: 4 up to 1,024 lanes, more above, so
    that a lane's registers fit (sm_90, ``ptxas -v``: 4 warps on 4,096 lanes use 255
    registers and spill 372 bytes; 16 warps use 124 and spill none)."""
    return min(16, max(4, block // 256))


def encode(x: torch.Tensor, bucket: int, levels: int,
           lloyd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes ``sign * (bin + 1)``, float32 bin means ``[buckets * levels]``) of the
    flat float32 ``x`` in buckets of ``bucket`` values, ``lloyd`` refinements: what
    ``Centroid.encode``'s torch path makes."""
    n = x.numel()
    nbuckets = -(-n // bucket)
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    means = torch.empty(nbuckets * levels, dtype=torch.float32, device=x.device)
    if n:
        block, log_block, rows = _layout(bucket)
        _encode_kernel[(triton.cdiv(nbuckets, rows),)](
            x, q, means, n, nbuckets, bucket, lloyd, ROWS=rows, BLOCK=block,
            LOG_BLOCK=log_block, LEVELS=levels, num_warps=_warps(block),
            enable_fp_fusion=False)
    return q, means


def decode(q: torch.Tensor, means: torch.Tensor, bucket: int,
           levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 values, one int32 flag per program: 1 where a code's magnitude is past
    ``levels``) of the received codes ``q`` and bin means; a code out of range decodes
    as if clamped into it, so nothing is read out of bounds."""
    n = q.numel()
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    programs = triton.cdiv(n, _TILE)
    bad = torch.zeros(programs, dtype=torch.int32, device=q.device)
    if n:
        _decode_kernel[(programs,)](q, means, out, bad, n, bucket, BLOCK=_TILE,
                                    LEVELS=levels)
    return out, bad
