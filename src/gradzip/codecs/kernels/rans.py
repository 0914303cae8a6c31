"""``ans`` on the device: interleaved rANS over 32 lanes a block, DietGPU's way.

The format and its CPU reference are ``codecs/entropy/lanes.py``; these kernels write
the same words, bit for bit (``tests/test_kernels.py``, under Triton's interpreter).
One program codes one block of one byte plane with ``LANES`` states in lock step: each
step loads ``LANES`` consecutive bytes, looks up their frequencies, and the lanes that
renormalise push their words onto the block's stack at slots an exclusive prefix sum
gives them. Encoding is:

1. a histogram of each plane (``tl.histogram`` per tile, summed with atomics);
2. the tables from the histograms (``lanes.quantize``: integer torch ops, no host
   read);
3. every block coded into its own ``BLOCK``-word slice of a scratch stack;
4. **one host read**: the total word count, to size the payload (and choose the
   stored form where coding does not pay);
5. each block's words copied to its offset (the exclusive prefix sum of the counts).

Decoding is one program a block, reading the words it needs from the top of its
stack; every read is clamped into the data, so a hostile payload cannot make a kernel
read outside it, and each block reports whether it decoded soundly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gradzip.codecs.entropy import lanes
from gradzip.codecs.entropy.lanes import BLOCK, LANES, LOW, RENORM_SHIFT, SCALE_BITS, STEPS, M

#: bytes per program of the histogram
_TILE = 4096
#: words per step of the copy into place
_COPY = 1024


@triton.jit
def _hist_kernel(planes_ptr, n, hist_ptr, TILE: tl.constexpr):
    """Histogram of one tile of one plane, added into that plane's 256 counts."""
    plane = tl.program_id(1)
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    live = offs < n
    byte = tl.load(planes_ptr + plane.to(tl.int64) * n + offs, mask=live, other=0)
    counts = tl.histogram(byte.to(tl.int32), 256, mask=live)
    idx = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + plane * 256 + idx, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _encode_kernel(planes_ptr, n, blocks, freq_ptr, start_ptr, stack_ptr, words_ptr,
                   states_ptr, sums_ptr, LANES: tl.constexpr, STEPS: tl.constexpr,
                   M: tl.constexpr, LOW: tl.constexpr, RENORM_SHIFT: tl.constexpr):
    """One block of one plane, its steps backwards, onto its slice of the stack."""
    row = tl.program_id(0)
    plane = row // blocks
    lane = tl.arange(0, LANES)
    first = (row % blocks).to(tl.int64) * (STEPS * LANES)
    src = planes_ptr + plane.to(tl.int64) * n
    stack = stack_ptr + row.to(tl.int64) * (STEPS * LANES)
    x = tl.full((LANES,), LOW, tl.int64)
    acc = tl.zeros((LANES,), tl.int64)
    top = tl.zeros((), tl.int32)
    for i in range(STEPS):
        pos = (STEPS - 1 - i) * LANES + lane
        live = first + pos < n
        s = tl.load(src + first + pos, mask=live, other=0).to(tl.int32)
        f = tl.load(freq_ptr + plane * 256 + s).to(tl.int64)
        c = tl.load(start_ptr + plane * 256 + s).to(tl.int64)
        emit = live & ((x >> RENORM_SHIFT) >= f)
        e = emit.to(tl.int32)
        tl.store(stack + top + tl.cumsum(e, 0) - e, (x & 0xFFFF).to(tl.int16), mask=emit)
        top += tl.sum(e, 0)
        x = tl.where(emit, x >> 16, x)
        f = tl.where(live, f, 1)
        x = tl.where(live, (x // f) * M + x % f + c, x)
        acc += tl.where(live, (s + 1).to(tl.int64) * (pos + 1), 0)
    tl.store(words_ptr + row, top)
    tl.store(states_ptr + row * LANES + lane, x.to(tl.int32))
    tl.store(sums_ptr + row, (tl.sum(acc, 0) & 0xFFFFFFFF).to(tl.int32))


@triton.jit
def _copy_kernel(stack_ptr, words_ptr, base_ptr, data_ptr, BLOCK: tl.constexpr,
                 COPY: tl.constexpr):
    """One block's words from its slice of the stack to its offset in the payload."""
    row = tl.program_id(0)
    count = tl.load(words_ptr + row)
    base = tl.load(base_ptr + row)
    for start in range(0, BLOCK, COPY):
        k = start + tl.arange(0, COPY)
        live = k < count
        word = tl.load(stack_ptr + row.to(tl.int64) * BLOCK + k, mask=live, other=0)
        tl.store(data_ptr + base + k, word, mask=live)


@triton.jit
def _decode_kernel(data_ptr, last, words_ptr, base_ptr, states_ptr, sums_ptr, freq_ptr,
                   start_ptr, slot_ptr, out_ptr, n, blocks, sound_ptr,
                   LANES: tl.constexpr, STEPS: tl.constexpr, M: tl.constexpr,
                   LOW: tl.constexpr, SCALE_BITS: tl.constexpr):
    """One block of one plane, its steps forwards, popping words off its stack."""
    row = tl.program_id(0)
    plane = row // blocks
    lane = tl.arange(0, LANES)
    first = (row % blocks).to(tl.int64) * (STEPS * LANES)
    dst = out_ptr + plane.to(tl.int64) * n
    x = tl.load(states_ptr + row * LANES + lane).to(tl.int64) & 0xFFFFFFFF
    top = tl.load(words_ptr + row).to(tl.int64)
    base = tl.load(base_ptr + row)
    acc = tl.zeros((LANES,), tl.int64)
    for j in range(STEPS):
        pos = j * LANES + lane
        live = first + pos < n
        slot = (x & (M - 1)).to(tl.int32)
        s = tl.load(slot_ptr + plane * M + slot)
        f = tl.load(freq_ptr + plane * 256 + s).to(tl.int64)
        c = tl.load(start_ptr + plane * 256 + s).to(tl.int64)
        x = tl.where(live, (f * (x >> SCALE_BITS) + slot - c) & 0xFFFFFFFF, x)
        tl.store(dst + first + pos, s.to(tl.uint8), mask=live)
        acc += tl.where(live, (s + 1).to(tl.int64) * (pos + 1), 0)
        need = live & (x < LOW)
        e = need.to(tl.int64)
        top -= tl.sum(e, 0)
        at = tl.minimum(tl.maximum(base + top + tl.cumsum(e, 0) - e, 0), last)
        word = tl.load(data_ptr + at, mask=need, other=0).to(tl.int64) & 0xFFFF
        x = tl.where(need, ((x << 16) | word) & 0xFFFFFFFF, x)
    want = tl.load(sums_ptr + row).to(tl.int64) & 0xFFFFFFFF
    sound = (tl.sum((x != LOW).to(tl.int32), 0) == 0) & (top == 0) \
        & ((tl.sum(acc, 0) & 0xFFFFFFFF) == want)
    tl.store(sound_ptr + row, sound.to(tl.int8))


def histogram(planes: torch.Tensor) -> torch.Tensor:
    """``[planes, 256]`` int64 counts of a ``[planes, n]`` uint8 tensor's bytes."""
    p, n = planes.shape
    hist = torch.zeros(p, 256, dtype=torch.int32, device=planes.device)
    if n:
        _hist_kernel[(triton.cdiv(n, _TILE), p)](planes, n, hist, TILE=_TILE)
    return hist.to(torch.int64)


def encode(planes: torch.Tensor, freq: torch.Tensor) -> lanes.Coded:
    """Code ``[planes, n]`` uint8 planes with their tables: the payload's tensors, sized
    by the one host read (the word count)."""
    p, n = planes.shape
    blocks = lanes.blocks_of(n)
    rows, device = p * blocks, planes.device
    freq32 = freq.to(torch.int32).contiguous()
    start32 = lanes.starts(freq).to(torch.int32).contiguous()
    stack = torch.empty(rows, BLOCK, dtype=torch.int16, device=device)
    words = torch.empty(rows, dtype=torch.int32, device=device)
    states = torch.empty(rows, LANES, dtype=torch.int32, device=device)
    sums = torch.empty(rows, dtype=torch.int32, device=device)
    _encode_kernel[(rows,)](planes, n, blocks, freq32, start32, stack, words, states, sums,
                            LANES=LANES, STEPS=STEPS, M=M, LOW=LOW,
                            RENORM_SHIFT=RENORM_SHIFT, num_warps=1)
    total = int(words.sum())  # the one host read: the payload's size
    data = torch.empty(total, dtype=torch.int16, device=device)
    if total:
        _copy_kernel[(rows,)](stack, words, _offsets(words), data, BLOCK=BLOCK, COPY=_COPY)
    return lanes.Coded(freq.to(torch.int16), words, states, sums, data)


def _offsets(words: torch.Tensor) -> torch.Tensor:
    counts = words.to(torch.int64)
    return counts.cumsum(0) - counts


def decode(c: lanes.Coded, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[planes, n]`` uint8 planes and a 0-d bool on the device: whether every block
    decoded soundly (``lanes.decode``'s contract, on the device, no host read)."""
    p = c.freq.shape[0]
    blocks = lanes.blocks_of(n)
    device = c.freq.device
    freq = c.freq.to(torch.int64)
    out = torch.empty(p, n, dtype=torch.uint8, device=device)
    if not n:
        return out, torch.ones((), dtype=torch.bool, device=device)
    sound = torch.zeros(p * blocks, dtype=torch.int8, device=device)
    data = c.data if c.data.numel() else torch.zeros(1, dtype=torch.int16, device=device)
    _decode_kernel[(p * blocks,)](
        data, data.numel() - 1, c.words, _offsets(c.words), c.states, c.sums,
        freq.to(torch.int32).contiguous(), lanes.starts(freq).to(torch.int32).contiguous(),
        lanes.slot_symbols(freq), out, n, blocks, sound,
        LANES=LANES, STEPS=STEPS, M=M, LOW=LOW, SCALE_BITS=SCALE_BITS, num_warps=1)
    return out, (sound != 0).all()
