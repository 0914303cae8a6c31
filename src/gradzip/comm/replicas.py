"""W replicas in one process: one thread per rank, each with its own torch.distributed
world, running the same code a real rank runs (``gradzip train --replicas W``).

A machine with 2 cores cannot run 8 processes of a useful model, but one process can run
8 replicas. Each replica thread joins a world of its own (thread-local) on PyTorch's
threaded backend, so DDP, gradzip's hooks and process groups, DiLoCo and SparseLoCo run
unchanged: the same codecs, aggregation paths and byte counts as gloo ranks, with every
collective a copy between threads that reduces in rank order (gloo's ring of 2 ranks
adds the same two values; of 4 or more, in another order: float rounding apart).

**Time.** Replicas share the cores, so wall time says nothing about one replica. Each
replica's time is the CPU time of its threads (``ReplicaClock``: the training thread and
the communication threads it starts, which call ``count_this_thread``), which is its
compute on one core when torch runs one intra-op thread; the link's time is then the
stated model's (``LinkModel``), added by the trainer per step.

The threaded backend is PyTorch's own (``torch.testing._internal.distributed``, the one
its multi-threaded tests use); only this module touches it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

#: the backend name PyTorch's threaded process group registers
BACKEND = "threaded"

_local = threading.local()
_install_lock = threading.Lock()
_serial = threading.Lock()
_installed = False


class ReplicaClock:
    """CPU seconds of one replica's threads: its training thread, and the threads that
    joined it (``inherit``). A thread that ended keeps the time it had when last read
    (or when it called ``leave``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clocks: dict[int, int] = {}  # thread ident -> its CPU clock id
        self._last: dict[int, float] = {}  # thread ident -> its seconds when last read
        self._ended = 0.0  # seconds of counted threads that have ended

    def add_current_thread(self) -> None:
        with self._lock:
            ident = threading.get_ident()
            self._clocks[ident] = time.pthread_getcpuclockid(ident)
            self._last[ident] = 0.0

    def remove_current_thread(self) -> None:
        with self._lock:
            ident = threading.get_ident()
            if ident in self._clocks:
                self._ended += time.clock_gettime(self._clocks.pop(ident))
                self._last.pop(ident)

    def now(self) -> float:
        with self._lock:
            for ident, clock in list(self._clocks.items()):
                try:
                    self._last[ident] = time.clock_gettime(clock)
                except OSError:  # the thread ended without ``leave``
                    self._ended += self._last.pop(ident)
                    del self._clocks[ident]
            return self._ended + sum(self._last.values())


@dataclass(frozen=True)
class LinkModel:
    """The stated link model of a simulated step (``compare/sweep.py``, with no token
    bucket: a real NIC): ``calls`` collectives of ``latency_s`` each, then ``bytes`` of
    one rank at ``bits_per_s``. DDP's overlap of communication with backward is not
    modelled (the built-in models fit one bucket, which starts after backward)."""

    bits_per_s: float
    latency_s: float
    rate: str  # as the user wrote it (e.g. 1gbit)

    def seconds(self, nbytes: int, calls: int) -> float:
        return calls * self.latency_s + 8.0 * nbytes / self.bits_per_s


@dataclass
class Replica:
    """What a replica thread knows about itself."""

    rank: int
    world_size: int
    clock: ReplicaClock
    link: LinkModel | None


def current() -> Replica | None:
    """The replica this thread works for (its training thread or one it started and
    that called ``count_this_thread``); None outside ``run_replicas``."""
    return getattr(_local, "replica", None)


def inherit() -> Callable[[], None]:
    """Call in a replica thread; returns what a thread it starts calls first, so that the
    new thread's CPU time counts towards the replica (a no-op outside replicas)."""
    replica = current()

    def start() -> None:
        if replica is not None:
            _local.replica = replica
            replica.clock.add_current_thread()

    return start


def leave() -> None:
    """Call last in a thread that ``inherit`` started: keep its time on the clock."""
    replica = current()
    if replica is not None:
        replica.clock.remove_current_thread()


@contextlib.contextmanager
def one_at_a_time() -> Iterator[None]:
    """Replicas take turns in the block (their code draws from torch's one global random
    generator: a model's initial weights must not depend on how threads interleave);
    outside replicas nothing."""
    if current() is None:
        yield
        return
    with _serial:
        yield


def _install() -> Any:
    """PyTorch's threaded world, once per process: torch.distributed's state becomes
    thread-local, so each replica thread has a world of its own."""
    global _installed
    try:
        from torch.testing._internal.distributed import multi_threaded_pg
    except ImportError as e:  # a torch built without its testing package
        raise RuntimeError(f"--replicas needs PyTorch's threaded process group "
                           f"(torch.testing._internal.distributed): {e}") from e
    with _install_lock:
        if not _installed:
            multi_threaded_pg._install_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
            _installed = True
    return multi_threaded_pg.ProcessLocalGroup


def run_replicas(world_size: int, fn: Callable[[int], T], *,
                 link: LinkModel | None = None) -> list[T]:
    """``[fn(0), ..., fn(world_size - 1)]``, each on a replica thread that has joined a
    threaded world of ``world_size`` ranks. The first replica that fails stops the others
    (their collectives end) and its error is raised here."""
    if world_size < 1:
        raise ValueError(f"replicas must be >= 1, got {world_size}")
    if dist.is_initialized():
        raise RuntimeError("--replicas runs its own ranks: torch.distributed is already "
                           "initialized in this process (do not start it under torchrun)")
    group_class = _install()
    group_class.reset()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def replica(rank: int) -> None:
        _local.replica = Replica(rank, world_size, ReplicaClock(), link)
        _local.replica.clock.add_current_thread()
        try:
            dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank)
            finally:
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            errors[rank] = e
            group_class.exception_handle(e)  # the others' collectives end (SystemExit)
        finally:
            _local.replica = None

    threads = [threading.Thread(target=replica, args=(r,), name=f"gradzip-replica{r}",
                                daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # a timed join lets Ctrl-C reach this (main) thread
            t.join(timeout=0.5)
    first = next((e for e in errors if e is not None and not isinstance(e, SystemExit)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return results
