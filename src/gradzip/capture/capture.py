"""``Capture``: which steps to record, and the tap the communication hooks call.

``gradzip.attach(model, spec, capture=Capture("grads", every=10))`` (or ``gradzip
train --capture DIR``) records each bucket as it is communicated: for every parameter
in it, its name, shape, dtype and offset in the bucket, and the gradient this rank
sent (``kind="local"``); with ``aggregated=True`` also the mean it got back. The
training loop (or the Hugging Face callback) says which step is running with
``begin_step(step, epoch)`` and ``end_step()``; a step is in the archive once it ended
and its buckets were written.

Schedules: ``every=N`` (steps divisible by N), ``steps=[...]`` (an explicit list),
``budget="10GB"`` (stop capturing once that many bytes were taken); they combine
(a step must pass each given one). Nothing given: every step.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradzip.capture.layout import StepKey, parse_size
from gradzip.capture.packs import DEFAULT_PACK_CAP, PackWriter
from gradzip.capture.writer import BackgroundWriter, WriterStats

#: torch dtypes a capture stores, by the name archives record
TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16",
                     torch.float64: "float64", torch.bfloat16: "bfloat16"}


class Capture:
    """Record communicated gradient buckets into an HDF5 archive in ``directory``."""

    def __init__(self, directory: str | os.PathLike[str], *, every: int | None = None,
                 steps: Iterable[int] | None = None, budget: str | int | None = None,
                 aggregated: bool = False, queue_size: int = 8, on_full: str = "wait",
                 pack_cap: str | int = DEFAULT_PACK_CAP, durable: bool = False) -> None:
        if every is not None and every < 1:
            raise ValueError(f"capture every must be >= 1, got {every}")
        if on_full not in ("wait", "drop"):
            raise ValueError(f"on_full must be 'wait' (nothing lost) or 'drop', got {on_full!r}")
        self.directory = Path(directory)
        self.every = every
        self.steps = None if steps is None else frozenset(int(s) for s in steps)
        self.budget = None if budget is None else parse_size(budget)
        self.aggregated = aggregated
        self.queue_size = queue_size
        self.on_full = on_full
        self.pack_cap = parse_size(pack_cap)
        self.durable = durable
        self.codec = ""
        self.taken = 0  # bytes handed to the writer
        self._writer: BackgroundWriter | None = None
        self._stats = WriterStats()
        self._key: StepKey | None = None
        self._rank = 0
        self._active = False

    def __repr__(self) -> str:
        return (f"Capture({str(self.directory)!r}, every={self.every}, "
                f"steps={sorted(self.steps) if self.steps else None}, budget={self.budget}, "
                f"aggregated={self.aggregated})")

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, rank: int, codec: str = "") -> None:
        """Open this rank's pack series and the writer thread (``attach`` calls it)."""
        if self._writer is not None:
            raise RuntimeError("this Capture is already attached; make one per model")
        self._rank = rank
        self.codec = codec
        packs = PackWriter(self.directory, f"rank{rank}", pack_cap=self.pack_cap)
        self._writer = BackgroundWriter(packs, queue_size=self.queue_size,
                                        drop=self.on_full == "drop", durable=self.durable)
        atexit.register(self.close)

    @property
    def stats(self) -> WriterStats:
        """What the writer did (kept after ``close``)."""
        return self._writer.stats if self._writer is not None else self._stats

    def wanted(self, step: int) -> bool:
        """Whether ``step`` is on the schedule (the budget is checked per bucket)."""
        return ((self.every is None or step % self.every == 0)
                and (self.steps is None or step in self.steps)
                and (self.budget is None or self.taken < self.budget))

    def begin_step(self, step: int, epoch: int = 0) -> None:
        """The step whose buckets the hooks will communicate next."""
        if self._key is not None:
            self.end_step()
        self._key = StepKey(self._rank, epoch, step)
        self._active = self._writer is not None and self.wanted(step)

    def end_step(self) -> None:
        """The step's buckets are all communicated: commit it to the archive."""
        if self._key is not None and self._active and self._writer is not None:
            self._writer.end_step(self._key)
        self._key, self._active = None, False

    @property
    def active(self) -> bool:
        """Whether the buckets communicated now are to be captured."""
        return self._active

    def close(self) -> None:
        """Write everything queued and close the archive. Idempotent; also runs at
        interpreter exit. A step that began but never ended (an error or a kill in the
        middle of it) is not committed: its buckets may be partial, so its datasets stay
        out of the index, and ``verify`` notes them as a step that never completed."""
        if self._writer is None:
            return
        atexit.unregister(self.close)
        self._key, self._active = None, False  # an unended step: not committed
        writer, self._writer = self._writer, None
        self._stats = writer.stats
        writer.close()

    # ---- the tap ---------------------------------------------------------------------------

    def record(self, bucket: int, names: Sequence[str], shapes: Sequence[Sequence[int]],
               values: torch.Tensor, *, offsets: Sequence[int] | None = None,
               kind: str = "local") -> None:
        """Copy one communicated bucket (flat ``values``: the tensors named ``names`` at
        ``offsets``, back to back by default) and queue it for writing."""
        writer, key = self._writer, self._key
        if writer is None or key is None or not self._active:
            return
        flat = values.detach().reshape(-1)
        if self.budget is not None and self.taken + flat.numel() * flat.element_size() \
                > self.budget:
            self._active = False  # the budget is spent: the rest of the run is not captured
            return
        dtype = TORCH_DTYPE_NAMES.get(flat.dtype)
        if dtype is None:
            raise TypeError(f"cannot capture {flat.dtype} gradients")
        host, prepare = _to_host(flat)
        if offsets is None:
            offsets = np.cumsum([0, *[int(np.prod(s)) for s in shapes[:-1]]]).tolist()
        params = [(n, tuple(int(d) for d in s), int(o))
                  for n, s, o in zip(names, shapes, offsets, strict=True)]
        payload = {"flat": host, "dtype": dtype, "params": params, "kind": kind,
                   "codec": self.codec}
        if writer.put_bucket(prepare, key, bucket, payload):
            self.taken += flat.numel() * flat.element_size()


def _to_host(flat: torch.Tensor) -> tuple[np.ndarray, Any]:
    """A host copy of ``flat`` as numpy (bf16 as uint16 bits), and what the writer must
    run before reading it (waiting for an asynchronous device copy into pinned memory)."""
    if flat.is_cuda:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        prepare = event.synchronize
    else:
        host = flat.clone()
        prepare = _nothing
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16), prepare
    return host.numpy(), prepare


def _nothing() -> None:
    return None
