"""The ways one codec's payloads from every rank become the mean, one object each.

* ``AllReduce`` — summable payloads (casts, shared-seed random-k): every rank encodes
  ``x / W`` and the payload tensors are all-reduced; link bytes per rank
  2(W-1)/W x payload, independent of W.
* ``Gather`` — any payload: every rank all-gathers every rank's payload and decodes all
  of them; link bytes (W-1) x payload, growing with W.
* ``TwoPhase`` — any payload, traffic that does not grow with W (the compressed
  all-reduce of DeepSpeed's 1-bit Adam, CGX and ZeRO++): split ``x`` into W chunks,
  send chunk j compressed to its owner j (``all_to_all``), each owner decodes and sums
  its chunk in fp32, re-encodes the mean, and the owners' payloads are all-gathered.
  Link bytes per rank about 2(W-1)/W x payload. With error feedback (``ef | ...``) both
  phases keep a residual: the sender's on its whole tensor, the owner's on its chunk
  (key ``{key}/owner``). The owner's fp32 sum also fixes low-precision sums
  (``fp16``/``bf16`` payloads added in 16 bits lose more as W grows).
* ``MultiRound`` — the chain's multi-round stage runs its own protocol (PowerSGD, ...).
* ``ReduceScatter`` — FSDP's reduce-scatter: summable payloads are reduce-scattered
  leaf by leaf, the rest are phase 1 of two-phase (``all_to_all``, decode, sum).

Each works through the codec's public body API (``encode_body``, ``decode_body``,
``encode_with_feedback``, ``reduce_rounds``) over a ``Communicator``; input checks,
error feedback around the whole reduction and the non-finite policy are
``reduce.py``'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from gradzip.aggregation.layout import as_bytes, chunk_bounds, decode_sum, piece_shapes
from gradzip.aggregation.nonfinite import (
    must_agree,
    poison,
    poison_where,
    poisoned,
    raise_if_poisoned,
)
from gradzip.codecs.base import Shapes
from gradzip.codecs.chain import Codec, Reduced
from gradzip.codecs.nonfinite import agreed_nonfinite_error
from gradzip.codecs.payload import Payload
from gradzip.collectives.communicator import Communicator


class MeanStrategy(ABC):
    """A way to average one tensor over the ranks of a communicator through a codec."""

    #: the path's name in stats and records (``CodecObserver.aggregated``)
    name: ClassVar[str]

    @abstractmethod
    def mean(self, codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
             want_local: bool, shapes: Shapes | None, finite: bool = True) -> Reduced:
        """(mean over ranks, this rank's own decoded contribution when ``want_local``).

        ``finite`` False: this rank's input was non-finite and ``x`` holds zeros; the
        strategy tells its peers in a collective it runs anyway, and all raise.
        """


class AllReduce(MeanStrategy):
    """Summable payloads: encode x / W, all-reduce the payload tensors, decode the sum."""

    name = "all_reduce"

    def mean(self, codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
             want_local: bool, shapes: Shapes | None, finite: bool = True) -> Reduced:
        world = comm.world_size
        p = codec.encode_body(x / world if world > 1 else x, key, shapes)
        leaves = [t for _, t in p.leaves()]
        if must_agree(codec, comm):
            sent = [t.clone() for t in leaves] if want_local and not finite else leaves
            poison(sent, finite)
            summed = comm.all_reduce(sent, op="sum")
            raise_if_poisoned(summed, key)
        else:
            summed = comm.all_reduce(leaves, op="sum")
        mean = codec.decode_body(p.with_leaves(summed), None, x.shape, shapes)
        local = codec.decode_body(p, None, x.shape, shapes) * world if want_local else None
        return mean, local


class Gather(MeanStrategy):
    """Any payload: all-gather every rank's payload, decode each, average in fp32."""

    name = "gather"

    def mean(self, codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
             want_local: bool, shapes: Shapes | None, finite: bool = True) -> Reduced:
        if not finite and must_agree(codec, comm):  # say so in the size exchange, then raise
            comm.all_gather_bytes(None, device=x.device)
            raise agreed_nonfinite_error(key)
        p = codec.encode_body(x, key, shapes)
        blobs = comm.all_gather_bytes(as_bytes(p, x))
        if blobs is None:
            raise agreed_nonfinite_error(key)
        local = None
        if want_local:
            local = codec.decode_body(p, None, x.shape, shapes).to(x.device)
        total = decode_sum(codec, blobs, x.numel(), shapes, x.device)
        return total.div_(comm.world_size).reshape(x.shape), local


class TwoPhase(MeanStrategy):
    """Compressed reduce-scatter to chunk owners, fp32 sum, compressed all-gather."""

    name = "two_phase"

    def mean(self, codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
             want_local: bool, shapes: Shapes | None, finite: bool = True) -> Reduced:
        world, rank, flat = comm.world_size, comm.rank, x.reshape(-1)
        if not finite and must_agree(codec, comm):  # say so in phase 1's size exchange
            comm.all_to_all_bytes(None, device=x.device)
            raise agreed_nonfinite_error(key)
        bounds = chunk_bounds(flat.numel(), world)
        pieces = [piece_shapes(shapes, bounds[j], bounds[j + 1]) for j in range(world)]
        sent = [codec.encode_body(flat[bounds[j]:bounds[j + 1]], f"{key}/to{j}", pieces[j])
                for j in range(world)]
        received = comm.all_to_all_bytes([as_bytes(p, flat[bounds[j]:bounds[j + 1]])
                                          for j, p in enumerate(sent)])
        if received is None:
            raise agreed_nonfinite_error(key)
        n_mine = bounds[rank + 1] - bounds[rank]
        mine = decode_sum(codec, received, n_mine, pieces[rank], x.device).div_(world)
        owner = codec.encode_with_feedback(mine, f"{key}/owner", pieces[rank])
        gathered = comm.all_gather_bytes(as_bytes(owner, mine))
        assert gathered is not None  # every rank sends its owner payload
        parts = [codec.decode_body(Payload.deserialize(b).to(x.device), None,
                                   torch.Size((bounds[j + 1] - bounds[j],)), pieces[j])
                 for j, b in enumerate(gathered)]
        mean = torch.cat([t.to(x.device).reshape(-1).float() for t in parts]).reshape(x.shape)
        local = None
        if want_local:
            own = [codec.decode_body(p, None, torch.Size((bounds[j + 1] - bounds[j],)),
                                     pieces[j]) for j, p in enumerate(sent)]
            local = torch.cat([t.to(x.device).reshape(-1).float() for t in own]).reshape(x.shape)
        return mean, local


class MultiRound(MeanStrategy):
    """The chain's multi-round stage talks to its peers itself (``Codec.reduce_rounds``);
    a non-finite input rides on its first collective (``reduce.py`` sets the flag)."""

    name = "multi_round"

    def mean(self, codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
             want_local: bool, shapes: Shapes | None, finite: bool = True) -> Reduced:
        return codec.reduce_rounds(x, key, comm, want_local, shapes)


class ReduceScatter:
    """Row ``rank`` of the sum over ranks of ``chunks`` (``[W, n]``): FSDP's reduce-scatter.

    Chunk j is encoded for rank j with its own codec state (key ``{key}/to{j}``, error
    feedback included); ``shapes`` are the tensors inside each chunk (the same in all).
    """

    name = "reduce_scatter"

    def shard(self, codec: Codec, chunks: torch.Tensor, key: str, comm: Communicator,
              shapes: Shapes | None = None, finite: bool = True) -> torch.Tensor:
        world, checks = comm.world_size, must_agree(codec, comm)
        n = chunks.shape[1]
        if not finite and checks and not codec.summable:
            comm.all_to_all_bytes(None, device=chunks.device)
            raise agreed_nonfinite_error(key)
        payloads = [codec.encode_with_feedback(chunks[j], f"{key}/to{j}", shapes)
                    for j in range(world)]
        if codec.summable:
            return self._summed(codec, payloads, key, comm, n, shapes, finite, checks)
        blobs = comm.all_to_all_bytes([as_bytes(p, chunks[j]) for j, p in enumerate(payloads)])
        if blobs is None:
            raise agreed_nonfinite_error(key)
        return decode_sum(codec, blobs, n, shapes, chunks.device)

    def shard_on_device(self, codec: Codec, chunks: torch.Tensor, key: str,
                        comm: Communicator, shapes: Shapes | None,
                        bad: torch.Tensor) -> torch.Tensor:
        """``shard`` for a summable codec under 'error' with no host read: ``bad`` (0-d
        bool; ``chunks`` then hold zeros) poisons the sums on the device, and every
        rank's flag goes to ``comm.watch``."""
        payloads = [codec.encode_with_feedback(chunks[j], f"{key}/to{j}", shapes)
                    for j in range(comm.world_size)]
        return self._summed(codec, payloads, key, comm, chunks.shape[1], shapes, True, True,
                            bad)

    @staticmethod
    def _summed(codec: Codec, payloads: list[Payload], key: str, comm: Communicator,
                n: int, shapes: Shapes | None, finite: bool, checks: bool,
                bad: torch.Tensor | None = None) -> torch.Tensor:
        """Summable payloads: reduce-scatter each leaf, stacked one row per owner
        (``bad``: the non-finite flag on the device, read through ``comm.watch``)."""
        per_chunk = [[t for _, t in p.leaves()] for p in payloads]
        stacked = [torch.stack([leaves[i] for leaves in per_chunk])
                   for i in range(len(per_chunk[0]))]
        rows = [row for t in stacked for row in t]
        if checks and bad is not None:  # every chunk's first value: each owner learns
            poison_where(rows, bad)      # it from its own row
        elif checks:
            poison(rows, finite)
        summed = [comm.reduce_scatter_sum(t) for t in stacked]
        if checks and bad is not None:
            flag = poisoned(summed)
            if flag is not None:
                comm.watch(flag, lambda: agreed_nonfinite_error(key))
        elif checks:
            raise_if_poisoned(summed, key)
        mine = payloads[comm.rank].with_leaves(summed)
        return codec.decode_body(mine, None, torch.Size((n,)), shapes).reshape(-1)


#: every mean strategy by the name ``path_for`` returns
STRATEGIES: dict[str, MeanStrategy] = {
    s.name: s for s in (AllReduce(), Gather(), TwoPhase(), MultiRound())}
