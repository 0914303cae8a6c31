"""``--optimizer muon``: Muon on the hidden weight matrices, AdamW on the rest.

Muon (Jordan et al., 2024) orthogonalizes each matrix's momentum by Newton-Schulz
iterations; it is defined for 2-D weights only, so embeddings (tied with the output
head here), norms and biases keep AdamW, as Muon's authors, Moonshot's Moonlight and
MuLoCo (Muon as DiLoCo's inner optimizer) do. ``torch.optim.Muon`` does the work, with
``adjust_lr_fn="match_rms_adamw"``: its update is scaled to AdamW's RMS, so one
``--lr`` and one schedule serve both halves.

The two optimizers appear as one ``torch.optim.Optimizer``: ``param_groups`` are theirs
(the learning-rate schedule moves both), ``state_dict`` holds both (checkpoints, a
torchft heal and DiLoCo's inner state carry it whole).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradzip.train.closure import closure_loss

#: modules whose matrices stay on AdamW: embeddings (token, learned position: rows
#: looked up, not multiplied) and the output head (untied from the embedding or not)
HEAD_NAMES = ("head", "lm_head")


def require_muon() -> None:
    """ValueError unless this PyTorch has ``torch.optim.Muon`` (2.9 and later)."""
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"--optimizer muon needs torch.optim.Muon (PyTorch >= 2.9); this "
                         f"is {torch.__version__}")


def split_for_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter],
                                              list[nn.Parameter]]:
    """(Muon's matrices, AdamW's matrices, AdamW's vectors) of ``model``'s trainable
    parameters, in the model's order."""
    adam = {id(p) for name, module in model.named_modules()
            if isinstance(module, nn.Embedding) or name.split(".")[-1] in HEAD_NAMES
            for p in module.parameters(recurse=False)}
    muon, adam_matrices, vectors = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2:
            vectors.append(p)
        elif p.dim() == 2 and id(p) not in adam:
            muon.append(p)
        else:
            adam_matrices.append(p)
    return muon, adam_matrices, vectors


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: ``torch.optim.Muon`` for the hidden matrices, AdamW for
    the rest (weight decay on matrices only)."""

    def __init__(self, model: nn.Module, *, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, momentum: float = 0.95) -> None:
        require_muon()
        muon, adam_matrices, vectors = split_for_muon(model)
        if not muon:
            raise ValueError("--optimizer muon found no hidden weight matrix to run Muon on")
        self.muon = torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay,
                                     momentum=momentum, adjust_lr_fn="match_rms_adamw")
        groups = [{"params": adam_matrices, "weight_decay": weight_decay},
                  {"params": vectors, "weight_decay": 0.0}]
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr,
                                       betas=betas, eps=eps)
        # the base class over the same group dicts: the schedule's changes reach both
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError("this optimizer state is not --optimizer muon's (it needs "
                             "'muon' and 'adamw' parts): resume with the run's optimizer")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # loading gives each its own new group dicts: share them again with the schedule
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
