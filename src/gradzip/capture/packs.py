"""Writing captured buckets into HDF5 packs that roll over at a size cap.

A ``PackWriter`` owns one series of packs, ``{directory}/{series}/pack_{n}.h5`` (one
series per rank or per conversion worker: HDF5 files have one writer). Each
parameter's gradient is one contiguous, unfiltered dataset, so its bytes sit at one
offset in the file: the reader memory-maps them, and a checksum covers exactly them.
Datasets carry their shape, dtype, offset in the bucket and CRC-32 as attributes; the
bucket's group and the file carry the codec and the torch and gradzip versions.

``write_bucket`` adds a bucket's datasets; ``commit_step`` flushes the pack to disk and
only then records the step in the index (``index.commit_step``). A crash before the
commit leaves datasets the index does not list (``verify`` reports them as
uncommitted); every committed step stays readable. A writer reopening an archive
starts a new pack rather than appending to one a crash may have left half-written.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gradzip.capture import index
from gradzip.capture.layout import StepKey, dataset_path

DEFAULT_PACK_CAP = int(1.8e12)  # 1.8 TB


def versions() -> dict[str, str]:
    import torch

    from gradzip import __version__

    return {"torch_version": str(torch.__version__), "gradzip_version": str(__version__)}


#: captured dtype -> the numpy dtype it is stored as (bfloat16 as its uint16 bits)
STORAGE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32),
                                       "float16": np.dtype(np.float16),
                                       "float64": np.dtype(np.float64),
                                       "bfloat16": np.dtype(np.uint16)}


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a tensor of ``dtype`` is stored as (bfloat16 as its uint16 bits)."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"cannot store {dtype} values (float32, float16, float64, bfloat16)")
    return STORAGE_DTYPES[dtype]


class PackWriter:
    """Buckets into one series of rolling packs, steps into the index."""

    def __init__(self, directory: str | os.PathLike[str], series: str, *,
                 pack_cap: int = DEFAULT_PACK_CAP) -> None:
        if pack_cap <= 0:
            raise ValueError(f"pack_cap must be positive, got {pack_cap}")
        self.directory = Path(directory)
        self.series = series
        self.pack_cap = pack_cap
        (self.directory / series).mkdir(parents=True, exist_ok=True)
        self.db = index.connect(self.directory)
        self._versions = versions()
        self._file: h5py.File | None = None
        self._path: Path | None = None
        self._pack_bytes = 0
        self._pending: dict[StepKey, list[index.Entry]] = {}
        self.bytes_written = 0

    def _next_pack(self) -> None:
        """Close the current pack and open a fresh one (never append to an old one)."""
        self._close_pack()
        n = 0
        while (self.directory / self.series / f"pack_{n}.h5").exists():
            n += 1
        self._path = self.directory / self.series / f"pack_{n}.h5"
        self._file = h5py.File(self._path, "w")
        self._file.attrs.update(self._versions)
        self._pack_bytes = 0

    def _close_pack(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            fsync_path(self._path)

    def write_bucket(self, key: StepKey, bucket: int, flat: np.ndarray, dtype: str,
                     params: list[tuple[str, tuple[int, ...], int]], *,
                     kind: str = "local", codec: str = "") -> int:
        """Store one bucket: ``params`` lists (name, shape, offset in ``flat``) of each
        tensor in it; ``flat`` holds the bucket's values (bfloat16 as uint16 bits).
        Returns the bytes written. Nothing is in the index until ``commit_step``."""
        if flat.dtype != storage_dtype(dtype):
            raise ValueError(f"bucket values are {flat.dtype}, expected {storage_dtype(dtype)} "
                             f"for {dtype}")
        if self._file is None or (self._pack_bytes and
                                  self._pack_bytes + flat.nbytes > self.pack_cap):
            self._next_pack()
        assert self._file is not None and self._path is not None
        entries = self._pending.setdefault(key, [])
        group = self._file.require_group(dataset_path(key, bucket, "", kind).rstrip("/"))
        group.attrs.update({"codec": codec, **self._versions})  # once per bucket
        written = 0
        for name, shape, offset in params:
            n = int(np.prod(shape, dtype=np.int64))
            values = np.ascontiguousarray(flat[offset:offset + n]).reshape(shape)
            path = dataset_path(key, bucket, name, kind)
            ds = self._file.create_dataset(path, data=values)  # contiguous, no filters
            crc = zlib.crc32(values.data)
            ds.attrs.update({"shape": list(shape), "dtype": dtype, "offset": offset,
                             "crc32": crc})
            file_offset = ds.id.get_offset()
            if file_offset is None:  # an empty tensor has no storage
                file_offset = 0
            entries.append(index.Entry(
                key.rank, key.epoch, key.step, bucket, kind, name,
                str(self._path.relative_to(self.directory)), path, int(file_offset),
                values.nbytes, dtype, tuple(int(d) for d in shape), offset, crc, codec))
            written += values.nbytes
        self._pack_bytes += written
        self.bytes_written += written
        return written

    def commit_step(self, key: StepKey, *, durable: bool = False) -> None:
        """Flush the pack, then index the step. A killed process loses nothing flushed
        (the kernel holds it); ``durable`` also fsyncs, for a machine that may lose power
        (the pack is fsynced when it is closed in any case)."""
        entries = self._pending.pop(key, [])
        if not entries:
            return
        if self._file is not None:
            self._file.flush()
            if durable:
                fsync_path(self._path)
        index.commit_step(self.db, key.rank, key.epoch, key.step, entries)

    def start_pack(self) -> Path:
        """Open a fresh pack now and return its path (relative to the archive), for a
        caller that records where it writes before it writes (``repair``)."""
        self._next_pack()
        assert self._path is not None
        return self._path.relative_to(self.directory)

    def take_written(self) -> list[index.Entry]:
        """Hand over every entry written and not committed (for ``repair``, which
        records moved tensors itself: ``commit_step`` would count their steps again)."""
        entries = [e for es in self._pending.values() for e in es]
        self._pending.clear()
        return entries

    def close(self) -> None:
        """Close the pack; steps never committed stay out of the index."""
        self._close_pack()
        self.db.close()

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def fsync_path(path: Path | None) -> None:
    """Make a file's (or a directory's entries') writes durable."""
    if path is None:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
