"""What a training run is built from, each part with a default.

The ``Trainer`` builds its model, optimizer, parallelism and data through a
``Components`` object (the ``build`` pattern of torchtitan's components): the defaults
are gradzip's GPT, AdamW (or SGD), ``parallel.parallelize`` and the prepared corpus; a
test or a user script passes its own instead of patching module globals::

    sgd = Components(optimizer=lambda model, o: SGD(model.parameters(), lr=o.lr))
    train(cfg, components=sgd)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.train.config import ModelConfig, OptimConfig
from gradzip.train.model import GPT
from gradzip.train.parallel import Parallelism, parallelize


def build_model(m: ModelConfig) -> nn.Module:
    """The GPT of ``m`` (on the CPU; the trainer moves it to its device)."""
    return GPT(m)


def build_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (or plain SGD, or Muon on the hidden matrices with AdamW on the rest:
    ``gradzip.train.muon``, or AdamW sized for the mean of the world's replicas:
    ``gradzip.train.global_adamw``); weight decay on matrices (and embeddings) only, not on norms
    and biases (decoupled in AdamW, an L2 term in SGD)."""
    groups = decay_groups([p for p in model.parameters() if p.requires_grad], o.weight_decay)
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=0.0)
    if o.optimizer == "muon":
        from gradzip.train.muon import MuonAdamW

        return MuonAdamW(model, lr=o.lr, weight_decay=o.weight_decay,
                         betas=(o.beta1, o.beta2), eps=o.eps)
    if o.optimizer == "adamw_global":
        from gradzip.train.global_adamw import GlobalAdamW

        return GlobalAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                           replicas=averaged_replicas())
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def decay_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups with ``weight_decay`` on matrices (and embeddings), none on norms
    and biases."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def averaged_replicas() -> int:
    """How many replicas a local-update method averages: the world's ranks (replicas
    in one process included; ``--ft``, where groups come and go, is refused by
    ``commands.train.check_ft``)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("--optimizer adamw_global sizes its step for the world's ranks: "
                         "build it once the process group exists (gradzip train does)")
    return dist.get_world_size()


@dataclass
class Components:
    """The parts of a run; each default is what ``gradzip train`` uses."""

    #: ModelConfig -> the unwrapped model
    model: Callable[[ModelConfig], nn.Module] = field(default=build_model)
    #: (the model the loop runs, OptimConfig) -> its optimizer
    optimizer: Callable[[nn.Module, OptimConfig], torch.optim.Optimizer] = \
        field(default=build_optimizer)
    #: (raw model, DistInfo, keyword settings of ``parallel.parallelize``) -> Parallelism
    parallelize: Callable[..., Parallelism] = field(default=parallelize)
    #: tokenizer, train and val splits; None: prepared from the configured sources
    data: Any = None
    #: the batch loader class; None: ``gradzip.train.data.BatchLoader``
    make_loader: Callable[..., Any] | None = None
