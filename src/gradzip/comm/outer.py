"""DiLoCo: rare synchronization of pseudo-gradients, through any gradzip codec.

DiLoCo (Douillard et al., 2023) trains ``sync_every`` (H) inner steps locally on every
rank, then averages the parameter drift — the pseudo-gradient ``anchor - params`` —
and applies it to the anchor (the last synchronized weights, kept in fp32) with an
outer SGD step with Nesterov momentum; the new anchor becomes every rank's weights.
``outer="average"`` applies the plain mean (post-local SGD: outer SGD, lr 1, no
momentum), the control without the outer optimizer.

The pseudo-gradient crosses the link through a gradzip codec (``codec="int8"``,
``"ef | topk(ratio=0.01)"``, ...; ``None``: the fp32 all-reduce) and its own reduction
(``Reducer.reduce_mean`` on gradzip's private group), so link bytes are counted in
``CommStats`` exactly as for the hooks; error feedback and other codec state stay per
rank and are checkpointed. The model is not wrapped by DDP: nothing is communicated on
the inner steps. Initial weights are broadcast once from rank 0.

Use: ``outer = DiLoCo(model, sync_every=32, codec="int8")`` after building the model;
call ``outer.step()`` after every inner optimizer step; evaluate inside
``with outer.synchronized_weights():``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.ddp import build_codec, private_group
from gradzip.comm.reducer import Reducer
from gradzip.comm.stats import CommStats

OUTER_KINDS = ("diloco", "average")


class DiLoCo:
    """Outer synchronization of ``model`` every ``sync_every`` inner steps."""

    def __init__(self, model: nn.Module, *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True,
                 codec: str | None = None, outer: str = "diloco",
                 process_group: dist.ProcessGroup | None = None, seed: int = 0,
                 nonfinite: str = "error") -> None:
        check_options(sync_every, outer_lr, outer_momentum, outer)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DiLoCo needs torch.distributed initialized")
        self.sync_every = sync_every
        self.outer = outer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group = private_group(process_group)
        self.comm = TorchCommunicator(self.group)
        self._broadcast(model)
        self.anchor = [p.detach().float().clone() for p in self.params]
        lr, momentum = (1.0, 0.0) if outer == "average" else (outer_lr, outer_momentum)
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum,
                                         nesterov=nesterov and momentum > 0)
        self.codec = build_codec(codec or "none", seed=seed, nonfinite=nonfinite)
        self.stats = CommStats()
        self.reducer = Reducer(self.codec, self.stats)
        self.inner_steps = 0
        self.syncs = 0  # since the run began (restored on resume)
        self.syncs_here = 0  # by this process: what ``stats`` covers

    def _broadcast(self, model: nn.Module) -> None:
        """Every rank starts from rank 0's weights and buffers."""
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=src, group=self.group)

    def step(self) -> bool:
        """After an inner optimizer step: synchronize when H steps have passed since the
        last sync (the boundaries depend only on the step count, so a resumed run keeps
        them). Returns whether it synchronized."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self.synchronize()
        return True

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the pseudo-gradients through the codec, outer step, new weights."""
        pseudo = torch.cat([(a - p.float()).reshape(-1)
                            for a, p in zip(self.anchor, self.params, strict=True)])
        shapes = [p.shape for p in self.params]
        mean = self.reducer.reduce_mean(pseudo, "pseudo_gradient", self.comm, shapes=shapes)
        for a, g in zip(self.anchor, mean.split([a.numel() for a in self.anchor]),
                        strict=True):
            a.grad = g.view_as(a)
        self.optimizer.step()
        for a, p in zip(self.anchor, self.params, strict=True):
            a.grad = None
            p.copy_(a)
        self.syncs += 1
        self.syncs_here += 1

    @contextlib.contextmanager
    def synchronized_weights(self) -> Iterator[None]:
        """The model holds the last synchronized weights (the anchor) inside."""
        local = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, p in zip(local, self.params, strict=True):
                    p.copy_(saved)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its local weights (ranks differ between syncs), the
        anchor, the outer optimizer, the codec's state and the step counts."""
        return {"kind": "diloco", "inner_steps": self.inner_steps, "syncs": self.syncs,
                "local": [p.detach().clone() for p in self.params],
                "anchor": [a.clone() for a in self.anchor],
                "optimizer": self.optimizer.state_dict(), "codec": self.codec.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != "diloco":
            raise ValueError(f"this checkpoint's comm state is {sd.get('kind')!r}, not a "
                             "DiLoCo state: resume with the same --outer")
        if len(sd["anchor"]) != len(self.anchor):
            raise ValueError("the checkpoint's DiLoCo state is for another model")
        with torch.no_grad():
            for a, saved in zip(self.anchor, sd["anchor"], strict=True):
                a.copy_(saved)
            for p, saved in zip(self.params, sd["local"], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.codec.load_state_dict(sd["codec"])
        self.inner_steps, self.syncs = int(sd["inner_steps"]), int(sd["syncs"])

    def close(self) -> None:
        """Nothing runs in the background; for symmetry with the hooks' handles."""


def check_options(sync_every: int, outer_lr: float, outer_momentum: float, outer: str) -> None:
    """Clear errors for values DiLoCo cannot run with (before any training)."""
    if outer not in OUTER_KINDS:
        raise ValueError(f"outer must be one of {', '.join(OUTER_KINDS)}, got {outer!r}")
    if sync_every < 1:
        raise ValueError(f"sync_every (H) must be >= 1, got {sync_every}")
    if outer_lr <= 0 or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer lr must be > 0 and outer momentum in [0, 1), got "
                         f"{outer_lr}, {outer_momentum}")
