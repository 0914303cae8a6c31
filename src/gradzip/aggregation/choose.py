"""Which way a codec's payloads are reduced: the chain's ``aggregate=`` option, its kind
(summable, multi-round), and for ``auto`` on a non-summable chain the link byte model.

``choose`` encodes the first real tensor of each size whole and as one of W chunks
with a stateless copy of the codec and compares (W-1) x P(n) with 2 (W-1) x P(n/W)
(plus the size exchanges). At W <= 2 two-phase cannot send less, and it adds a
second lossy step, so gather is kept.
"""

from __future__ import annotations

import weakref

import torch

from gradzip.aggregation.layout import chunk_bounds, piece_shapes
from gradzip.codecs.base import Shapes
from gradzip.codecs.chain import Codec
from gradzip.collectives.communicator import Communicator
from gradzip.collectives.linkmodel import link_bytes
from gradzip.collectives.upload import device_tensor

#: per codec, the path ``auto`` chose for each (tensor size, world size)
_CHOSEN: weakref.WeakKeyDictionary[Codec, dict[tuple[int, int], str]] = \
    weakref.WeakKeyDictionary()


def modeled_bytes(path: str, full: int, chunk: int, world: int, backend: str = "ideal") -> int:
    """Link bytes per rank of ``path`` for payloads of ``full`` (whole) / ``chunk`` bytes."""
    sizes = link_bytes("all_gather", 8, world, backend)  # a gather's payload-size exchange
    if path == "gather":
        return link_bytes("all_gather", full, world, backend) + sizes
    a2a_sizes = link_bytes("all_gather", 8 * world, world, backend)
    return (link_bytes("all_to_all", chunk * world, world, backend) + a2a_sizes
            + link_bytes("all_gather", chunk, world, backend) + sizes)


def choose(codec: Codec, x: torch.Tensor, world: int, shapes: Shapes | None,
           backend: str = "ideal", comm: Communicator | None = None) -> str:
    """``gather`` or ``two_phase``, whichever the link model (of ``backend``: gloo's
    per-call cost makes two-phase's extra calls dearer) says sends fewer bytes.

    The payload sizes depend on each rank's data (a threshold keeps what it finds, an
    entropy coder codes what it gets). With ``comm`` they are agreed first, one max
    all-reduce of two numbers, once per tensor size and world size: both paths pad to
    the largest payload, so the maximum is the figure that decides, and every rank
    then issues the same collectives (ranks that chose apart would hang NCCL).
    """
    if world <= 2:
        return "gather"
    probe = codec.probe()  # a stateless copy: measuring must not touch real state
    flat = x.detach().reshape(-1).float()
    bounds = chunk_bounds(flat.numel(), world)
    full = probe.encode_body(flat, "probe", shapes).wire_bytes
    chunk = probe.encode_body(flat[:bounds[1]], "probe/c",
                              piece_shapes(shapes, 0, bounds[1])).wire_bytes
    if comm is not None and comm.world_size > 1:
        sizes = device_tensor([full, chunk], x.device, torch.int64)
        full, chunk = (int(v) for v in comm.all_reduce([sizes], op="max")[0].tolist())
    gather = modeled_bytes("gather", full, chunk, world, backend)
    two = modeled_bytes("two_phase", full, chunk, world, backend)
    return "two_phase" if two < gather else "gather"


def forget_paths(codec: Codec) -> None:
    """Forget the paths chosen for ``codec``: the next reduction of each size agrees
    again. For ranks that come and go (torchft): a rank that starts afresh agrees on
    its first reduction while its peers, who remember, would not, and their
    collectives would no longer match."""
    _CHOSEN.pop(codec, None)


def path_for(codec: Codec, x: torch.Tensor, world: int, shapes: Shapes | None = None,
             backend: str = "ideal", comm: Communicator | None = None) -> str:
    """How ``x`` is reduced over ``world`` ranks: all_reduce, multi_round, gather or
    two_phase (``auto`` asks the link byte model of ``backend``, once per size and
    world size). With ``comm``, the payload sizes the choice rests on are agreed over
    its ranks first (their maximum), so every rank takes the same path even when its
    sizes depend on its data."""
    if codec.multi_round:
        return "multi_round"
    if codec.aggregate != "auto":  # also for summable codecs: two-phase sums in fp32
        return codec.aggregate
    if codec.summable:
        return "all_reduce"
    chosen = _CHOSEN.setdefault(codec, {})
    k = (x.numel(), world)
    if k not in chosen:
        chosen[k] = choose(codec, x, world, shapes, backend, comm)
    return chosen[k]
