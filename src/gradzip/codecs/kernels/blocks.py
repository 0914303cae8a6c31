"""Where each block of a bucket starts and how long it is, on the data's device.

The torch path walks a ``Layout`` of pieces; a kernel needs one table it can index by
block: ``starts`` (int64) and ``lengths`` (int32) of the blocks of tensors of ``numels``
values back to back, blocks of ``block`` values restarting at every tensor (an empty
tensor has none), the same blocks as ``layout.tensor_layout(numels, block)``. Tables
are cached per (sizes, block, device): a bucket's layout repeats every step, so the
one host-to-device copy happens once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from gradzip.collectives.upload import upload


@dataclass(frozen=True)
class BlockTable:
    """The blocks of a bucket: ``starts[b]``, ``lengths[b]`` for ``b < count``."""

    starts: torch.Tensor
    lengths: torch.Tensor
    count: int
    #: the row width of a kernel: the next power of two at or above the longest block
    width: int


def block_table(numels: Sequence[int], block: int, device: torch.device) -> BlockTable:
    """The table of ``numels`` cut into blocks of ``block`` values, on ``device``.

    The first use uploads it on that use's stream; until that copy is done, a use on
    another stream (the hooks' comm thread) waits for it on the device, not the host."""
    held = _cached(tuple(int(n) for n in numels), int(block), torch.device(device))
    table, landed = held
    if landed is not None:
        if landed.query():  # copied: later uses need no edge (and no CUDA call)
            held[1] = None
        else:
            torch.cuda.current_stream(table.starts.device).wait_event(landed)
    return table


@lru_cache(maxsize=256)
def _cached(numels: tuple[int, ...], block: int, device: torch.device) -> list[Any]:
    """[the table, the CUDA event after its upload (None once it has completed)]."""
    starts: list[torch.Tensor] = []
    lengths: list[torch.Tensor] = []
    offset = 0
    for n in numels:
        if n:
            first = torch.arange(0, n, block, dtype=torch.int64)
            starts.append(first + offset)
            lengths.append((n - first).clamp_(max=block).to(torch.int32))
        offset += n
    start = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64)
    length = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int32)
    longest = max((min(n, block) for n in numels if n), default=1)
    table = BlockTable(upload(start, device), upload(length, device), start.numel(),
                       1 << max(longest - 1, 0).bit_length())
    landed = None
    if device.type == "cuda":
        landed = torch.cuda.Event()
        landed.record()
    return [table, landed]
