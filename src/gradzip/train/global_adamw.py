"""``--optimizer adamw_global``: AdamW whose step is sized for the mean of W replicas.

Local-update methods (DiLoCo, SparseLoCo) run AdamW on each replica's own gradient and
then average the replicas' changes. Adam divides each coordinate's step by the root of
its second moment, and a replica's gradient of 1/W of the batch carries W times the
noise variance of the mean gradient DDP's AdamW sees. Where noise dominates a
coordinate, each replica's step is then about 1/sqrt(W) of the one AdamW would take on
the mean gradient, and the noise of the W steps cancels in the average: the mean is a
step of the right direction and too short a length (frontier page, "Where the gap at
W = 8 comes from"; a scalar outer learning rate cannot fix it, since coordinates where
the signal dominates are not shortened).

This optimizer estimates, per coordinate and from the replica's own moments alone (no
communication), what the second moment of the mean of W such gradients would be, and
divides by that. With ``m`` and ``v`` Adam's bias-corrected moments and ``c`` the
fraction of a noise's variance that survives ``m``'s moving average (``(1 - b1) / (1 +
b1)`` in the steady state), the noise variance is ``s2 = (v - m^2) / (1 - c)``, capped at
``v``, and the mean gradient's second moment ``v - (1 - 1/W) s2``: ``v`` where the
gradient is all signal, ``v / W`` where it is all noise. At W = 1 it is AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gradzip.train.closure import closure_loss


def mean_second_moment(m: torch.Tensor, v: torch.Tensor, replicas: int,
                       kept_noise: float) -> torch.Tensor:
    """The second moment the mean of ``replicas`` gradients would have, from one
    replica's bias-corrected first (``m``) and second (``v``) moments; ``kept_noise``:
    the fraction of a gradient noise's variance that ``m`` keeps (below 1)."""
    noise = (v - m * m).clamp_(min=0).div_(1 - kept_noise)
    noise = torch.minimum(noise, v)
    return v - noise.mul_(1 - 1 / replicas)


def kept_noise_fraction(beta1: float, step: int) -> float:
    """The variance of ``step`` terms of unit-variance white noise after Adam's
    bias-corrected moving average of decay ``beta1``."""
    scale = (1 - beta1) / (1 - beta1 ** step)
    return scale * scale * (1 - beta1 ** (2 * step)) / (1 - beta1 * beta1)


class GlobalAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose denominator is ``mean_second_moment`` of
    ``replicas`` replicas; ``replicas=1`` is ``torch.optim.AdamW``'s update."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, replicas: int = 1) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if replicas > 1 and betas[0] == 0:
            raise ValueError("adamw_global tells noise from signal by how much of it Adam's "
                             "first moment averages away: it needs beta1 > 0 (--beta1)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.replicas = replicas

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, beta1, beta2)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], beta1: float,
                beta2: float) -> None:
        """One AdamW step of ``p`` with the replicas' mean second moment."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = int(state["step"].item())
        grad, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        correction1, correction2 = 1 - beta1 ** step, 1 - beta2 ** step
        if self.replicas == 1 or step == 1:  # the first step has no noise to tell apart
            # torch.optim.AdamW's own arithmetic, so that W = 1 is AdamW bit for bit
            denom = (v.sqrt() / correction2 ** 0.5).add_(group["eps"])
        else:
            second = mean_second_moment(m / correction1, v / correction2, self.replicas,
                                        kept_noise_fraction(beta1, step))
            denom = second.sqrt_().add_(group["eps"])
        p.addcdiv_(m, denom, value=-group["lr"] / correction1)
