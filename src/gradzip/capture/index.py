"""The archive's index: one SQLite file mapping every captured tensor to its pack.

One row per dataset: (rank, epoch, step, bucket, kind, name) -> pack file, HDF5
path, byte offset of its (contiguous, unfiltered) data in the pack, size, dtype,
shape, its offset in the bucket and a CRC-32 of its bytes. A step's rows and its
``steps`` row are committed in one transaction after its data was flushed to the
pack, so after a crash (kill -9 at any moment) the index lists exactly the completed
steps, each readable. SQLite's journal makes the commit atomic, and several writers
(one per rank or worker) may share one index.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_NAME = "index.sqlite"
FORMAT_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tensors (
    rank INTEGER NOT NULL, epoch INTEGER NOT NULL, step INTEGER NOT NULL,
    bucket INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
    pack TEXT NOT NULL, dataset TEXT NOT NULL, file_offset INTEGER NOT NULL,
    nbytes INTEGER NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL,
    bucket_offset INTEGER NOT NULL, crc32 INTEGER NOT NULL, codec TEXT NOT NULL,
    PRIMARY KEY (rank, epoch, step, bucket, kind, name));
CREATE TABLE IF NOT EXISTS steps (
    rank INTEGER NOT NULL, epoch INTEGER NOT NULL, step INTEGER NOT NULL,
    buckets INTEGER NOT NULL, nbytes INTEGER NOT NULL,
    PRIMARY KEY (rank, epoch, step));
"""

_COLUMNS = ("rank", "epoch", "step", "bucket", "kind", "name", "pack", "dataset",
            "file_offset", "nbytes", "dtype", "shape", "bucket_offset", "crc32", "codec")


@dataclass(frozen=True)
class Entry:
    """One captured tensor: where it came from and where its bytes are."""

    rank: int
    epoch: int
    step: int
    bucket: int
    kind: str  # "local" (what this rank sent) or "aggregated" (the mean it got back)
    name: str
    pack: str  # path relative to the archive directory
    dataset: str
    file_offset: int
    nbytes: int
    dtype: str  # numpy dtype name, or "bfloat16" (stored as uint16 bits)
    shape: tuple[int, ...]
    bucket_offset: int  # elements before it in its bucket
    crc32: int
    codec: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def row(self) -> tuple[Any, ...]:
        values = {**self.__dict__, "shape": json.dumps(list(self.shape))}
        return tuple(values[c] for c in _COLUMNS)

    @classmethod
    def from_row(cls, row: Iterable[Any]) -> Entry:
        d = dict(zip(_COLUMNS, row, strict=True))
        d["shape"] = tuple(json.loads(d["shape"]))
        return cls(**d)


def connect(directory: Path, *, readonly: bool = False) -> sqlite3.Connection:
    """The index of the archive in ``directory`` (created when writing)."""
    path = Path(directory) / INDEX_NAME
    if readonly:
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no capture archive here (no {INDEX_NAME})")
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
    else:
        # one writer thread uses it at a time (opened by the owner, used by its thread)
        db = sqlite3.connect(path, timeout=60, check_same_thread=False)
        _while_locked(lambda: _prepare(db))
    return db


def _prepare(db: sqlite3.Connection) -> None:
    # write-ahead log: a commit is atomic and survives the process being killed
    # without an fsync per step (synced at checkpoints and on close)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA)
    db.execute("INSERT OR IGNORE INTO meta VALUES ('format_version', ?)",
               (str(FORMAT_VERSION),))
    db.commit()


def _while_locked(fn: Any, timeout_s: float = 60.0) -> None:
    """Run ``fn``, retrying while another writer (rank) holds the database: switching
    to WAL takes an exclusive lock that SQLite's busy timeout does not wait for."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fn()
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02 + random.random() * 0.05)


def commit_step(db: sqlite3.Connection, rank: int, epoch: int, step: int,
                entries: list[Entry]) -> None:
    """Record a completed step and all its tensors in one transaction."""
    placeholders = ",".join("?" * len(_COLUMNS))
    with db:  # one transaction: all of the step or none of it
        db.executemany(f"INSERT OR REPLACE INTO tensors VALUES ({placeholders})",
                       [e.row() for e in entries])
        # a step may be committed in parts (``archive pack`` commits bucket by bucket)
        db.execute("INSERT INTO steps VALUES (?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET "
                   "buckets = buckets + excluded.buckets, nbytes = nbytes + excluded.nbytes",
                   (rank, epoch, step, len({(e.bucket, e.kind) for e in entries}),
                    sum(e.nbytes for e in entries)))


def move_entries(db: sqlite3.Connection, old_pack: str, moved: list[Entry]) -> None:
    """Point committed tensors of ``old_pack`` at their copies (``archive repair``), all
    in one transaction, made durable before it returns (the old pack is deleted next);
    the steps they belong to stay as they were."""
    with db:
        for e in moved:
            updated = db.execute(
                "UPDATE tensors SET pack=?, dataset=?, file_offset=? WHERE rank=? AND "
                "epoch=? AND step=? AND bucket=? AND kind=? AND name=? AND crc32=? AND "
                "pack=?", (e.pack, e.dataset, e.file_offset, e.rank, e.epoch, e.step,
                           e.bucket, e.kind, e.name, e.crc32, old_pack)).rowcount
            if updated != 1:
                raise ValueError(f"cannot move {e.name} (rank {e.rank}, step {e.step}, "
                                 f"bucket {e.bucket}): no committed tensor in {old_pack} "
                                 "with its checksum")
        left = db.execute("SELECT COUNT(*) FROM tensors WHERE pack=?", (old_pack,)).fetchone()
        if left[0]:
            raise ValueError(f"{left[0]} committed tensor(s) of {old_pack} have no copy")
    db.execute("PRAGMA wal_checkpoint(FULL)")  # WAL at synchronous=NORMAL: not yet synced


def record_repair(db: sqlite3.Connection, old_pack: str, new_pack: str | None) -> None:
    """Note (``new_pack``), or forget (None), a repair under way: a run killed midway
    leaves a copy, or the damaged pack, that the next repair removes."""
    with db:
        if new_pack is None:
            db.execute("DELETE FROM meta WHERE key=?", ("repair:" + old_pack,))
        else:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                       ("repair:" + old_pack, new_pack))


def repairs_under_way(db: sqlite3.Connection) -> list[tuple[str, str]]:
    """(damaged pack, its copy) of every repair a kill cut short."""
    return [(k.removeprefix("repair:"), v) for k, v in db.execute(
        "SELECT key, value FROM meta WHERE key LIKE 'repair:%' ORDER BY key")]


def packs_in_use(db: sqlite3.Connection) -> set[str]:
    """Every pack the index points at."""
    return {r[0] for r in db.execute("SELECT DISTINCT pack FROM tensors")}


def query(db: sqlite3.Connection, **where: Any) -> Iterator[Entry]:
    """Entries matching every given column (None = any), in archive order."""
    clauses = [(k, v) for k, v in where.items() if v is not None]
    for k, _ in clauses:
        if k not in _COLUMNS:
            raise ValueError(f"cannot filter on {k!r}; columns are {', '.join(_COLUMNS)}")
    sql = f"SELECT {','.join(_COLUMNS)} FROM tensors"
    if clauses:
        sql += " WHERE " + " AND ".join(f"{k} = ?" for k, _ in clauses)
    sql += " ORDER BY rank, epoch, step, bucket, kind DESC, bucket_offset"
    for row in db.execute(sql, [v for _, v in clauses]):
        yield Entry.from_row(row)


def completed_steps(db: sqlite3.Connection) -> list[tuple[int, int, int]]:
    return [tuple(r) for r in db.execute(
        "SELECT rank, epoch, step FROM steps ORDER BY rank, epoch, step")]


def has_bucket(db: sqlite3.Connection, rank: int, epoch: int, step: int, bucket: int) -> bool:
    """Whether the archive already holds this bucket (its local gradient)."""
    return db.execute("SELECT 1 FROM tensors WHERE rank=? AND epoch=? AND step=? AND "
                      "bucket=? AND kind='local' LIMIT 1",
                      (rank, epoch, step, bucket)).fetchone() is not None
