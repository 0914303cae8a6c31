"""Where buckets to analyze come from: a capture archive, a directory of ``.pt`` bucket
files, or one tensor file (``.pt`` tensor or dict, ``.npy``).

``find_buckets(path)`` lists them as small picklable ``BucketRef``s (worker processes load
their own); ``load(ref)`` returns the bucket's values as one flat array in their stored
dtype (bfloat16 as its uint16 bits) with each tensor's name, shape and offset.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BucketRef:
    """One bucket: how to find it, and where it sits in training (None: unknown)."""

    kind: str  # "archive", "pt" (one bucket file) or "file" (one tensor file)
    path: str
    rank: int | None = None
    epoch: int | None = None
    step: int | None = None
    bucket: int | None = None

    @property
    def key(self) -> str:
        """A stable name: the resume key of the results file."""
        if self.step is None:
            return Path(self.path).name
        return f"R{self.rank}_E{self.epoch}_S{self.step}_B{self.bucket}"


@dataclass
class BucketData:
    """A loaded bucket: flat values and the tensors inside it."""

    values: np.ndarray  # flat, stored dtype
    dtype: str
    params: list[tuple[str, tuple[int, ...], int]]  # (name, shape, offset)


def find_buckets(path: str | os.PathLike[str]) -> list[BucketRef]:
    """Every bucket under ``path`` (an archive, a .pt directory or one file), in order."""
    from gradzip.capture.index import INDEX_NAME
    from gradzip.capture.layout import split_pt_files, unnamed_files_message

    p = Path(path)
    if p.is_dir() and (p / INDEX_NAME).is_file():
        from gradzip.capture import Archive

        with Archive(p) as archive:
            keys = sorted({(e.rank, e.epoch, e.step, e.bucket)
                           for e in archive.entries(kind="local")})
        if not keys:
            raise FileNotFoundError(f"{p}: an empty capture archive (no bucket in it)")
        return [BucketRef("archive", str(p), *k) for k in keys]
    if p.is_dir():
        named, other = split_pt_files(p)
        if not named:
            raise FileNotFoundError(unnamed_files_message(p, other) if other else
                                    f"{p}: no capture archive (index.sqlite) and no .pt files")
        if other:
            print(f"{p}: {len(other)} .pt file(s) not named as capture buckets are left "
                  f"out (e.g. {other[0].name})", file=sys.stderr)
        return [BucketRef("pt", str(f), key.rank, key.epoch, key.step, bucket)
                for f, key, bucket in named]
    if p.is_file():
        return [BucketRef("file", str(p))]
    raise FileNotFoundError(f"{p}: no such archive, directory or tensor file")


def load(ref: BucketRef) -> BucketData:
    """The bucket's values and layout."""
    if ref.kind == "archive":
        return _from_archive(ref)
    if ref.path.endswith(".npy"):
        return _from_arrays({"values": np.asarray(_load_npy(ref.path))})
    import torch

    obj = _load_pt(ref.path)
    tensors = obj if isinstance(obj, dict) else {"tensor": obj}
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError("expected a tensor or a dict name -> tensor")
    return _from_tensors(tensors)


def _load_npy(path: str) -> np.ndarray:
    """A .npy file's array, memory-mapped; never a pickle (it could run code)."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise ValueError(f"{path}: not a .npy file (no NumPy header); save the values with "
                         "numpy.save")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        if "pickled" in str(e) or "Python objects" in str(e):
            raise ValueError(f"{path}: holds Python objects, which gradzip never loads (a "
                             "pickle can run code); save a float array with numpy.save"
                             ) from None
        raise ValueError(f"{path}: not a readable .npy file ({_first_line(e)})") from None


def _load_pt(path: str) -> Any:
    """A torch.save file, loaded with weights_only=True (tensors and plain containers
    only: a pickle of anything else could run code)."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a tensor file gradzip can read safely (a tensor or a "
                         f"dict name -> tensor saved with torch.save): {_first_line(e)}"
                         ) from None


def _first_line(e: BaseException) -> str:
    """The gist of a loader's error, without its advice to load unsafely."""
    text = str(e)
    if "WeightsUnpickler error:" in text:  # PyTorch's weights_only refusal: keep the cause
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(e).__name__
    return first if len(first) <= 160 else first[:157] + "..."


def _from_archive(ref: BucketRef) -> BucketData:
    from gradzip.capture import Archive

    with Archive(ref.path) as archive:
        entries = archive.entries(rank=ref.rank, epoch=ref.epoch, step=ref.step,
                                  bucket=ref.bucket, kind="local")
        values = archive.bucket(ref.rank, ref.epoch, ref.step, ref.bucket)  # type: ignore[arg-type]
    return BucketData(values, entries[0].dtype,
                      [(e.name, e.shape, e.bucket_offset) for e in entries])


def _from_tensors(tensors: dict[str, Any]) -> BucketData:
    import torch

    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"a bucket holds one dtype, this one {sorted(map(str, dtypes))}")
    from gradzip.capture.packs import STORAGE_DTYPES

    dtype = str(next(iter(dtypes))).removeprefix("torch.")
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"cannot analyze {dtype} values (float32, float16, bfloat16 only)")
    flat = torch.cat([t.detach().reshape(-1) for t in tensors.values()])
    values = (flat.view(torch.int16).numpy().view(np.uint16) if flat.dtype == torch.bfloat16
              else flat.numpy())
    return BucketData(values, dtype, _layout({k: tuple(t.shape) for k, t in tensors.items()}))


def _from_arrays(arrays: dict[str, np.ndarray]) -> BucketData:
    dtypes = {str(a.dtype) for a in arrays.values()}
    dtype = dtypes.pop()
    if dtypes or dtype not in ("float32", "float16"):
        raise ValueError(f"cannot analyze {dtype} arrays (float32, float16)")
    flat = np.concatenate([a.reshape(-1) for a in arrays.values()])
    return BucketData(flat, dtype, _layout({k: a.shape for k, a in arrays.items()}))


def _layout(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...], int]]:
    out, offset = [], 0
    for name, shape in shapes.items():
        out.append((name, tuple(int(d) for d in shape), offset))
        offset += int(np.prod(shape, dtype=np.int64))
    return out


def as_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """The values as float32 (bfloat16 bits widened exactly)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)
