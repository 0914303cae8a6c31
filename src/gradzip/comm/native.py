"""FSDP2's own gradient collectives, counted from outside: plain FSDP and native HSDP.

Without a codec FSDP2 reduces gradients itself (a reduce-scatter per unit and, under
HSDP, an all-reduce over the replicate group), and gradzip must not replace that: it is
every FSDP comparison's baseline. ``NativeCollectives`` wraps the ``torch.distributed``
functions FSDP2 calls (``reduce_scatter_single`` in torch 2.13, ``reduce_scatter_tensor``
before it; the old names forward to the new ones inside ``distributed_c10d``, never
through the wrapped attribute, so no call is counted twice) and records each call in a
``CommStats`` as the link byte model counts it, like every other run's figures.

Only gradient traffic counts, as for DDP and for FSDP with a codec: FSDP2's parameter
all-gathers are not wrapped. The trainer's own all-reduces (losses, flags) name no
group, so a replicate-group filter leaves them out. On CUDA a call returns at enqueue
time: its time is two events on the calling stream (FSDP2's reduce-scatter stream),
read when the step closes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradzip.collectives.linkmodel import backend_model, link_bytes
from gradzip.comm.eventtimes import EventTimings
from gradzip.comm.stats import CommStats, Reduction

#: FSDP2's reduce-scatter, by the names torch >= 2.9 call it
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def _input_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The input tensor of a reduce-scatter (``output, input, ...``; FSDP2 passes both
    by keyword)."""
    if "input" in kwargs:
        return kwargs["input"]
    return args[1]


class NativeCollectives:
    """Counts FSDP2's reduce-scatters (link ``shard`` under HSDP) and, with
    ``replicate_group``, native HSDP's all-reduces over it (link ``replicate``), into
    ``stats``, until ``close``."""

    def __init__(self, replicate_group: Any = None) -> None:
        self.stats = CommStats()
        self.replicate_group = replicate_group
        self._timings = EventTimings()
        self.stats.add_settler(self._timings.settle)
        #: name -> (the function wrapped, its wrapper)
        self._saved: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        shard_link = "shard" if replicate_group is not None else ""
        for name in REDUCE_SCATTERS:
            if hasattr(dist, name):
                self._wrap(name, "reduce_scatter", _input_of, shard_link)
        if replicate_group is not None:
            self._wrap("all_reduce", "all_reduce",
                       lambda a, k: a[0] if a else k["tensor"], "replicate",
                       only=replicate_group)

    def _wrap(self, name: str, op: str,
              tensor_of: Callable[[tuple[Any, ...], dict[str, Any]], torch.Tensor],
              link: str, only: Any = None) -> None:
        original = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if only is not None and group is not only:
                return original(*args, **kwargs)
            t = tensor_of(args, kwargs)
            cuda = t.is_cuda
            if cuda:
                start_event = torch.cuda.Event(enable_timing=True)
                start_event.record()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            end = time.perf_counter()
            self._record(op, t, group, link, (start, end),
                         (start_event, _recorded_event()) if cuda else None)
            return result

        setattr(dist, name, counted)
        self._saved[name] = (original, counted)

    def _record(self, op: str, t: torch.Tensor, group: Any, link: str,
                span: tuple[float, float], events: tuple[Any, Any] | None) -> None:
        world = dist.get_world_size(group)
        handed = t.numel() * t.element_size()
        wire = link_bytes(op, handed, world, backend_model(dist.get_backend(group)))
        r = Reduction(numel=t.numel(), sent_values=t.numel(), bytes_raw=wire,
                      bytes_handed=handed, bytes_by_op={op: wire}, calls_by_op={op: 1},
                      seconds_by_op={op: span[1] - span[0]}, paths=["torch"], span=span,
                      link=link)
        if events is None:
            self.stats.record(r)
        else:
            self._timings.later(r, self.stats, span=events, comm=events)

    def close(self) -> None:
        """Put back the functions this wrapped (only where they are still its own)."""
        for name, (original, wrapper) in self._saved.items():
            if getattr(dist, name) is wrapper:
                setattr(dist, name, original)
        self._saved = {}


def _recorded_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
