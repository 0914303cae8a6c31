"""Aggregation: how one codec's payloads from every rank become the mean (or a shard).

Four explicit ways, each a short function over the ``Communicator``:

* ``all_reduce_mean`` — summable payloads (casts, shared-seed random-k): every rank
  encodes ``x / W`` and the payload tensors are all-reduced; link bytes per rank
  2(W-1)/W x payload, independent of W.
* ``gather_mean`` — any payload: every rank all-gathers every rank's payload and
  decodes all of them; link bytes (W-1) x payload, growing with W.
* ``two_phase_mean`` — any payload, traffic that does not grow with W (the
  compressed all-reduce of DeepSpeed's 1-bit Adam, CGX and ZeRO++): split ``x`` into W
  chunks, send chunk j compressed to its owner j (``all_to_all``), each owner decodes
  and sums its chunk in fp32, re-encodes the mean, and the owners' payloads are
  all-gathered. Link bytes per rank about 2(W-1)/W x payload. With error feedback
  (``ef | ...``) both phases keep a residual: the sender's on its whole tensor, the
  owner's on its chunk (key ``{key}/owner``). The owner's fp32 sum also fixes
  low-precision sums (``fp16``/``bf16`` payloads added in 16 bits lose more as W grows).
* ``reduce_scatter_sum`` — FSDP's reduce-scatter: summable payloads are reduce-
  scattered leaf by leaf, the rest are phase 1 of two-phase (``all_to_all``, decode, sum).

``choose`` picks gather or two-phase for a non-summable codec from the link byte
model: it encodes the first real tensor of each size whole and as one of W chunks
with a stateless copy of the codec and compares (W-1) x P(n) with 2 (W-1) x P(n/W)
(plus the size exchanges). At W <= 2 two-phase cannot send less, and it adds a
second lossy step, so gather is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gradzip.codecs.base import Shapes
from gradzip.codecs.communicator import Communicator
from gradzip.codecs.linkmodel import link_bytes
from gradzip.codecs.nonfinite import agreed_nonfinite_error
from gradzip.codecs.payload import Payload

if TYPE_CHECKING:
    from gradzip.codecs.chain import Codec

#: ``aggregate=`` settings of a codec; ``auto`` chooses per codec, size and world size
AGGREGATIONS = ("auto", "gather", "two_phase")

Result = tuple[torch.Tensor, torch.Tensor | None]


# ---------------------------------------------------------------- layout helpers
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


def _decode_sum(codec: Codec, blobs: list[torch.Tensor], n: int,
                shapes: Shapes | None, device: torch.device) -> torch.Tensor:
    """fp32 sum of the decoded payloads, in rank order (the same sum on every rank)."""
    total = torch.zeros(n, dtype=torch.float32, device=device)
    for blob in blobs:  # rebuilt on the host, decoded where the sum lives
        p = Payload.deserialize(blob).to(device)
        total += codec._decode_body(p, None, torch.Size((n,)), shapes).to(device).reshape(-1)
    return total


def _to_bytes(p: Payload, x: torch.Tensor) -> torch.Tensor:
    """The payload as bytes on ``x``'s device (its shape is known to every receiver)."""
    return p.to_tensor(device=x.device)


# ---------------------------------------------------------------- non-finite input
# Under ``nonfinite='error'`` a rank whose input was NaN/Inf must not simply raise: its
# peers would wait in the collective it skipped (a hang on NCCL). Each way below folds
# the news into a collective it runs anyway, and every rank raises the same error:
# a summed payload carries a NaN in its first value; a size exchange carries "none".
def _checks(codec: Codec, comm: Communicator) -> bool:
    """Whether this reduction must agree on finiteness (``'propagate'`` agreed already)."""
    return codec.nonfinite == "error" and comm.world_size > 1


def poison(leaves: list[torch.Tensor], finite: bool) -> None:
    """Put NaN in the first value of every floating leaf of a non-finite rank's payload
    (in place, on the device), so the all-reduced sums carry the news to every rank."""
    if not finite:
        for t in leaves:
            if t.numel() and t.dtype.is_floating_point:
                t.view(-1)[:1] = float("nan")


def raise_if_poisoned(leaves: list[torch.Tensor], key: str) -> None:
    """After the all-reduce: every rank sees the same sums, so every rank raises here
    together if any rank poisoned them (one host read of one value)."""
    heads = [t.reshape(-1)[:1].float() for t in leaves if t.numel() and t.dtype.is_floating_point]
    if heads and not bool(torch.isfinite(torch.cat(heads)).all()):
        raise agreed_nonfinite_error(key)


# ---------------------------------------------------------------- the four ways
def all_reduce_mean(codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
                    want_local: bool, shapes: Shapes | None, finite: bool = True) -> Result:
    """Summable payloads: encode x / W, all-reduce the payload tensors, decode the sum."""
    world = comm.world_size
    p = codec._encode_body(x / world if world > 1 else x, key, shapes)
    leaves = [t for _, t in p.leaves()]
    if _checks(codec, comm):
        sent = [t.clone() for t in leaves] if want_local and not finite else leaves
        poison(sent, finite)
        summed = comm.all_reduce(sent, op="sum")
        raise_if_poisoned(summed, key)
    else:
        summed = comm.all_reduce(leaves, op="sum")
    mean = codec._decode_body(p.with_leaves(summed), None, x.shape, shapes)
    local = codec._decode_body(p, None, x.shape, shapes) * world if want_local else None
    return mean, local


def gather_mean(codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
                want_local: bool, shapes: Shapes | None, finite: bool = True) -> Result:
    """Any payload: all-gather every rank's payload, decode each, average in fp32."""
    if not finite and _checks(codec, comm):  # say so in the size exchange, then raise
        comm.all_gather_bytes(None, device=x.device)
        raise agreed_nonfinite_error(key)
    p = codec._encode_body(x, key, shapes)
    blobs = comm.all_gather_bytes(_to_bytes(p, x))
    if blobs is None:
        raise agreed_nonfinite_error(key)
    local = None
    if want_local:
        local = codec._decode_body(p, None, x.shape, shapes).to(x.device)
    total = _decode_sum(codec, blobs, x.numel(), shapes, x.device)
    return total.div_(comm.world_size).reshape(x.shape), local


def two_phase_mean(codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
                   want_local: bool, shapes: Shapes | None, finite: bool = True) -> Result:
    """Compressed reduce-scatter to chunk owners, fp32 sum, compressed all-gather."""
    world, rank, flat = comm.world_size, comm.rank, x.reshape(-1)
    if not finite and _checks(codec, comm):  # say so in phase 1's size exchange
        comm.all_to_all_bytes(None, device=x.device)
        raise agreed_nonfinite_error(key)
    bounds = chunk_bounds(flat.numel(), world)
    pieces = [piece_shapes(shapes, bounds[j], bounds[j + 1]) for j in range(world)]
    sent = [codec._encode_body(flat[bounds[j]:bounds[j + 1]], f"{key}/to{j}", pieces[j])
            for j in range(world)]
    received = comm.all_to_all_bytes([_to_bytes(p, flat[bounds[j]:bounds[j + 1]])
                                      for j, p in enumerate(sent)])
    if received is None:
        raise agreed_nonfinite_error(key)
    n_mine = bounds[rank + 1] - bounds[rank]
    mine = _decode_sum(codec, received, n_mine, pieces[rank], x.device).div_(world)
    owner = codec._encode_with_feedback(mine, f"{key}/owner", pieces[rank])
    gathered = comm.all_gather_bytes(_to_bytes(owner, mine))
    assert gathered is not None  # every rank sends its owner payload
    parts = [codec._decode_body(Payload.deserialize(b).to(x.device), None,
                                torch.Size((bounds[j + 1] - bounds[j],)), pieces[j])
             for j, b in enumerate(gathered)]
    mean = torch.cat([t.to(x.device).reshape(-1).float() for t in parts]).reshape(x.shape)
    local = None
    if want_local:
        own = [codec._decode_body(p, None, torch.Size((bounds[j + 1] - bounds[j],)), pieces[j])
               for j, p in enumerate(sent)]
        local = torch.cat([t.to(x.device).reshape(-1).float() for t in own]).reshape(x.shape)
    return mean, local


def reduce_scatter_sum(codec: Codec, chunks: torch.Tensor, key: str, comm: Communicator,
                       shapes: Shapes | None = None, finite: bool = True) -> torch.Tensor:
    """Row ``rank`` of sum over ranks of ``chunks`` (``[W, n]``): FSDP's reduce-scatter.

    Chunk j is encoded for rank j with its own codec state (key ``{key}/to{j}``, error
    feedback included); ``shapes`` are the tensors inside each chunk (the same in all).
    """
    world, checks = comm.world_size, _checks(codec, comm)
    n = chunks.shape[1]
    if not finite and checks and not codec.summable:
        comm.all_to_all_bytes(None, device=chunks.device)
        raise agreed_nonfinite_error(key)
    payloads = [codec._encode_with_feedback(chunks[j], f"{key}/to{j}", shapes)
                for j in range(world)]
    if codec.summable:
        per_chunk = [[t for _, t in p.leaves()] for p in payloads]
        stacked = [torch.stack([leaves[i] for leaves in per_chunk])
                   for i in range(len(per_chunk[0]))]
        if checks:  # every chunk's first value: each owner learns it from its own row
            poison([row for t in stacked for row in t], finite)
        summed = [comm.reduce_scatter_sum(t) for t in stacked]
        if checks:
            raise_if_poisoned(summed, key)
        mine = payloads[comm.rank].with_leaves(summed)
        return codec._decode_body(mine, None, torch.Size((n,)), shapes).reshape(-1)
    blobs = comm.all_to_all_bytes([_to_bytes(p, chunks[j]) for j, p in enumerate(payloads)])
    if blobs is None:
        raise agreed_nonfinite_error(key)
    return _decode_sum(codec, blobs, n, shapes, chunks.device)


# ---------------------------------------------------------------- choosing
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
    full = probe._encode_body(flat, "probe", shapes).wire_bytes
    chunk = probe._encode_body(flat[:bounds[1]], "probe/c",
                               piece_shapes(shapes, 0, bounds[1])).wire_bytes
    if comm is not None and comm.world_size > 1:
        sizes = torch.tensor([full, chunk], dtype=torch.int64, device=x.device)
        full, chunk = (int(v) for v in comm.all_reduce([sizes], op="max")[0].tolist())
    gather = modeled_bytes("gather", full, chunk, world, backend)
    two = modeled_bytes("two_phase", full, chunk, world, backend)
    return "two_phase" if two < gather else "gather"
