"""Sparsifiers: ``topk``, ``randomk`` and ``threshold`` — send a few entries, zero the rest.

* ``topk`` keeps the k entries of largest magnitude (Aji & Heafield 2017, "Sparse
  Communication for Distributed Gradient Descent"; Stich et al. 2018 with error
  feedback). Exact: ties at the k-th magnitude are broken by lowest position. With
  ``chunk=C`` it keeps the top k (or ratio x C) of every C consecutive entries instead,
  as SparseLoCo does (arXiv 2508.15706: 64 of every 4,096): every region of the tensor
  keeps its share, and the payload is the same, so decoding does not change.
* ``randomk`` keeps k uniformly random positions chosen from a seed shared by all
  ranks, so only the values travel and payloads can be summed (all-reduced):
  Stich et al. 2018, "Sparsified SGD with Memory"; Wangni et al. 2018 for the
  d/k rescaling that makes it unbiased.
* ``threshold`` keeps every entry with ``|x| >= v`` (Strom 2015, "Scalable
  Distributed DNN Training Using Commodity GPU Cloud Computing"); the count varies.

All three send ``values`` (float32, the field a following quantizer may compress:
``topk | qsgd``) and, except randomk, the positions in the shared form of
``gradzip.codecs.indices`` (int32 gaps, a bitmap, or all values densely above 31/32
density: whichever serializes smallest). None is unbiased
except ``randomk(scale=true)``; pair the biased ones with ``ef`` for convergence.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np
import torch

from gradzip.codecs import kernels
from gradzip.codecs.base import Compressor, Shapes, Slot
from gradzip.codecs.indices import (
    Selection,
    abs_ge,
    abs_ge_positions,
    sparse_decode,
    sparse_payload,
)
from gradzip.codecs.nonfinite import host_reads_free
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, SpecError, at_least, in_range, positive, register
from gradzip.collectives.upload import upload

#: at or below this many entries topk selects exactly on the whole tensor
EXACT_BELOW = 1 << 16
#: entries sampled to estimate the top-k threshold of a larger tensor
SAMPLE = 1 << 16


def keep_count(numel: int, ratio: float, k: int | None) -> int:
    """How many entries to keep: ``k`` if given, else ``round(ratio * numel)``, at least 1.

    Capped at ``numel`` (so an empty tensor keeps 0 and a scalar keeps itself).
    """
    want = k if k is not None else max(1, round(ratio * numel))
    return min(numel, want)


def _ratio_k_params(default_ratio: float) -> tuple[Param, Param]:
    return (
        Param("ratio", float, default_ratio, "fraction of entries kept (density), in (0, 1]",
              in_range(0.0, 1.0, lo_open=True)),
        Param("k", int, None, "keep exactly this many entries per tensor instead of a ratio "
              "(capped at the tensor's size)", at_least(1)),
    )


def _check_ratio_or_k(stage: Compressor, default_ratio: float) -> None:
    if stage.params["k"] is not None and stage.params["ratio"] != default_ratio:
        raise SpecError(f"{stage.name}: give ratio or k, not both")


# ---------------------------------------------------------------- exact top-k
def topk_among(mag: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` positions of largest ``mag`` (ascending; ties go to the lowest position).

    ``mag[i]`` is the magnitude at ``positions[i]``; ``positions`` ascend. A linear-time
    selection (``kthvalue``) finds the k-th largest magnitude m; everything above m is
    kept, then the first few entries equal to m fill up to exactly k. No sort is
    needed, so the result stays in position order.
    """
    c = mag.numel()
    if k >= c:
        return positions
    if k <= 0:
        return positions[:0]
    kth = mag.kthvalue(c - k + 1).values
    keep = mag > kth
    need = k - int(keep.count_nonzero())
    if need > 0:
        ties = torch.nonzero(mag == kth).reshape(-1)[:need]
        keep[ties] = True
    return positions[keep]


def topk_positions(flat: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Ascending positions of the exact top-``k`` magnitudes of a flat float32 tensor.

    ``torch.topk`` on 16M entries takes ~0.7 s on one core. Instead: estimate the
    threshold from a random sample of ``SAMPLE`` magnitudes (aimed a few standard
    deviations low, so it lands a little below the true k-th magnitude), keep the
    candidates above it in one comparison pass, and select exactly among those
    (~1.2k of them). If the estimate was too high (fewer than k candidates, which
    the margin makes vanishingly rare) it falls back to the whole tensor. The sample
    only affects speed: the result is always the exact top-k.
    """
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if k > 0 and kernels.runs_on(flat):  # the device's radix select, in position order
        from gradzip.codecs.kernels import select

        return select.topk_positions(flat, k)
    if not host_reads_free(flat):  # a GPU's topk is fast and needs no host reads
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    if n > EXACT_BELOW:
        pick = torch.randint(n, (SAMPLE,), generator=generator).to(flat.device)
        sample = flat[pick].abs()
        expect = SAMPLE * k / n
        rank = min(SAMPLE, math.ceil(expect + 4.0 * math.sqrt(expect) + 8))
        estimate = float(sample.kthvalue(SAMPLE - rank + 1).values)
        candidates = abs_ge_positions(flat, estimate)
        if candidates.numel() >= k:
            return topk_among(flat[candidates].abs(), candidates, k)
    return topk_among(flat.abs(), torch.arange(n, device=flat.device), k)


def chunked_topk_positions(flat: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Ascending positions of the top-``k`` magnitudes of every ``chunk`` consecutive
    entries of ``flat`` (the last chunk, if short, keeps ``min(k, its size)``).

    Ties within a chunk go to ``torch.topk``'s choice: the selection is exact in
    magnitude but, unlike whole-tensor ``topk``, not tie-broken by position.
    """
    n = flat.numel()
    full = n // chunk
    parts = []
    if full:
        rows = flat[: full * chunk].abs().view(full, chunk)
        idx = torch.topk(rows, min(k, chunk), dim=1, sorted=False).indices
        base = torch.arange(full, device=flat.device).unsqueeze(1) * chunk
        parts.append((idx + base).reshape(-1))
    if n > full * chunk:
        tail = flat[full * chunk:].abs()
        parts.append(torch.topk(tail, min(k, tail.numel()), sorted=False).indices
                     + full * chunk)
    return torch.cat(parts).sort().values


@register("topk")
class TopK(Compressor):
    """Exact top-k by magnitude: the k largest |x| and their positions.

    Wire: ``values`` float32[k] in position order + positions as int32 gaps
    (``deltas``) or a ``bitmap``, whichever is smaller, or above 31/32 density just
    all values with zeros (meta ``sel`` names the form). Biased and not summable
    (each rank keeps different positions); use ``ef | topk`` to converge.
    """

    summary = "exact top-k by magnitude: values + index gaps or bitmap (Aji & Heafield 2017)"
    values_field = "values"
    fixed_layout = True  # k follows from the size; the form from k and the size
    PARAMS = (*_ratio_k_params(0.01),
              Param("chunk", int, None, "select within every chunk of this many consecutive "
                    "entries (k or ratio per chunk; SparseLoCo: k=64, chunk=4096) instead of "
                    "over the whole tensor", at_least(1)),
              Param("tile", int, None, "select within every tile x tile block of each "
                    "tensor seen as a matrix (1-D tensors: strips of tile^2; a side that "
                    "tile does not divide takes its largest divisor below tile); k or ratio "
                    "per tile (templar's SparseLoCo: k=64, tile=64)", at_least(1)))
    #: with ``tile``, the tensors' shapes decide the tiles (decode needs none: positions)
    per_tensor = True

    def validate(self) -> None:
        _check_ratio_or_k(self, 0.01)
        if self.params["chunk"] is not None and self.params["tile"] is not None:
            raise ValueError("topk: give chunk (consecutive entries) or tile (blocks of "
                             "each matrix), not both")

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        if self.params["tile"] is None:
            return self.encode(x, slot)
        flat = x.detach().reshape(-1).float().contiguous()
        return sparse_payload(flat, Selection(flat.numel(),
                                              indices=self._tile_positions(flat, shapes)))

    def _tile_positions(self, flat: torch.Tensor, shapes: Shapes) -> torch.Tensor:
        """Ascending positions in ``flat`` of the top k of every tile of every tensor."""
        side = self.params["tile"]
        found, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            rows, cols = (1, n) if len(shape) < 2 else (int(shape[0]), n // int(shape[0]))
            if rows == 1:  # a vector: strips of side^2, as chunks
                found.append(chunked_topk_positions(
                    flat[offset:offset + n], side * side,
                    keep_count(side * side, self.params["ratio"], self.params["k"])) + offset)
            else:
                r, c = _divisor_below(rows, side), _divisor_below(cols, side)
                where = torch.arange(n, device=flat.device).view(rows // r, r, cols // c, c)
                where = where.permute(0, 2, 1, 3).reshape(-1, r * c)  # a row per tile
                mags = flat[offset:offset + n].abs()[where]
                k = min(keep_count(r * c, self.params["ratio"], self.params["k"]), r * c)
                top = torch.topk(mags, k, dim=1, sorted=False).indices
                found.append(where.gather(1, top).reshape(-1) + offset)
            offset += n
        return torch.cat(found).sort().values if found else torch.zeros(0, dtype=torch.long)

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.detach().reshape(-1).float().contiguous()
        if self.params["tile"] is not None:  # one tensor: its own shape decides the tiles
            return sparse_payload(flat, Selection(flat.numel(), indices=self._tile_positions(
                flat, [x.shape])))
        chunk = self.params["chunk"]
        if chunk is not None and flat.numel() > chunk:
            positions = chunked_topk_positions(flat, chunk, keep_count(
                chunk, self.params["ratio"], self.params["k"]))
        else:
            k = keep_count(flat.numel(), self.params["ratio"], self.params["k"])
            positions = topk_positions(flat, k, slot.generator("cpu"))
        return sparse_payload(flat, Selection(flat.numel(), indices=positions))

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        return sparse_decode(p, shape)


def _divisor_below(dim: int, side: int) -> int:
    """``side`` if it divides ``dim``, else the largest divisor of ``dim`` below it."""
    return next(t for t in range(min(side, dim), 0, -1) if dim % t == 0)


# ---------------------------------------------------------------- random-k
def _distinct_draws(n: int, k: int, g: torch.Generator) -> np.ndarray:
    """k distinct positions in [0, n), uniformly random among all k-subsets, sorted.

    Draws with replacement (``randint``) until at least k distinct positions have
    turned up, then drops a uniformly random surplus. Because the draws are i.i.d.,
    the distinct set of a given size is a uniform subset of that size, and so is a
    uniform sub-subset of it: the result is a uniform k-subset, found in
    O(k log k) instead of ``randperm(n)``'s O(n) (2 s for n = 16M).
    """
    # int32 sorts several times faster; np.unique (hash-based in NumPy 2) is 30x slower
    dtype = np.int32 if n < 2**31 else np.int64
    seen = np.empty(0, dtype=dtype)
    while seen.size < k:
        need = k - seen.size
        # draws expected to give `need` new distinct values, plus 4 sigma of slack
        frac = min(need / max(n - seen.size, 1), 1 - 1e-9)
        m = math.ceil(-(n - seen.size) * math.log1p(-frac) + 4 * math.sqrt(need) + 16)
        draws = torch.randint(n, (m,), generator=g, dtype=torch.int64).numpy().astype(dtype)
        merged = np.sort(np.concatenate([seen, draws]))
        first = np.ones(merged.size, dtype=np.bool_)
        np.not_equal(merged[1:], merged[:-1], out=first[1:])
        seen = merged[first]
    if seen.size > k:
        if seen.size <= 1 << 16:
            drop = torch.randperm(seen.size, generator=g)[: seen.size - k].numpy()
        else:  # the surplus is a few sigma: draw it the same way, not with an O(d) randperm
            drop = _distinct_draws(seen.size, seen.size - k, g)
        keep = np.ones(seen.size, dtype=np.bool_)
        keep[drop] = False
        seen = seen[keep]
    return seen.astype(np.int64)


#: recently generated random-k positions, so the decode right after an encode (the
#: all-reduce path) does not draw them again; small entries only, a few of them
_RECENT: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()
_RECENT_ENTRIES = 8
_RECENT_MAX_K = 1 << 20
_RECENT_LOCK = threading.Lock()  # simulated ranks are threads of one process


def random_positions(n: int, k: int, seed: int) -> torch.Tensor:
    """Ascending int64 positions of a uniform random k-subset of [0, n), from ``seed``.

    Always generated on the CPU (then moved by the caller): CUDA and CPU generators
    give different streams, and a payload may be decoded on another device than it
    was encoded on, so the positions must not depend on the device. The result may
    be shared with later calls for the same arguments: treat it as read-only.
    """
    key = (n, k, seed)
    with _RECENT_LOCK:
        hit = _RECENT.get(key)
    if hit is not None:
        return hit
    positions = _random_positions(n, k, seed)
    if k <= _RECENT_MAX_K:
        with _RECENT_LOCK:
            _RECENT[key] = positions
            while len(_RECENT) > _RECENT_ENTRIES:
                _RECENT.popitem(last=False)
    return positions


def _random_positions(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if k >= n:
        return torch.arange(n)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    if 2 * k <= n:
        return torch.from_numpy(_distinct_draws(n, k, g))
    # dense: pick the n - k positions to leave out instead
    keep = np.ones(n, dtype=np.bool_)
    keep[_distinct_draws(n, n - k, g)] = False
    return torch.from_numpy(np.flatnonzero(keep))


#: ``randomk``'s generators, by the payload's ``gen`` meta: the CPU generator's draws
#: (no ``gen``: every payload before the device generator) or the keyed hash's k largest
DRAWS, HASH = "draws", "hash"
#: the hash's multiplier (odd: a bijection mod 2**32; below 2**31, so products fit int64)
HASH_MULTIPLIER = 0x45D9F3B
_HASH_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


def hash_round_keys(seed: int) -> tuple[int, int, int]:
    """The hash's three 32-bit round keys: each half of the 64-bit seed, then both and a
    constant (2**32 over the golden ratio)."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    return lo, hi, lo ^ hi ^ _HASH_GOLDEN


def hash_keys(n: int, seed: int) -> torch.Tensor:
    """The 31-bit keys of positions ``0..n-1`` under ``seed`` (``kernels/hashk.py``'s,
    in torch ops on the CPU): three keyed rounds of xor-shift and multiply, in int64."""
    x = torch.arange(n, dtype=torch.int64) & _MASK32
    for key in hash_round_keys(seed):
        x = x ^ key
        for _ in range(2):
            x = (((x >> 16) ^ x) * HASH_MULTIPLIER) & _MASK32
        x = (x >> 16) ^ x
    return x >> 1


def hash_positions(n: int, k: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions, on ``like``'s device, of the ``k`` largest
    ``hash_keys`` (ties to the lowest position): where ``like`` takes the kernel path by
    the radix select (``kernels/hashk.py``), elsewhere by ``topk`` over keys made unique
    by their position (the same positions; the host's way is O(n), for decoding)."""
    if k >= n:
        return torch.arange(n, device=like.device)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=like.device)
    if kernels.runs_on(like, numel=n):
        from gradzip.codecs.kernels import hashk
        return hashk.positions(n, k, seed, like.device)
    unique = (hash_keys(n, seed) << 32) | (n - 1 - torch.arange(n, dtype=torch.int64))
    return upload(unique.topk(k, sorted=False).indices.sort().values, like.device)


@register("randomk")
class RandomK(Compressor):
    """Random-k with a shared seed: every rank keeps the same k random positions.

    Wire: ``values`` float32[k] (position order) + meta ``seed`` (the shared 63-bit
    seed of this step; the decoder regenerates the positions from it). No indices
    travel, so this sends 4 bytes per kept entry and is summable: the payloads of all
    ranks can be all-reduced. With ``scale=true`` decoded values are multiplied by
    d/k so E[decode(encode(x))] = x (unbiased, Wangni et al. 2018), at the price of
    a d/k-fold larger variance; leave it off under ``ef`` (Stich et al. 2018).

    The positions come from a CPU generator (uploaded to the data's device), or, where
    the data is on a GPU, from the k largest of a keyed hash of each position, chosen
    on the device (``kernels/hashk.py``; meta ``gen``: ``hash``): any device rebuilds
    either from the seed.
    """

    summary = "random-k with a shared seed: only values travel, summable (Stich et al. 2018)"
    summable = True
    values_field = "values"
    PARAMS = (
        *_ratio_k_params(0.01),
        Param("scale", bool, False, "multiply kept values by d/k so the estimate is unbiased"),
    )

    def validate(self) -> None:
        _check_ratio_or_k(self, 0.01)
        # per instance: only the scaled variant is unbiased (the class default,
        # what ``codecs list`` shows for plain ``randomk``, stays False)
        self.unbiased = bool(self.params["scale"])  # type: ignore[misc]

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.detach().reshape(-1).float().contiguous()
        n = flat.numel()
        k = keep_count(n, self.params["ratio"], self.params["k"])
        seed = slot.seed(shared=True)
        if kernels.runs_on(flat):  # chosen on the device (kernels/hashk.py)
            positions = hash_positions(n, k, seed, flat)
            return Payload({"values": flat[positions]}, {"seed": seed, "gen": HASH})
        positions = upload(random_positions(n, k, seed), flat.device)
        return Payload({"values": flat[positions]}, {"seed": seed})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        n = math.prod(shape)
        values = p.tensor("values").reshape(-1).float()
        k = values.numel()
        # the positions are regenerated for k values: a wrong count would silently
        # scatter every value to another place
        want = keep_count(n, self.params["ratio"], self.params["k"])
        if k != want:
            raise PayloadError(f"randomk payload has {k} values; {self.spec} keeps {want} of {n}")
        generator = p.meta.get("gen", DRAWS)
        if generator == HASH:
            positions = hash_positions(n, k, p.int("seed"), values)
        elif generator == DRAWS:
            positions = upload(random_positions(n, k, p.int("seed")), values.device)
        else:
            raise PayloadError(f"randomk payload names an unknown generator {generator!r}")
        if self.params["scale"] and k:
            values = values * (n / k)
        return Selection(n, indices=positions).scatter(values).reshape(shape)


# ---------------------------------------------------------------- threshold
@register("threshold")
class Threshold(Compressor):
    """Fixed-threshold sparsification (Strom 2015): keep every entry with |x| >= v.

    Wire: like ``topk`` (``values`` + gaps, bitmap or dense); the count varies
    with the data. ``v`` is in gradient units and must be tuned per model and scale — the
    weakness that DGC's sampled threshold removes. The default keeps ~0.7% of the
    entries of a small LM's gradient (``gradzip.bench.samples.real_gradient_flat``)
    but nearly all of a unit-scale tensor. Strom also keeps the residual (use
    ``ef | threshold``) and sends only the sign of each kept entry, i.e. ±v (one
    32-bit word of position + sign bit); here the exact values are sent, and a
    following quantizer may shrink them. Biased, not summable.
    """

    summary = "keep entries with |x| >= v, variable count (Strom 2015)"
    values_field = "values"
    PARAMS = (
        Param("v", float, 0.01, "keep entries whose magnitude is at least v (gradient units), > 0",
              positive),
    )

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.detach().reshape(-1).float().contiguous()
        return sparse_payload(flat, Selection(flat.numel(), mask=abs_ge(flat, self.params["v"])))

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        return sparse_decode(p, shape)
