"""``TorchCommunicator``: the codec ``Communicator`` over a torch.distributed process group.

Codecs never import torch.distributed; the hooks in this package hand them one of
these. Byte counting happens in the base class (the link bytes of each collective, and
the bytes handed to it), so every collective a codec issues — the payload
itself, size exchanges, PowerSGD's second round, a max all-reduce of scales — is
counted the same way. Device-agnostic: tensors stay on whatever device they are on
(gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradzip.collectives.communicator import Communicator
from gradzip.collectives.linkmodel import backend_model

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchCommunicator(Communicator):
    """Blocking collectives on ``group`` (None = the default group), counted per op."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call dist.init_process_group first"
            )
        self.group = group
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.counter.backend = backend_model(dist.get_backend(group))

    # ------------------------------------------------------------ transport
    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        # on a copy: callers may still read the tensor they passed (a summable codec
        # decodes its own payload after the all-reduce for error feedback's residual),
        # and the simulated communicator leaves inputs untouched too
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=_OPS[op], group=self.group)
        return _finished(out)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        _finished(t)
        return out

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        chunks = [c.contiguous() for c in chunks]
        out = [torch.empty_like(c) for c in chunks]
        dist.all_to_all(out, chunks, group=self.group)
        if chunks:
            _finished(chunks[0])
        return out

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.contiguous().reshape(-1)  # gloo wants 1-D: world x n in, n out
        out = torch.empty(t.shape[1], dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=self.group)
        return _finished(out)


def _finished(t: torch.Tensor) -> torch.Tensor:
    """``t``, after the collective that wrote it has run (CUDA only).

    A blocking collective on NCCL returns when it is enqueued; the counters time each
    call, so the calling stream (gradzip's own, on the communication thread) is
    synchronized here and the time is the transfer's, not the enqueue's. The jobs read
    most results on the host next anyway.
    """
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    return t


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
