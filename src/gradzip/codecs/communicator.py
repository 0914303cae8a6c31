"""The Communicator: how multi-round codecs talk to their peers, counting every byte.

Codecs never import torch.distributed. They call these four collectives; the real
implementation (``gradzip.comm``) maps them onto a process group, and the simulated
one (``gradzip.codecs.simulated``) runs N virtual workers in threads of one process.

Byte accounting is done here, once, for every implementation, in two numbers per
collective: ``handed``, the bytes this rank hands to it (padding included), and
``wire``, the bytes this rank puts on its link for it, from the algorithm the
backend runs (``linkmodel.py``: a ring all-reduce sends 2(W-1)/W of its input, an
all-gather (W-1) times it). Only ``wire`` is reported as bytes on the wire.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from gradzip.codecs.linkmodel import link_bytes

REDUCE_OPS = ("sum", "max", "min")


@dataclass
class CommCounter:
    """Per collective, since the last ``reset``: link bytes, bytes handed, calls, time.

    ``wire[op]``: bytes this rank put on its link (the link model of ``op``);
    ``handed[op]``: bytes this rank handed to ``op`` (what a naive count would say).
    """

    world_size: int = 1
    #: the link model (``linkmodel.BACKENDS``): ``gloo`` for gloo process groups
    backend: str = "ideal"
    wire: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    handed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: the longest single call since the last reset (the reduction's main collective)
    longest: float = 0.0

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        """Count one ``op`` call that was handed ``nbytes`` by this rank."""
        self.handed[op] += nbytes
        self.wire[op] += link_bytes(op, nbytes, self.world_size, self.backend)
        self.calls[op] += 1
        self.seconds[op] += seconds
        self.longest = max(self.longest, seconds)

    @property
    def total_wire(self) -> int:
        return sum(self.wire.values())

    @property
    def total_handed(self) -> int:
        return sum(self.handed.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def reset(self) -> None:
        self.wire.clear()
        self.handed.clear()
        self.calls.clear()
        self.seconds.clear()
        self.longest = 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator(ABC):
    """Collectives over ``world_size`` ranks; subclasses provide the transport."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.counter = CommCounter(world_size=world_size)

    # ------------------------------------------------------------ transport
    @abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce ``t`` over ranks and return the result; ``t`` itself must be left
        unchanged (callers such as error feedback still read their own payload)."""

    @abstractmethod
    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on all ranks), in rank order."""

    @abstractmethod
    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``chunks[j]`` to rank j; return what each rank sent to this one.

        All chunks have the same shape and dtype on every rank.
        """

    @abstractmethod
    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (shape ``[world_size, n]``) over ranks and return row ``rank``."""

    # ------------------------------------------------------------ public
    def all_reduce(self, tensors: list[torch.Tensor], op: str = "sum") -> list[torch.Tensor]:
        """Element-wise reduce each tensor over ranks (``sum``, ``max`` or ``min``)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {REDUCE_OPS}, got {op!r}")
        out = []
        for t in tensors:
            start = time.perf_counter()
            out.append(self._all_reduce(t, op))
            self.counter.add("all_reduce", _nbytes(t), time.perf_counter() - start)
        return out

    def reduce_scatter_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (shape ``[world_size, ...]``) over ranks; return this rank's row."""
        if t.dim() < 1 or t.shape[0] != self.world_size:
            raise ValueError(
                f"reduce_scatter_sum needs a leading dim of {self.world_size}, got {tuple(t.shape)}"
            )
        start = time.perf_counter()
        out = self._reduce_scatter(t.reshape(self.world_size, -1))
        self.counter.add("reduce_scatter", _nbytes(t), time.perf_counter() - start)
        return out.reshape(t.shape[1:])

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor; shapes must agree across ranks."""
        start = time.perf_counter()
        out = self._all_gather(t)
        self.counter.add("all_gather", _nbytes(t), time.perf_counter() - start)
        return out

    def all_gather_bytes(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D uint8 buffer, sizes may differ (sizes exchanged first)."""
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError("all_gather_bytes takes a 1-D uint8 tensor")
        size = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
        sizes = [int(s) for s in self.all_gather(size)]
        longest = max(sizes)
        padded = data
        if data.numel() < longest:
            padded = torch.zeros(longest, dtype=torch.uint8, device=data.device)
            padded[: data.numel()] = data
        gathered = self.all_gather(padded)
        return [g[:n] for g, n in zip(gathered, sizes, strict=True)]

    def all_to_all_bytes(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send 1-D uint8 ``chunks[j]`` to rank j (sizes may differ); return received."""
        if len(chunks) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} chunks, got {len(chunks)}")
        device = chunks[0].device if chunks else torch.device("cpu")
        sizes = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
        all_sizes = self.all_gather(sizes)  # [rank i][j] = bytes i sends to j
        longest = max(int(s.max()) for s in all_sizes) if all_sizes else 0
        padded = []
        for c in chunks:
            buf = torch.zeros(longest, dtype=torch.uint8, device=device)
            buf[: c.numel()] = c
            padded.append(buf)
        start = time.perf_counter()
        received = self._all_to_all(padded)
        self.counter.add("all_to_all", longest * len(padded), time.perf_counter() - start)
        return [r[: int(all_sizes[i][self.rank])] for i, r in enumerate(received)]
