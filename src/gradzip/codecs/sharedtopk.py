"""``sharedtopk``: one index set for every rank, chosen by a rotating leader, so the
kept values can be summed: ScaleCom's cyclic local top-k (Chen et al., NeurIPS 2020,
"ScaleCom: Scalable Sparsified Gradient Compression for Communication-Efficient
Distributed Training").

A gathered top-k (``topk`` over ``aggregate=gather``, SparseLoCo as its paper runs it)
sends every rank's positions and values to every other rank: (W-1) payloads per rank,
so its bytes grow with the number of ranks. Here one rank, the leader, takes the top k
of every ``chunk`` consecutive entries of its own (error-fed) tensor; the positions are
broadcast (``ceil(log2 chunk)`` bits each), every rank reads its own values at them,
and those are all-reduced in 16 bits (divided by W first, as PyTorch's fp16 hook does),
or with ``values=int8`` as integers against a scale per chunk that every rank shares
(one max all-reduce of a float per chunk first; each rank rounds to ``127 // W``
levels so that the int8 sum cannot overflow: 63 at W = 2, 15 at W = 8, 7 at W = 16;
what rounding loses stays in the error-feedback residual). Per rank that is about one
position and 2 (W-1)/W values per kept entry, whatever W.
The leader rotates every exchange (and differs between tensors), so every rank's
gradient picks the positions in turn; positions another rank would have kept stay in
its error-feedback residual (``ef | sharedtopk``) until they are chosen.

Alone (one rank, ``encode``/``decode``) it is a chunked top-k whose payload is the
packed positions and the values (16 bits, or int8 with a float scale per chunk).
"""

from __future__ import annotations

import hashlib

import torch

from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.bitpack import pack_bits, packed_bits_len, unpack_bits
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, at_least, register
from gradzip.codecs.sparse import chunked_topk_positions
from gradzip.collectives.communicator import Communicator

#: the float dtypes the kept values may be summed in (or ``int8``, with shared scales)
VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: int8's levels on one side of zero; W ranks each use ``INT8_LEVELS // W``
INT8_LEVELS = 127


def position_bits(numel: int, chunk: int) -> int:
    """Bits of one position inside its chunk (a tensor shorter than a chunk is one)."""
    return max(1, (min(numel, chunk) - 1).bit_length())


def kept_per_chunk(numel: int, chunk: int, k: int) -> list[tuple[int, int, int]]:
    """(start, length, kept) of every chunk of ``numel`` entries: each keeps ``k`` (a
    chunk shorter than ``k`` keeps all of it), as ``chunked_topk_positions`` selects."""
    out = [(start, min(chunk, numel - start), 0) for start in range(0, numel, chunk)]
    return [(s, n, min(k, n)) for s, n, _ in out]


def leader_of(key: str, step: int, world: int) -> int:
    """The rank whose positions every rank uses for ``key`` at exchange ``step``: a turn
    per exchange, offset per key so one rank does not lead every tensor at once."""
    offset = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    return (offset + step) % world


@register("sharedtopk")
class SharedTopK(Compressor):
    """Top k of every chunk on one rotating leader; its positions broadcast and every
    rank's values at them all-reduced (ScaleCom's CLT-k; see the module doc)."""

    summary = ("top-k of every chunk on a rotating leader, positions broadcast, values "
               "all-reduced: bytes independent of W (ScaleCom, Chen et al. 2020)")
    PARAMS = (
        Param("k", int, 64, "entries kept per chunk (SparseLoCo: 64 of 4096)", at_least(1)),
        Param("chunk", int, 4096, "consecutive entries each k is taken from", at_least(1)),
        Param("values", str, "fp16", "how the kept values are summed: a float dtype, or "
              "int8 against a scale per chunk shared by every rank",
              choices=(*VALUE_DTYPES, "int8")),
    )
    multi_round = True  # a broadcast, then an all-reduce
    summable = False
    unbiased = False

    def _positions(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() == 0:
            return torch.zeros(0, dtype=torch.long, device=flat.device)
        return chunked_topk_positions(flat, self.params["chunk"], self.params["k"])

    def _pack(self, positions: torch.Tensor, numel: int) -> torch.Tensor:
        """Each position as its offset in its chunk, ``position_bits`` bits, packed."""
        chunk, bits = self.params["chunk"], position_bits(numel, self.params["chunk"])
        offsets = positions % chunk
        shifts = torch.arange(bits, device=positions.device)
        return pack_bits(((offsets.unsqueeze(1) >> shifts) & 1).bool())

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """The positions ``_pack`` packed; bytes from a peer are checked, not trusted."""
        chunk, bits = self.params["chunk"], position_bits(numel, self.params["chunk"])
        layout = kept_per_chunk(numel, chunk, self.params["k"])
        count = sum(kept for _, _, kept in layout)
        if packed.dtype != torch.uint8 or packed.numel() != packed_bits_len(count * bits):
            raise PayloadError(f"sharedtopk: {packed.numel()} position bytes of "
                               f"{packed.dtype}, expected {packed_bits_len(count * bits)} "
                               f"of uint8 for {count} positions of {bits} bits")
        flags = unpack_bits(packed.reshape(-1), count * bits).view(count, bits).long()
        offsets = (flags << torch.arange(bits, device=flags.device)).sum(1)
        full = numel // chunk
        which = self._chunk_of_each(count, numel, offsets.device)
        starts = which * chunk  # entry j's chunk; a short last chunk is number ``full``
        lengths = torch.where(which < full, chunk, numel - full * chunk)
        if count and bool((offsets >= lengths).any()):
            raise PayloadError("sharedtopk: a position lies beyond the end of its chunk")
        return starts + offsets

    def _chunk_of_each(self, count: int, numel: int, device: torch.device) -> torch.Tensor:
        """The chunk each of the ``count`` kept entries (in position order) lies in."""
        full, per_full = numel // self.params["chunk"], min(self.params["k"],
                                                            self.params["chunk"])
        return (torch.arange(count, device=device) // per_full).clamp_(max=full)

    def _chunks(self, numel: int) -> int:
        return -(-numel // self.params["chunk"])

    def _int8_scales(self, values: torch.Tensor, numel: int, levels: int,
                     comm: Communicator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(each kept entry's chunk's step, its inverse): the chunk's largest magnitude
        (the largest over ranks, with ``comm``) over ``levels``."""
        which = self._chunk_of_each(values.numel(), numel, values.device)
        amax = torch.zeros(self._chunks(numel), device=values.device).scatter_reduce_(
            0, which, values.abs(), "amax")
        if comm is not None and comm.world_size > 1:
            (amax,) = comm.all_reduce([amax], op="max")
        step = amax / levels
        inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
        return step, inverse[which]

    # ------------------------------------------------------------ standalone
    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.detach().reshape(-1).float()
        positions = self._positions(flat)
        packed, kept = self._pack(positions, flat.numel()), flat[positions]
        if self.params["values"] != "int8":
            return Payload({"positions": packed, "values": self._cast(kept, 1)})
        step, inverse = self._int8_scales(kept, flat.numel(), INT8_LEVELS, None)
        return Payload({"positions": packed, "values": _rounded(kept, inverse, INT8_LEVELS),
                        "scale": step})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        numel = shape.numel()
        positions = self._unpack(p.tensor("positions"), numel)
        values = p.tensor("values")
        integers = self.params["values"] == "int8"
        if values.dim() != 1 or values.numel() != positions.numel() \
                or values.dtype.is_floating_point == integers \
                or (integers and values.dtype != torch.int8):
            raise PayloadError(f"sharedtopk: {values.numel()} values of {values.dtype} "
                               f"for {positions.numel()} positions ({self.params['values']})")
        decoded = values.float()
        if integers:
            scale = p.tensor("scale")
            if scale.dtype != torch.float32 or scale.numel() != self._chunks(numel) \
                    or not bool(torch.isfinite(scale).all()):
                raise PayloadError(f"sharedtopk: {scale.numel()} scales of {scale.dtype}, "
                                   f"expected {self._chunks(numel)} finite float32")
            decoded = decoded * scale[self._chunk_of_each(values.numel(), numel,
                                                          values.device)]
        out = torch.zeros(numel, dtype=torch.float32, device=values.device)
        out[positions.to(values.device)] = decoded
        return out.reshape(shape)

    # ------------------------------------------------------------ distributed
    def reduce(self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The leader's positions (broadcast), every rank's values there (all-reduced):
        (the mean, zero elsewhere; this rank's own values at the positions)."""
        flat, world = x.detach().reshape(-1).float(), comm.world_size
        n = flat.numel()
        if n == 0:
            return torch.zeros_like(flat).reshape(x.shape), (
                torch.zeros_like(flat).reshape(x.shape) if want_local else None)
        leader = leader_of(slot.key, slot.step, world)
        if comm.rank == leader:
            packed = self._pack(self._positions(flat), n)
        else:
            packed = torch.zeros(packed_bits_len(self._count(n) * position_bits(
                n, self.params["chunk"])), dtype=torch.uint8, device=flat.device)
        positions = self._unpack(comm.broadcast(packed, leader), n)
        summed, own = self._sum_values(flat[positions], n, comm)
        mean = torch.zeros_like(flat)
        mean[positions] = summed
        local = None
        if want_local:  # what this rank put in: its residual keeps the rest
            local = torch.zeros_like(flat)
            local[positions] = own
        return mean.reshape(x.shape), (local.reshape(x.shape) if local is not None else None)

    def _sum_values(self, kept: torch.Tensor, numel: int, comm: Communicator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean over ranks of ``kept``, this rank's ``kept`` as it was sent)."""
        world = comm.world_size
        if self.params["values"] != "int8":
            sent = self._cast(kept / world, world)
            (summed,) = comm.all_reduce([sent])
            return summed.float(), sent.float() * world
        levels = INT8_LEVELS // world
        if levels < 1:
            raise ValueError(f"sharedtopk(values=int8) sums int8 over at most "
                             f"{INT8_LEVELS} ranks, got {world}; use values=fp16")
        step, inverse = self._int8_scales(kept, numel, levels, comm)
        q = _rounded(kept, inverse, levels)
        each = step[self._chunk_of_each(kept.numel(), numel, kept.device)]
        (total,) = comm.all_reduce([q])
        return total.float() * each / world, q.float() * each

    def _cast(self, values: torch.Tensor, world: int) -> torch.Tensor:
        """``values`` in the summing dtype, saturated so that ``world`` of them still
        add up to a finite sum (a 16-bit cast would turn 7e4 into inf)."""
        dtype = VALUE_DTYPES[self.params["values"]]
        limit = torch.finfo(dtype).max / world
        return values.clamp(-limit, limit).to(dtype)

    def _count(self, numel: int) -> int:
        return sum(kept for _, _, kept in kept_per_chunk(numel, self.params["chunk"],
                                                          self.params["k"]))


def _rounded(values: torch.Tensor, inverse: torch.Tensor, levels: int) -> torch.Tensor:
    """``values`` x ``inverse`` rounded to the nearest of +-``levels`` integers, int8."""
    return (values * inverse).round_().clamp_(-levels, levels).to(torch.int8)
