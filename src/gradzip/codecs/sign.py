"""Sign codecs: ``signsgd``, ``efsignsgd`` and ``onebit`` — one bit per value.

All three send the signs bit-packed (``bitpack.pack_signs``: 8 values per byte, so
16M values are 2 MiB, 32x smaller than fp32) and decode through a 256-row lookup
table straight to float32. The bit sent is the float's own IEEE sign bit, so
zero still gets a definite side: +0.0 decodes as positive, -0.0 as negative
(``torch.copysign`` agrees, which keeps error feedback exact).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradzip.codecs.base import Compressor, Shapes, Slot
from gradzip.codecs.bitpack import (
    bits_to_values,
    count_ones,
    pack_signs,
    unpack_bits,
)
from gradzip.codecs.layout import Layout, block_stats, scale_pieces, spread, tensor_layout
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.quantize import numels
from gradzip.codecs.registry import Param, register
from gradzip.collectives.communicator import Communicator
from gradzip.collectives.upload import device_tensor

#: values per chunk for the reductions below (512 KB of fp32: stays in L2)
_CHUNK = 1 << 17


def _l1(flat: torch.Tensor) -> float:
    """sum |x|, chunked through a small buffer (a full ``abs()`` temporary costs more).

    Chunk sums are float32 (fast); if one overflows (|x| near float32's limit, where a
    finite input would otherwise decode to NaN) the sum is redone in float64.
    """
    scratch = torch.empty(min(flat.numel(), _CHUNK), device=flat.device)
    total = 0.0
    for s in range(0, flat.numel(), _CHUNK):
        c = flat[s:s + _CHUNK]
        total += float(torch.abs(c, out=scratch[:c.numel()]).sum())
    if not math.isfinite(total):
        total = float(flat.abs().sum(dtype=torch.float64))
    return total


def _side_sums(flat: torch.Tensor) -> tuple[float, float]:
    """(sum of x > 0, sum of x < 0), each accumulated on its own (no cancellation).

    Like ``_l1``: float32 chunk sums, redone in float64 if one overflowed.
    """
    scratch = torch.empty(min(flat.numel(), _CHUNK), device=flat.device)
    pos = neg = 0.0
    for s in range(0, flat.numel(), _CHUNK):
        c = flat[s:s + _CHUNK]
        buf = scratch[:c.numel()]
        pos += float(torch.clamp(c, min=0, out=buf).sum())
        neg += float(torch.clamp(c, max=0, out=buf).sum())
    if not (math.isfinite(pos) and math.isfinite(neg)):
        pos = float(flat.clamp(min=0).sum(dtype=torch.float64))
        neg = float(flat.clamp(max=0).sum(dtype=torch.float64))
    return pos, neg


def _scalar(p: Payload, name: str) -> float:
    t = p.tensor(name)
    if t.numel() != 1:
        raise PayloadError(f"payload field {name!r} must hold one value, has {t.numel()}")
    return float(t.reshape(-1)[0])


def _counts(sizes: list[int], device: torch.device) -> torch.Tensor:
    """float64 number of values per tensor (for per-tensor means)."""
    return device_tensor(sizes, device, torch.float64)


def _finite_stats(flat: torch.Tensor, layout: Layout, kind: str) -> torch.Tensor:
    """``block_stats`` with float32 partials, redone from float64 if one overflowed."""
    out = block_stats(flat, layout, kind)
    if not torch.isfinite(out).all():
        out = block_stats(flat.double(), layout, kind)
    return out


def _decode_signs(p: Payload, shape: torch.Size, pos: float, neg: float) -> torch.Tensor:
    """Sign bits to ``pos`` (bit 0) / ``neg`` (bit 1) values of ``shape``."""
    try:
        return bits_to_values(p.tensor("bits"), shape.numel(), pos, neg).reshape(shape)
    except (TypeError, ValueError) as e:
        raise PayloadError(f"sign payload: {e}") from None


# ---------------------------------------------------------------- signsgd
@register("signsgd")
class SignSGD(Compressor):
    """signSGD with majority vote (Bernstein et al., ICML 2018 / ICLR 2019).

    Each rank sends ``sign(x)``, one bit per value. Decode returns +1 / -1 (+0.0 maps to
    +1, -0.0 to -1), so the optimizer's learning rate is the step size, as in the paper;
    ``scale=l1`` also sends ``||x||_1 / d`` (one fp32) and decodes ``+-||x||_1 / d``,
    a drop-in magnitude for plain SGD learning rates.

    ``reduce`` (``vote=true``) is the paper's majority vote: every rank all-gathers
    the packed bits (the bytes on the wire: 1 bit/value/rank) and takes the
    element-wise ``sign(sum of signs)``; with an even number of ranks a tie gives 0
    (no majority, no step). With ``scale=l1`` the vote is scaled by the mean of the
    ranks' scales. ``vote=false`` instead averages the decoded signs (the
    single-round gather path), which also lets ``signsgd`` follow a sparsifier.
    Not unbiased. ``ef`` may wrap only ``signsgd(scale=l1)``: with the default +-1 the
    residual (gradient minus +-1) dwarfs the gradient and the sent sign flips every
    step, so the chain refuses ``ef | signsgd``; ``efsignsgd`` is error feedback with
    the l1 scale built in.
    """

    fixed_layout = True

    summary = "signSGD: 1 bit/value, majority-vote reduce (Bernstein et al. 2018)"
    # the class flag describes the default (vote=true), as ``codecs list`` shows it;
    # each instance sets its own from ``vote``
    multi_round = True
    fixed_magnitude = True  # scale=one; per instance below
    PARAMS = (
        Param("scale", str, "one",
              "decoded magnitude: one (+-1, as in the paper) or l1 (+-||x||_1/d, one fp32 sent)",
              choices=("one", "l1")),
        Param("vote", bool, True,
              "reduce by majority vote of the signs; false: average the decoded signs"),
    )

    def __init__(self, **params: object) -> None:
        super().__init__(**params)
        self.multi_round = bool(self.params["vote"])  # type: ignore[misc]
        # +-1 is in the optimizer's units, not the gradient's: ef must not wrap it
        self.fixed_magnitude = self.params["scale"] == "one"  # type: ignore[misc]

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.reshape(-1)
        fields: dict[str, torch.Tensor | bytes | Payload] = {"bits": pack_signs(flat)}
        if self.params["scale"] == "l1":
            mag = _l1(flat) / flat.numel() if flat.numel() else 0.0
            fields["scale"] = torch.tensor([mag], dtype=torch.float32, device=x.device)
        return Payload(fields)

    def _magnitude(self, p: Payload) -> float:
        return _scalar(p, "scale") if self.params["scale"] == "l1" else 1.0

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        s = self._magnitude(p)
        return _decode_signs(p, shape, s, -s)

    def reduce(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Majority vote over ranks: ``sign(sum_r sign(x_r))``, ties 0."""
        n, world = x.numel(), comm.world_size
        own = self.encode(x, slot)
        # every rank's payload has the same layout for the same tensor, so a plain
        # all-gather of the serialized bytes suffices (no size exchange needed)
        blobs = comm.all_gather(own.to_tensor(device=x.device))
        votes = torch.zeros(n, dtype=torch.int16 if world < 2**15 else torch.int32,
                            device=x.device)
        mags = []
        for blob in blobs:
            p = Payload.deserialize(blob).to(x.device)
            votes.add_(unpack_bits(p.tensor("bits"), n).to(x.device))  # counts negatives
            mags.append(self._magnitude(p))
        # world - 2 * (#negative) = #positive - #negative; its sign is the vote
        result = votes.mul_(-2).add_(world).sign_().to(torch.float32)
        mag = sum(mags) / world
        if mag != 1.0:
            result.mul_(mag)
        local = self.decode(own, x.shape, slot).to(x.device) if want_local else None
        return result.reshape(x.shape), local


# ---------------------------------------------------------------- efsignsgd
@register("efsignsgd")
class EFSignSGD(Compressor):
    """EF-signSGD (Karimireddy et al., ICML 2019): scaled sign with error feedback built in.

    With memory e (zero at first): ``p = x + e``, send ``delta = (||p||_1 / d) sign(p)``
    and keep ``e = p - delta``. The scaled sign is a contraction, so with the memory
    the method converges like SGD where plain signSGD may not. The paper applies the
    learning rate before compressing (p = lr * g + e); a codec sees gradients, so the
    memory is in gradient units (the same when the learning rate is constant).

    The memory lives in ``slot.data["residual"]`` (it checkpoints with the codec
    state) and is per key and position, so use ``efsignsgd`` first in a chain, not
    after a sparsifier. Wire: signs bit-packed (1 bit/value) + ``scale`` fp32:
    32x vs fp32 for large tensors. Decode returns ``copysign(scale, p)``.
    """

    fixed_layout = True

    own_feedback = True
    positional_state = True  # the residual, one value per coordinate
    per_tensor = True

    summary = "EF-signSGD: (||p||_1/d) sign(p) with built-in error feedback (1 bit/value)"

    def _compensated(self, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        """``p = x + e``, in the memory's own storage (updated in place after sending)."""
        residual = slot.data.get("residual")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(
                f"efsignsgd: key {slot.key!r} changed shape {tuple(residual.shape)} -> "
                f"{tuple(x.shape)}; use a distinct key per tensor"
            )
        # the memory is updated in place (a fresh 64 MB tensor per step costs ~40 ms
        # in page faults); like every stage's state, take a deep copy to snapshot it
        if residual is None:
            return x.float().clone(memory_format=torch.contiguous_format)
        return residual.to(x.device).add_(x)

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        p = self._compensated(x, slot)
        flat = p.reshape(-1)
        n = flat.numel()
        scale = _l1(flat) / n if n else 0.0
        bits = pack_signs(flat)
        # e = p - copysign(scale, p), chunk by chunk through a small buffer
        buf = torch.empty(min(n, _CHUNK), device=flat.device)
        for s in range(0, n, _CHUNK):
            c = flat[s:s + _CHUNK]
            b = buf[:c.numel()].fill_(scale)
            c.sub_(torch.copysign(b, c, out=b))
        slot.data["residual"] = p
        return Payload({"bits": bits, "scale": torch.tensor([scale], dtype=torch.float32,
                                                           device=x.device)})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        s = _scalar(p, "scale")
        return _decode_signs(p, shape, s, -s)

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """Scale ``||p_i||_1 / d_i`` per tensor of the bucket; the memory stays per bucket.

        ``scale`` has one fp32 per tensor (0 for an empty one).
        """
        if len(shapes) == 1:
            return self.encode(x, slot)
        p = self._compensated(x, slot)
        flat = p.reshape(-1)
        sizes = numels(shapes)
        layout = tensor_layout(sizes, device=flat.device)
        l1 = _finite_stats(flat, layout, "sumabs")
        scale = (l1 / _counts(sizes, flat.device).clamp(min=1)).float()
        bits = pack_signs(flat)
        # e = p - copysign(scale_i, p), piece by piece through a small buffer
        scratch = torch.empty(layout.largest, device=flat.device)
        for piece in layout.pieces:
            c = flat[piece.start:piece.start + piece.size].view(piece.rows, piece.width)
            b = scratch[:piece.size].view(piece.rows, piece.width)
            c.sub_(torch.copysign(spread(scale, piece), c, out=b))
        slot.data["residual"] = p
        return Payload({"bits": bits, "scale": scale})

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        if len(shapes) == 1:
            return self.decode(p, shape, slot)
        scale = p.tensor("scale").float().reshape(-1)
        if scale.numel() != len(shapes):
            raise PayloadError(
                f"efsignsgd payload has {scale.numel()} scales for {len(shapes)} tensors"
            )
        unit = _decode_signs(p, torch.Size((shape.numel(),)), 1.0, -1.0)
        layout = tensor_layout(numels(shapes), device=unit.device)
        return scale_pieces(unit, layout, scale).reshape(shape)


# ---------------------------------------------------------------- onebit
@register("onebit")
class OneBit(Compressor):
    """1-bit SGD (Seide et al., Interspeech 2014): sign bits + two reconstruction values.

    Values are split by sign bit (negative and -0.0 vs the rest); each side decodes to the mean of
    its values, which is the least-squares reconstruction for that split. The paper's
    error feedback (quantization error added to the next minibatch's gradient) is
    the separate ``ef`` stage: ``ef | onebit`` is 1-bit SGD as published.

    ``scope=column`` (default) follows the paper: a 2-D tensor gets a (negative,
    positive) pair per column (statistics over dim 0). A column pair costs 64 bits,
    so 2-D tensors with fewer than 256 rows (where the pairs would exceed a quarter
    of the sign bits) and all other shapes use one pair per tensor, as does
    ``scope=tensor``. Wire: signs bit-packed (1 bit/value) + ``recon`` fp32 of shape
    (2,) or (2, columns), holding (positive mean, negative mean): 16M values in one
    tensor are 32x smaller than fp32.

    Given a bucket's tensor shapes (``encode_tensors``), the scope applies to each
    tensor in it: ``recon`` holds a pair per non-column tensor, shape (2, tensors),
    and ``cols`` the column pairs of the column tensors, shape (2, their columns).
    """

    fixed_layout = True

    summary = "1-bit SGD: sign bits + per-column means of each side (use with ef)"
    PARAMS = (
        Param("scope", str, "column",
              "reconstruction values per column of 2-D tensors (>= 256 rows), or per tensor",
              choices=("column", "tensor")),
    )
    MIN_ROWS = 256
    per_tensor = True

    def _by_column(self, shape: torch.Size) -> bool:
        """Whether a tensor of ``shape`` gets a pair per column (else one pair)."""
        return self.params["scope"] == "column" and len(shape) == 2 and shape[0] >= self.MIN_ROWS

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        if self._by_column(x.shape):
            return self._encode_columns(x)
        flat = x.reshape(-1)
        n = flat.numel()
        bits = pack_signs(flat)
        nneg = count_ones(bits)
        pos, neg = _side_sums(flat)
        recon = torch.tensor([pos / max(n - nneg, 1), neg / max(nneg, 1)], dtype=torch.float32,
                             device=x.device)
        return Payload({"bits": bits, "recon": recon})

    @staticmethod
    def _encode_columns(x: torch.Tensor) -> Payload:
        x = x.contiguous()
        return Payload({"bits": pack_signs(x), "recon": OneBit._column_recon(x)})

    @staticmethod
    def _column_recon(x: torch.Tensor) -> torch.Tensor:
        """fp32 (2, columns): each column's (positive mean, negative mean) of 2-D ``x``."""
        rows, cols = x.shape
        mask = torch.signbit(x)
        if x.device.type == "cpu":  # numpy's column sum of uint8 is ~5x faster here
            nneg = torch.from_numpy(mask.numpy().view(np.uint8).sum(axis=0, dtype=np.int32))
        else:
            nneg = mask.view(torch.uint8).sum(0, dtype=torch.int32)
        pos = torch.zeros(cols, dtype=torch.float64, device=x.device)
        neg = torch.zeros_like(pos)
        # column sums over row bands that fit in cache, accumulated in float64
        band = max(1, _CHUNK // cols)
        scratch = torch.empty(min(band, rows), cols, device=x.device)
        for r in range(0, rows, band):
            xc = x[r:r + band]
            buf = scratch[:xc.shape[0]]
            pos += torch.clamp(xc, min=0, out=buf).sum(0)
            neg += torch.clamp(xc, max=0, out=buf).sum(0)
        if not (torch.isfinite(pos).all() and torch.isfinite(neg).all()):
            # a float32 band sum overflowed (|x| near float32's limit): redo in float64
            pos = x.clamp(min=0).sum(0, dtype=torch.float64)
            neg = x.clamp(max=0).sum(0, dtype=torch.float64)
        recon = torch.stack([pos / (rows - nneg).clamp(min=1), neg / nneg.clamp(min=1)])
        return recon.float()

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        recon = p.tensor("recon").float()
        if recon.dim() == 1 and recon.numel() == 2:
            return _decode_signs(p, shape, float(recon[0]), float(recon[1]))
        if recon.dim() != 2 or recon.shape[0] != 2 or len(shape) != 2 or recon.shape[1] != shape[1]:
            raise PayloadError(
                f"onebit payload: reconstruction values of shape {tuple(recon.shape)} "
                f"do not fit a tensor of shape {tuple(shape)}"
            )
        try:
            mask = unpack_bits(p.tensor("bits"), shape.numel()).to(recon.device).view(shape)
        except (TypeError, ValueError) as e:
            raise PayloadError(f"onebit payload: {e}") from None
        out = torch.empty(shape, dtype=torch.float32, device=recon.device)
        return self._fill_columns(out, mask, recon)

    @staticmethod
    def _fill_columns(out: torch.Tensor, mask: torch.Tensor, recon: torch.Tensor) -> torch.Tensor:
        """2-D ``out`` = each column's positive mean, or its negative mean where ``mask``.

        ``mask`` (bool, or float 0/1) may be ``out`` itself.
        """
        # positive mean + bit * (negative mean - positive mean), band by band
        pos, diff = recon[0], recon[1] - recon[0]
        if not torch.isfinite(diff).all():  # means near float32's limit: the gap overflows
            return out.copy_(torch.where(mask.bool(), recon[1], recon[0]))
        band = max(1, _CHUNK // out.shape[1])
        for r in range(0, out.shape[0], band):
            o = out[r:r + band]
            torch.mul(mask[r:r + band], diff, out=o).add_(pos)
        return out

    # ------------------------------------------------------------ per tensor
    def _split(self, shapes: Shapes) -> tuple[list[int], list[bool]]:
        """Each tensor's size, and whether it gets column pairs."""
        return numels(shapes), [self._by_column(torch.Size(s)) for s in shapes]

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """Pairs per tensor (vectorized over the bucket), column pairs per tall matrix."""
        if len(shapes) == 1:
            return self.encode(x.reshape(shapes[0]), slot)
        flat = x.reshape(-1).contiguous()
        sizes, columns = self._split(shapes)
        layout = tensor_layout(sizes, skip=columns, device=flat.device)
        pos = _finite_stats(flat, layout, "sumpos")
        neg = _finite_stats(flat, layout, "sumneg")
        nneg = block_stats(flat, layout, "countneg")
        count = _counts([n for n, c in zip(sizes, columns, strict=True) if not c], flat.device)
        recon = torch.stack([pos / (count - nneg).clamp(min=1), neg / nneg.clamp(min=1)])
        cols = [self._column_recon(t.view(shape))
                for t, shape in self._column_tensors(flat, shapes, sizes, columns)]
        return Payload({
            "bits": pack_signs(flat),
            "recon": recon.float(),
            "cols": torch.cat(cols, 1) if cols else torch.zeros(2, 0, device=flat.device),
        })

    @staticmethod
    def _column_tensors(flat: torch.Tensor, shapes: Shapes, sizes: list[int],
                        columns: list[bool]) -> list[tuple[torch.Tensor, torch.Size]]:
        """(flat slice, shape) of each column tensor, in bucket order."""
        out, offset = [], 0
        for shape, n, col in zip(shapes, sizes, columns, strict=True):
            if col:
                out.append((flat[offset:offset + n], torch.Size(shape)))
            offset += n
        return out

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        if len(shapes) == 1:
            return self.decode(p, torch.Size(shapes[0]), slot).reshape(shape)
        sizes, columns = self._split(shapes)
        recon, cols = p.tensor("recon").float(), p.tensor("cols").float()
        ncols = sum(s[1] for s, c in zip(shapes, columns, strict=True) if c)
        if recon.shape != (2, len(sizes) - sum(columns)) or cols.shape != (2, ncols):
            raise PayloadError(
                f"onebit payload: reconstruction values {tuple(recon.shape)} and "
                f"{tuple(cols.shape)} do not fit the bucket's tensors"
            )
        # the sign bits as float 0/1 through the lookup table (bool x float is slow),
        # then scaled and shifted in place: pos + bit * (neg - pos)
        out = _decode_signs(p, torch.Size((shape.numel(),)), 0.0, 1.0).to(recon.device)
        self._fill_pairs(out, recon, tensor_layout(sizes, skip=columns, device=out.device))
        c0 = 0
        for o, s in self._column_tensors(out, shapes, sizes, columns):
            self._fill_columns(o.view(s), o.view(s), cols[:, c0:c0 + s[1]])
            c0 += s[1]
        return out.reshape(shape)

    @staticmethod
    def _fill_pairs(out: torch.Tensor, recon: torch.Tensor, layout: Layout) -> None:
        """Flat ``out`` holds bits as 0/1: make it its tensor's positive mean, or its
        negative mean where the bit is 1."""
        pos, neg = recon[0].contiguous(), recon[1].contiguous()
        diff = neg - pos
        finite = bool(torch.isfinite(diff).all())
        for piece in layout.pieces:
            o = out[piece.start:piece.start + piece.size].view(piece.rows, piece.width)
            if finite:
                o.mul_(spread(diff, piece)).add_(spread(pos, piece))
            else:  # means near float32's limit: the gap overflows
                o.copy_(torch.where(o > 0.5, spread(neg, piece), spread(pos, piece)))
