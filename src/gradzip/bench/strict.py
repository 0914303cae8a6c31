"""NCCL's rules on gloo: several ranks on one GPU, and the checks a CPU run can make.

NCCL refuses two ranks on one device, so several processes can share one GPU only over
gloo, which runs few collectives on CUDA tensors. And NCCL is stricter than gloo where
it hurts: it refuses a tensor on the host, and a collective whose shapes differ between
ranks hangs or corrupts memory on it, where gloo raises or copies what it gets.

``StrictCollectives`` patches torch.distributed's Python collectives for the duration.
Each call first checks that every tensor it is handed is on the ranks' device (a CPU
tensor on a CUDA run fails as NCCL would) and that every rank of the group passes the
same shapes and dtypes (one small object all-gather on the same group: the exchange
NCCL would not make), and then runs: on the CPU as is; on a GPU through the host (the
tensors copied down, the gloo collective, the results copied back) and as completed
work, so a future chained on it runs after the data is back. The checks are the point:
the staging makes the timing unlike NCCL's, and nothing here measures speed.

Collectives that PyTorch issues from C++ (DDP's initial broadcast, its bucket
all-reduce when no hook is registered) are not patched: gloo runs them on CUDA tensors
itself.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

#: torch.distributed's collectives gradzip and FSDP2 call from Python (the ``*_single``
#: names are FSDP2's on recent torch; those this torch lacks are skipped). The first
#: argument of each is its output.
PATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
           "all_to_all_single", "broadcast")


class StrictViolation(RuntimeError):
    """A collective NCCL would refuse, hang in or corrupt."""


class StrictCollectives:
    """Patches ``PATCHED`` with NCCL's checks for ranks on ``device`` (module doc);
    ``calls`` counts the checked collectives by name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls: dict[str, int] = {}
        self._originals: dict[str, Callable[..., Any]] = {}
        self._inside = threading.local()  # the shape exchange's own collectives

    def __enter__(self) -> StrictCollectives:
        for name in PATCHED:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._checked(name, self._originals[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _checked(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def collective(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):
                return original(*args, **kwargs)
            # by name, however the caller passed them (a positional group or async_op)
            named = dict(signature.bind(*args, **kwargs).arguments)
            tensors = [t for t in tree_flatten(list(named.values()))[0]
                       if isinstance(t, torch.Tensor)]
            self._check_devices(name, tensors)
            with self._nested():
                self._check_shapes(name, tensors, named.get("group"))
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.device.type == "cpu":
                return original(*args, **kwargs)
            return self._through_host(original, named)
        return collective

    @contextmanager
    def _nested(self) -> Iterator[None]:
        self._inside.active = True
        try:
            yield
        finally:
            self._inside.active = False

    def _check_devices(self, name: str, tensors: list[torch.Tensor]) -> None:
        wrong = sorted({str(t.device) for t in tensors if t.device.type != self.device.type})
        if wrong:
            raise StrictViolation(f"{name} was handed tensors on {', '.join(wrong)}: the "
                                  f"ranks run on {self.device.type}, and NCCL refuses them")

    def _check_shapes(self, name: str, tensors: list[torch.Tensor], group: Any) -> None:
        mine = [(tuple(t.shape), str(t.dtype)) for t in tensors]
        world = dist.get_world_size(group)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, (name, mine), group=group)
        if any(other != every[0] for other in every):
            raise StrictViolation(f"{name}: the ranks passed different shapes or dtypes "
                                  f"({every}); NCCL would hang or corrupt memory")

    def _through_host(self, original: Callable[..., Any], named: dict[str, Any]) -> Any:
        """Run ``original`` on host copies of the device tensors, copy its output (the
        first argument) back, and return completed work for ``async_op``."""
        def down(t: Any) -> Any:
            return t.detach().cpu() if isinstance(t, torch.Tensor) else t

        host = {key: tree_map(down, value) for key, value in named.items()}
        async_op = bool(host.pop("async_op", False))
        with self._nested():
            original(**host)
        output = next(iter(named))
        pairs = list(zip(tree_flatten(named[output])[0], tree_flatten(host[output])[0],
                         strict=True))
        for device_tensor, copy in pairs:
            if isinstance(device_tensor, torch.Tensor):
                device_tensor.detach().copy_(copy)
        if not async_op:
            return None
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([t for t, _ in pairs])
        return torch._C._distributed_c10d._create_work_from_future(done)  # type: ignore[attr-defined]
