"""Host-made tensors onto the data's device without stalling the host.

Some codec inputs are made on the CPU on purpose: random positions and sketch hashes
from a CPU generator (the same stream on every device), lookup tables, segment
lengths. ``t.to(cuda)`` from pageable memory blocks the host until the copy is done, a
sync per bucket in the middle of backward. ``upload`` stages the tensor in pinned
memory and copies it with ``non_blocking=True``: the copy is queued on the current
stream, ahead of the kernels that read it, and the caching host allocator keeps the
pinned block until the copy has run. ``DeviceWatch.blocking_uploads`` finds the
uploads that still block (on ``meta`` tensors, without a GPU).
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, copied without blocking the host; ``t``
    itself where it already is there."""
    if t.device == device:
        return t
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
