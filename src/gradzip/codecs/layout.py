"""Blocks inside a flat bucket, and the cache-sized pieces that cover them.

A per-tensor codec keeps statistics (a scale, a norm, a pair of means) per *block*,
where blocks restart at every tensor boundary: one block per tensor (TernGrad,
EF-signSGD) or fixed-size blocks within each tensor (int8, QSGD). The work runs
over *pieces* of about ``CHUNK`` values, each handled by a few whole-piece torch
ops, so a bucket of any number of tensors costs one vectorized pass:

* a **uniform** piece is ``rows`` x ``width`` values where row ``r`` lies in block
  ``block + r`` (whole blocks, or part of one block larger than a chunk): the fast
  2-D view kernels (``amax(1)``, broadcast multiply) apply, as in the plain path;
* a **ragged** piece gathers consecutive *small* tensors (below ``SMALL`` values,
  empty ones included) into one piece with explicit block ``lengths``; it uses
  ``segment_reduce`` and ``repeat_interleave``, which cost ~2 ns/value here (10x a
  view kernel), so only small tensors go this way, and their count never turns
  into a Python loop.

Layouts are cached per (tensor sizes, block), since a bucket's layout repeats
every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from gradzip.collectives.upload import upload

#: values per piece: 512 KB of fp32, inside this machine's 1 MB L2 per core
CHUNK = 1 << 17
#: values per piece on an accelerator: a piece's few ops are kernel launches there
#: (~5 us each), so pieces are as large as the scratch memory allows (64 MB of fp32)
DEVICE_CHUNK = 1 << 24


def piece_size(device: torch.device | None) -> int:
    """``CHUNK`` on the CPU (cache-sized), ``DEVICE_CHUNK`` elsewhere (launch-bound)."""
    return CHUNK if device is None or device.type in ("cpu", "meta") else DEVICE_CHUNK
#: tensors below this many values share ragged pieces (a uniform piece costs ~20 us
#: of per-op overhead, a ragged value ~2.5 ns: they break even near 8K values)
SMALL = 1 << 13


@dataclass(frozen=True)
class Piece:
    """Values ``[start, start + rows * width)``; row ``r`` belongs to block ``block + r``.

    A ragged piece has ``lengths`` (its blocks' sizes, zeros allowed), ``rows`` = 1
    and ``width`` = the sum of ``lengths``.
    """

    start: int
    rows: int
    width: int
    block: int
    lengths: torch.Tensor | None = None
    #: ``lengths`` copied to each device it was used on (layouts are cached and reused
    #: every step: one host-to-device copy per device, not one per call), with the
    #: CUDA event after the copy: a later use on another stream waits for it there
    _on_device: dict[torch.device, tuple[torch.Tensor, Any]] = field(
        default_factory=dict, compare=False, hash=False, repr=False)

    def lengths_on(self, device: torch.device) -> torch.Tensor:
        """``lengths`` on ``device`` (``segment_reduce`` and ``repeat_interleave`` need
        them beside the data: CPU lengths with CUDA data are a device-mismatch error)."""
        assert self.lengths is not None
        if device.type == "cpu":
            return self.lengths
        found = self._on_device.get(device)
        if found is None:
            copied = upload(self.lengths, device)
            landed = torch.cuda.Event() if device.type == "cuda" else None
            if landed is not None:
                landed.record()
            found = self._on_device[device] = (copied, landed)
        if found[1] is not None:  # a GPU-side edge: no host wait
            torch.cuda.current_stream(device).wait_event(found[1])
        return found[0]

    @property
    def size(self) -> int:
        return self.rows * self.width

    @property
    def nblocks(self) -> int:
        return self.rows if self.lengths is None else self.lengths.numel()


@dataclass(frozen=True)
class Layout:
    """The pieces covering ``n`` values cut into ``nblocks`` blocks (see module doc)."""

    n: int
    nblocks: int
    pieces: tuple[Piece, ...]

    @property
    def largest(self) -> int:
        return max((p.size for p in self.pieces), default=0)


def num_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def _uniform(n: int, block: int, chunk: int = CHUNK) -> Iterator[tuple[int, int, int, int]]:
    """Cover ``n`` values in blocks of ``block`` with pieces of about ``chunk`` values.

    Yields ``(start, rows, width, first_block)``: ``rows`` whole blocks of ``width``
    values, or (for blocks larger than a chunk) part of one block. The last,
    partial block is its own block.
    """
    full = n // block
    if block <= chunk:
        per = chunk // block
        for b in range(0, full, per):
            yield b * block, min(per, full - b), block, b
    else:
        for b in range(full):
            for s in range(0, block, chunk):
                yield b * block + s, 1, min(chunk, block - s), b
    tail = n - full * block
    for s in range(0, tail, chunk):
        yield full * block + s, 1, min(chunk, tail - s), full


def uniform_layout(n: int, block: int) -> Layout:
    """One tensor of ``n`` values in blocks of ``block`` (the plain, non-per-tensor path)."""
    pieces = tuple(Piece(s, r, w, b) for s, r, w, b in _uniform(n, block))
    return Layout(n, num_blocks(n, block), pieces)


def tensor_layout(numels: Sequence[int], block: int | None = None,
                  skip: Sequence[bool] | None = None,
                  device: torch.device | None = None) -> Layout:
    """Tensors of ``numels`` values back to back; blocks restart at every tensor.

    ``device``: where the data is (its piece size, ``piece_size``). ``block`` None:
    one block per tensor (an empty tensor still has its block, of length 0).
    Otherwise blocks of ``block`` values within each tensor (an empty tensor has
    none). Tensors marked in ``skip`` get no blocks and no pieces (a codec handles
    them another way, e.g. 1-bit SGD's column statistics).
    """
    skips = tuple(bool(k) for k in skip) if skip is not None else (False,) * len(numels)
    return _tensor_layout(tuple(int(n) for n in numels), block, skips, piece_size(device))


@lru_cache(maxsize=256)
def _tensor_layout(numels: tuple[int, ...], block: int | None,
                   skip: tuple[bool, ...], chunk: int = CHUNK) -> Layout:
    pieces: list[Piece] = []
    group: list[int] = []  # block lengths of the ragged piece being gathered
    group_start = group_block = offset = nblocks = 0

    def flush() -> None:
        if group:
            lengths = torch.tensor(group, dtype=torch.int64)
            pieces.append(Piece(group_start, 1, sum(group), group_block, lengths))
            group.clear()

    for n, skipped in zip(numels, skip, strict=True):
        if skipped:
            flush()
            offset += n
            continue
        size = max(n, 1) if block is None else block
        count = 1 if block is None else num_blocks(n, block)
        if n < SMALL:
            if not group:
                group_start, group_block = offset, nblocks
            full, tail = divmod(n, size)
            group.extend([size] * full + ([tail] if tail or count > full else []))
            if sum(group) >= chunk:
                flush()
        else:
            flush()
            pieces.extend(Piece(offset + s, r, w, nblocks + b)
                          for s, r, w, b in _uniform(n, size, chunk))
        offset += n
        nblocks += count
    flush()
    return Layout(offset, nblocks, tuple(pieces))


# ---------------------------------------------------------------- per-block statistics
#: elementwise transform into ``out`` before a block reduction
Transform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

TRANSFORMS: dict[str, tuple[Transform, str]] = {
    "absmax": (lambda x, out: torch.abs(x, out=out), "max"),
    "sumabs": (lambda x, out: torch.abs(x, out=out), "sum"),
    "sumsq": (lambda x, out: torch.mul(x, x, out=out), "sum"),
    "sumpos": (lambda x, out: torch.clamp(x, min=0, out=out), "sum"),
    "sumneg": (lambda x, out: torch.clamp(x, max=0, out=out), "sum"),
    "countneg": (lambda x, out: out.copy_(torch.signbit(x)), "sum"),
}


def block_stats(x: torch.Tensor, layout: Layout, kind: str,
                center: torch.Tensor | None = None) -> torch.Tensor:
    """float64 per-block ``kind`` statistic of flat ``x`` (see ``TRANSFORMS``).

    ``center`` (per block) is subtracted first (a centred sum of squares for a
    standard deviation). Piece partials are float32 (fast) accumulated in float64;
    a float32 overflow shows up as inf, which callers may redo from ``x.double()``.
    Max statistics assume non-negative values (an empty block gets 0).
    """
    transform, op = TRANSFORMS[kind]
    out = torch.zeros(layout.nblocks, dtype=torch.float64, device=x.device)
    scratch = torch.empty(layout.largest, dtype=x.dtype, device=x.device)
    for p in layout.pieces:
        buf = scratch[:p.size].view(p.rows, p.width)
        v = x[p.start:p.start + p.size].view(p.rows, p.width)
        if center is not None:
            v = torch.sub(v, spread(center.to(x.dtype), p), out=buf)
        if p.lengths is None and kind == "absmax":
            # amax and amin separately are ~4x faster than abs().amax(1) here
            part = torch.maximum(v.amax(1), v.amin(1).neg())
        elif p.lengths is None:
            t = transform(v, buf)
            part = t.amax(1) if op == "max" else t.sum(1)
        else:
            t = transform(v, buf)
            part = torch.segment_reduce(t.reshape(-1), op, lengths=p.lengths_on(t.device),
                                        unsafe=True,
                                        initial=0)
        dest = out[p.block:p.block + p.nblocks]
        if op == "max":
            torch.maximum(dest, part.double(), out=dest)
        else:
            dest += part
    return out


def spread(values: torch.Tensor, p: Piece) -> torch.Tensor:
    """Per-block ``values`` shaped to broadcast over piece ``p`` viewed as (rows, width)."""
    if p.lengths is None:
        return values[p.block:p.block + p.rows, None]
    mine = values[p.block:p.block + p.nblocks]
    return torch.repeat_interleave(mine, p.lengths_on(mine.device), output_size=p.size)[None, :]


def scale_pieces(out: torch.Tensor, layout: Layout, values: torch.Tensor) -> torch.Tensor:
    """Multiply flat ``out`` in place by its block's value (a decoder's last step)."""
    values = values.to(out.dtype)
    for p in layout.pieces:
        out[p.start:p.start + p.size].view(p.rows, p.width).mul_(spread(values, p))
    return out
