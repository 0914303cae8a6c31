"""``sharedtopk``: one set of positions for every rank, so the kept values can be
summed: a top-k whose link bytes do not grow with the number of ranks.

A gathered top-k (``topk`` over ``aggregate=gather``, SparseLoCo as its paper runs it)
sends every rank's positions and values to every other rank: (W-1) payloads per rank,
so its bytes grow with W. Here the ranks first agree on one set of positions per
``chunk`` consecutive entries, then every rank reads its own (error-fed) values there
and those are all-reduced. The set comes from

* ``select=leader`` (ScaleCom's cyclic local top-k; Chen et al., NeurIPS 2020,
  "ScaleCom: Scalable Sparsified Gradient Compression for Communication-Efficient
  Distributed Training"): one rank, turning every exchange (and different for each
  tensor), takes the top k of each chunk of its own tensor and broadcasts them; or
* ``select=each``: every rank takes its own top ``ceil(k / W)`` of each chunk, the
  picks are all-gathered and their union (at most about k, fewer where ranks agree) is
  the set: every rank's largest entries each exchange, for the same position bytes.

Positions cross as their offsets in the chunk, ``ceil(log2 chunk)`` bits each. Values
are all-reduced in 16 bits (divided by W first, as PyTorch's fp16 hook does), or with
``values=int8`` as integers against a scale per chunk every rank shares (one max
all-reduce of a float per chunk first; each rank rounds to ``127 // W`` levels so the
int8 sum cannot overflow: 63 at W = 2, 15 at W = 8, 7 at W = 16). Per rank that is
about one position and 2 (W-1)/W values per kept entry, whatever W. What a rank does
not send (the entries outside the set, the rounding) stays in its error-feedback
residual (``ef | sharedtopk``) until a later exchange picks it.

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
#: who picks the shared positions (see the module doc)
SELECTIONS = ("leader", "each")


def position_bits(numel: int, chunk: int) -> int:
    """Bits of one position inside its chunk (a tensor shorter than a chunk is one)."""
    return max(1, (min(numel, chunk) - 1).bit_length())


def kept_per_chunk(numel: int, chunk: int, k: int) -> list[tuple[int, int, int]]:
    """(start, length, kept) of every chunk of ``numel`` entries: each keeps ``k`` (a
    chunk shorter than ``k`` keeps all of it), as ``chunked_topk_positions`` selects."""
    lengths = [(start, min(chunk, numel - start)) for start in range(0, numel, chunk)]
    return [(start, n, min(k, n)) for start, n in lengths]


def kept_count(numel: int, chunk: int, k: int) -> int:
    """How many entries a top ``k`` of every chunk keeps."""
    return sum(kept for _, _, kept in kept_per_chunk(numel, chunk, k))


def leader_of(key: str, step: int, world: int) -> int:
    """The rank whose positions every rank uses for ``key`` at exchange ``step``: a turn
    per exchange, offset per key so one rank does not lead every tensor at once."""
    offset = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    return (offset + step) % world


@register("sharedtopk")
class SharedTopK(Compressor):
    """Top k of every chunk at positions all ranks share (a rotating leader's, or the
    union of every rank's share), their values all-reduced (see the module doc)."""

    summary = ("top-k at positions every rank shares (a rotating leader's or each rank's "
               "share), values all-reduced: bytes independent of W (ScaleCom 2020)")
    PARAMS = (
        Param("k", int, 64, "entries kept per chunk (SparseLoCo: 64 of 4096)", at_least(1)),
        Param("chunk", int, 4096, "consecutive entries each k is taken from", at_least(1)),
        Param("values", str, "fp16", "how the kept values are summed: a float dtype, or "
              "int8 against a scale per chunk shared by every rank",
              choices=(*VALUE_DTYPES, "int8")),
        Param("select", str, "leader", "who picks the positions: a rotating leader's top "
              "k, or the union of each rank's top ceil(k / W)", choices=SELECTIONS),
    )
    multi_round = True  # positions (a broadcast or an all-gather), then an all-reduce
    values_field = "values"  # the kept values (the statistics' count of what was kept)
    summable = False
    unbiased = False

    # ------------------------------------------------------------ positions
    def _positions(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        if flat.numel() == 0:
            return torch.zeros(0, dtype=torch.long, device=flat.device)
        return chunked_topk_positions(flat, self.params["chunk"], k)

    def _pack(self, positions: torch.Tensor, numel: int) -> torch.Tensor:
        """Each position as its offset in its chunk, ``position_bits`` bits, packed."""
        chunk, bits = self.params["chunk"], position_bits(numel, self.params["chunk"])
        shifts = torch.arange(bits, device=positions.device)
        return pack_bits((((positions % chunk).unsqueeze(1) >> shifts) & 1).bool())

    def _packed_len(self, numel: int, k: int) -> int:
        count = kept_count(numel, self.params["chunk"], k)
        return packed_bits_len(count * position_bits(numel, self.params["chunk"]))

    def _unpack(self, packed: torch.Tensor, numel: int, k: int) -> torch.Tensor:
        """The positions ``_pack`` packed of a top ``k``; bytes from a peer are checked,
        not trusted."""
        chunk, bits = self.params["chunk"], position_bits(numel, self.params["chunk"])
        count = kept_count(numel, chunk, k)
        if packed.dtype != torch.uint8 or packed.numel() != packed_bits_len(count * bits):
            raise PayloadError(f"sharedtopk: {packed.numel()} position bytes of "
                               f"{packed.dtype}, expected {packed_bits_len(count * bits)} "
                               f"of uint8 for {count} positions of {bits} bits")
        flags = unpack_bits(packed.reshape(-1), count * bits).view(count, bits).long()
        offsets = (flags << torch.arange(bits, device=flags.device)).sum(1)
        full, per_full = numel // chunk, min(k, chunk)
        which = (torch.arange(count, device=offsets.device) // per_full).clamp_(max=full)
        lengths = torch.where(which < full, chunk, numel - full * chunk)
        if count and bool((offsets >= lengths).any()):
            raise PayloadError("sharedtopk: a position lies beyond the end of its chunk")
        return which * chunk + offsets  # a short last chunk is number ``full``

    def _agreed(self, flat: torch.Tensor, slot: Slot, comm: Communicator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ascending positions every rank uses this exchange (``select``), the
        packed positions this rank sent toward them: empty for a non-leader)."""
        n, world, k = flat.numel(), comm.world_size, self.params["k"]
        if self.params["select"] == "each":
            share = -(-k // world)
            mine = self._pack(self._positions(flat, share), n)
            picked = comm.all_gather(mine)
            return torch.unique(torch.cat([self._unpack(p, n, share) for p in picked])), mine
        leader = leader_of(slot.key, slot.step, world)
        if comm.rank == leader:
            packed = mine = self._pack(self._positions(flat, k), n)
        else:  # a buffer to receive into; this rank sends none of it
            packed = torch.zeros(self._packed_len(n, k), dtype=torch.uint8, device=flat.device)
            mine = packed[:0]
        return self._unpack(comm.broadcast(packed, leader), n, k), mine

    # ------------------------------------------------------------ values
    def _int8_scales(self, values: torch.Tensor, chunks: torch.Tensor, numel: int,
                     levels: int, comm: Communicator | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(every chunk's step, each value's inverse step): a chunk's largest magnitude
        (over ranks, with ``comm``) over ``levels``; ``chunks``: the chunk of each value."""
        amax = torch.zeros(-(-numel // self.params["chunk"]), device=values.device)
        amax.scatter_reduce_(0, chunks, values.abs(), "amax")
        if comm is not None and comm.world_size > 1:
            (amax,) = comm.all_reduce([amax], op="max")
        inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
        return amax / levels, inverse[chunks]

    def _sum_values(self, kept: torch.Tensor, chunks: torch.Tensor, numel: int,
                    comm: Communicator
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(the mean over ranks of ``kept``, this rank's ``kept`` as it was sent, the
        fields it sent: the values, and with int8 the scales whose maximum it took)."""
        world = comm.world_size
        if self.params["values"] != "int8":
            sent = self._cast(kept / world, world)
            (summed,) = comm.all_reduce([sent])
            return summed.float(), sent.float() * world, {"values": sent}
        levels = INT8_LEVELS // world
        if levels < 1:
            raise ValueError(f"sharedtopk(values=int8) sums int8 over at most "
                             f"{INT8_LEVELS} ranks, got {world}; use values=fp16")
        step, inverse = self._int8_scales(kept, chunks, numel, levels, comm)
        q, scales, step = _rounded(kept, inverse, levels), step, step[chunks]
        (total,) = comm.all_reduce([q])
        return total.float() * step / world, q.float() * step, {"values": q, "scale": scales}

    def _cast(self, values: torch.Tensor, world: int) -> torch.Tensor:
        """``values`` in the summing dtype, saturated so that ``world`` of them still
        add up to a finite sum (a 16-bit cast would turn 7e4 into inf)."""
        dtype = VALUE_DTYPES[self.params["values"]]
        limit = torch.finfo(dtype).max / world
        return values.clamp(-limit, limit).to(dtype)

    # ------------------------------------------------------------ standalone
    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.detach().reshape(-1).float()
        positions = self._positions(flat, self.params["k"])
        packed, kept = self._pack(positions, flat.numel()), flat[positions]
        if self.params["values"] != "int8":
            return Payload({"positions": packed, "values": self._cast(kept, 1)})
        step, inverse = self._int8_scales(kept, positions // self.params["chunk"],
                                          flat.numel(), INT8_LEVELS, None)
        return Payload({"positions": packed, "values": _rounded(kept, inverse, INT8_LEVELS),
                        "scale": step})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        numel = shape.numel()
        positions = self._unpack(p.tensor("positions"), numel, self.params["k"])
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
            chunks = -(-numel // self.params["chunk"])
            if scale.dtype != torch.float32 or scale.numel() != chunks \
                    or not bool(torch.isfinite(scale).all()):
                raise PayloadError(f"sharedtopk: {scale.numel()} scales of {scale.dtype}, "
                                   f"expected {chunks} finite float32")
            decoded = decoded * scale[positions.to(values.device) // self.params["chunk"]]
        out = torch.zeros(numel, dtype=torch.float32, device=values.device)
        out[positions.to(values.device)] = decoded
        return out.reshape(shape)

    # ------------------------------------------------------------ distributed
    def reduce(self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions agreed (``select``), every rank's values there all-reduced: (the
        mean, zero elsewhere; this rank's own values at the positions, as sent)."""
        flat = x.detach().reshape(-1).float()
        mean, local = torch.zeros_like(flat), torch.zeros_like(flat) if want_local else None
        if flat.numel():
            positions, mine = self._agreed(flat, slot, comm)
            summed, own, sent = self._sum_values(flat[positions],
                                                 positions // self.params["chunk"],
                                                 flat.numel(), comm)
            slot.sent = Payload({"positions": mine, **sent})
            mean[positions] = summed
            if local is not None:  # what this rank put in: its residual keeps the rest
                local[positions] = own
        return mean.reshape(x.shape), (local.reshape(x.shape) if local is not None else None)


def _rounded(values: torch.Tensor, inverse: torch.Tensor, levels: int) -> torch.Tensor:
    """``values`` x ``inverse`` rounded to the nearest of +-``levels`` integers, int8."""
    return (values * inverse).round_().clamp_(-levels, levels).to(torch.int8)
