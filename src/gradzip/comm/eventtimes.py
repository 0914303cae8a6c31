"""Times that are still on a GPU: a reduction recorded once its CUDA events ran.

On NCCL a collective returns, and its future's callbacks run, when the work is
enqueued; so do a codec's kernels. A host clock there times the enqueue: a reduction
whose encode, all-reduce and decode take milliseconds on the GPU would read as
microseconds. Every hot path that must not wait for the GPU (the future-chained DDP
path, PyTorch's own hooks measured as ``torch:*`` methods) records a pair of
timing events around each part instead, on the stream that runs it, and hands the
reduction here; ``settle`` (a ``CommStats`` settler, run as the step closes, when the
step's work is done anyway) reads the events and records the reduction with its device
times. The spans it records are measured from the first start event of the step, so
overlapping buckets are counted once, as on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradzip.comm.stats import CommStats, Reduction


def event_pair() -> tuple[Any, Any]:
    """Two timing events; record the first now, on the current stream."""
    pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    pair[0].record()
    return pair


@dataclass
class _Untimed:
    reduction: Reduction
    stats: CommStats
    span: tuple[Any, Any]  # the whole reduction, call to completion
    comm: tuple[Any, Any] | None  # the collective alone: seconds_by_op
    encode: tuple[Any, Any] | None
    decode: tuple[Any, Any] | None
    #: a reduction of several collectives: (op, start, end) each, in issue order; the
    #: codec's time is the span outside them (``split``)
    comms: list[tuple[str, Any, Any]] | None = None


class EventTimings:
    """Reductions waiting for their CUDA events (see the module doc)."""

    #: a caller that never closes a step stays bounded
    LIMIT = 4096

    def __init__(self) -> None:
        self._untimed: list[_Untimed] = []
        self._origin: Any = None  # the event spans are measured from

    def later(self, r: Reduction, stats: CommStats, span: tuple[Any, Any], *,
              comm: tuple[Any, Any] | None = None, encode: tuple[Any, Any] | None = None,
              decode: tuple[Any, Any] | None = None,
              comms: list[tuple[str, Any, Any]] | None = None) -> None:
        """Record ``r`` in ``stats`` once its events ran: ``span`` sets its span,
        ``comm`` its one collective's seconds, ``encode``/``decode`` the codec's; or
        ``comms``, every collective's events (``split_codec_time``)."""
        if self._origin is None:
            self._origin = span[0]
        stats.hold()
        self._untimed.append(_Untimed(r, stats, span, comm, encode, decode, comms))
        if len(self._untimed) > self.LIMIT:
            self.settle(keep_origin=True)

    def settle(self, keep_origin: bool = False) -> None:
        """Read every pending reduction's events and record it (waits for them);
        ``keep_origin``: the step goes on (the spans after stay on one clock)."""
        untimed, self._untimed = self._untimed, []
        origin = self._origin
        if not keep_origin:
            self._origin = None
        for u in untimed:
            r = u.reduction
            u.span[1].synchronize()
            if u.comm is not None:
                op = next(iter(r.calls_by_op), "all_reduce")
                r.seconds_by_op = {op: _seconds(u.comm)}
            if u.encode is not None:
                r.encode_s = _seconds(u.encode)
            if u.decode is not None:
                r.decode_s = _seconds(u.decode)
            wire = u.span
            if u.comms:
                split_codec_time(r, u.span, u.comms)
                # the step's communication time is the union of collectives' spans: the
                # codec's time is in encode_s/decode_s already
                wire = (u.comms[0][1], u.comms[-1][2])
            r.span = (origin.elapsed_time(wire[0]) / 1e3, origin.elapsed_time(wire[1]) / 1e3)
            u.stats.record(r)
            u.stats.release()


def split_codec_time(r: Reduction, span: tuple[Any, Any],
                     comms: list[tuple[str, Any, Any]]) -> None:
    """Set ``r``'s collective seconds per op from their events, and (unless it was
    plain) its codec's: the decode from the last collective's end to the span's end,
    the encode the rest outside the collectives (a multi-round protocol's compute
    between rounds counts as encode, as on the host)."""
    seconds: dict[str, float] = {}
    each = []
    for op, start, end in comms:
        s = _seconds((start, end))
        seconds[op] = seconds.get(op, 0.0) + s
        each.append(s)
    r.seconds_by_op = seconds
    r.extra_collective_s = sum(each) - max(each)
    if r.paths != ["plain"]:
        r.decode_s = _seconds((comms[-1][2], span[1]))
        r.encode_s = max(_seconds(span) - sum(each) - r.decode_s, 0.0)


def _seconds(pair: tuple[Any, Any]) -> float:
    pair[1].synchronize()
    return float(pair[0].elapsed_time(pair[1])) / 1e3
