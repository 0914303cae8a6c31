"""``BatchLoader``: packed fixed-length sequences, one disjoint share per rank, exact resume.

Packing: the token stream (documents separated by EOT) is cut into windows of
``seq_len + 1`` tokens at stride ``seq_len``, starting at a per-epoch offset in
``[0, seq_len)`` so window boundaries move between epochs; ``x`` is a window without its last
token and ``y`` without its first. There are ``N = (num_tokens - seq_len) // seq_len``
windows in every epoch.

Order: epoch ``e`` visits the windows in a permutation drawn from ``(seed, e)``. Global step
``s`` takes the ``world_size * batch_size`` windows at ``perm[s*W*B : (s+1)*W*B]`` and rank
``r`` the ``r``-th block of ``batch_size`` of them, so the ranks' shares are disjoint and each
rank reads only its own windows. The remainder of an epoch that does not fill a global
batch is skipped, so every rank takes the same number of steps.

A batch is a pure function of ``(seed, epoch, step, rank, world_size)``. The state is just
the position of the next batch the *caller* gets (prefetched batches do not count), so
``load_state_dict`` resumes with exactly the batches an uninterrupted run would have seen.

Prefetch: a daemon thread computes the next ``prefetch`` batches into a bounded queue; the
work is a gather from memory-mapped files, which releases the GIL, so a thread is enough and
there is no worker process that could be orphaned on Ctrl-C or a failed rank. ``close()``
(or leaving the ``with`` block, or garbage collection) stops and joins it.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import numpy as np
import torch

from gradzip.train.data.cache import TokenShards

STATE_VERSION = 1


class _Order:
    """The per-epoch window order; keeps the current epoch's permutation."""

    def __init__(self, tokens: TokenShards, batch_size: int, seq_len: int, rank: int,
                 world_size: int, seed: int) -> None:
        self.tokens, self.B, self.T = tokens, batch_size, seq_len
        self.rank, self.W, self.seed = rank, world_size, seed
        self.windows = (tokens.num_tokens - seq_len) // seq_len
        self.steps_per_epoch = self.windows // (world_size * batch_size) if self.windows > 0 else 0
        self._epoch: int | None = None
        self._shift = 0
        self._perm = np.empty(0, dtype=np.int64)

    def _plan(self, epoch: int) -> None:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch, 0x67A7D])
            self._shift = int(rng.integers(self.T))
            self._perm = rng.permutation(self.windows)
            self._epoch = epoch

    def batch(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of this rank at global ``step`` of ``epoch``."""
        self._plan(epoch)
        first = (step * self.W + self.rank) * self.B
        starts = self._perm[first:first + self.B] * self.T + self._shift
        buf = np.empty((self.B, self.T + 1), dtype=np.int64)
        for i, s in enumerate(starts):
            buf[i] = self.tokens.read(int(s), self.T + 1)
        t = torch.from_numpy(buf)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _produce(order: _Order, epoch: int, step: int, out: queue.Queue[Any],
             stop: threading.Event) -> None:
    """Worker thread: batches from (epoch, step) on, into ``out``, until ``stop``."""
    try:
        while not stop.is_set():
            item: Any = order.batch(epoch, step)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1
            if step == order.steps_per_epoch:
                epoch, step = epoch + 1, 0
    except BaseException as e:  # handed to the consumer, which re-raises it
        while not stop.is_set():
            try:
                out.put(_Failure(e), timeout=0.1)
                break
            except queue.Full:
                continue


def _stop_worker(stop: threading.Event, thread: threading.Thread | None,
                 q: queue.Queue[Any] | None) -> None:
    stop.set()
    if q is not None:  # unblock a producer waiting on a full queue
        with q.mutex:
            q.queue.clear()
    if thread is not None and thread is not threading.current_thread():
        thread.join()


class BatchLoader:
    """Infinite iterator of ``(x, y)`` int64 tensors ``[batch_size, seq_len]`` for one rank."""

    def __init__(self, tokens: TokenShards, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, prefetch: int = 2) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, "
                             f"{seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.prefetch = prefetch
        self._order = _Order(tokens, batch_size, seq_len, rank, world_size, seed)
        if self._order.steps_per_epoch < 1:
            need = world_size * batch_size * seq_len + seq_len
            raise ValueError(
                f"dataset too small: {tokens.num_tokens:,} tokens give "
                f"{max(self._order.windows, 0)} windows of {seq_len + 1} tokens, but one global "
                f"batch ({world_size} ranks x {batch_size}) needs {world_size * batch_size} "
                f"(at least {need:,} tokens); use more data or a smaller batch_size/seq_len")
        self.epoch, self.step = 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Any] | None = None
        self._finalizer: Any = None
        self._closed = False
        self._start()

    # -- worker ---------------------------------------------------------------------------

    def _start(self) -> None:
        if self.prefetch == 0:
            return
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        order = _Order(self.tokens, self.batch_size, self.seq_len, self.rank, self.world_size,
                       self.seed)  # the thread's own, so its cached permutation is private
        self._thread = threading.Thread(
            target=_produce, args=(order, self.epoch, self.step, self._queue, self._stop),
            name=f"gradzip-batches-rank{self.rank}", daemon=True)
        self._thread.start()
        # stop the thread if the loader is dropped without close(); no reference to self
        self._finalizer = weakref.finalize(self, _stop_worker, self._stop, self._thread,
                                           self._queue)

    def _halt(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_worker once
            self._finalizer = None
        self._thread, self._queue = None, None

    # -- iteration ------------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        """Global steps in one pass over the windows (the same on every rank)."""
        return self._order.steps_per_epoch

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed:
            raise RuntimeError("BatchLoader is closed")
        if self._queue is None:
            batch = self._order.batch(self.epoch, self.step)
        else:
            while True:
                try:
                    item = self._queue.get(timeout=1.0)
                    break
                except queue.Empty:
                    if self._thread is None or not self._thread.is_alive():
                        raise RuntimeError("the batch prefetch thread died") from None
            if isinstance(item, _Failure):
                self.close()
                raise RuntimeError(f"batch prefetch failed: {item.exc!r}") from item.exc
            batch = item
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return batch

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch, plus what must match on resume."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "step": self.step,
                "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "world_size": self.world_size, "num_tokens": self.tokens.num_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the following batches equal those of the saved run."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} is not "
                             f"{STATE_VERSION}")
        mine = self.state_dict()
        for key in ("seed", "batch_size", "seq_len", "world_size", "num_tokens"):
            if state.get(key) != mine[key]:
                raise ValueError(f"cannot resume the data position: {key} was {state.get(key)}"
                                 f" when saved, is {mine[key]} now (the batches would differ)")
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"loader state position epoch={epoch} step={step} is out of range")
        self._halt()
        self.epoch, self.step = epoch, step
        if not self._closed:
            self._start()

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop and join the prefetch thread; idempotent."""
        self._closed = True
        self._halt()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BatchLoader(rank {self.rank}/{self.world_size}, batch {self.batch_size}x"
                f"{self.seq_len}, epoch {self.epoch} step {self.step}/{self.steps_per_epoch})")
