"""``stdbins``: templar's statistical quantizer, bins over a multiple of the std.

SparseLoCo's public code (templar) sends its top-k values in 2 bits this way: centre
the values on their mean, cut ``sigmas`` standard deviations around it into ``bins``
equal bins (values beyond fall into the outer bins), and decode each code to the mean
of the values that fell into its bin (a lookup table of ``bins`` means sent along).
``centroid`` is gradzip's default for the same job (equal-count magnitude bins with
Lloyd steps and a table per 256 values); this stage is the authors' choice, as an
option (``sparseloco(values=stdbins)``) for the frontier to compare. The bins here are
symmetric about the mean (``floor(c / step + bins / 2)``; templar rounds, which puts
one more bin below the mean than above it), and the table is per encoded tensor:
after ``topk`` that is per exchange, the kept values of every tensor together.

Wire: ``q`` uint8 codes in ``[0, bins)`` (a following ``ans`` codes them to their
entropy, at most log2(bins) bits) and ``table`` fp32 ``[bins]``: the mean plus each
bin's mean offset. An empty bin decodes to the mean.
"""

from __future__ import annotations

import torch

from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, positive, register
from gradzip.codecs.validation import codes_below


def _power_of_two(value: int) -> str | None:
    if not isinstance(value, int) or not 2 <= value <= 256 or value & (value - 1):
        return "must be in [2, 256] and a power of two"
    return None


@register("stdbins")
class StdBins(Compressor):
    """Uniform bins over ``sigmas`` standard deviations around the mean, each decoded to
    the mean of its values (templar's SparseLoCo quantizer; see the module doc)."""

    summary = "templar's 2-bit values: bins over a multiple of the std, a table of bin means"
    fixed_layout = True
    PARAMS = (
        Param("bins", int, 4, "bins (a power of two: 4 is 2 bits per value)",
              _power_of_two),
        Param("sigmas", float, 6.0, "the width the bins span, in standard deviations "
              "around the mean (values beyond fall into the outer bins)", positive),
    )

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.reshape(-1).float()
        bins = self.params["bins"]
        if flat.numel() == 0:
            return Payload({"q": torch.zeros(0, dtype=torch.uint8, device=flat.device),
                            "table": torch.zeros(bins, device=flat.device)})
        mean = flat.double().mean()
        centred = flat - mean.float()
        spread = centred.std() if flat.numel() > 1 else centred.new_zeros(())
        step = self.params["sigmas"] * spread.double() / bins
        usable = torch.isfinite(step) & (step > 0)
        step = torch.where(usable, step, torch.ones_like(step)).float()
        q = torch.floor(centred / step + bins / 2).clamp_(0, bins - 1).to(torch.uint8)
        codes, wide = q.long(), centred.double()
        # scatter-adds, not bincount: on CUDA bincount reads the largest code on the host
        counts = wide.new_zeros(bins).scatter_add_(0, codes, torch.ones_like(wide))
        sums = wide.new_zeros(bins).scatter_add_(0, codes, wide)
        offsets = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
        return Payload({"q": q, "table": (mean + offsets).float()})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        q, table = p.tensor("q").reshape(-1), p.tensor("table").reshape(-1)
        bins = self.params["bins"]
        if q.dtype != torch.uint8 or q.numel() != shape.numel():
            raise PayloadError(f"stdbins payload: q is {q.numel()} {q.dtype} values, shape "
                               f"{tuple(shape)} needs {shape.numel()} uint8")
        if table.dtype != torch.float32 or table.numel() != bins:
            raise PayloadError(f"stdbins payload: a table of {table.numel()} {table.dtype}, "
                               f"needs {bins} float32")
        q = codes_below(q, bins, f"stdbins payload ({bins} bins)", PayloadError)
        return table[q.long()].reshape(shape)
