"""The closure an optimizer's ``step(closure)`` may take, as ``torch.optim`` runs it."""

from __future__ import annotations

from typing import Any

import torch


def closure_loss(closure: Any) -> Any:
    """The loss ``closure`` returns, computed with gradients on (an optimizer's ``step``
    runs under ``no_grad``); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
