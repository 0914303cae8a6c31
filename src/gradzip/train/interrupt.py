"""Ctrl-C and SIGTERM during training: finish the step, checkpoint, record, exit 130.

A signal only sets a flag (``StopRequest``). Ranks cannot simply stop when they see it:
torchrun forwards the signal to every worker at about the same moment, but one rank may
see it just before a step boundary and another just after, and the first would
checkpoint while the second waits in the next step's all-reduce. So the ranks agree: the
flag rides in the all-reduce that already averages the training loss at every
``--log-every`` step (a mean of 0/1 flags is above 0 when any rank was signalled), and
every rank stops at the same logged step. No collective is added, so link bytes, the
kernel's byte counter and profiler traces are what they were; the price is that a run
of several ranks stops at the next logged step (a single process stops after the step
it is in). Megatron-LM agrees on its exit signal with an all-gather every iteration.

A second Ctrl-C aborts at once (KeyboardInterrupt: no checkpoint at the interrupt).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

#: the exit status of a run stopped by a signal, as a shell reports a SIGINT'd process
EXIT_INTERRUPTED = 130

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


#: the loops of other threads (``--replicas``) that the main thread's signals reach
_listeners: set[StopRequest] = set()
_listening = threading.Lock()


@contextlib.contextmanager
def forward_signals() -> Iterator[None]:
    """In the main thread, for the block: SIGINT and SIGTERM reach every training loop
    running in another thread (the replicas of ``--replicas``), each as if it had been
    signalled itself; they agree on stopping as ranks do."""

    def deliver(signum: int, frame: FrameType | None) -> None:
        with _listening:
            loops = list(_listeners)
        for loop in loops:
            loop._on_signal(signum, frame)

    previous = {sig: signal.signal(sig, deliver) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StopRequest:
    """SIGINT/SIGTERM handlers for one training loop: the first signal is remembered."""

    def __init__(self, *, announce: bool = True, when: str = "this step") -> None:
        self.signal_name: str | None = None  # the first signal seen here, if any
        self.announce = announce  # print what happens next (rank 0)
        self.when = when  # where the run will stop, for that message
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        """Take SIGINT and SIGTERM in the main thread; in another (a replica's), receive
        what the main thread's ``forward_signals`` hands on."""
        try:
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: leave the handlers alone
            self.restore()
            with _listening:
                _listeners.add(self)
        return self

    def restore(self) -> None:
        """Put the previous handlers back (stop listening, in another thread)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        with _listening:
            _listeners.discard(self)

    @property
    def requested(self) -> bool:
        """A signal reached this process (this rank's view; ranks agree at a log step)."""
        return self.signal_name is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None:  # the second one: stop now
            self.restore()
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        if self.announce:
            print(f"\n{self.signal_name}: finishing {self.when}, then a checkpoint and the "
                  f"results record (Ctrl-C again to stop at once, without them)",
                  file=sys.stderr, flush=True)
