"""Flags a hook leaves on a GPU, read once, when backward ends.

On CPU a check reads its flag at once. On CUDA a read stalls the host until the GPU
catches up, and a hook on the autograd thread (DDP's chained callback, FSDP2's
reduce-scatter and all-reduce hooks) would stall backward with it. Instead each flag
(a non-finite input, a corrupt received payload) stays on the device, behind an event
on the stream that wrote it, and all of them are read in one host read when backward
has nothing left to overlap: in a final autograd callback, before any optimizer step
can apply the result. While host syncs are counted on a CPU
(``bench.devicecheck.count_host_syncs``) the CPU takes this path too. Every rank holds the same
flags (they come out of the same collectives), so every rank raises there, with the
same words. Two limits: where an optimizer steps inside backward (a post-accumulate-grad
hook on the unit's parameters) the hook reads its flags at once instead
(``steps_in_backward``); and a check on received bytes (``codecs.validation``) is made
by the rank that received them only, so, as on the byte path, a corrupt payload stops
that rank while its peers may wait in the next collective until its timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradzip.codecs.nonfinite import host_reads_free


class PendingChecks:
    """Flags waiting on a GPU, each with the error it stands for."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, Any, Callable[[], Exception]]] = []

    def watch(self, flag: torch.Tensor, error: Callable[[], Exception]) -> None:
        """Raise ``error()`` if ``flag`` (0-d bool) is set: now where a host read is free
        (CPU), else at ``raise_ready``. The flag is read there after the stream that
        wrote it (an event recorded now), whatever stream reads it."""
        if host_reads_free(flag):
            if bool(flag):
                raise error()
            return
        event = None
        if flag.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending.append((flag.reshape(()), event, error))

    def raise_ready(self) -> None:
        """Raise for the first set flag among those watched so far (then forget them):
        one host read for all of them (and one per flag only when one is set)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        device = pending[0][0].device
        for _, event, _ in pending:
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)
        if not bool(torch.stack([flag.to(device) for flag, _, _ in pending]).any()):
            return
        for flag, _, error in pending:
            if bool(flag):
                raise error()


class AtBackwardEnd:
    """A hook's ``PendingChecks``, read in a final callback of each backward it runs in.

    ``arm`` is called by every reduction of the hook: the first of a backward (autograd
    graph task) queues the callback. A backward that aborted never ran its callback, so
    flags it left are read at the next one's first reduction."""

    def __init__(self) -> None:
        self.checks = PendingChecks()
        self._task: int | None = None

    def arm(self) -> None:
        task = torch._C._current_graph_task_id()
        if task < 0 or task == self._task:  # outside backward, or queued already
            return
        self.checks.raise_ready()
        torch.autograd.Variable._execution_engine.queue_callback(self.at_backward_end)
        self._task = task

    def at_backward_end(self) -> None:
        self._task = None
        self.checks.raise_ready()


def steps_in_backward(params: Iterable[torch.Tensor]) -> bool:
    """Whether an optimizer may step inside backward, right after a reduction of
    ``params`` (a post-accumulate-grad hook, FSDP2's optimizer-in-backward): its flags
    must then be read in the hook, before that step applies the result."""
    return any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params)
