"""``CommWorker``: one thread per process that runs communication jobs in order.

The DDP hook must return a future instead of blocking, so communication overlaps
the rest of backward. Single-round codecs could chain futures of async
collectives, but multi-round codecs (PowerSGD, shared-scale integers) and the
all-gather path (sizes first, then payloads) are sequences of dependent
collectives written as plain code. Running them on one dedicated thread keeps
every codec on one code path: jobs run strictly in submission order (DDP submits
buckets in the same order on every rank), and each completes a
``torch.futures.Future``.

The jobs' collectives go to gradzip's own process group (see ``ddp.py``), so
they never interleave with DDP's collectives on the model's group.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch


class CommWorker:
    """A daemon thread executing ``submit``-ted jobs one at a time, FIFO."""

    def __init__(self, name: str = "gradzip-comm") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, fn: Callable[[], Any], tensor: torch.Tensor | None = None
               ) -> torch.futures.Future:
        """Queue ``fn``; the returned future holds its result (or its exception).

        On CUDA, ``tensor``'s producer stream is recorded so the job waits for
        backward's kernels that wrote it before reading it.
        """
        if self._closed:
            raise RuntimeError("gradzip communication worker is closed")
        fut: torch.futures.Future = torch.futures.Future()
        event = None
        if tensor is not None and tensor.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        self._queue.put((fn, fut, event, tensor.device if tensor is not None else None))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut, event, device = item
            try:
                if event is not None:
                    event.synchronize()
                result = fn()
                if device is not None and device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                fut.set_result(result)
            except BaseException as e:  # noqa: BLE001 - delivered to the waiter
                fut.set_exception(e)

    def close(self) -> None:
        """Finish queued jobs, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
