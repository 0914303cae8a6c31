"""The background writer: captured buckets go to the packs on their own thread.

The training step only copies a bucket to host memory and enqueues it; this thread
writes it (``PackWriter``) and commits each step when its end is enqueued. The queue
is bounded: when it is full the step waits (nothing is lost) unless the capture asked
to drop, and then every dropped bucket is counted. An error on the thread is raised in
the training thread at its next call, never swallowed; ``close`` writes everything
still queued, commits the steps that ended and joins the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradzip.capture.layout import StepKey
from gradzip.capture.packs import PackWriter


@dataclass
class WriterStats:
    """What the writer did: buckets written, bytes, dropped, time the step waited."""

    buckets: int = 0
    bytes: int = 0
    steps: int = 0
    dropped: int = 0
    wait_s: float = 0.0
    write_s: float = 0.0


class BackgroundWriter:
    """A thread that drains a bounded queue of buckets into a ``PackWriter``."""

    def __init__(self, packs: PackWriter, *, queue_size: int = 8, drop: bool = False,
                 durable: bool = False) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.packs = packs
        self.drop = drop
        self.durable = durable
        self.stats = WriterStats()
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gradzip-capture", daemon=True)
        self._thread.start()
        self._closed = False

    def put_bucket(self, prepare: Callable[[], None], key: StepKey, bucket: int,
                   payload: dict[str, Any]) -> bool:
        """Queue one bucket (``payload``: the ``write_bucket`` arguments; ``prepare``
        runs on the thread first, e.g. waiting for a device copy). False if dropped."""
        self.raise_if_failed()
        item = ("bucket", (prepare, key, bucket, payload))
        if self.drop:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.stats.dropped += 1
                return False
            return True
        start = time.perf_counter()
        self._queue.put(item)
        self.stats.wait_s += time.perf_counter() - start
        return True

    def end_step(self, key: StepKey) -> None:
        """The step is complete: commit it once its buckets are written."""
        self.raise_if_failed()
        self._queue.put(("commit", key))

    def close(self) -> None:
        """Write what is queued, commit ended steps, stop the thread, close the pack."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(("stop", None))
        self._thread.join()
        self.packs.close()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"gradzip capture: the writer failed: {error}") from error

    def _run(self) -> None:
        while True:
            what, item = self._queue.get()
            if what == "stop":
                return
            if self._error is not None:
                continue  # keep draining so the training thread never blocks forever
            try:
                start = time.perf_counter()
                if what == "bucket":
                    prepare, key, bucket, payload = item
                    prepare()
                    self.stats.bytes += self.packs.write_bucket(key, bucket, **payload)
                    self.stats.buckets += 1
                else:
                    self.packs.commit_step(item, durable=self.durable)
                    self.stats.steps += 1
                self.stats.write_s += time.perf_counter() - start
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
