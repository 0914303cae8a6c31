"""Rewriting packs whose HDF5 structure a kill left damaged (``gradzip archive repair``).

HDF5 does not order its metadata writes, so a process killed during a flush can leave a
pack whose structure no longer finds datasets it held, while every committed tensor's
bytes are intact at the offset the index records (``verify`` checks them against their
CRC-32 and reports such a pack as repairable). ``repair`` copies each such pack's
committed tensors into a fresh pack of the same series, checks that every copy has the
original's checksum, points the index at the copies in one transaction and only then
deletes the damaged pack: a kill at any moment leaves either the old pack indexed (and
the new one a leftover ``verify`` ignores) or the new one.

Run it when no process writes the archive.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gradzip.capture import index
from gradzip.capture.archive import Archive, verify
from gradzip.capture.index import Entry
from gradzip.capture.layout import StepKey
from gradzip.capture.packs import PackWriter, storage_dtype


def repair(directory: str | os.PathLike[str],
           report: Callable[[str], None] = print) -> list[str]:
    """Rewrite every pack ``verify`` calls repairable; returns the packs rewritten.
    Refuses (``ValueError``) an archive with a fatal problem: its bytes are wrong, and
    a copy would only hide that."""
    _, problems = verify(directory)
    fatal = [p for p in problems if p.fatal]
    if fatal:
        raise ValueError(f"{directory}: {len(fatal)} problem(s) repair cannot mend (e.g. "
                         f"{fatal[0]}); `gradzip archive verify` lists them")
    damaged = sorted({p.where for p in problems if p.repairable})
    for pack in damaged:
        moved_to = _rewrite(Path(directory), pack)
        report(f"{pack}: rewrote its committed tensors into {moved_to}")
    return damaged


def _rewrite(directory: Path, pack: str) -> str:
    """Copy ``pack``'s committed tensors into a fresh pack, index them there, delete it."""
    with Archive(directory) as archive:
        entries = archive.entries()
        mine = [e for e in entries if e.pack == pack]
        writer = PackWriter(directory, str(Path(pack).parent))
        try:
            for bucket in _buckets(mine):
                _write_bucket(writer, archive, bucket)
            copies = writer.take_written()
        finally:
            writer.close()  # fsyncs the new pack before the index points at it
    _check_copies(mine, copies)
    db = index.connect(directory)
    try:
        index.move_entries(db, copies)
    finally:
        db.close()
    (directory / pack).unlink()
    return copies[0].pack if copies else "(nothing: no committed tensor was in it)"


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


def _check_copies(originals: list[Entry], copies: list[Entry]) -> None:
    """Every original has one copy with its checksum, or nothing is moved."""
    def key(e: Entry) -> tuple[object, ...]:
        return (e.rank, e.epoch, e.step, e.bucket, e.kind, e.name, e.crc32)
    if sorted(map(key, originals)) != sorted(map(key, copies)):
        raise RuntimeError("the rewritten pack does not hold every tensor with its checksum; "
                           "the index still points at the old pack (nothing was moved)")
