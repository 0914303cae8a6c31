"""``fp8``: 8-bit floats with a float32 scale per block (e4m3 or e5m2).

The 8-bit baseline beside ``int8``: each block of ``block`` values (restarting at every
tensor of a bucket) is scaled so that its largest magnitude lands on the format's
largest finite value (448 for e4m3, 57344 for e5m2), then rounded to the format, to
nearest even, subnormals included. Where ``int8`` spends its 255 levels evenly, fp8
spends them on a logarithmic grid: relative error about 2**-4 (e4m3) or 2**-3 (e5m2)
at every magnitude, down to 2**-9 (2**-16) of the block's largest value, where
``int8`` rounds everything below 1/254 of it to zero. Block scaling follows the fp8
training recipes (per-block scales of 128 values).

Wire: one byte per value (the fp8 bits, as uint8) and one fp32 scale per block:
1.03 bytes/value at ``block=128`` (3.88x against fp32). Not summable: every rank
scales its blocks by its own maximum, so payloads are gathered, not added (an fp8
sum would also round at every hop of a ring, and gloo has no fp8 sum).

On a CUDA device with Triton the encode and decode are one fused kernel each
(``kernels.quant``), equal bit for bit to the torch path here.
"""

from __future__ import annotations

import torch

from gradzip.codecs import kernels
from gradzip.codecs.base import Compressor, Shapes, Slot
from gradzip.codecs.kernels.blocks import block_table
from gradzip.codecs.layout import block_stats, spread, tensor_layout
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.quantize import numels, safe_inverse
from gradzip.codecs.registry import Param, at_least, register

#: format -> (torch dtype, largest finite value)
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


@register("fp8")
class Fp8(Compressor):
    """FP8 (e4m3 or e5m2) with one fp32 abs-max scale per block (see the module doc)."""

    summary = "8-bit float (e4m3 or e5m2) with an fp32 scale per block"
    fixed_layout = True
    per_tensor = True
    PARAMS = (
        Param("format", str, "e4m3", "e4m3 (3 mantissa bits, up to 448) or e5m2 (2 bits, "
              "wider range)", choices=("e4m3", "e5m2")),
        Param("block", int, 128, "values per fp32 abs-max scale (the last may be short)",
              at_least(1)),
    )

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.reshape(-1).contiguous()  # a strided view too takes the kernel path
        return self._encode(flat, [flat.numel()])

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """Blocks restarting at every tensor of the bucket."""
        return self._encode(x.reshape(-1), numels(shapes))

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        return self._decode(p, shape, [shape.numel()])

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        return self._decode(p, shape, numels(shapes))

    def _encode(self, flat: torch.Tensor, sizes: list[int]) -> Payload:
        fmt, block = self.params["format"], self.params["block"]
        dtype, largest = FORMATS[fmt]
        if kernels.runs_on(flat, block):
            from gradzip.codecs.kernels import quant

            codes, scale = quant.fp8_encode(flat, block_table(sizes, block, flat.device), fmt)
            return Payload({"values": codes, "scale": scale})
        layout = tensor_layout(sizes, block, device=flat.device)
        amax = block_stats(flat, layout, "absmax").float()
        inv = safe_inverse(largest, amax)
        codes = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
        scratch = torch.empty(layout.largest, dtype=torch.float32, device=flat.device)
        for p in layout.pieces:
            y = scratch[:p.size].view(p.rows, p.width)
            torch.mul(flat[p.start:p.start + p.size].view(p.rows, p.width), spread(inv, p),
                      out=y)
            y.clamp_(-largest, largest)
            codes[p.start:p.start + p.size].view(p.rows, p.width).copy_(
                y.to(dtype).view(torch.uint8))
        return Payload({"values": codes, "scale": amax / largest})

    def _decode(self, p: Payload, shape: torch.Size, sizes: list[int]) -> torch.Tensor:
        fmt, block = self.params["format"], self.params["block"]
        codes, scale = p.tensor("values").reshape(-1), p.tensor("scale").reshape(-1).float()
        if codes.dtype != torch.uint8 or codes.numel() != shape.numel():
            raise PayloadError(f"fp8 payload: {codes.numel()} values of {codes.dtype}, shape "
                               f"{tuple(shape)} needs {shape.numel()} of torch.uint8")
        layout = tensor_layout(sizes, block, device=codes.device)
        if scale.numel() != layout.nblocks:
            raise PayloadError(f"fp8 payload has {scale.numel()} scales for "
                               f"{layout.nblocks} blocks")
        if kernels.runs_on(codes, block):
            from gradzip.codecs.kernels import quant

            table = block_table(sizes, block, codes.device)
            return quant.fp8_decode(codes, table, scale, fmt).reshape(shape)
        values = codes.view(FORMATS[fmt][0]).float()
        for piece in layout.pieces:
            part = values[piece.start:piece.start + piece.size].view(piece.rows, piece.width)
            part.mul_(spread(scale, piece))
        return values.reshape(shape)
