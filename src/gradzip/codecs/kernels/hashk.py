"""``randomk``'s positions on the device: the k largest of a keyed hash, radix-selected.

On a host ``randomk`` draws its k positions from a CPU generator and uploads them
(``sparse.random_positions``), so every device agrees with it; on an H200 that host work
made its encode 11.9 GB/s (8% of a copy). On a device it instead keeps the k positions
whose 31-bit keys ``hash(seed, i)`` are largest (ties to the lowest positions): a
uniform random k-subset when the hash is, found by the radix select ``topk`` uses
(``select.py``) on the keys, with no host work and no host read. The hash is a
bijection of the 32-bit position (three rounds of xor-shift and multiply, keyed by
each half of the 64-bit seed and then by both) computed in int64 without overflow,
so ``sparse.hash_keys`` computes the same keys with torch ops on a CPU: a payload
made either way decodes on any device (its ``gen`` meta says which generator chose
the positions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gradzip.codecs.kernels import select
from gradzip.codecs.sparse import HASH_MULTIPLIER, hash_round_keys

#: positions per program
_BLOCK = 4096


@triton.jit
def _mix(x, MULTIPLIER: tl.constexpr):
    x = (((x >> 16) ^ x) * MULTIPLIER) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * MULTIPLIER) & 0xFFFFFFFF
    return (x >> 16) ^ x


# Triton makes an integer argument equal to 1 a compile-time constant, which has no
# ``.to``: a seed whose round key is 1 would not compile. The keys stay arguments.
@triton.jit(do_not_specialize=["key0", "key1", "key2"])
def _keys_kernel(out_ptr, n, key0, key1, key2, BLOCK: tl.constexpr,
                 MULTIPLIER: tl.constexpr):
    """The keys of one block of positions; ``key0..2``: the rounds' 32-bit keys."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _mix((offs & 0xFFFFFFFF) ^ key0.to(tl.int64), MULTIPLIER)
    x = _mix(x ^ key1.to(tl.int64), MULTIPLIER)
    x = _mix(x ^ key2.to(tl.int64), MULTIPLIER)
    tl.store(out_ptr + offs, (x >> 1).to(tl.int32), mask=offs < n)


def keys(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """int32 keys of positions ``0..n-1`` (``sparse.hash_keys`` on the device)."""
    out = torch.empty(n, dtype=torch.int32, device=device)
    if n:
        _keys_kernel[(triton.cdiv(n, _BLOCK),)](out, n, *hash_round_keys(seed),
                                               BLOCK=_BLOCK, MULTIPLIER=HASH_MULTIPLIER)
    return out


def positions(n: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest keys (``0 < k < n``), no host read:
    the keys, non-negative int32, are the bits of finite or NaN float32 values the radix
    select orders exactly as the integers."""
    return select.topk_positions(keys(n, seed, device).view(torch.float32), k)
