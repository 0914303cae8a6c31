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
they never interleave with DDP's collectives on the model's group. On CUDA the
thread sets its device and runs every job on a stream of gradzip's own
(``streams.py``): its collectives and codec kernels never make backward's stream
wait.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from gradzip.comm import replicas
from gradzip.comm.streams import SideStreams


class CommWorker:
    """A daemon thread executing ``submit``-ted jobs one at a time, FIFO."""

    def __init__(self, name: str = "gradzip-comm") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams = SideStreams()
        #: under ``--replicas`` its CPU time is its replica's
        self._join_replica = replicas.inherit()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, fn: Callable[[], Any], tensor: torch.Tensor | None = None
               ) -> torch.futures.Future:
        """Queue ``fn``; the returned future holds its result (or its exception).

        On CUDA, the job runs on gradzip's own stream (``streams.SideStreams``), after
        an event recorded now on the stream that produced ``tensor`` (backward's), and
        its stream is synchronized before the future completes.
        """
        if self._closed:
            raise RuntimeError("gradzip communication worker is closed")
        fut: torch.futures.Future = torch.futures.Future()
        event = self._streams.mark(tensor)
        self._queue.put((fn, fut, event, tensor.device if tensor is not None else None))
        return fut

    def _run(self) -> None:
        self._join_replica()
        while True:
            item = self._queue.get()
            if item is None:
                replicas.leave()
                return
            fn, fut, event, device = item
            try:
                fut.set_result(self._streams.run(fn, device, event))
            except BaseException as e:  # noqa: BLE001 - delivered to the waiter
                fut.set_exception(e)

    def close(self) -> None:
        """Finish queued jobs, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
