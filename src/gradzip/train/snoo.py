"""SNOO's outer step: a Nesterov step on the weights' change over K optimizer steps.

SNOO (Kallusky et al., 2025) keeps an fp32 copy of the weights at the last outer step
(the anchor). Every ``sync_every`` steps the change since then, ``anchor - weights``, is
a pseudo-gradient; an SGD step with Nesterov momentum moves the anchor by it and the
weights become the new anchor. Under DDP every rank holds the same weights, so this
communicates nothing. It is DiLoCo's outer loop with one worker, which is why a
local-update method's gain must be measured against it: part of what DiLoCo shows over
plain DDP is its outer optimizer, not its rare synchronization.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class NesterovOuterStep:
    """The outer step over ``model``'s trainable parameters, every ``sync_every`` calls
    of ``step`` (once per optimizer step)."""

    def __init__(self, model: nn.Module, *, sync_every: int, lr: float,
                 momentum: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.anchor = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)
        self.sync_every = sync_every
        self.steps = 0
        self.outer_steps = 0

    @torch.no_grad()
    def step(self) -> bool:
        """After an optimizer step; returns whether an outer step ran."""
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        for a, p in zip(self.anchor, self.params, strict=True):
            a.grad = a - p.detach().float()
        self.optimizer.step()
        for a, p in zip(self.anchor, self.params, strict=True):
            a.grad = None
            p.copy_(a)
        self.outer_steps += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "snoo", "steps": self.steps, "outer_steps": self.outer_steps,
                "anchor": [a.clone() for a in self.anchor],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != "snoo":
            raise ValueError(f"this checkpoint's outer state is {sd.get('kind')!r}, not "
                             "SNOO's: resume with the same --outer")
        if len(sd["anchor"]) != len(self.anchor):
            raise ValueError("the checkpoint's SNOO state is for another model")
        with torch.no_grad():
            for a, saved in zip(self.anchor, sd["anchor"], strict=True):
                a.copy_(saved)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.steps, self.outer_steps = int(sd["steps"]), int(sd["outer_steps"])
