"""``demo``: DeMo, Decoupled Momentum Optimization (Peng, Quesnelle & Kingma, 2024).

Each rank keeps a local momentum ``m <- decay * m + g``, views every tensor of the bucket
as a matrix (1-D tensors as one row), cuts it into tiles and takes each tile's
orthonormal DCT-II; only the ``topk`` largest coefficients of every tile are sent (their
fp32 values and their positions in the tile, one byte each for tiles of up to 256
coefficients, else two). What was sent, brought back by the inverse DCT, is subtracted
from the momentum (error feedback: what was not sent stays for later). The ranks' sent
components are gathered, each DCT coefficient is averaged over the ranks that sent it
(as the reference's ``scatter_reduce(..., "mean", include_self=False)``), and the update
is the **sign** of the inverse DCT of those means: use it with SGD without momentum, the
learning rate being the step size.

Tiles are ``chunk x chunk`` where a dimension allows it; a dimension that ``chunk``
does not divide uses its largest divisor below ``chunk`` (as the reference does), so no
padding is ever sent. Positions are one byte in tiles of up to 256 coefficients, else
two (int16), so ``chunk`` is at most 181 (a 181 x 181 tile has 32,761).

Deviations from the reference optimizer (``bloc97/DeMo``, ``demo.py``), both because a
codec sees gradients, not the optimizer: the reference's momentum accumulates
``lr * g``, this one ``g`` (the same updates under a constant learning rate, since the
top-k choice and the sign are scale-free; under a schedule the reference weighs past
gradients by their step's learning rate), and the reference decays weights decoupled
(``p *= 1 - lr * wd``) inside its step, which here is the optimizer's business
(``torch.optim.SGD(weight_decay=...)`` is coupled: use a decoupled optimizer step, or
none). Wire per tile: ``topk`` x (4 + 1 or 2) bytes; 64 x 64 tiles with topk 32
send 160 B for 16 KiB of fp32, ~100x less.

State: the momentum, per bucket key (it checkpoints with the codec state). FSDP's flat
shards have no matrix layout for the tiles, so the sharded paths refuse ``demo``.
"""

from __future__ import annotations

import functools
import math

import torch

from gradzip.codecs.base import Compressor, Shapes, Slot
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.quantize import numels
from gradzip.codecs.registry import Param, at_least, in_range, register
from gradzip.collectives.communicator import Communicator


@functools.lru_cache(maxsize=64)
def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n x n): coefficients of a vector v are D @ v."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi / n * (i + 0.5) * k) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32)


def tile_size(dim: int, chunk: int) -> int:
    """``chunk`` if it divides ``dim``, else the largest divisor of ``dim`` below it."""
    for t in range(min(chunk, dim), 0, -1):
        if dim % t == 0:
            return t
    return 1


def matrix_view(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of a tensor seen as a matrix: 1-D tensors are one row."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def _tiles(mat: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """(R, C) -> (R/r * C/c, r, c): the tiles, row-major."""
    rows, cols = mat.shape
    return mat.reshape(rows // r, r, cols // c, c).permute(0, 2, 1, 3).reshape(-1, r, c)


def _untile(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    n, r, c = tiles.shape
    return tiles.reshape(rows // r, cols // c, r, c).permute(0, 2, 1, 3).reshape(rows, cols)


#: a tensor's layout entry: (offset, rows, cols, tile rows, tile cols, k)
_Entry = tuple[int, int, int, int, int, int]
#: one tensor's sent components: its entry, (tiles x k) positions and values
_Sent = tuple[_Entry, torch.Tensor, torch.Tensor]


@register("demo")
class DeMo(Compressor):
    """DeMo: top-k DCT components of a local momentum, sign of their mean (Peng et al.)."""

    PARAMS = (
        Param("chunk", int, 64, "tile side: DCT-II over chunk x chunk tiles (1-D tensors: "
              "chunk values); at most 181, since positions in a tile are 16-bit",
              in_range(1, 181)),
        Param("topk", int, 32, "DCT coefficients sent per tile", at_least(1)),
        Param("decay", float, 0.999, "momentum decay: m <- decay * m + g",
              in_range(0.0, 1.0)),
    )
    summary = ("DeMo: top-k DCT coefficients of a local momentum per tile, error feedback, "
               "sign of the mean (Peng et al. 2024)")
    multi_round = True  # all-gathers the sparse components, then takes the sign
    own_feedback = True  # the momentum keeps what was not sent
    positional_state = True  # the momentum, one value per coordinate
    fixed_magnitude = True  # the update is +-1
    per_tensor = True  # tiles follow each tensor's matrix view
    needs_matrices = True  # FSDP's flat shards have no matrix layout

    # ------------------------------------------------------------------ layout
    def _layout(self, shapes: Shapes) -> list[_Entry]:
        """Per tensor: (offset, rows, cols, tile rows, tile cols, k)."""
        chunk, out, offset = self.params["chunk"], [], 0
        for shape, n in zip(shapes, numels(shapes), strict=True):
            rows, cols = matrix_view(shape)
            r = 1 if rows == 1 else tile_size(rows, chunk)
            c = tile_size(cols, chunk)
            out.append((offset, rows, cols, r, c, min(self.params["topk"], r * c)))
            offset += n
        return out

    # ------------------------------------------------------------------ encode
    def _momentum(self, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        m = slot.data.get("momentum")
        if m is not None and m.shape != x.shape:
            raise ValueError(f"demo: key {slot.key!r} changed shape {tuple(m.shape)} -> "
                             f"{tuple(x.shape)}; use a distinct key per tensor")
        if m is None:
            m = torch.zeros_like(x, dtype=torch.float32)
            slot.data["momentum"] = m
        return m.mul_(self.params["decay"]).add_(x.reshape(m.shape))

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        return self.encode_tensors(x, slot, [x.shape])

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """Top-k DCT coefficients of every tile of the momentum; the momentum loses them."""
        m = self._momentum(x.reshape(-1), slot)
        values, positions = [], []
        for offset, rows, cols, r, c, k in self._layout(shapes):
            part = m[offset:offset + rows * cols]
            tiles = _tiles(part.view(rows, cols), r, c)
            dr, dc = dct_matrix(r).to(m.device), dct_matrix(c).to(m.device)
            coeffs = (dr @ tiles @ dc.T).reshape(tiles.shape[0], r * c)
            idx = coeffs.abs().topk(k, dim=1, sorted=False).indices
            vals = coeffs.gather(1, idx)
            sent = torch.zeros_like(coeffs).scatter_(1, idx, vals).reshape(-1, r, c)
            part.sub_(_untile(dr.T @ sent @ dc, rows, cols).reshape(-1))  # error feedback
            values.append(vals.reshape(-1))
            positions.append(idx.reshape(-1).to(torch.uint8 if r * c <= 256 else torch.int16))
        empty = m.new_zeros(0)
        return Payload({"values": torch.cat(values) if values else empty,
                        "pos8": _cat(positions, torch.uint8, m.device),
                        "pos16": _cat(positions, torch.int16, m.device)})

    # ------------------------------------------------------------------ decode
    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        return self.decode_tensors(p, shape, slot, [shape])

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        """The sent components, back in the parameter domain (inverse DCT per tile)."""
        out = torch.zeros(math.prod(shape), dtype=torch.float32, device=_device(p))
        for entry, idx, vals in self._components(p, shapes):
            coeffs = torch.zeros(idx.shape[0], entry[3] * entry[4], device=out.device)
            self._inverse(entry, coeffs.scatter_(1, idx, vals), out)
        return out.reshape(shape)

    def _components(self, p: Payload, shapes: Shapes) -> list[_Sent]:
        """Per tensor: its layout entry, and the (tiles x k) positions and values sent,
        checked against the layout the receiver knows (lengths, positions in range)."""
        values = p.tensor("values").float()
        pos = {8: p.tensor("pos8"), 16: p.tensor("pos16")}
        used, v0 = {8: 0, 16: 0}, 0
        out: list[_Sent] = []
        for entry in self._layout(shapes):
            _, rows, cols, r, c, k = entry
            n_tiles = (rows // r) * (cols // c)
            width = 8 if r * c <= 256 else 16
            count = n_tiles * k
            if v0 + count > values.numel() or used[width] + count > pos[width].numel():
                raise PayloadError("demo payload is shorter than its tensors' tiles need")
            idx = pos[width][used[width]:used[width] + count].long().reshape(n_tiles, k)
            if idx.numel() and not bool(((idx >= 0) & (idx < r * c)).all()):
                raise PayloadError("demo payload holds a position outside its tile")
            out.append((entry, idx, values[v0:v0 + count].reshape(n_tiles, k)))
            used[width] += count
            v0 += count
        if v0 != values.numel():
            raise PayloadError("demo payload holds more values than its tensors' tiles")
        return out

    @staticmethod
    def _inverse(entry: _Entry, coeffs: torch.Tensor, out: torch.Tensor) -> None:
        """Write the inverse DCT of one tensor's (tiles x r*c) coefficients into flat ``out``."""
        offset, rows, cols, r, c, _ = entry
        dr, dc = dct_matrix(r).to(coeffs.device), dct_matrix(c).to(coeffs.device)
        tiles = dr.T @ coeffs.reshape(-1, r, c) @ dc
        out[offset:offset + rows * cols] = _untile(tiles, rows, cols).reshape(-1)

    # ------------------------------------------------------------------ reduce
    def reduce(self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.reduce_tensors(x, slot, comm, want_local, [x.shape])

    def reduce_tensors(self, x: torch.Tensor, slot: Slot, comm: Communicator,
                       want_local: bool, shapes: Shapes
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sign of the mean over ranks of the sent components, taken as the reference
        takes it: each DCT coefficient is averaged over the ranks that sent it (a
        coefficient two of four ranks sent is their mean, not half of it), then the
        inverse DCT, then the sign. Every rank's payload has the same layout (k per
        tile), so one all-gather of the serialized bytes suffices."""
        own = self.encode_tensors(x, slot, shapes)
        blobs = comm.all_gather(own.to_tensor(device=x.device))
        # received payloads are rebuilt on the host: their components go where x is
        received = [self._components(Payload.deserialize(b).to(x.device), shapes)
                    for b in blobs]
        update = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        for t, entry in enumerate(self._layout(shapes)):
            n_tiles = (entry[1] // entry[3]) * (entry[2] // entry[4])
            sums = torch.zeros(n_tiles, entry[3] * entry[4], device=x.device)
            counts = torch.zeros_like(sums)
            for parts in received:  # in rank order on every rank: the same sums everywhere
                _, idx, vals = parts[t]
                sums.scatter_add_(1, idx, vals)
                counts.scatter_add_(1, idx, torch.ones_like(vals))
            self._inverse(entry, sums.div_(counts.clamp_(min=1)), update)
        local = self.decode_tensors(own, x.shape, slot, shapes) if want_local else None
        return update.sign_().reshape(x.shape), local


def _device(p: Payload) -> torch.device:
    return next((t.device for _, t in p.leaves()), torch.device("cpu"))


def _cat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mine = [p for p in parts if p.dtype == dtype]
    return torch.cat(mine) if mine else torch.zeros(0, dtype=dtype, device=device)
