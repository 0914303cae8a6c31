"""A cheap cross-rank check that state every rank computes on its own is the same.

Some multi-round codecs derive state locally from all-reduced data and never send
it: GradiVeQ's PCA basis, Sketch's heavy-hitter candidates. Exact arithmetic gives
every rank the same result, but a different BLAS, CPU, library version or restored
checkpoint can make one rank's copy differ, and then the coefficients or values the
ranks sum belong to different bases or coordinates: wrong sums, silently. So when
such state is (re)computed, every rank hashes it and one all-reduce (op ``max`` of
``[hash, -hash]``, which gives the maximum and the minimum at once) tells every
rank whether all hashes agree: 16 bytes per check, counted like any other traffic.
"""

from __future__ import annotations

import hashlib

import torch

from gradzip.collectives.communicator import Communicator
from gradzip.collectives.upload import device_tensor

#: bytes one check hands to its all-reduce (two int64)
CHECK_BYTES = 16


class StateDivergenceError(RuntimeError):
    """State that must be identical on every rank differs between ranks."""


def fingerprint(t: torch.Tensor) -> int:
    """A 62-bit hash of ``t``'s dtype, shape and exact bytes (any changed bit changes it)."""
    data = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{data.dtype}/{tuple(data.shape)}".encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def check_same_on_all_ranks(comm: Communicator, t: torch.Tensor, codec: str, what: str,
                            key: str) -> None:
    """Raise ``StateDivergenceError`` on every rank unless ``t`` is identical on all ranks.

    ``codec``, ``what`` and ``key`` name the state in the error. Every rank takes part
    in the one collective and every rank sees the same verdict, so all of them raise
    together (none is left waiting in a later collective).
    """
    if comm.world_size < 2:
        return
    h = fingerprint(t)
    pair = device_tensor([h, -h], t.device, torch.int64)
    (top,) = comm.all_reduce([pair], op="max")
    high, low = int(top[0]), -int(top[1])
    if high != low:
        raise StateDivergenceError(
            f"{codec}: the {what} for key {key!r} differs between ranks (rank {comm.rank} "
            f"has fingerprint {h:#x}; the ranks range over {low:#x}..{high:#x}). Every rank "
            "computes it on its own and it must be identical, or the ranks would sum "
            "values that mean different things; run the same gradzip, torch and BLAS "
            "build with the same codec seed on every rank, and restore every rank from "
            "the same checkpoint"
        )
