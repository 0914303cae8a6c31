"""An in-process Communicator: N virtual workers, one thread each.

Used by tests and by ``gradzip bench aggregate`` to run every codec's multi-rank
protocol exactly as it would run over a real process group, without one. Results are
deterministic: reductions add contributions in rank order on every worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from gradzip.collectives.communicator import Communicator

T = TypeVar("T")


class _Exchange:
    """The shared mailbox of one simulated group."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.slots: list[Any] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)

    def swap(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return seen


class SimulatedCommunicator(Communicator):
    """One virtual worker's view of a simulated group."""

    def __init__(self, rank: int, exchange: _Exchange) -> None:
        super().__init__(rank, exchange.world_size)
        self._ex = exchange

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        parts = self._ex.swap(self.rank, t.clone())
        out = parts[0].clone()
        for p in parts[1:]:
            if op == "sum":
                out += p
            elif op == "max":
                torch.maximum(out, p, out=out)
            else:
                torch.minimum(out, p, out=out)
        return out

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = self._ex.swap(self.rank, t.clone())
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise RuntimeError(f"all_gather shapes differ across ranks: {sorted(shapes)}")
        return [p.clone() for p in parts]

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._ex.swap(self.rank, t.clone())
        out = parts[0][self.rank].clone()
        for p in parts[1:]:
            out += p[self.rank]
        return out

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        parts = self._ex.swap(self.rank, [c.clone() for c in chunks])
        return [parts[src][self.rank].clone() for src in range(self.world_size)]

    def _broadcast(self, t: torch.Tensor, src: int) -> tuple[torch.Tensor, str]:
        parts = self._ex.swap(self.rank, t.clone())
        if tuple(parts[src].shape) != tuple(t.shape):
            raise RuntimeError(f"broadcast shapes differ: {tuple(parts[src].shape)} from "
                               f"rank {src}, {tuple(t.shape)} here")
        return parts[src].clone(), "broadcast"


def simulated_group(world_size: int, timeout: float = 60.0) -> list[SimulatedCommunicator]:
    """``world_size`` communicators that talk to each other (use one per thread)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ex = _Exchange(world_size, timeout)
    return [SimulatedCommunicator(r, ex) for r in range(world_size)]


def run_simulated(world_size: int, fn: Callable[[int, SimulatedCommunicator], T]) -> list[T]:
    """Run ``fn(rank, comm)`` for every virtual worker concurrently; results by rank.

    An exception in any worker is re-raised here (the others are released by the
    barrier's timeout being broken).
    """
    comms = simulated_group(world_size)

    def work(rank: int) -> T:
        try:
            return fn(rank, comms[rank])
        except BaseException:
            comms[rank]._ex.barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=world_size) as pool:
        futures = [pool.submit(work, r) for r in range(world_size)]
        errors = [f.exception() for f in futures]
        broken = threading.BrokenBarrierError
        real = [e for e in errors if e is not None and not isinstance(e, broken)]
        if real:
            raise real[0]
        if any(errors):
            raise errors[0]  # type: ignore[misc]
        return [f.result() for f in futures]
