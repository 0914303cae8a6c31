"""Identity and float casts: ``none``, ``fp16``, ``bf16``.

All three are summable (the cast values are all-reduced directly, as PyTorch's
``fp16_compress_hook``/``bf16_compress_hook`` do) and deterministic.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import register


@register("none")
class Identity(Compressor):
    """No compression: the tensor in its own dtype (the all-reduce baseline)."""

    summary = "no compression; the tensor is sent as is"
    summable = True
    unbiased = True
    keeps_dtype = True
    values_field = "values"

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        return Payload({"values": x.reshape(-1)})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        return _values(p, shape, self.name)


def _values(p: Payload, shape: torch.Size, stage: str) -> torch.Tensor:
    """The ``values`` field, checked to hold exactly one value per element of ``shape``."""
    values = p.tensor("values")
    if values.numel() != shape.numel():
        raise PayloadError(
            f"{stage}: payload has {values.numel()} values for shape {tuple(shape)}"
        )
    return values.reshape(shape)


class _Cast(Compressor):
    dtype: ClassVar[torch.dtype]
    summable = True
    values_field = "values"

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        # saturate instead of overflowing to inf: a clipped gradient beats a NaN step.
        # Cast first, then fix the (rare) infinities in the small tensor: one pass over
        # the input instead of a clamped fp32 copy (NaN stays NaN; an infinite input or
        # a value that rounds past the largest finite value gets it, as clamping would).
        limit = torch.finfo(self.dtype).max
        values = x.reshape(-1).to(self.dtype, copy=True)
        values.nan_to_num_(nan=float("nan"), posinf=limit, neginf=-limit)
        return Payload({"values": values})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        return _values(p, shape, self.name).float()

    def decode_into(self, p: Payload, out: torch.Tensor, slot: Slot | None) -> None:
        out.copy_(_values(p, out.shape, self.name))  # converts while copying


@register("fp16")
class Fp16(_Cast):
    """IEEE half precision, round to nearest (2 bytes/value; saturates at +-65504)."""

    summary = "cast to float16 (2 bytes/value)"
    dtype = torch.float16


@register("bf16")
class Bf16(_Cast):
    """bfloat16, round to nearest (2 bytes/value, fp32's range)."""

    summary = "cast to bfloat16 (2 bytes/value)"
    dtype = torch.bfloat16
