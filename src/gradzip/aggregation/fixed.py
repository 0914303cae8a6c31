"""Fixed-layout payloads exchanged as equal-length device buffers, with no host read.

A codec whose payload layout follows from the input's shape alone
(``Codec.fixed_layout``: ``int8``, ``qsgd``, ``topk``, the casts, the sign codecs,
``centroid``, with or without ``ef``) gives every rank a payload of one layout for the
same tensor. Its tensors then travel back to back in one uint8 buffer whose length
every rank works out itself (``Frame``): no size exchange (a host read of every rank's
size), no serialized frame (headers written on the host), no parse on the host; each
received buffer is cut into views on the device and decoded on this rank's own
payload's skeleton. The sum is the byte path's (``strategies.Gather`` and
``ReduceScatter``'s exchange): the same decodes added in the same rank order.

The non-finite news rides in the buffer: its last byte says whether the sender's
input held NaN/Inf (the sender encoded zeros instead, so no NaN reaches any codec
state). The flags, and the decoders' checks on the bytes they received
(``codecs.validation``), go to ``Communicator.watch``: read at once, or, on a hook
that defers them, read once when backward ends, before any optimizer step.

The exchange itself reads nothing on the host. Codecs that read it in their own encode
or decode still do: the sign codecs (an l1 scale, a header) and ``terngrad``. ``none``,
the casts, ``int8``, ``qsgd``, ``fp8``, ``topk`` and ``centroid`` (with or without
``ef``) read nothing on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradzip.codecs.base import Shapes
from gradzip.codecs.chain import Codec, Reduced
from gradzip.codecs.nonfinite import agreed_nonfinite_error
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.validation import deferred_checks
from gradzip.collectives.communicator import Communicator

#: every tensor starts at a multiple of this many bytes (the largest element size), so
#: a received buffer's slices view as their dtype without a copy
ALIGN = 8


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Frame:
    """Where each tensor of a payload sits in its buffer: (offset, dtype, shape) per
    leaf in ``Payload.leaves`` order, then the flag byte; ``nbytes`` in all."""

    spans: tuple[tuple[int, torch.dtype, torch.Size], ...]
    flag_at: int
    nbytes: int

    @classmethod
    def of(cls, p: Payload) -> Frame:
        spans, offset = [], 0
        for _, t in p.leaves():
            spans.append((offset, t.dtype, t.shape))
            offset += _padded(t.numel() * t.element_size())
        return cls(tuple(spans), offset, offset + ALIGN)

    def pack(self, p: Payload, bad: torch.Tensor) -> torch.Tensor:
        """``p``'s tensors and the flag ``bad`` (0-d bool) in one uint8 buffer."""
        leaves = [t for _, t in p.leaves()]
        device = bad.device
        parts = []
        for t in leaves:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            parts.append(raw)
            pad = _padded(raw.numel()) - raw.numel()
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        parts.append(bad.reshape(1).to(torch.uint8))
        parts.append(torch.zeros(ALIGN - 1, dtype=torch.uint8, device=device))
        return torch.cat(parts)

    def unpack(self, blob: torch.Tensor, skeleton: Payload) -> tuple[Payload, torch.Tensor]:
        """The payload a received buffer holds (``skeleton``'s structure and metadata,
        its tensors viewed in place) and its sender's flag (0-d bool)."""
        if blob.numel() != self.nbytes:
            raise PayloadError(f"a fixed-layout buffer has {blob.numel()} bytes, "
                               f"expected {self.nbytes}")
        if blob.storage_offset() % ALIGN:
            blob = blob.clone()
        leaves = [blob[offset:offset + shape.numel() * dtype.itemsize].view(dtype).reshape(shape)
                  for offset, dtype, shape in self.spans]
        return skeleton.with_leaves(leaves), blob[self.flag_at] != 0


def gather_mean(codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
                want_local: bool, shapes: Shapes | None, bad: torch.Tensor) -> Reduced:
    """``strategies.Gather`` for a fixed layout: (mean over ranks, this rank's decode).
    ``bad``: whether this rank's input was non-finite (``x`` then holds zeros)."""
    p = codec.encode_body(x, key, shapes)
    frame = Frame.of(p)
    blobs = comm.all_gather(frame.pack(p, bad))
    total = _decode_sum(codec, frame, p, blobs, x.numel(), shapes, comm, key)
    local = codec.decode_own(p, None, x.shape, shapes) if want_local else None
    return total.div_(comm.world_size).reshape(x.shape), local


def scatter_sum(codec: Codec, chunks: torch.Tensor, key: str, comm: Communicator,
                shapes: Shapes | None, bad: torch.Tensor) -> torch.Tensor:
    """``ReduceScatter``'s exchange for a fixed layout: chunk j encoded for rank j (key
    ``{key}/to{j}``), one ``all_to_all`` of equal buffers, this rank's fp32 sum."""
    world, n = comm.world_size, chunks.shape[1]
    payloads = [codec.encode_with_feedback(chunks[j], f"{key}/to{j}", shapes)
                for j in range(world)]
    frame = Frame.of(payloads[0])
    if any(Frame.of(p) != frame for p in payloads[1:]):
        raise AssertionError(f"{codec}: chunks of one size gave payloads of different "
                             "layouts; its stages must not declare fixed_layout")
    received = comm.all_to_all([frame.pack(p, bad) for p in payloads])
    return _decode_sum(codec, frame, payloads[comm.rank], received, n, shapes, comm, key)


def _decode_sum(codec: Codec, frame: Frame, skeleton: Payload, blobs: list[torch.Tensor],
                n: int, shapes: Shapes | None, comm: Communicator, key: str) -> torch.Tensor:
    """The fp32 sum, in rank order, of what ``blobs`` decode to; their flags and the
    decoders' checks handed to ``comm.watch``."""
    total = torch.zeros(n, dtype=torch.float32, device=blobs[0].device)
    flags = []
    with deferred_checks() as checks:
        for blob in blobs:
            p, flag = frame.unpack(blob, skeleton)
            flags.append(flag)
            total += codec.decode_body(p, None, torch.Size((n,)), shapes).reshape(-1)
    nonfinite = torch.stack(flags).any()
    corrupt = checks.failed(total.device)

    def error() -> Exception:  # read only when the flag is set
        if bool(nonfinite):
            return agreed_nonfinite_error(key)
        return PayloadError(f"a payload received for {key!r} failed its checks "
                            f"({checks.describe()})")
    comm.watch(nonfinite | corrupt, error)  # one read (or none, deferred)
    return total
