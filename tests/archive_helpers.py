"""Shared by the archive tests: the damage a kill during an HDF5 flush can do to a pack."""

from __future__ import annotations

from pathlib import Path


def damage_root_heap(pack: Path) -> None:
    """Zero the root group's local heap (its link names), as a kill during an HDF5 flush
    left it in one run of the capture's kill -9 test: the root cannot be listed ("free
    block size is zero?") and no committed dataset is found through it, while every
    dataset's bytes stay where the index says. Superblock version 0: the root's cached
    heap address is at bytes 88-96."""
    raw = bytearray(pack.read_bytes())
    heap = int.from_bytes(raw[88:96], "little")
    assert raw[heap:heap + 4] == b"HEAP"
    size, data = (int.from_bytes(raw[heap + o:heap + o + 8], "little") for o in (8, 24))
    raw[data:data + size] = bytes(size)
    pack.write_bytes(bytes(raw))
