"""Reading and checking a capture archive.

``Archive(dir)`` lists what was captured (filter by rank, epoch, step, bucket, name,
kind), loads one tensor or one bucket as a flat array, memory-mapped from its pack
(every dataset is contiguous and unfiltered, at the file offset the index records),
and iterates. ``verify(dir)`` checks every indexed tensor against its checksum and its
pack's HDF5 structure and says exactly what is wrong and where.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradzip.capture import index
from gradzip.capture.index import Entry
from gradzip.capture.packs import storage_dtype


class ArchiveError(RuntimeError):
    """A capture archive is missing, unreadable or does not hold what was asked."""


class Archive:
    """A capture archive directory, read through its index."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        try:
            self._db = index.connect(self.directory, readonly=True)
        except FileNotFoundError as e:
            raise ArchiveError(str(e)) from None

    def entries(self, *, rank: int | None = None, epoch: int | None = None,
                step: int | None = None, bucket: int | None = None, name: str | None = None,
                kind: str | None = None) -> list[Entry]:
        """Every captured tensor matching the filters (None = any), in archive order."""
        return list(index.query(self._db, rank=rank, epoch=epoch, step=step, bucket=bucket,
                                name=name, kind=kind))

    def steps(self) -> list[tuple[int, int, int]]:
        """(rank, epoch, step) of every completed step."""
        return index.completed_steps(self._db)

    def __iter__(self) -> Iterator[Entry]:
        return index.query(self._db)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM tensors").fetchone()[0])

    def load(self, entry: Entry, *, copy: bool = False) -> np.ndarray:
        """The tensor's values in its shape (bfloat16 as uint16 bits: see ``tensor``),
        memory-mapped read-only from its pack unless ``copy``."""
        path = self.directory / entry.pack
        dtype = storage_dtype(entry.dtype)
        if entry.nbytes == 0:
            return np.zeros(entry.shape, dtype=dtype)
        if not path.is_file():
            raise ArchiveError(f"{entry.dataset}: its pack {entry.pack} is missing")
        if path.stat().st_size < entry.file_offset + entry.nbytes:
            raise ArchiveError(f"{entry.pack}: truncated, {entry.dataset} ends past the file")
        values = np.memmap(path, dtype=dtype, mode="r", offset=entry.file_offset,
                           shape=entry.shape)
        return np.array(values) if copy else values

    def tensor(self, entry: Entry) -> Any:
        """The tensor as a ``torch.Tensor`` of its captured dtype (bfloat16 included)."""
        import torch

        values = torch.from_numpy(self.load(entry, copy=True))
        return values.view(torch.bfloat16) if entry.dtype == "bfloat16" else values

    def bucket(self, rank: int, epoch: int, step: int, bucket: int,
               kind: str = "local") -> np.ndarray:
        """One bucket as a flat array: its tensors at their offsets in the bucket, each
        checked against the CRC-32 the index holds (``ArchiveError`` if it differs)."""
        parts = self.entries(rank=rank, epoch=epoch, step=step, bucket=bucket, kind=kind)
        if not parts:
            raise ArchiveError(f"no {kind} bucket {bucket} of rank {rank}, epoch {epoch}, "
                               f"step {step} in {self.directory}")
        size = max(e.bucket_offset + e.numel for e in parts)
        flat = np.empty(size, dtype=storage_dtype(parts[0].dtype))
        for e in parts:
            values = self.load(e)
            crc = zlib.crc32(np.ascontiguousarray(values).data)
            if crc != e.crc32:  # a disk is untrusted too: never analyze changed bytes
                raise ArchiveError(f"{e.pack}:{e.dataset}: checksum mismatch (index "
                                   f"{e.crc32:#010x}, data {crc:#010x}): the bytes changed "
                                   "after capture")
            flat[e.bucket_offset:e.bucket_offset + e.numel] = values.reshape(-1)
        return flat

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class Problem:
    """Something wrong in an archive: where (pack, dataset) and what."""

    where: str
    what: str
    fatal: bool = True
    #: the pack's HDF5 structure is damaged while every indexed byte in it checks out:
    #: ``repair`` rewrites it (``where`` is the pack)
    repairable: bool = False

    def __str__(self) -> str:
        return f"{'error' if self.fatal else 'note'}: {self.where}: {self.what}"


def verify(directory: str | os.PathLike[str]) -> tuple[int, list[Problem]]:
    """(tensors checked, problems): every indexed tensor's bytes against its CRC-32, its
    dataset in the pack's HDF5 structure; datasets no committed step lists are notes.
    Raises ArchiveError when ``directory`` is not an archive."""
    with Archive(directory) as archive:
        entries = list(archive)
        problems = [p for e in entries for p in _check_bytes(archive, e)]
        by_pack: dict[str, list[Entry]] = {}
        for entry in entries:
            by_pack.setdefault(entry.pack, []).append(entry)
        committed = {e.dataset.split("/")[1] for e in entries}  # R_r_E_e_S_s groups
        bad_bytes = {p.where.split(":")[0] for p in problems}
        for pack in sorted(_packs(archive.directory) | set(by_pack)):
            found = _check_structure(archive.directory, pack, by_pack.get(pack, []),
                                     committed)
            problems += found if pack in bad_bytes else _repairable(pack, found)
    return len(entries), problems


class _Damaged(Problem):
    """A problem with the pack's HDF5 structure alone (not with the indexed bytes)."""


def _repairable(pack: str, found: list[Problem]) -> list[Problem]:
    """One note for a pack whose HDF5 structure is damaged while every indexed byte in it
    checks out: a kill during an HDF5 flush can leave the pack's metadata half-written
    (HDF5 does not order its metadata writes), and gradzip reads the bytes by offset
    whatever the structure says; ``gradzip archive repair`` rewrites the pack."""
    damaged = [p for p in found if isinstance(p, _Damaged)]
    if not damaged:
        return found
    note = Problem(pack, f"HDF5's structure of this pack is damaged ({len(damaged)} "
                         f"problem(s), e.g. {damaged[0].where}: {damaged[0].what}), as a "
                         "kill during an HDF5 flush can leave it; every indexed tensor in it "
                         "checks out against its CRC-32 and gradzip reads it, but HDF5 tools "
                         "may not: `gradzip archive repair DIR` rewrites the pack",
                   fatal=False, repairable=True)
    return [p for p in found if not isinstance(p, _Damaged)] + [note]


def _packs(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.glob("*/pack_*.h5")}


def _check_bytes(archive: Archive, e: Entry) -> list[Problem]:
    where = f"{e.pack}:{e.dataset}"
    try:
        values = archive.load(e)
    except (ArchiveError, OSError, ValueError) as err:
        return [Problem(where, str(err))]
    crc = zlib.crc32(np.ascontiguousarray(values).data)
    if crc != e.crc32:
        return [Problem(where, f"checksum mismatch (index {e.crc32:#010x}, data {crc:#010x}):"
                               " the bytes changed after capture")]
    return []


def _check_structure(directory: Path, pack: str, entries: list[Entry],
                     committed: set[str]) -> list[Problem]:
    """The pack opens with HDF5 and holds each indexed dataset at the indexed offset.

    ``committed`` names every step group the index holds (in any pack): a dataset the
    index does not list belongs to a step that never completed, or to one captured again
    after a resume from an earlier checkpoint (the index keeps the later capture)."""
    import h5py

    path = directory / pack
    if not path.is_file():
        return [Problem(pack, "pack file missing")]
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        if not entries:  # a pack no committed step uses: a run stopped while writing
            return [Problem(pack, f"HDF5 cannot open it ({err}), and no committed step is in "
                                  "it: the leftover of a step that never completed "
                                  "(ignored)", fatal=False)]
        if "lock" in str(err):  # HDF5 locks a pack while a capture writes it
            return [Problem(pack, f"in use by a writer ({err}): its indexed bytes are "
                                  "checked above, its HDF5 structure is not (verify it "
                                  "again when the run has ended)", fatal=False)]
        return [_Damaged(pack, f"HDF5 cannot open it ({err})")]
    problems: list[Problem] = []
    with f:
        listed = {e.dataset for e in entries}
        steps_here = {e.dataset.split("/")[1] for e in entries}  # R_r_E_e_S_s groups
        for e in entries:
            try:
                ds = f.get(e.dataset)
            except (RuntimeError, OSError, KeyError) as err:
                problems.append(_Damaged(f"{pack}:{e.dataset}", f"HDF5 cannot open it ({err})"))
                continue
            if not isinstance(ds, h5py.Dataset):
                problems.append(_Damaged(f"{pack}:{e.dataset}", "indexed dataset not in the pack"))
            elif (ds.id.get_offset() or 0) != e.file_offset or tuple(ds.shape) != e.shape:
                problems.append(Problem(f"{pack}:{e.dataset}", "dataset offset or shape "
                                        "differs from the index"))
        found, unreadable = _datasets_in(f)
        orphans = [d for d in found if d not in listed]
        again = [d for d in orphans if d.split("/")[1] in committed]
        unfinished = [d for d in orphans if d not in again]
        if again:
            problems.append(Problem(pack, f"{len(again)} dataset(s) of steps captured again "
                                          f"after a resume from an earlier checkpoint; the "
                                          f"index holds the later capture (ignored), e.g. "
                                          f"{again[0]}", fatal=False))
        if unfinished:
            problems.append(Problem(pack, f"{len(unfinished)} dataset(s) of steps that never "
                                          f"completed (ignored), e.g. {unfinished[0]}",
                                    fatal=False))
        for group, why in unreadable:
            where, what = f"{pack}:{group}", f"HDF5 cannot list it ({why})"
            if (group == "/" and bool(entries)) or group.split("/")[-1] in steps_here:
                problems.append(_Damaged(where, what))  # the root, or a step indexed here
            else:
                problems.append(Problem(where, what + "; the leftover of a step that never "
                                        "completed, cut off by a kill, or of one captured "
                                        "again (ignored)", fatal=False))
    return problems


def _datasets_in(f: Any) -> tuple[list[str], list[tuple[str, str]]]:
    """(every dataset's path, [(group, error)] for groups HDF5 cannot walk).

    Walks one top-level group at a time: a process killed while writing a step can leave
    that step's group linked but its header past the file's recorded end, and one such
    group must not hide the others (``visititems`` on the root gives up at the first)."""
    import h5py

    found: list[str] = []
    unreadable: list[tuple[str, str]] = []
    try:
        names = list(f.keys())
    except (RuntimeError, OSError, KeyError) as err:
        return found, [("/", str(err))]
    for name in names:
        try:
            obj = f[name]
            if isinstance(obj, h5py.Dataset):
                found.append("/" + name)
                continue
            obj.visititems(lambda sub, o, top=name: found.append(f"/{top}/{sub}")
                           if isinstance(o, h5py.Dataset) else None)
        except (RuntimeError, OSError, KeyError) as err:
            unreadable.append(("/" + name, str(err)))
    return found, unreadable
