"""Device discipline, checked without a GPU: host syncs and mixed-device operations.

On CUDA, every ``.item()``, ``int(t)``, ``.tolist()``, ``.cpu()`` or NumPy call on a
device tensor stalls the host until the GPU catches up, and an operation that mixes
a device tensor with a CPU tensor fails outright. Neither shows on a CPU-only
machine, where every tensor is a host tensor. Two proxies find them there:

* ``DeviceWatch`` — a ``TorchDispatchMode`` that records every operator whose
  tensor arguments live on more than one device (a 0-d CPU scalar is allowed, as
  PyTorch allows it) and every host transfer (``.to``/``.copy_`` between devices),
  and counts the operators that read a value to the host (``_local_scalar_dense``:
  ``.item()``, ``int()``, ``float()``, ``bool()``).  Run a codec on ``meta`` tensors
  inside it: a meta tensor has no values, so any host read raises, and a CPU-made
  tensor that meets the data is recorded as a mix.
* ``count_host_syncs`` — counts, on ordinary tensors and on every thread, the calls
  that would be host syncs on a GPU: ``.item()``, ``int()``, ``float()``, ``bool()``,
  ``.tolist()`` and ``.cpu()``. The DDP hook's budget test asserts
  these per bucket (``tests/test_sync_budget.py``).

On a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` is the ground truth
(``gradzip bench gpu`` reports it).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradzip.codecs.nonfinite import device_path_only

#: operators that move data between devices on purpose (counted, not errors)
_TRANSFERS = {"aten._to_copy.default", "aten.copy_.default", "aten._copy_from.default",
              "aten._copy_from_and_resize.default"}
#: operators that read a tensor's value on the host
_READS = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"}


@dataclass
class DeviceWatch(TorchDispatchMode):
    """Records mixed-device operators, transfers and host reads (see the module doc)."""

    mixes: list[str] = field(default_factory=list)
    transfers: Counter[str] = field(default_factory=Counter)
    reads: int = 0
    #: host-to-device copies without ``non_blocking`` (``.to(device)``,
    #: ``torch.tensor(..., device=)``): from pageable memory, CUDA blocks the host until
    #: the copy is done; from pinned memory with ``non_blocking=True`` it does not
    blocking_uploads: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        target = kwargs.get("device")
        if name in _TRANSFERS:
            kinds = {t.device.type for t in tensors} | ({torch.device(target).type}
                                                        if target is not None else set())
            if len(kinds) > 1:
                self.transfers["->".join(sorted(kinds))] += 1
            if _blocking_upload(name, args, kwargs):
                self.blocking_uploads.append(name)
        elif len(devices) > 1:
            self.mixes.append(f"{name} on {sorted(devices)}")
        if name in _READS:
            self.reads += 1
        return func(*args, **kwargs)


def _blocking_upload(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a transfer operator copies host memory to a device without
    ``non_blocking`` (``_to_copy(src, device=)`` or ``copy_(dst, src)``)."""
    if name == "aten._to_copy.default":
        src, dst = args[0].device.type, torch.device(kwargs.get("device") or
                                                     args[0].device).type
    elif name == "aten.copy_.default":
        src, dst = args[1].device.type, args[0].device.type
    else:
        return False
    blocking = not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    return src == "cpu" and dst != "cpu" and bool(blocking)


@dataclass
class SyncCount:
    """Calls that would be host syncs on a GPU, by kind."""

    counts: Counter[str] = field(default_factory=Counter)
    #: the same calls by the name of the thread that made them (``MainThread`` is where
    #: backward runs the hooks on a CPU; gradzip's comm thread has its own name)
    threads: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


#: the tensor methods that read values to the host (``int(t)`` is ``t.__int__()``)
#: (``.numpy()`` is not among them: it fails on a device tensor, so it only ever runs on
#: a host tensor, after the ``.cpu()`` that was the sync)
_SYNC_METHODS = ("item", "__int__", "__float__", "__bool__", "__index__", "tolist", "cpu")


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """Count, on every thread, the calls on tensors that would be host syncs on a GPU:
    ``item``, ``int()``/``float()``/``bool()``, ``tolist`` and ``cpu``.

    The methods of ``torch.Tensor`` are wrapped for the duration (Python-level calls
    only: what gradzip's own code does). Not thread-safe against other patches.
    """
    out = SyncCount()
    originals = {name: getattr(torch.Tensor, name) for name in _SYNC_METHODS}

    def counting(name: str) -> Any:
        original = originals[name]
        kind = "item" if name.startswith("__") else name

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out.counts[kind] += 1
            out.threads[threading.current_thread().name] += 1
            return original(self, *args, **kwargs)
        return method

    try:
        for name in originals:
            setattr(torch.Tensor, name, counting(name))
        with device_path_only():  # the reads a GPU would make, not the CPU's shortcuts
            yield out
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
