"""How long a codec call took, on the device that ran it.

On the CPU a call's host time is its time. On CUDA the host returns as soon as the
kernels are queued: an encode timed on the host reads microseconds, and the kernels'
real time lands in whatever waits next, the collective (``TorchCommunicator``
synchronizes after it), so encode time would be counted as communication. ``Clock``
records timing events around the call on the current stream and waits for the second
one: the kernels' own time, not the host's, and not the work queued before them.
It is used where a codec's time is reported to an observer (the communication
thread's ``Reducer``), where waiting costs no overlap with backward.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Clock:
    """Started at construction; ``seconds()`` reads it (see the module doc)."""

    def __init__(self, device: torch.device | None) -> None:
        self.events: tuple[Any, Any] | None = None
        if device is not None and device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start = time.perf_counter()

    def seconds(self) -> float:
        if self.events is None:
            return time.perf_counter() - self.start
        self.events[1].record()
        self.events[1].synchronize()
        return float(self.events[0].elapsed_time(self.events[1])) / 1e3
