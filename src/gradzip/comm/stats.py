"""``CommStats``: what the gradient communication of each step cost, measured.

Every number comes from the collectives that actually ran (their real sizes, calls
and times), never from a codec's nominal ratio:

* ``bytes_wire``: the bytes this rank put on its links, per collective it ran, from
  the real tensor sizes and the algorithm the backend runs for that collective
  (``gradzip.collectives.linkmodel``: ring all-reduce 2(W-1)/W x n, all-gather
  (W-1) x n, all-to-all (W-1)/W x n, reduce-scatter (W-1)/W x n on NCCL but
  2(W-1)/W x n on gloo, which runs a whole all-reduce; on gloo every call adds its
  measured transport cost): payloads, padding, size exchanges, every extra round.
* ``bytes_raw``: the same link model for PyTorch's uncompressed collective of the
  same gradients in their own dtype (ring all-reduce for DDP, reduce-scatter for
  FSDP): the baseline of ``compression_ratio`` (a bf16 model's ``none`` is 1.0x).
* ``bytes_handed``: the bytes this rank handed to collectives. Not wire bytes (an
  all-gather's input crosses the link W-1 times); kept to compare with other tools.
* ``comm_ms``: wall time during which this rank had a collective in flight: the
  union of the reductions' intervals where they overlap (asynchronous buckets on the
  future-chained path), the sum where they run one after another (the communication
  thread). ``comm_ms_by_op``: time inside each kind of collective, summed per call.
* ``extra_collective_ms``: time in collective calls beyond the main one (its longest
  call) of each reduced tensor: second rounds, size exchanges, flags.
* ``encode_ms`` / ``decode_ms``: codec compute time (multi-round codecs interleave
  their compute with their collectives; all of it is reported as ``encode_ms``).
* ``index_bytes``: payload bytes of position fields (a field path component named
  ``deltas``, ``bitmap``, ``index``, ``indices``, ``idx`` or ``positions``), the
  positional overhead of sparsifiers.
* ``payload_bytes``: bytes of this rank's encoded payloads (what a codec made, before
  any collective framing); with ``index_bytes`` and the values sent it gives
  ``bits_per_kept_value``: ``indices`` and ``values`` bits per value a sparsifier kept
  (SparseLoCo's figure), None for dense codecs.
* ``density``: sent values / gradient entries (1.0 for dense codecs).
* ``extra_collectives``: collective calls beyond one per reduced tensor.
* ``aggregation``: how many codec calls took each aggregation path (``plain``
  uncompressed, ``all_reduce``, ``gather``, ``two_phase``, ``multi_round``,
  ``reduce_scatter``); ``auto`` picks gather or two-phase from the link model.
* ``residual_norm``: L2 norm over all error-feedback residuals after the step.
* ``grad_rel_error`` / ``grad_cos_sim``: only in diagnostic mode, against the exact
  mean gradient from an extra fp32 all-reduce whose bytes are reported separately
  as ``bytes_diagnostic`` and never counted in ``bytes_wire``.
* ``links``: where reductions cross more than one link (HSDP: the ``shard`` link
  inside a node, the ``replicate`` link between nodes), each link's ``bytes_raw``,
  ``bytes_wire``, ``bytes_handed``, ``compression_ratio``, ``comm_ms`` and
  ``reductions``; the top-level figures are their sums. Empty with one link.

The hook (possibly on a communication thread) records into the open step; the
trainer calls ``end_step()`` once per optimizer step to close it.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Acc:
    """Sums over the reductions of one step (or of all steps)."""

    reductions: int = 0
    numel: int = 0
    sent_values: int = 0
    #: values and values kept of the reductions that sent an encoded payload (a plain
    #: reduction, DDP's first step or before ``start_step``, sends every value)
    coded_numel: int = 0
    coded_kept: int = 0
    bytes_raw: int = 0
    bytes_wire: int = 0
    bytes_handed: int = 0
    index_bytes: int = 0
    payload_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    seconds_by_op: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    paths: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    diagnosed: bool = False
    bytes_diagnostic: int = 0
    err_sq: float = 0.0
    ref_sq: float = 0.0
    est_sq: float = 0.0
    dot: float = 0.0
    residual_norm: float | None = None
    extra_collective_s: float = 0.0
    #: (start, end) of asynchronous reductions, which may overlap each other
    spans: list[tuple[float, float]] = field(default_factory=list)
    #: collective seconds of reductions that ran one after another (no span)
    sequential_s: float = 0.0
    #: comm seconds of closed steps (each step's union computed when it closed)
    closed_comm_s: float = 0.0
    #: per named link: bytes_raw, bytes_wire, bytes_handed, seconds, reductions
    links: dict[str, dict[str, float]] = field(default_factory=dict)

    def comm_s(self) -> float:
        return self.closed_comm_s + self.sequential_s + union_length(self.spans)

    def merge(self, o: _Acc) -> None:
        """Add a closed step ``o`` into these totals."""
        self.closed_comm_s += o.comm_s()
        for name in ("reductions", "numel", "sent_values", "coded_numel", "coded_kept",
                     "bytes_raw", "bytes_wire",
                     "bytes_handed", "index_bytes", "payload_bytes", "encode_s", "decode_s",
                     "bytes_diagnostic", "err_sq", "ref_sq", "est_sq", "dot", "extra_collective_s"):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        for op, v in o.seconds_by_op.items():
            self.seconds_by_op[op] += v
        for op, v in o.bytes_by_op.items():
            self.bytes_by_op[op] += v
        for op, v in o.calls_by_op.items():
            self.calls_by_op[op] += v
        for path, v in o.paths.items():
            self.paths[path] += v
        for name, figures in o.links.items():
            mine = self.links.setdefault(name, dict.fromkeys(figures, 0))
            for key, v in figures.items():
                mine[key] += v
        self.diagnosed = self.diagnosed or o.diagnosed
        if o.residual_norm is not None:
            self.residual_norm = o.residual_norm

    def bits_per_kept_value(self) -> dict[str, float] | None:
        """Payload bits per value a sparsifier kept, for its indices and its values
        (everything else: scales, headers), over the reductions that sent a payload;
        None when every value was sent. Plain reductions are left out: their values
        were kept but crossed outside any payload."""
        kept = self.coded_kept
        if not kept or kept >= self.coded_numel or not self.payload_bytes:
            return None
        values = max(self.payload_bytes - self.index_bytes, 0)
        return {"indices": 8 * self.index_bytes / kept, "values": 8 * values / kept}

    def view(self, steps: int) -> dict[str, Any]:
        calls = sum(self.calls_by_op.values())
        cos = None
        rel = None
        if self.diagnosed:
            rel = math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq > 0 else 0.0
            denom = math.sqrt(self.ref_sq * self.est_sq)
            cos = self.dot / denom if denom > 0 else 1.0
        return {
            "steps": steps,
            "bytes_raw": self.bytes_raw,
            "bytes_wire": self.bytes_wire,
            "bytes_handed": self.bytes_handed,
            "compression_ratio": self.bytes_raw / self.bytes_wire if self.bytes_wire else None,
            "index_bytes": self.index_bytes,
            "density": self.sent_values / self.numel if self.numel else None,
            "payload_bytes": self.payload_bytes,
            "bits_per_kept_value": self.bits_per_kept_value(),
            "encode_ms": self.encode_s * 1e3,
            "decode_ms": self.decode_s * 1e3,
            "comm_ms": self.comm_s() * 1e3,
            "extra_collective_ms": self.extra_collective_s * 1e3,
            "comm_ms_by_op": {op: s * 1e3 for op, s in sorted(self.seconds_by_op.items())},
            "bytes_by_op": dict(sorted(self.bytes_by_op.items())),
            "calls_by_op": dict(sorted(self.calls_by_op.items())),
            "extra_collectives": max(calls - self.reductions, 0),
            "aggregation": dict(sorted(self.paths.items())),
            "residual_norm": self.residual_norm,
            "grad_rel_error": rel,
            "grad_cos_sim": cos,
            "bytes_diagnostic": self.bytes_diagnostic,
            "links": {name: _link_view(f) for name, f in sorted(self.links.items())},
        }


def _link_view(f: dict[str, float]) -> dict[str, Any]:
    """One link's figures as ``view`` reports them."""
    return {"bytes_raw": int(f["bytes_raw"]), "bytes_wire": int(f["bytes_wire"]),
            "bytes_handed": int(f["bytes_handed"]),
            "compression_ratio": f["bytes_raw"] / f["bytes_wire"] if f["bytes_wire"] else None,
            "comm_ms": f["seconds"] * 1e3, "reductions": int(f["reductions"])}


@dataclass
class Reduction:
    """What one reduction of one tensor cost (filled by the reducer)."""

    numel: int
    sent_values: int
    bytes_raw: int
    bytes_handed: int = 0
    index_bytes: int = 0
    #: bytes of this rank's encoded payloads
    payload_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    seconds_by_op: dict[str, float] = field(default_factory=dict)
    bytes_by_op: dict[str, int] = field(default_factory=dict)
    calls_by_op: dict[str, int] = field(default_factory=dict)
    #: aggregation path of each codec call: plain, all_reduce, gather, two_phase,
    #: multi_round or reduce_scatter
    paths: list[str] = field(default_factory=list)
    #: seconds in calls beyond the main (longest) one
    extra_collective_s: float = 0.0
    #: (start, end) perf_counter times of an asynchronous reduction, which may overlap
    #: others; None when it ran on the communication thread, one after another
    span: tuple[float, float] | None = None
    #: the link it crossed where there are several (HSDP: "shard" or "replicate")
    link: str = ""


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    busy, covered_to = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    return busy


class CommStats:
    """Per-step and cumulative communication statistics of one attached codec."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = _Acc()
        self._last = _Acc()
        self._total = _Acc()
        self._residuals: dict[str, float | torch.Tensor] = {}
        self._ready: dict[str, Any] = {}  # events the residual tensors' streams recorded
        self._settlers: list[Callable[[], None]] = []
        self._held = 0  # reductions to be recorded when the step settles
        self._recorded = 0  # reductions recorded, every step
        #: bytes_raw and bytes_wire of the closed steps compressed throughout (no plain
        #: reduction): the steady compression ratio
        self._steady = {"bytes_raw": 0, "bytes_wire": 0}
        self.steps = 0

    def add_settler(self, settle: Callable[[], None]) -> None:
        """Call ``settle`` before a step closes: it records reductions whose times were
        still on a GPU (the chained path times its all-reduces with CUDA events)."""
        self._settlers.append(settle)

    # ------------------------------------------------------------ recording
    def record(self, r: Reduction) -> None:
        """Add one reduced tensor to the open step."""
        with self._lock:
            a = self._open
            self._recorded += 1
            a.reductions += 1
            a.numel += r.numel
            a.sent_values += r.sent_values
            if r.payload_bytes:
                a.coded_numel += r.numel
                a.coded_kept += r.sent_values
            a.bytes_raw += r.bytes_raw
            a.bytes_handed += r.bytes_handed
            a.index_bytes += r.index_bytes
            a.payload_bytes += r.payload_bytes
            a.encode_s += r.encode_s
            a.decode_s += r.decode_s
            for op, v in r.seconds_by_op.items():
                a.seconds_by_op[op] += v
            a.extra_collective_s += r.extra_collective_s
            if r.span is not None:
                a.spans.append(r.span)
            else:
                a.sequential_s += sum(r.seconds_by_op.values())
            for op, n in r.bytes_by_op.items():
                a.bytes_by_op[op] += n
                a.bytes_wire += n
            for op, n in r.calls_by_op.items():
                a.calls_by_op[op] += n
            for path in r.paths:
                a.paths[path] += 1
            if r.link:
                f = a.links.setdefault(r.link, {"bytes_raw": 0, "bytes_wire": 0,
                                                "bytes_handed": 0, "seconds": 0.0,
                                                "reductions": 0})
                f["bytes_raw"] += r.bytes_raw
                f["bytes_wire"] += sum(r.bytes_by_op.values())
                f["bytes_handed"] += r.bytes_handed
                f["seconds"] += sum(r.seconds_by_op.values())
                f["reductions"] += 1

    def record_diagnostic(self, err_sq: float, ref_sq: float, est_sq: float, dot: float,
                          nbytes: int) -> None:
        """Add one tensor's comparison against the exact mean (diagnostic mode)."""
        with self._lock:
            a = self._open
            a.diagnosed = True
            a.err_sq += err_sq
            a.ref_sq += ref_sq
            a.est_sq += est_sq
            a.dot += dot
            a.bytes_diagnostic += nbytes

    def record_residual(self, key: str, norm: float) -> None:
        """The error-feedback residual norm of ``key`` after its latest reduction."""
        self.record_residual_sq(key, norm * norm)

    def record_residual_sq(self, key: str, sq: float | torch.Tensor,
                           ready: Any = None) -> None:
        """The squared residual norm of ``key`` after its latest reduction; a tensor
        (on a GPU) is read as the step closes, with every other key's, in one read,
        after ``ready`` (a CUDA event on the stream that computed it)."""
        with self._lock:
            self._residuals[key] = sq
            if ready is not None:
                self._ready[key] = ready

    def end_step(self) -> None:
        """Close the open step: it becomes ``summary()`` and is added to ``totals()``."""
        for settle in self._settlers:  # they ``record``: outside the lock
            settle()
        with self._lock:
            if self._residuals:
                for event in self._ready.values():  # e.g. DiLoCo's exchange thread's
                    event.synchronize()
                self._ready.clear()
                self._open.residual_norm = math.sqrt(_total(list(self._residuals.values())))
            self._last = self._open
            self._total.merge(self._open)
            if self._open.reductions and "plain" not in self._open.paths:
                self._steady["bytes_raw"] += self._open.bytes_raw
                self._steady["bytes_wire"] += self._open.bytes_wire
            self._open = _Acc()
            self.steps += 1

    # ------------------------------------------------------------ reading
    def summary(self) -> dict[str, Any]:
        """The last completed step (all zeros/None before the first ``end_step``)."""
        with self._lock:
            return self._last.view(1 if self.steps else 0)

    def totals(self) -> dict[str, Any]:
        """Cumulative over all completed steps (same keys as ``summary``)."""
        with self._lock:
            return self._total.view(self.steps)

    def steady_bytes(self) -> dict[str, int]:
        """bytes_raw and bytes_wire summed over the closed steps that sent no plain
        reduction (DDP's first step and steps before ``start_step`` are left out)."""
        with self._lock:
            return dict(self._steady)

    def reductions_seen(self) -> int:
        """Reductions so far, recorded or held, over every step: it grows whenever
        anything is reduced, whoever closes the steps."""
        with self._lock:
            return self._recorded + self._held

    def hold(self) -> None:
        """One reduction of the open step will be recorded when it settles (its times
        are still CUDA events: the chained path on a GPU)."""
        with self._lock:
            self._held += 1

    def release(self) -> None:
        """A held reduction was recorded."""
        with self._lock:
            self._held = max(0, self._held - 1)

    def open_reductions(self) -> int:
        """Reductions of the open step so far, recorded or held (0: nothing communicated
        since the last ``end_step``)."""
        with self._lock:
            return self._open.reductions + self._held

    def pending(self) -> dict[str, Any]:
        """The open (not yet closed) step, e.g. to inspect a step mid-way."""
        with self._lock:
            return self._open.view(0)


def _total(values: list[float | torch.Tensor]) -> float:
    """The sum of numbers and 0-d tensors, the tensors read in one host read."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    numbers = sum(float(v) for v in values if not isinstance(v, torch.Tensor))
    if not tensors:
        return numbers
    device = tensors[0].device
    return numbers + float(torch.stack([t.float().to(device) for t in tensors]).sum())
