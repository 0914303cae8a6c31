"""Identity and float casts: ``none``, ``fp16``, ``bf16``.

All three are summable (the cast values are all-reduced directly, as PyTorch's
``fp16_compress_hook``/``bf16_compress_hook`` do) and deterministic.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.nonfinite import host_reads_free, nonfinite_flag
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import register

#: the flag of an input found finite on the host (one shared tensor, never written)
_FINITE = torch.zeros((), dtype=torch.bool)


@register("none")
class Identity(Compressor):
    """No compression: the tensor in its own dtype (the all-reduce baseline)."""

    summary = "no compression; the tensor is sent as is"
    summable = True
    unbiased = True
    keeps_dtype = True
    values_field = "values"
    fixed_layout = True

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
    fixed_layout = True

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        return self.encode_flagged(x, slot)[0]

    def encode_flagged(self, x: torch.Tensor, slot: Slot) -> tuple[Payload, torch.Tensor]:
        """The cast, saturating instead of overflowing to Inf (a clipped gradient beats
        a NaN step: NaN stays NaN, an infinite input or a value that rounds past the
        largest finite one gets that value), and whether ``x`` held NaN/Inf.

        On the CPU a host read is free, so the flag comes from the cast's own output, a
        half-size pass (NaN and Inf survive a cast): only where that output is not
        finite is ``x`` checked exactly (a finite value past fp16's range also casts to
        Inf) and the output saturated. On a GPU a host read would stall the stream:
        ``x`` is checked and the output saturated on the device, every time."""
        limit = torch.finfo(self.dtype).max
        values = x.reshape(-1).to(self.dtype, copy=True)
        if host_reads_free(x):
            if values.numel() == 0 or math.isfinite(values.sum().item()):
                return Payload({"values": values}), _FINITE
            flag = nonfinite_flag(x)
        else:
            flag = nonfinite_flag(x) if x.numel() else torch.zeros((), dtype=torch.bool,
                                                                    device=x.device)
        values.nan_to_num_(nan=float("nan"), posinf=limit, neginf=-limit)
        return Payload({"values": values}), flag

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
