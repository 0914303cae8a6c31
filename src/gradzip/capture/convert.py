"""``gradzip archive pack``: a directory of ``.pt`` bucket files into HDF5 packs.

Each ``R_{r}_E_{e}_S_{s}_B_{b}.pt`` holds one bucket as a dict name -> tensor (the
format existing capture hooks write); its tensors are stored in dict order, back to
back, as ``write_bucket`` stores a captured bucket. Producer/consumer: this process
finds files and hands them to ``workers`` processes, each the one writer of its own
pack series (``packer{k}/pack_{n}.h5``), all sharing one index. A bucket the index
already holds is skipped, so a second run (or ``--watch`` after a restart) converts
only what is new. With ``delete_source`` a file is removed only after its packed copy
was read back from the pack and found bit-identical.

``watch=True`` keeps looking for new files; a file is taken once its size and mtime
held still for one poll (a writer may still be filling it) and it loads.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradzip.capture import index
from gradzip.capture.archive import Archive
from gradzip.capture.layout import (
    PT_PATTERN,
    StepKey,
    parse_pt_name,
    split_pt_files,
    unnamed_files_message,
)
from gradzip.capture.packs import DEFAULT_PACK_CAP, PackWriter


@dataclass
class PackReport:
    """What a conversion did: files packed (bytes), skipped as present, failed (why)."""

    packed: int = 0
    bytes: int = 0
    present: int = 0
    deleted: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    #: .pt files left alone, and why (a name that is not the capture format)
    skipped: dict[str, str] = field(default_factory=dict)


def bucket_arrays(path: Path) -> tuple[np.ndarray, str, list[tuple[str, tuple[int, ...], int]]]:
    """A ``.pt`` bucket as (flat values, dtype, [(name, shape, offset)])."""
    import torch

    from gradzip.capture.capture import TORCH_DTYPE_NAMES

    tensors = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(tensors, dict) or not tensors or not all(
            isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError("not a bucket file: expected a non-empty dict name -> tensor")
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in TORCH_DTYPE_NAMES:
        raise ValueError(f"a bucket holds one float dtype, this one {sorted(map(str, dtypes))}")
    dtype = next(iter(dtypes))
    flat = torch.cat([t.detach().reshape(-1) for t in tensors.values()])
    values = (flat.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16
              else flat.numpy())
    params, offset = [], 0
    for name, t in tensors.items():
        params.append((str(name), tuple(t.shape), offset))
        offset += t.numel()
    return values, TORCH_DTYPE_NAMES[dtype], params


def _read_back_equal(out: Path, key: StepKey, bucket: int, values: np.ndarray) -> bool:
    with Archive(out) as archive:
        stored = archive.bucket(key.rank, key.epoch, key.step, bucket)
    return stored.dtype == values.dtype and stored.tobytes() == values.tobytes()


def _worker(k: int, out: str, pack_cap: int, delete: bool, tasks: Any, results: Any) -> None:
    """Pack the files handed over on ``tasks`` into series ``packer{k}``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops us cleanly
    with PackWriter(out, f"packer{k}", pack_cap=pack_cap) as packs:
        while (item := tasks.get()) is not None:
            path = Path(item)
            try:
                key, bucket = parse_pt_name(path.name)  # type: ignore[misc]
                values, dtype, params = bucket_arrays(path)
                nbytes = packs.write_bucket(key, bucket, values, dtype, params)
                packs.commit_step(key)
                if delete:
                    if not _read_back_equal(Path(out), key, bucket, values):
                        raise RuntimeError("the packed copy read back differs; source kept")
                    path.unlink()
                results.put((item, None, nbytes))
            except Exception as e:  # noqa: BLE001 - reported, the rest goes on
                results.put((item, f"{type(e).__name__}: {e}", 0))


class _Finder:
    """New bucket files of ``source``: not in the archive, and (watching) not growing."""

    def __init__(self, source: Path, out: Path, watch: bool) -> None:
        self.source, self.watch = source, watch
        self.db = index.connect(out)
        self.seen: dict[Path, tuple[int, int]] = {}
        self.taken: set[Path] = set()

    def poll(self, report: PackReport) -> list[Path]:
        ready = []
        for path in sorted(self.source.glob("*.pt")):
            parsed = parse_pt_name(path.name)
            if path in self.taken:
                continue
            if parsed is None:
                self.taken.add(path)
                report.skipped[str(path)] = f"not named {PT_PATTERN}"
                continue
            key, bucket = parsed
            if index.has_bucket(self.db, key.rank, key.epoch, key.step, bucket):
                self.taken.add(path)
                report.present += 1
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            stamp = (st.st_size, st.st_mtime_ns)
            if self.watch and self.seen.get(path) != stamp:
                self.seen[path] = stamp  # take it at the next poll if it holds still
                continue
            self.taken.add(path)
            ready.append(path)
        return ready


def pack_directory(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                   workers: int = 2, delete_source: bool = False, watch: bool = False,
                   poll_s: float = 1.0, idle_exit_s: float | None = None,
                   pack_cap: int = DEFAULT_PACK_CAP,
                   on_file: Callable[[str, str | None], None] | None = None) -> PackReport:
    """Convert the bucket files of ``source`` into packs in ``out`` (see the module).

    Watching ends after ``idle_exit_s`` seconds without a new file (None: only on
    KeyboardInterrupt, which finishes the files in hand and closes the packs).
    ``on_file(path, error)`` is called as each file is done."""
    source_dir, out_dir = Path(source), Path(out)
    if not source_dir.is_dir():
        raise FileNotFoundError(f"{source_dir}: no such directory of .pt bucket files")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    named, other = split_pt_files(source_dir)
    if not watch and not named:  # refuse before making an empty archive
        raise FileNotFoundError(unnamed_files_message(source_dir, other))
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(k, str(out_dir), pack_cap, delete_source,
                                                tasks, results), daemon=True)
             for k in range(workers)]
    for p in procs:
        p.start()
    report, finder = PackReport(), _Finder(source_dir, out_dir, watch)
    pending, last_new = 0, time.monotonic()
    take = functools.partial(_take, results, report, on_file, delete_source)
    try:
        while True:
            new = finder.poll(report)
            for path in new:
                tasks.put(str(path))
            pending += len(new)
            if new:
                last_new = time.monotonic()
            if not watch:
                break
            pending -= take(poll_s)
            if idle_exit_s is not None and not pending \
                    and time.monotonic() - last_new > idle_exit_s:
                break
    finally:
        for _ in procs:
            tasks.put(None)  # each worker finishes the files in hand, then closes its pack
        while pending and any(p.is_alive() for p in procs):
            pending -= take(1.0)
        pending -= take(0.0)
        for p in procs:
            p.join()
    if pending:
        raise RuntimeError(f"a packing worker died with {pending} file(s) unfinished; they "
                           "stay in the source directory: run `gradzip archive pack` again")
    return report


def _take(results: Any, report: PackReport, on_file: Callable[..., None] | None,
          deleted: bool, wait_s: float) -> int:
    """Tally the files finished within ``wait_s`` (and any that follow at once)."""
    done = 0
    while True:
        try:
            path, error, nbytes = results.get(timeout=wait_s) if wait_s else \
                results.get_nowait()
        except queue.Empty:
            return done
        done, wait_s = done + 1, 0.0
        if error is None:
            report.packed += 1
            report.bytes += nbytes
            report.deleted += int(deleted)
        else:
            report.failed[path] = error
        if on_file is not None:
            on_file(path, error)
