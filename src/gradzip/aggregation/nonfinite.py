"""Agreeing on a non-finite input: every rank raises (or returns NaN) together.

Under ``nonfinite='error'`` a rank whose input was NaN/Inf must not simply raise: its
peers would wait in the collective it skipped (a hang on NCCL). Each way of reducing
folds the news into a collective it runs anyway, and every rank raises the same error:
a summed payload carries a NaN in its first value; a size exchange carries "none"; a
multi-round protocol's first collective carries a flag (``Communicator.carry_flag``).
Under ``'propagate'`` the ranks agree first (``propagated``), before anything is encoded.
"""

from __future__ import annotations

import torch

from gradzip.codecs.chain import Codec
from gradzip.codecs.nonfinite import agreed_nonfinite_error
from gradzip.collectives.communicator import Communicator
from gradzip.collectives.upload import device_tensor


def must_agree(codec: Codec, comm: Communicator) -> bool:
    """Whether this reduction must agree on finiteness (``'propagate'`` agreed already)."""
    return codec.nonfinite == "error" and comm.world_size > 1


def poison(leaves: list[torch.Tensor], finite: bool) -> None:
    """Put NaN in the first value of every floating leaf of a non-finite rank's payload
    (in place, on the device), so the all-reduced sums carry the news to every rank."""
    if not finite:
        for t in leaves:
            if t.numel() and t.dtype.is_floating_point:
                t.view(-1)[:1] = float("nan")


def poison_where(leaves: list[torch.Tensor], bad: torch.Tensor) -> None:
    """``poison`` by a flag on the device (0-d bool): no host read."""
    for t in leaves:
        if t.numel() and t.dtype.is_floating_point:
            head = t.view(-1)[:1]
            head.copy_(torch.where(bad, torch.full_like(head, float("nan")), head))


def poisoned(leaves: list[torch.Tensor]) -> torch.Tensor | None:
    """After the all-reduce, on the device: whether any rank poisoned the sums (None:
    no floating leaf carries a head)."""
    heads = [t.reshape(-1)[:1].float() for t in leaves if t.numel() and t.dtype.is_floating_point]
    return ~torch.isfinite(torch.cat(heads)).all() if heads else None


def raise_if_poisoned(leaves: list[torch.Tensor], key: str) -> None:
    """After the all-reduce: every rank sees the same sums, so every rank raises here
    together if any rank poisoned them (one host read of one value)."""
    flag = poisoned(leaves)
    if flag is not None and bool(flag):
        raise agreed_nonfinite_error(key)


def propagated(codec: Codec, finite: bool, key: str, comm: Communicator,
               device: torch.device) -> bool:
    """Under 'propagate': whether any rank's input was non-finite, so every rank
    returns NaN before anything is encoded (one rank needs no collective)."""
    if codec.nonfinite != "propagate":
        return False
    if comm.world_size == 1:
        return not finite
    flag = device_tensor([0.0 if finite else 1.0], device)
    return float(comm.all_reduce([flag], op="max")[0]) > 0
