"""Error feedback (``ef``): remember what compression dropped and add it back later.

With residual memory e (zero at first), each step sends C(beta*e + gamma*g) and keeps
e <- (beta*e + gamma*g) - D(C(...)). With beta = gamma = 1 this is the EF of
Seide et al. (1-bit SGD), Karimireddy et al. (EF-SGD) and Stich et al. (mem-SGD);
other values give GRACE's "residual memory". Works in front of any codec.
"""

from __future__ import annotations

import torch

from gradzip.codecs.base import Decode, Encode, Reduce, Slot, Wrapper
from gradzip.codecs.payload import Payload
from gradzip.codecs.registry import Param, in_range, register


@register("ef")
class ErrorFeedback(Wrapper):
    """Residual memory around the rest of the chain."""

    summary = "error feedback: add back what the previous steps dropped"
    PARAMS = (
        Param("beta", float, 1.0, "decay of the stored residual", in_range(0.0, 1.0)),
        Param("gamma", float, 1.0, "scale of the fresh gradient", in_range(0.0, 1.0, lo_open=True)),
    )

    def _compensate(self, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        residual = slot.data.get("residual")
        gamma, beta = self.params["gamma"], self.params["beta"]
        if residual is None:
            return x * gamma if gamma != 1.0 else x.clone()
        if residual.shape != x.shape:
            raise ValueError(
                f"ef: key {slot.key!r} changed shape {tuple(residual.shape)} -> "
                f"{tuple(x.shape)}; use a distinct key per tensor"
            )
        residual = residual.to(x.device)
        if gamma == 1.0:  # one pass over the tensor: this runs on every step
            return torch.add(x, residual, alpha=beta)
        return (x * gamma).add_(residual, alpha=beta)

    def encode(self, x: torch.Tensor, slot: Slot, inner: Encode, inner_decode: Decode) -> Payload:
        compensated = self._compensate(x, slot)
        payload = inner(compensated)
        slot.data["residual"] = compensated - inner_decode(payload).to(compensated)
        return payload

    def reduce(
        self, x: torch.Tensor, slot: Slot, inner: Reduce, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        compensated = self._compensate(x, slot)
        mean, local = inner(compensated, True)
        assert local is not None
        slot.data["residual"] = _difference(compensated, local, slot.data.get("residual"))
        return mean, (local if want_local else None)

    @staticmethod
    def residual_norm(slot: Slot) -> float:
        r = slot.data.get("residual")
        return float(r.norm()) if r is not None else 0.0


def _difference(a: torch.Tensor, b: torch.Tensor, reuse: torch.Tensor | None) -> torch.Tensor:
    """a - b, written into ``reuse`` (last step's residual, already added into ``a``)
    when it fits: no fresh bucket-sized allocation on every step."""
    b = b.to(a)
    if reuse is not None and reuse.shape == a.shape and reuse.dtype == a.dtype \
            and reuse.device == a.device and reuse.is_contiguous():
        return torch.sub(a, b, out=reuse)
    return a - b
