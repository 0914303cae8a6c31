"""``ans``'s device format: 32 interleaved rANS lanes per block, DietGPU's layout.

The host coder (``_rans``) steps eight states through a chunk one symbol after another:
a GPU has nothing to run in parallel there. Here a stream of bytes is cut into blocks
of ``BLOCK`` symbols, each block coded on its own by ``LANES`` states in lock step (a
warp on a GPU): at step ``j`` lane ``l`` codes symbol ``j * LANES + l`` of its block, so
every step reads ``LANES`` consecutive bytes. Wider integer fields are cut into byte
planes (byte ``i`` of every value), each with its own table.

rANS with 12-bit probabilities (``M = 4096``), 32-bit states in ``[2**16, 2**32)`` and
16-bit renormalisation, so a lane writes at most one word a symbol. Encoding runs the
steps backwards; at each step the lanes that renormalise write their low 16 bits, in
lane order, to the top of the block's word stack (an exclusive prefix sum over the
lanes' flags gives each its slot). Decoding runs the steps forwards, and at each step
the lanes that need a word take them, in lane order, from the top of the same stack:
the words were pushed in the reverse order they are popped. A block's states start at
``2**16`` and its final states travel (``LANES`` x 32 bits); a sound block decodes
back to states of ``2**16`` with its stack used up exactly.

The table is made from the plane's histogram with integer arithmetic only (so a GPU
and a CPU build the same one): each symbol present gets ``1 + count * (M - used) //
n``, and what is left of ``M`` goes to the most frequent symbol (the first of equals).

Every block carries a 32-bit checksum of its symbols, ``sum (s + 1) * (i + 1)`` over
its positions ``i`` (mod 2**32), checked after decoding: with the final states and the
stack's exact use, a corrupt word cannot decode to a silently wrong tensor.

This module is the format's reference on the CPU, in vectorised torch ops (all lanes of
all blocks of all planes step together; 12-20 MB/s here): the Triton kernels
(``codecs/kernels/rans.py``) write the same words, bit for bit (``tests/test_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LANES = 32
#: symbols a block (a power of two, a multiple of ``LANES``)
BLOCK = 1 << 14
STEPS = BLOCK // LANES
SCALE_BITS = 12
M = 1 << SCALE_BITS
#: the lowest state: where encoding starts and a sound decode ends
LOW = 1 << 16
#: states at or above ``f << RENORM_SHIFT`` renormalise before coding a symbol of ``f``
RENORM_SHIFT = 32 - SCALE_BITS
_MASK32 = (1 << 32) - 1


@dataclass
class Coded:
    """One coded stream of ``planes`` byte planes: what crosses the wire, as tensors.

    ``freq``: int16 ``[planes, 256]``; ``words``: per-block word counts (int32, one a
    block); ``states``: final states (int32 bits of the uint32 states, ``[blocks,
    LANES]``); ``sums``: per-block checksums (int32 bits); ``data``: the words of every
    block back to back (int16 bits of uint16 words)."""

    freq: torch.Tensor
    words: torch.Tensor
    states: torch.Tensor
    sums: torch.Tensor
    data: torch.Tensor


def blocks_of(n: int) -> int:
    """Blocks of one plane of ``n`` symbols."""
    return -(-n // BLOCK)


def planes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat integer tensor as ``[itemsize, n]`` uint8 byte planes (little-endian)."""
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).reshape(flat.numel(), flat.element_size())
    return raw.t().contiguous()


def from_planes(planes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``planes_of``: ``[itemsize, n]`` byte planes as a flat ``dtype``."""
    return planes.t().contiguous().view(dtype).reshape(-1)


def histogram(planes: torch.Tensor) -> torch.Tensor:
    """``[planes, 256]`` int64 counts of a ``[planes, n]`` uint8 tensor's bytes."""
    hist = torch.zeros(planes.shape[0], 256, dtype=torch.int64, device=planes.device)
    ones = torch.ones(planes.shape, dtype=torch.int64, device=planes.device)
    return hist.scatter_add_(1, planes.to(torch.int64), ones)


def quantize(counts: torch.Tensor) -> torch.Tensor:
    """Each plane's histogram (``[planes, 256]``, int64) as frequencies summing to
    ``M``, in integer ops on the histogram's device (module doc)."""
    present = counts > 0
    used = present.sum(1, keepdim=True)
    total = counts.sum(1, keepdim=True).clamp(min=1)
    freq = torch.where(present, 1 + counts * (M - used) // total, 0)
    top = counts.argmax(1, keepdim=True)
    return freq.scatter_add(1, top, M - freq.sum(1, keepdim=True))


def starts(freq: torch.Tensor) -> torch.Tensor:
    """Each symbol's first slot: the exclusive cumulative sum of its plane's table."""
    return freq.cumsum(1) - freq


def slot_symbols(freq: torch.Tensor) -> torch.Tensor:
    """``[planes, M]`` int32: the symbol that owns each slot. Safe for any table (a
    received one is checked separately): slots past the table's sum go to 255."""
    ends = freq.to(torch.int64).cumsum(1)
    slots = torch.arange(M, device=freq.device).expand(freq.shape[0], M).contiguous()
    return torch.searchsorted(ends, slots, right=True).clamp(max=255).to(torch.int32)


def table_ok(freq: torch.Tensor) -> torch.Tensor:
    """0-d bool: every plane's table is non-negative and sums to ``M``."""
    f = freq.to(torch.int64)
    return (f >= 0).all() & (f.sum(1) == M).all()


def _symbols(planes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symbols as ``[planes * blocks, STEPS, LANES]`` int64 (zero past the end) and the
    matching mask of real ones."""
    p, n = planes.shape
    padded = blocks_of(n) * BLOCK
    sym = torch.zeros(p, padded, dtype=torch.int64, device=planes.device)
    sym[:, :n] = planes
    live = (torch.arange(padded, device=planes.device) < n).expand(p, padded)
    return sym.view(-1, STEPS, LANES), live.reshape(-1, STEPS, LANES)


def checksums(sym: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Each block's checksum (module doc) as int32 bits, from ``_symbols``' layout."""
    at = torch.arange(1, BLOCK + 1, device=sym.device).view(STEPS, LANES)
    sums = torch.where(live, (sym + 1) * at, 0).sum((1, 2)) & _MASK32
    return _as_int32(sums)


def byte_checksum(raw: torch.Tensor) -> torch.Tensor:
    """A 1-element int32 checksum of uint8 ``raw``: ``sum (b + 1) * (i % 65521 + 1)``
    mod 2**32 over its bytes ``b`` at ``i`` (any one flipped bit changes it: the change
    is below 2**23). For the raw form, which has no rANS states to check."""
    at = torch.arange(raw.numel(), device=raw.device) % 65521 + 1
    return _as_int32(((raw.to(torch.int64) + 1) * at).sum().reshape(1) & _MASK32)


def _as_int32(u: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 as the int32 with the same bits."""
    return (u - ((u >> 31) << 32)).to(torch.int32)


def _as_uint32(i: torch.Tensor) -> torch.Tensor:
    return i.to(torch.int64) & _MASK32


def encode(planes: torch.Tensor, freq: torch.Tensor) -> Coded:
    """Code ``[planes, n]`` uint8 byte planes with their tables (``quantize``)."""
    sym, live = _symbols(planes)
    rows = sym.shape[0]
    per_plane = rows // planes.shape[0]
    f_rows = freq.to(torch.int64).repeat_interleave(per_plane, 0)
    start_rows = starts(freq.to(torch.int64)).repeat_interleave(per_plane, 0)
    f_all = f_rows.gather(1, sym.view(rows, -1)).view_as(sym)
    c_all = start_rows.gather(1, sym.view(rows, -1)).view_as(sym)
    x = torch.full((rows, LANES), LOW, dtype=torch.int64)
    stack = torch.zeros(rows, BLOCK + 1, dtype=torch.int64)  # the last column: a sink
    top = torch.zeros(rows, 1, dtype=torch.int64)
    for j in range(STEPS - 1, -1, -1):
        m, f, c = live[:, j], f_all[:, j], c_all[:, j]
        emit = m & ((x >> RENORM_SHIFT) >= f)
        e = emit.to(torch.int64)
        slot = torch.where(emit, top + e.cumsum(1) - e, BLOCK)
        stack.scatter_(1, slot, x & 0xFFFF)
        top += e.sum(1, keepdim=True)
        x = torch.where(emit, x >> 16, x)
        f = torch.where(m, f, 1)
        x = torch.where(m, (x // f) * M + x % f + c, x)
    counts = top.view(-1)
    keep = torch.arange(BLOCK) < counts[:, None]
    data = stack[:, :BLOCK][keep]
    return Coded(freq.to(torch.int16), counts.to(torch.int32), _as_int32(x),
                 checksums(sym, live), (data - ((data >> 15) << 16)).to(torch.int16))


def decode(c: Coded, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[planes, n]`` uint8 planes from ``c`` and a 0-d bool: whether every block
    decoded soundly (final states, the stack used up, checksums; the table and word
    counts are checked by the caller). Memory-safe for any input."""
    p = c.freq.shape[0]
    rows = p * blocks_of(n)
    freq = c.freq.to(torch.int64)
    sym_of = slot_symbols(freq).to(torch.int64).repeat_interleave(rows // p, 0)
    f_rows = freq.repeat_interleave(rows // p, 0)
    start_rows = starts(freq).repeat_interleave(rows // p, 0)
    counts = c.words.to(torch.int64)
    base = (counts.cumsum(0) - counts)[:, None]
    data = c.data.to(torch.int64) & 0xFFFF
    last = max(data.numel() - 1, 0)
    if not data.numel():
        data = torch.zeros(1, dtype=torch.int64)
    x = _as_uint32(c.states)
    top = counts[:, None].clone()
    live = (torch.arange(blocks_of(n) * BLOCK) < n).view(-1, STEPS, LANES).repeat(p, 1, 1)
    out = torch.zeros(rows, STEPS, LANES, dtype=torch.int64)
    for j in range(STEPS):
        m = live[:, j]
        slot = x & (M - 1)
        s = sym_of.gather(1, slot)
        decoded = (f_rows.gather(1, s) * (x >> SCALE_BITS) + slot
                   - start_rows.gather(1, s)) & _MASK32
        x = torch.where(m, decoded, x)
        out[:, j] = torch.where(m, s, 0)
        need = m & (x < LOW)
        e = need.to(torch.int64)
        top -= e.sum(1, keepdim=True)
        at = (base + top + e.cumsum(1) - e).clamp(0, last)
        x = torch.where(need, ((x << 16) | data[at]) & _MASK32, x)
    sound = ((x == LOW).all(1) & (top.view(-1) == 0)
             & (checksums(out, live) == c.sums)).all()
    return out.view(p, -1)[:, :n].to(torch.uint8), sound
