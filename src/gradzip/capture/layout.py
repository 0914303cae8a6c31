"""Names in a capture archive: HDF5 paths, escaped parameter names, sizes, .pt files.

An archive stores each captured bucket under
``/R_{rank}_E_{epoch}_S_{step}/B_{bucket}/{param_name}`` (the gradient this rank sent)
and, when the aggregated gradient is captured too, ``.../A_{bucket}/{param_name}``.
Parameter names may hold ``/`` (HDF5's path separator): it is escaped as ``%2F`` and
``%`` as ``%25``, so every name maps back exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: what a captured dataset holds: the gradient this rank sent, or the mean it got back
KINDS = {"local": "B", "aggregated": "A"}

_PT_NAME = re.compile(r"^R_(\d+)_E_(\d+)_S_(\d+)_B_(\d+)\.pt$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


@dataclass(frozen=True, order=True)
class StepKey:
    """Which step of which rank a bucket belongs to."""

    rank: int
    epoch: int
    step: int

    @property
    def group(self) -> str:
        return f"R_{self.rank}_E_{self.epoch}_S_{self.step}"


def escape(name: str) -> str:
    """A parameter name as one HDF5 path component (reversible: see ``unescape``)."""
    return name.replace("%", "%25").replace("/", "%2F")


def unescape(component: str) -> str:
    return component.replace("%2F", "/").replace("%25", "%")


def dataset_path(key: StepKey, bucket: int, name: str, kind: str = "local") -> str:
    """``/R_{r}_E_{e}_S_{s}/B_{b}/{escaped name}`` (``A_{b}`` for aggregated)."""
    return f"/{key.group}/{KINDS[kind]}_{bucket}/{escape(name)}"


def parse_pt_name(filename: str) -> tuple[StepKey, int] | None:
    """``R_{r}_E_{e}_S_{s}_B_{b}.pt`` -> (StepKey, bucket); None for other names."""
    m = _PT_NAME.match(filename)
    if not m:
        return None
    r, e, s, b = map(int, m.groups())
    return StepKey(r, e, s), b


#: the bucket file names gradzip reads, for messages
PT_PATTERN = "R_{rank}_E_{epoch}_S_{step}_B_{bucket}.pt"


def split_pt_files(directory: Path) -> tuple[list[tuple[Path, StepKey, int]], list[Path]]:
    """The ``.pt`` files of ``directory``: those named ``R_{r}_E_{e}_S_{s}_B_{b}.pt``,
    with their step and bucket, in (rank, epoch, step, bucket) order, and the others."""
    named, other = [], []
    for f in sorted(directory.glob("*.pt")):
        parsed = parse_pt_name(f.name)
        if parsed is None:
            other.append(f)
        else:
            named.append((f, *parsed))
    named.sort(key=lambda item: (item[1], item[2]))
    return named, other


def unnamed_files_message(directory: Path, other: list[Path]) -> str:
    """Why no bucket file was found in ``directory``, naming what is there instead."""
    if not other:
        return f"{directory}: no .pt bucket files here (named {PT_PATTERN})"
    return (f"{directory}: no .pt file is named {PT_PATTERN} (the capture format), so "
            f"none is a bucket of a known rank and step; {len(other)} other .pt file(s), "
            f"e.g. {other[0].name}: rename them, or analyze one as a FILE")


def parse_size(text: str | int | float) -> int:
    """``"10GB"``, ``"1.8TB"``, ``"512MiB"``, ``"4096"`` -> bytes (k/M/G/T = 1000, Ki.. = 1024)."""
    if isinstance(text, int | float):
        if text <= 0:
            raise ValueError(f"a size must be positive, got {text}")
        return int(text)
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"a size looks like '10GB', '1.8TB', '512MiB' or '4096', got {text!r}")
    unit = m.group(2).lower()
    scale = _UNITS[unit[:1]] if "i" not in unit else 1024 ** (" kmgtp".index(unit[0]))
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value
