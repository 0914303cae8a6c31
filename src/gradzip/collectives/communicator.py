"""The Communicator: how multi-round codecs talk to their peers, counting every byte.

Codecs never import torch.distributed. They call these collectives; the real
implementation (``gradzip.comm``) maps them onto a process group, and the simulated
one (``gradzip.collectives.simulated``) runs N virtual workers in threads of one process.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gradzip.collectives.linkmodel import link_bytes
from gradzip.collectives.upload import device_tensor

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


@dataclass
class _Flag:
    """A flag waiting for a collective to carry it (``Communicator.carry_flag``)."""

    raised: bool
    error: Callable[[], Exception]
    device: torch.device


def on_host(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Equal-length byte buffers of a collective, on the host in one device-to-host
    copy (one host sync for all of them, not one per buffer)."""
    if not buffers or all(b.device.type == "cpu" for b in buffers):
        return buffers
    return list(torch.stack(buffers).cpu().unbind(0))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator(ABC):
    """Collectives over ``world_size`` ranks; subclasses provide the transport."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.counter = CommCounter(world_size=world_size)
        self._flag: _Flag | None = None
        #: where ``watch`` hands a flag instead of reading it (a hook on a GPU, which
        #: reads them all once, when backward ends); None: read at once
        self.deferred: Callable[[torch.Tensor, Callable[[], Exception]], None] | None = None

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

    def _broadcast(self, t: torch.Tensor, src: int) -> tuple[torch.Tensor, str]:
        """(rank ``src``'s ``t`` on every rank, the collective that moved it).

        A transport with a broadcast of its own overrides this. The default is an
        all-reduce of ``t`` on ``src`` and zeros elsewhere, and it is counted as the
        all-reduce it is: 2 (W-1)/W of ``t`` per rank, not a broadcast's (W-1)/W."""
        sent = t if self.rank == src else torch.zeros_like(t)
        return self._all_reduce(sent, "sum"), "all_reduce"

    # ------------------------------------------------------------ a flag on the next call
    def carry_flag(self, raised: bool, error: Callable[[], Exception],
                   device: torch.device) -> None:
        """Carry this rank's flag (a non-finite input) on the next all-reduce or all-gather.

        A multi-round protocol has no round of its own for the news that some rank's
        gradient was NaN, and a rank that raised alone would leave its peers waiting
        in the protocol's first collective. So the flag rides on that collective: a
        NaN in the first value of a float sum (no extra byte), else one more element.
        Every rank reads the result and raises ``error()`` together if any rank set
        it. ``settle_flag`` agrees on a flag no collective carried.
        """
        self._flag = _Flag(raised, error, device)

    def settle_flag(self) -> None:
        """Agree on a flag still pending (one max all-reduce), raising if any rank set it."""
        flag, self._flag = self._flag, None
        if flag is not None:
            mark = device_tensor([1.0 if flag.raised else 0.0], flag.device)
            if float(self.all_reduce([mark], op="max")[0]) > 0:
                raise flag.error()

    def drop_flag(self) -> None:
        """Forget a pending flag (the protocol failed for another reason)."""
        self._flag = None

    def _with_flag(self, t: torch.Tensor, op: str) -> tuple[torch.Tensor, Callable[
            [torch.Tensor], torch.Tensor]]:
        """``t`` with the pending flag on it, and how to take it off the result again."""
        flag, self._flag = self._flag, None
        assert flag is not None
        if t.dtype.is_floating_point and t.numel():
            # NaN survives a sum; +inf a max, -inf a min (a NaN in a max or min is
            # lost or kept by the order the backend compares in)
            poison = {"sum": float("nan"), "max": float("inf"), "min": float("-inf")}[op]
            sent = t.clone() if flag.raised else t
            if flag.raised:
                sent.view(-1)[:1] = poison

            def check_head(out: torch.Tensor) -> torch.Tensor:
                head = out.reshape(-1)[:1]
                if bool(head.isnan().all() if op == "sum" else head.isinf().all()):
                    raise flag.error()
                return out
            return sent, check_head
        mark = (-1 if op == "min" else 1) if flag.raised else 0
        sent = torch.cat([t.reshape(-1), t.new_full((1,), mark)])

        def strip(out: torch.Tensor) -> torch.Tensor:
            last = out.reshape(-1)[-1:]
            if bool((last < 0) if op == "min" else (last > 0)):
                raise flag.error()
            return out.reshape(-1)[:-1].reshape(t.shape)
        return sent, strip

    def watch(self, flag: torch.Tensor, error: Callable[[], Exception]) -> None:
        """Raise ``error()`` if ``flag`` (a 0-d bool every rank computed alike) is set:
        now (one host read), or where ``deferred`` says (later, with the step's other
        flags, before anything uses the result)."""
        if self.deferred is not None:
            self.deferred(flag, error)
        elif bool(flag):
            raise error()

    # ------------------------------------------------------------ public
    def all_reduce(self, tensors: list[torch.Tensor], op: str = "sum") -> list[torch.Tensor]:
        """Element-wise reduce each tensor over ranks (``sum``, ``max`` or ``min``)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {REDUCE_OPS}, got {op!r}")
        out = []
        for t in tensors:
            strip: Callable[[torch.Tensor], torch.Tensor] | None = None
            if self._flag is not None:
                t, strip = self._with_flag(t, op)
            start = time.perf_counter()
            reduced = self._all_reduce(t, op)
            self.counter.add("all_reduce", _nbytes(t), time.perf_counter() - start)
            out.append(strip(reduced) if strip is not None else reduced)
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

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``t`` on every rank (``t``: the same shape and dtype on all;
        its values matter on ``src`` only, and it is left unchanged)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast source must be in [0, {self.world_size}), got {src}")
        if self.world_size == 1:
            return t.clone()
        start = time.perf_counter()
        out, op = self._broadcast(t, src)
        self.counter.add(op, _nbytes(t), time.perf_counter() - start)
        return out

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor; shapes must agree across ranks."""
        flag, self._flag = self._flag, None
        sent = t if flag is None else torch.cat(
            [t.reshape(-1), t.new_full((1,), 1 if flag.raised else 0)])
        start = time.perf_counter()
        out = self._all_gather(sent)
        self.counter.add("all_gather", _nbytes(sent), time.perf_counter() - start)
        if flag is None:
            return out
        if bool(torch.stack([o.reshape(-1)[-1] for o in out]).ne(0).any()):
            raise flag.error()
        return [o.reshape(-1)[:-1].reshape(t.shape) for o in out]

    def all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``chunks[j]`` to rank j, all of one shape and dtype on every rank; return
        what each rank sent to this one, on the chunks' device."""
        if len(chunks) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} chunks, got {len(chunks)}")
        kinds = {(tuple(c.shape), c.dtype) for c in chunks}
        if len(kinds) > 1:  # a backend would abort the process on the size mismatch
            raise ValueError(f"all_to_all needs chunks of one shape and dtype, got {kinds}; "
                             "pad them (all_to_all_bytes does)")
        start = time.perf_counter()
        out = self._all_to_all(chunks)
        self.counter.add("all_to_all", sum(_nbytes(c) for c in chunks),
                         time.perf_counter() - start)
        return out

    def all_gather_bytes(self, data: torch.Tensor | None,
                         device: torch.device | None = None) -> list[torch.Tensor] | None:
        """Every rank's 1-D uint8 buffer, sizes may differ (sizes exchanged first), on
        the host: every receiver parses them there, so they come back in one copy.

        A rank with nothing to send (``data`` None, on ``device``: its gradient was
        non-finite) says so in the size exchange; then every rank gets None and the
        payloads are not exchanged.
        """
        if data is not None and (data.dtype != torch.uint8 or data.dim() != 1):
            raise ValueError("all_gather_bytes takes a 1-D uint8 tensor")
        where = data.device if data is not None else (device or torch.device("cpu"))
        size = device_tensor([-1 if data is None else data.numel()], where, torch.int64)
        sizes = torch.cat(self.all_gather(size)).tolist()  # one host read
        if data is None or min(sizes) < 0:
            return None
        longest = max(sizes)
        padded = data
        if data.numel() < longest:
            padded = torch.zeros(longest, dtype=torch.uint8, device=data.device)
            padded[: data.numel()] = data
        gathered = on_host(self.all_gather(padded))
        return [g[:n] for g, n in zip(gathered, sizes, strict=True)]

    def all_to_all_bytes(self, chunks: list[torch.Tensor] | None,
                         device: torch.device | None = None) -> list[torch.Tensor] | None:
        """Send 1-D uint8 ``chunks[j]`` to rank j (sizes may differ); return received,
        on the host, in one copy.

        ``chunks`` None (a non-finite gradient, on ``device``): as ``all_gather_bytes``,
        every rank gets None after the size exchange.
        """
        if chunks is not None and len(chunks) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} chunks, got {len(chunks)}")
        where = chunks[0].device if chunks else (device or torch.device("cpu"))
        counts = [-1] * self.world_size if chunks is None else [c.numel() for c in chunks]
        sizes = device_tensor(counts, where, torch.int64)
        # [rank i][j] = bytes i sends to j: one host read
        all_sizes = torch.stack(self.all_gather(sizes)).tolist()
        if chunks is None or min(min(row) for row in all_sizes) < 0:
            return None
        longest = max(max(row) for row in all_sizes) if all_sizes else 0
        padded = []
        for c in chunks:
            buf = torch.zeros(longest, dtype=torch.uint8, device=where)
            buf[: c.numel()] = c
            padded.append(buf)
        start = time.perf_counter()
        received = on_host(self._all_to_all(padded))
        self.counter.add("all_to_all", longest * len(padded), time.perf_counter() - start)
        return [r[: all_sizes[i][self.rank]] for i, r in enumerate(received)]
