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

from typing import Any

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, copied without blocking the host; ``t``
    itself where it already is there."""
    if t.device == device:
        return t
    if t.device.type != "cpu" or device.type == "cpu":  # not a host-to-device copy
        return t.to(device)
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def device_tensor(data: Any, device: torch.device, dtype: torch.dtype | None = None,
                  ) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without blocking the host:
    small values a collective or a codec needs on the device (sizes, flags, scales,
    constants) are made on the host and uploaded (``upload``); ``torch.tensor`` with a
    CUDA device copies from pageable memory and waits for the copy."""
    return upload(torch.tensor(data, dtype=dtype), torch.device(device))


#: byte alignment of each tensor inside a shared upload (any dtype's view is legal)
ALIGN = 16


def upload_all(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``, the host ones in one upload: a received payload's
    leaves (values, positions, scales) come back to the GPU in one copy, not one
    blocking copy each. Tensors already on ``device`` are returned as they are."""
    host = [i for i, t in enumerate(tensors) if t.device != device]
    if device.type == "cpu":
        return [t.to(device) for t in tensors]
    if len(host) < 2:
        return [upload(t, device) for t in tensors]
    sizes = [tensors[i].numel() * tensors[i].element_size() for i in host]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // ALIGN) * ALIGN)
    frame = torch.empty(starts[-1], dtype=torch.uint8,
                        pin_memory=device.type == "cuda")
    for i, start, n in zip(host, starts, sizes, strict=False):
        frame[start:start + n] = tensors[i].detach().cpu().contiguous().reshape(-1) \
            .view(torch.uint8)
    moved = upload(frame, device)
    out = list(tensors)
    for i, start, n in zip(host, starts, sizes, strict=False):
        t = tensors[i]
        out[i] = moved[start:start + n].view(t.dtype).reshape(t.shape)
    return out
