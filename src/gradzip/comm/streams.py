"""``SideStreams``: CUDA streams of gradzip's own for work on a background thread.

A thread that issues NCCL work on the default stream makes the default stream, where
backward runs, wait for every collective it issues (a blocking ``dist.all_reduce``
ties the calling stream to NCCL's), and its codec kernels queue behind backward's: the
overlap the thread exists for is lost. So a background job runs on a stream of its
own, per device, with explicit edges:

* ``mark(tensor)`` (the submitting thread): an event on the stream that produced the
  tensor (backward's), recorded when the job is queued;
* ``run(job, device, event)`` (the background thread): sets the thread's device,
  makes gradzip's stream wait for the event (a GPU-side edge, no host wait), runs the
  job with that stream current, and synchronizes it before returning, so the plain
  future the job completes only ever holds finished results;
* ``adopt(tensor)`` (the consuming thread): a result the job allocated, used on the
  consumer's stream, is recorded on that stream (``record_stream``), so the allocator
  does not hand its block to the next job while the consumer still reads it.

On CPU both are no-ops around ``job()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class SideStreams:
    """One CUDA stream per device, created on first use (see the module docstring)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    @staticmethod
    def mark(tensor: torch.Tensor | None) -> Any:
        """An event after the current stream's work on ``tensor``'s device (CUDA only)."""
        if tensor is None or tensor.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def stream(self, device: torch.device) -> Any:
        """gradzip's stream on ``device``."""
        found = self._streams.get(device)
        if found is None:
            found = self._streams[device] = torch.cuda.Stream(device)
        return found

    @staticmethod
    def adopt(tensor: torch.Tensor) -> torch.Tensor:
        """Hand ``tensor``, made by a job on gradzip's stream, to the current stream.

        The caching allocator gives a freed block back to the stream that allocated it
        at once: if the consuming thread frees the tensor while its own stream's
        kernels still read it, the next job on gradzip's stream can take the block and
        overwrite it under them (DiLoCo's mean, read by the outer step). Recording the
        current stream on it keeps the block until that stream's work ran."""
        if tensor.device.type == "cuda":
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return tensor

    def run(self, job: Callable[[], T], device: torch.device | None, event: Any) -> T:
        """``job()`` on gradzip's stream of ``device``, after ``event``; finished on return."""
        if device is None or device.type != "cuda":
            return job()
        torch.cuda.set_device(device)
        stream = self.stream(device)
        if event is not None:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            result = job()
        stream.synchronize()
        return result
