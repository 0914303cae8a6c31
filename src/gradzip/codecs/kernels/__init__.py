"""Device backends of codec stages: fused Triton kernels, chosen by the tensor's device.

A kernel is not a second codec: ``int8``, ``qsgd`` and ``fp8`` keep one registered
stage and one spec, and run their fused kernel where the data is on a CUDA device and
Triton is installed, the torch path everywhere else; ``topk`` selects its positions
with a radix select on the device (``select.py``), the sign codecs and TernGrad
pack and unpack their bits and trits with one kernel each (``bits.py``, behind
``bitpack``), and ``centroid`` bins, averages and refines each bucket in one program
(``centroid.py``). The torch path on a GPU is a
dozen full passes and launches per bucket (abs-max, the inverse in float64, multiply,
round, clamp, cast; 38 GB/s for ``int8`` on an H200 against 452 for a copy); a
kernel reads each value once and writes its code once.

Every kernel computes what the torch path computes, bit for bit (the same float32
multiply, the same float64 inverse, round half to even, the same random bits), so a
payload made on a GPU decodes on a CPU to the same tensor; where a kernel sums in a
tree (``qsgd``'s norms, ``centroid``'s bin means) the sum may round by an ulp where the
torch path's one-by-one sum does not (each module says when). ``make test`` checks that on
the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is
imported, as ``tests/conftest.py`` does where there is no GPU): ``interpreted()`` lets
CPU tensors take the kernel path there. ``GRADZIP_KERNELS=off`` keeps the torch path
on a GPU too (to compare the two).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

#: the widest block a kernel row holds (a block of ``block`` values is one row of the
#: next power of two); wider blocks take the torch path
MAX_BLOCK = 4096
#: the most values a kernel takes: several index by an int32 program id times their
#: block (cheaper than int64 on a GPU), exact up to 2^31 minus a block; larger tensors
#: (8 GiB of float32 in one bucket) take the torch path
MAX_NUMEL = 2**31 - 2**16

_forced = [False]


@cache
def triton_installed() -> bool:
    """Whether ``triton`` imports here (a GPU build of PyTorch brings it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_on() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enabled() -> bool:
    """Whether kernels may run at all (``GRADZIP_KERNELS=off`` turns them off)."""
    return os.environ.get("GRADZIP_KERNELS", "on").lower() not in ("off", "0", "false", "no")


def runs_on(x: torch.Tensor, block: int = 1, numel: int = 0) -> bool:
    """Whether the kernel path runs for ``x`` cut into blocks of ``block`` values: a
    contiguous tensor (a kernel reads memory in order, whatever the strides say) of at
    most ``MAX_NUMEL`` values. ``numel``: the values the kernel indexes where that is
    more than ``x`` holds (an unpack writes ``n`` values from ``n / 8`` bytes)."""
    if not enabled() or block > MAX_BLOCK or not triton_installed():
        return False
    if x.device.type != "cuda" and not (x.device.type == "cpu" and _forced[0]):
        return False
    return max(x.numel(), numel) <= MAX_NUMEL and x.is_contiguous()


@contextmanager
def interpreted() -> Iterator[None]:
    """CPU tensors take the kernel path inside the block, run by Triton's interpreter
    (for tests: ``TRITON_INTERPRET=1`` must have been set before ``triton`` was
    imported, or the kernels would be compiled for a GPU that is not there)."""
    if not interpreter_on():
        raise RuntimeError("set TRITON_INTERPRET=1 before importing triton to run the "
                           "kernels on the CPU")
    if not triton_installed():
        raise RuntimeError("triton is not installed: pip install triton")
    _forced[0] = True
    try:
        yield
    finally:
        _forced[0] = False
