"""Exact top-k positions by magnitude on the device: a radix select, then compaction.

``torch.topk`` on a 6.5M-value bucket takes 160 us of H200 time (its radix passes and a
gather), and the positions then need a 70 us sort (docs/benchmarks/gpu.md). Here the
magnitude's float32 bits, sign cleared, are the key (for finite values they order as
the magnitudes do), and the k-th largest key is found in three histogram passes over
its bits (11, 11 and 9 of them), each keeping only the values whose higher bits match
the bins chosen so far; a one-program kernel after each pass picks the bin that holds
the k-th largest and carries the count above it, all on the device. Then each tile of
the input counts its keys above the threshold and equal to it, one program scans those
counts, and each tile writes its kept positions at its offset, in position order: no
sort. Ties at the threshold go to the lowest positions, as ``sparse.topk_among`` does,
so the positions equal the CPU path's exactly (``tests/test_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gradzip.collectives.upload import device_tensor

#: values per program
_BLOCK = 4096
#: (shift, bits) of each pass over the 31-bit key, most significant first
_PASSES = ((20, 11), (9, 11), (0, 9))
#: tiles per step of the one-program scan
_SCAN = 1024


@triton.jit
def _keys(x_ptr, offs, mask):
    """The magnitude's bits: float32 bits with the sign cleared (0 for masked lanes)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _hist_kernel(x_ptr, n, state_ptr, hist_ptr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Histogram of key bits [SHIFT, SHIFT + BITS) over the keys whose higher bits equal
    the prefix chosen so far (``state[0]``)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = _keys(x_ptr, offs, mask)
    live = mask & ((key >> (SHIFT + BITS)) == tl.load(state_ptr).to(tl.int32))
    counts = tl.histogram((key >> SHIFT) & ((1 << BITS) - 1), 1 << BITS, mask=live)
    idx = tl.arange(0, 1 << BITS)
    tl.atomic_add(hist_ptr + idx, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _find_kernel(hist_ptr, state_ptr, BITS: tl.constexpr):
    """One program: the bin holding the ``state[1]``-th largest of this pass's keys;
    appends it to the prefix, moves the count above it from ``state[1]`` to ``state[2]``."""
    idx = tl.arange(0, 1 << BITS)
    from_top = tl.load(hist_ptr + ((1 << BITS) - 1 - idx))  # the highest bin first
    reached = tl.cumsum(from_top, axis=0)
    k_left = tl.load(state_ptr + 1)
    j = tl.sum((reached < k_left).to(tl.int32), axis=0)  # bins wholly above the k-th
    above = tl.sum(tl.where(idx < j, from_top, 0), axis=0).to(tl.int64)
    prefix = tl.load(state_ptr)
    tl.store(state_ptr, (prefix << BITS) | ((1 << BITS) - 1 - j))
    tl.store(state_ptr + 1, k_left - above)
    tl.store(state_ptr + 2, tl.load(state_ptr + 2) + above)


@triton.jit
def _count_kernel(x_ptr, n, state_ptr, above_ptr, ties_ptr, BLOCK: tl.constexpr):
    """Per tile: keys above the threshold (``state[0]``) and keys equal to it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = _keys(x_ptr, offs, mask)
    threshold = tl.load(state_ptr).to(tl.int32)
    tl.store(above_ptr + tl.program_id(0), tl.sum((mask & (key > threshold)).to(tl.int32)))
    tl.store(ties_ptr + tl.program_id(0), tl.sum((mask & (key == threshold)).to(tl.int32)))


@triton.jit
def _scan_kernel(above_ptr, ties_ptr, state_ptr, offset_ptr, tie_offset_ptr, tiles,
                 CHUNK: tl.constexpr):
    """One program: each tile's first output slot and the ties before it, given that
    only the first ``state[1]`` ties are kept."""
    need = tl.load(state_ptr + 1)
    kept_before = tl.zeros((), tl.int64)
    ties_before = tl.zeros((), tl.int64)
    for start in range(0, tiles, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        live = idx < tiles
        above = tl.load(above_ptr + idx, mask=live, other=0).to(tl.int64)
        ties = tl.load(ties_ptr + idx, mask=live, other=0).to(tl.int64)
        tie_start = ties_before + tl.cumsum(ties, axis=0) - ties
        taken = tl.minimum(tl.maximum(need - tie_start, 0), ties)
        kept = above + taken
        tl.store(offset_ptr + idx, kept_before + tl.cumsum(kept, axis=0) - kept, mask=live)
        tl.store(tie_offset_ptr + idx, tie_start, mask=live)
        kept_before += tl.sum(kept, axis=0)
        ties_before += tl.sum(ties, axis=0)


@triton.jit
def _write_kernel(x_ptr, n, state_ptr, offset_ptr, tie_offset_ptr, out_ptr,
                  BLOCK: tl.constexpr):
    """Per tile: the kept positions, in order, from the tile's first slot."""
    tile = tl.program_id(0)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = _keys(x_ptr, offs, mask)
    threshold = tl.load(state_ptr).to(tl.int32)
    tie = (mask & (key == threshold)).to(tl.int64)
    tie_rank = tl.load(tie_offset_ptr + tile) + tl.cumsum(tie, axis=0) - tie
    keep = (mask & (key > threshold)) | ((tie > 0) & (tie_rank < tl.load(state_ptr + 1)))
    kept = keep.to(tl.int64)
    slot = tl.load(offset_ptr + tile) + tl.cumsum(kept, axis=0) - kept
    tl.store(out_ptr + slot, offs.to(tl.int64), mask=keep)


def topk_positions(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest ``|flat|`` (finite float32 values;
    ties to the lowest positions), ``0 < k < flat.numel()``, with no host read."""
    n, device = flat.numel(), flat.device
    tiles = triton.cdiv(n, _BLOCK)
    state = device_tensor([0, k, 0], device, torch.int64)  # prefix, k left, count above
    hists = torch.zeros(sum(1 << bits for _, bits in _PASSES), dtype=torch.int32,
                        device=device)
    at = 0
    for shift, bits in _PASSES:
        hist = hists[at:at + (1 << bits)]
        at += 1 << bits
        _hist_kernel[(tiles,)](flat, n, state, hist, SHIFT=shift, BITS=bits, BLOCK=_BLOCK)
        _find_kernel[(1,)](hist, state, BITS=bits)
    counts = torch.empty(4 * tiles, dtype=torch.int64, device=device)
    above, ties = counts[:tiles], counts[tiles:2 * tiles]
    offsets, tie_offsets = counts[2 * tiles:3 * tiles], counts[3 * tiles:]
    _count_kernel[(tiles,)](flat, n, state, above, ties, BLOCK=_BLOCK)
    _scan_kernel[(1,)](above, ties, state, offsets, tie_offsets, tiles, CHUNK=_SCAN)
    out = torch.empty(k, dtype=torch.int64, device=device)
    _write_kernel[(tiles,)](flat, n, state, offsets, tie_offsets, out, BLOCK=_BLOCK)
    return out
