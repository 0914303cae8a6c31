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

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

#: torch.distributed's collectives gradzip and FSDP2 call from Python
PATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_to_all", "all_to_all_single", "broadcast")


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
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._checked(name, self._originals[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _checked(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):
                return original(*args, **kwargs)
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self._check_devices(name, tensors)
            with self._nested():
                self._check_shapes(name, tensors, kwargs.get("group"))
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.device.type == "cpu":
                return original(*args, **kwargs)
            return self._through_host(original, args, kwargs)
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

    def _through_host(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Run ``original`` on host copies of the device tensors, copy every tensor back
        (outputs are written in place), and return completed work for ``async_op``."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def down(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                host = t.detach().cpu()
                pairs.append((t, host))
                return host
            return t

        host_args, host_kwargs = tree_map(down, (args, kwargs))
        async_op = bool(host_kwargs.pop("async_op", False))
        with self._nested():
            original(*host_args, **host_kwargs)
        for device_tensor, host in pairs:
            device_tensor.detach().copy_(host)
        if not async_op:
            return None
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([t for t, _ in pairs])
        return torch._C._distributed_c10d._create_work_from_future(done)  # type: ignore[attr-defined]
