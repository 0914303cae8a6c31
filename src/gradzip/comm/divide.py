"""The mean's pre-division and the non-finite check in one pass over a CPU bucket.

PyTorch's ``allreduce_hook`` divides the bucket by the world size (one read and one
write of every value) and all-reduces it. gradzip's ``none`` must also know whether
the bucket held NaN/Inf, so every rank stops in the same step: as a separate pass
(a sum, ``nonfinite_flag``) that check cost a second read of the bucket, about 10% of
a step on a 100 MB bucket here (issue 40's hook bench). ``divide_checked`` folds it
into the division: each value is tested as it is read (``|v| <= max`` fails for NaN
and +-Inf), branch-free so the loop stays vectorized, and the quotient is IEEE
division, bit-identical to ``Tensor.div_``. On other devices and dtypes it declines
(None) and the caller divides and checks as before (a GPU runs both at memory speed).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

#: dtypes the kernel takes (NumPy views of the bucket)
_DTYPES = (torch.float32, torch.float64)


@njit(cache=True, nogil=True)
def _divide_flagged(x: np.ndarray, divisor: np.floating, largest: np.floating) -> bool:
    """``x /= divisor`` in place; whether any value was NaN or +-Inf."""
    finite = True
    for i in range(x.shape[0]):
        v = x[i]
        finite &= abs(v) <= largest
        x[i] = v / divisor
    return not finite


def divide_checked(buffer: torch.Tensor, world: int) -> torch.Tensor | None:
    """``buffer.div_(world)`` and whether ``buffer`` held NaN/Inf before (a 0-d bool),
    in one pass; None, with ``buffer`` untouched, where the kernel does not apply (not
    a contiguous CPU float32/float64 tensor)."""
    if buffer.device.type != "cpu" or buffer.dtype not in _DTYPES \
            or not buffer.is_contiguous():
        return None
    values = buffer.detach().reshape(-1).numpy()
    kind = values.dtype.type
    bad = _divide_flagged(values, kind(world), kind(np.finfo(values.dtype).max))
    return torch.tensor(bool(bad))
