"""Rewriting packs whose HDF5 structure a kill left damaged (``gradzip archive repair``).

HDF5 does not order its metadata writes, so a process killed during a flush can leave a
pack whose structure no longer finds datasets it held, while every committed tensor's
bytes are intact at the offset the index records (``verify`` checks them against their
CRC-32 and reports such a pack as repairable). ``repair`` copies each such pack's
committed tensors into a fresh pack of the same series, reads every copy back against
the original's checksum, points the index at the copies in one durable transaction and
only then deletes the damaged pack: a kill at any moment leaves either the old pack
indexed or the new one, and the next repair removes the other (the index notes a repair
under way). A pack a writer holds (HDF5's lock) is refused.
"""

from __future__ import annotations

import fcntl
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from gradzip.capture import index
from gradzip.capture.archive import Archive, verify
from gradzip.capture.index import Entry
from gradzip.capture.layout import StepKey
from gradzip.capture.packs import PackWriter, fsync_path, storage_dtype


def repair(directory: str | os.PathLike[str],
           report: Callable[[str], None] = print) -> list[str]:
    """Finish any repair a kill cut short, then rewrite every pack ``verify`` calls
    repairable; returns the packs rewritten. A pack with a fatal problem is not one of
    them: its bytes are wrong, and a copy would only hide that."""
    directory = Path(directory)
    with Archive(directory):  # ArchiveError for a directory that is none: nothing written
        pass
    _finish_cut_short(directory, report)
    _, problems = verify(directory)
    damaged = sorted({p.where for p in problems if p.repairable})
    for pack in damaged:
        report(f"{pack}: rewrote its committed tensors into {_rewrite(directory, pack)}")
    return damaged


def _finish_cut_short(directory: Path, report: Callable[[str], None]) -> None:
    """A repair killed before the index moved leaves its copy (removed: the damaged pack
    is still the indexed one); killed after, the damaged pack (removed: nothing points
    at it)."""
    db = index.connect(directory)
    try:
        in_use = index.packs_in_use(db)
        for old, new in index.repairs_under_way(db):
            stale = new if old in in_use else old
            if stale not in in_use and (directory / stale).exists():
                (directory / stale).unlink()
                report(f"{stale}: removed, left by a repair a kill cut short")
            index.record_repair(db, old, None)
    finally:
        db.close()


def _rewrite(directory: Path, pack: str) -> str:
    """Copy ``pack``'s committed tensors into a fresh pack, read them back, index them
    there, delete ``pack``. Holds ``pack``'s lock throughout: refuses one a writer has."""
    with _locked(directory / pack), Archive(directory) as archive:
        mine = [e for e in archive.entries() if e.pack == pack]
        if not mine:
            raise ValueError(f"{pack}: no committed tensor is in it; nothing to rewrite")
        writer = PackWriter(directory, str(Path(pack).parent))
        new = str(writer.start_pack())
        index.record_repair(writer.db, pack, new)
        try:
            for bucket in _buckets(mine):
                _write_bucket(writer, archive, bucket)
            copies = writer.take_written()
        finally:
            writer.close()  # fsyncs the new pack before the index points at it
        _check_copies(directory, mine, copies, new)
        db = index.connect(directory)
        try:
            index.move_entries(db, pack, copies)
            fsync_path(directory / Path(pack).parent)  # the copy's name, before the unlink
            (directory / pack).unlink()
            index.record_repair(db, pack, None)
        finally:
            db.close()
    return new


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The lock HDF5 takes on a file it writes (``flock``), held: no writer has it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{path}: a process is writing it; repair it when the run has "
                             "ended") from None
        yield
    finally:
        os.close(fd)


def _buckets(entries: list[Entry]) -> list[list[Entry]]:
    """The entries grouped by the bucket (rank, epoch, step, bucket, kind) they form."""
    groups: dict[tuple[int, int, int, int, str], list[Entry]] = {}
    for e in entries:
        groups.setdefault((e.rank, e.epoch, e.step, e.bucket, e.kind), []).append(e)
    return list(groups.values())


def _write_bucket(writer: PackWriter, archive: Archive, bucket: list[Entry]) -> None:
    """One bucket's tensors, each at its offset in the bucket, as the capture wrote them."""
    first = bucket[0]
    flat = np.zeros(max(e.bucket_offset + e.numel for e in bucket),
                    dtype=storage_dtype(first.dtype))
    for e in bucket:
        flat[e.bucket_offset:e.bucket_offset + e.numel] = archive.load(e).reshape(-1)
    writer.write_bucket(StepKey(first.rank, first.epoch, first.step), first.bucket, flat,
                        first.dtype, [(e.name, e.shape, e.bucket_offset) for e in bucket],
                        kind=first.kind, codec=first.codec)


def _check_copies(directory: Path, originals: list[Entry], copies: list[Entry],
                  new: str) -> None:
    """Every original has one copy with its checksum, in ``new``, whose bytes read back
    from the file at its offset match that checksum and whose HDF5 dataset sits at that
    offset; else nothing is moved (the copy is left for the next repair to remove)."""
    import h5py

    def key(e: Entry) -> tuple[int, int, int, int, str, str, int]:
        return (e.rank, e.epoch, e.step, e.bucket, e.kind, e.name, e.crc32)
    if sorted(map(key, originals)) != sorted(map(key, copies)) or any(
            e.pack != new for e in copies):
        raise RuntimeError(f"{new} does not hold every tensor with its checksum; the index "
                           "still points at the damaged pack (nothing was moved)")
    with open(directory / new, "rb") as raw, h5py.File(directory / new, "r") as f:
        for e in copies:
            raw.seek(e.file_offset)
            if e.nbytes and (zlib.crc32(raw.read(e.nbytes)) != e.crc32 or
                             f[e.dataset].id.get_offset() != e.file_offset):
                raise RuntimeError(f"{new}:{e.dataset} did not read back as written; the "
                                   "index still points at the damaged pack")
