"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Write to a temporary name in the same directory, flush and ``fsync`` it, ``rename`` over
the target (atomic on POSIX), then ``fsync`` the directory so the rename itself survives
a crash. Temporary names carry the pid, so a leftover from a killed writer is recognisable
and is removed by :func:`remove_stale_temps`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TMP_MARK = ".tmp-"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The JSON in ``path``, or None if the file does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:  # cannot happen with atomic writes unless edited by hand
        raise ValueError(f"{path}: corrupt metadata file ({e}); delete it to rebuild") from e


def remove_stale_temps(directory: str | os.PathLike[str]) -> int:
    """Delete temporary files left in ``directory`` by interrupted writers; return how many."""
    n = 0
    d = Path(directory)
    if not d.is_dir():
        return 0
    for p in d.iterdir():
        if TMP_MARK in p.name:
            p.unlink(missing_ok=True)
            n += 1
    return n
