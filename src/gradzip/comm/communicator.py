"""``TorchCommunicator``: the codec ``Communicator`` over a torch.distributed process group.

Codecs never import torch.distributed; the hooks in this package hand them one of
these. Byte counting happens in the base class (the link bytes of each collective, and
the bytes handed to it), so every collective a codec issues — the payload
itself, size exchanges, PowerSGD's second round, a max all-reduce of scales — is
counted the same way. Device-agnostic: tensors stay on whatever device they are on
(gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from gradzip.collectives.communicator import Communicator
from gradzip.collectives.linkmodel import backend_model

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchCommunicator(Communicator):
    """Blocking collectives on ``group`` (None = the default group), counted per op.

    On a GPU a blocking collective returns when NCCL has it enqueued. By default the
    calling stream (gradzip's own, on the communication thread) is synchronized after
    each one, so the counters time the transfer, not the enqueue (the jobs read most
    results on the host next anyway). With ``deferred`` set (a hook on the autograd
    thread, which must not wait), nothing is synchronized: each collective is
    bracketed by CUDA events instead (``events``), read when the step closes.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call dist.init_process_group first"
            )
        self.group = group
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.counter.backend = backend_model(dist.get_backend(group))
        #: (op, start event, end event) of each collective since ``events.clear()``,
        #: on a GPU with ``deferred`` set
        self.events: list[tuple[str, Any, Any]] = []

    def on_events(self, t: torch.Tensor) -> bool:
        """Whether collectives on ``t`` are timed by events, without a sync."""
        return t.device.type == "cuda" and self.deferred is not None

    @contextmanager
    def _collective(self, op: str, t: torch.Tensor) -> Iterator[None]:
        """Run one collective on ``t``'s device: then synchronize, or record its events."""
        timed = self.on_events(t)
        start = torch.cuda.Event(enable_timing=True) if timed else None
        if start is not None:
            start.record()
        yield
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((op, start, end))
        elif t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()

    # ------------------------------------------------------------ transport
    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        # on a copy: callers may still read the tensor they passed (a summable codec
        # decodes its own payload after the all-reduce for error feedback's residual),
        # and the simulated communicator leaves inputs untouched too
        out = t.clone(memory_format=torch.contiguous_format)
        with self._collective("all_reduce", t):
            dist.all_reduce(out, op=_OPS[op], group=self.group)
        return out

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        with self._collective("all_gather", t):
            dist.all_gather(out, t, group=self.group)
        return out

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Chunk j to rank j, one chunk back from each, shaped like the one sent there.

        One ``all_to_all_single`` on the chunks back to back: every backend has it
        (gloo's list ``all_to_all`` is missing from some torch releases gradzip
        supports: "Backend gloo does not support alltoall" on torch 2.11). gloo runs
        it on host tensors only, so on a device a refusal sends it through the host."""
        if not chunks:
            return []
        sizes = [c.numel() for c in chunks]
        sent = torch.cat([c.reshape(-1) for c in chunks])
        got = torch.empty_like(sent)
        try:
            with self._collective("all_to_all", chunks[0]):
                dist.all_to_all_single(got, sent, output_split_sizes=sizes,
                                       input_split_sizes=sizes, group=self.group)
        except RuntimeError as e:
            if sent.device.type == "cpu" or "does not support" not in str(e):
                raise
            host = torch.empty_like(sent, device="cpu")
            with self._collective("all_to_all", host):
                dist.all_to_all_single(host, sent.cpu(), output_split_sizes=sizes,
                                       input_split_sizes=sizes, group=self.group)
            got = host.to(sent.device)
        return [part.view_as(c) for part, c in zip(got.split(sizes), chunks, strict=True)]

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.contiguous().reshape(-1)  # gloo wants 1-D: world x n in, n out
        out = torch.empty(t.shape[1], dtype=t.dtype, device=t.device)
        with self._collective("reduce_scatter", t):
            dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def _broadcast(self, t: torch.Tensor, src: int) -> tuple[torch.Tensor, str]:
        out = t.clone(memory_format=torch.contiguous_format)  # ``t`` stays as it was
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        with self._collective("broadcast", t):
            dist.broadcast(out, src=root, group=self.group)
        return out, "broadcast"


class HostCommunicator(TorchCommunicator):
    """The same collectives on a gloo group, for tensors on any device: each one's
    inputs go to the host, and its results come back to the inputs' device.

    For a background thread beside NCCL: NCCL does not support collectives issued from
    two threads on two communicators in an order that differs between ranks (DiLoCo's
    exchange thread against the main thread's log all-reduce, evaluation or checkpoint
    barrier: a hang). On gloo the two threads' collectives never share a communicator,
    and gloo's order is per group."""

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return super()._all_reduce(t.cpu(), op).to(t.device)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [r.to(t.device) for r in super()._all_gather(t.cpu())]

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        device = chunks[0].device if chunks else torch.device("cpu")
        return [r.to(device) for r in super()._all_to_all([c.cpu() for c in chunks])]

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        return super()._reduce_scatter(t.cpu()).to(t.device)

    def _broadcast(self, t: torch.Tensor, src: int) -> tuple[torch.Tensor, str]:
        out, op = super()._broadcast(t.cpu(), src)
        return out.to(t.device), op
