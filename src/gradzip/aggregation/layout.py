"""How a flat tensor is cut into one chunk per rank, and how chunks travel as bytes."""

from __future__ import annotations

import torch

from gradzip.codecs.base import Shapes
from gradzip.codecs.chain import Codec
from gradzip.codecs.payload import Payload


def chunk_bounds(n: int, world: int) -> list[int]:
    """W + 1 offsets cutting ``n`` values into W contiguous chunks (sizes differ by <= 1)."""
    base, extra = divmod(n, world)
    bounds = [0]
    for j in range(world):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return bounds


def piece_shapes(shapes: Shapes | None, start: int, end: int) -> list[torch.Size] | None:
    """The tensors of a flat bucket that fall in ``[start, end)``.

    A tensor wholly inside keeps its shape; a cut one becomes a 1-D piece (its
    statistics are then per piece, still never across two tensors).
    """
    if shapes is None:
        return None
    out: list[torch.Size] = []
    offset = 0
    for s in shapes:
        n = s.numel()
        lo, hi = max(offset, start), min(offset + n, end)
        if lo < hi or (n == 0 and start <= offset < end):
            out.append(s if (lo, hi) == (offset, offset + n) else torch.Size((hi - lo,)))
        offset += n
    return out


def as_bytes(p: Payload, like: torch.Tensor) -> torch.Tensor:
    """The payload as bytes on ``like``'s device (its shape is known to every receiver)."""
    return p.to_tensor(device=like.device)


def decode_sum(codec: Codec, blobs: list[torch.Tensor], n: int,
               shapes: Shapes | None, device: torch.device) -> torch.Tensor:
    """fp32 sum of the payloads ``blobs`` decode to, in rank order (the same sum on every
    rank). Each blob is parsed on the host and decoded where the sum lives."""
    total = torch.zeros(n, dtype=torch.float32, device=device)
    for blob in blobs:
        p = Payload.deserialize(blob).to(device)
        total += codec.decode_body(p, None, torch.Size((n,)), shapes).to(device).reshape(-1)
    return total
