"""PyTorch's own DDP comm hooks as methods, measured with gradzip's ``CommStats``.

Methods: ``torch:none`` (``default_hooks.allreduce_hook``: DDP's all-reduce, the mean of
the bucket, as a Python hook), ``torch:fp16`` (``fp16_compress_hook``), ``torch:bf16``
(``bf16_compress_hook``, which needs NCCL: refused on gloo when attached) and
``torch:powersgd(rank=R[, start_iter=N])`` (``powerSGD_hook`` with error feedback and
warm start, compressing from iteration N, default 2, the least PyTorch allows).

So that a race against gradzip's codecs is fair, they are measured the same way: a
thin hook around PyTorch's records, per bucket, when DDP called it and when its future
completed (a ``Reduction`` span: overlapping buckets count their time once), and the
bytes PyTorch's hook handed to ``dist.all_reduce`` on a process group of its own
(counted by wrapping ``torch.distributed.all_reduce`` for calls on that group only;
powerSGD's second all-reduce runs in a future callback, and is counted too), turned
into link bytes by the same link model. On CUDA the span is two events on the hook's
streams, read as the step closes (``eventtimes``): NCCL completes the future when the
work is enqueued, so a host clock would time the enqueue. ``torch:none`` is PyTorch's Python
``allreduce_hook`` rather than DDP's C++ default, which cannot be timed per bucket;
the two compute the same mean (the C++ path is 3-7% faster on the step of
``gradzip bench comm``).

PyTorch's ``powerSGD_hook`` hangs or aborts on gloo when a model has several buckets:
``attach_torch`` refuses that, and the trainer gives it one bucket. Its state (error
feedback, warm-start Q) is not checkpointed, so a ``torch:powersgd`` run cannot resume
exactly: its ``load_state_dict`` refuses.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from gradzip.collectives.linkmodel import backend_model, link_bytes
from gradzip.comm.eventtimes import EventTimings, event_pair
from gradzip.comm.groups import new_group
from gradzip.comm.stats import CommStats, Reduction

PREFIX = "torch:"
_POWERSGD = re.compile(r"^powersgd(?:\((.*)\))?$")
HOOKS = {"none": "allreduce_hook", "fp16": "fp16_compress_hook",
         "bf16": "bf16_compress_hook", "powersgd": "powerSGD_hook"}


def is_torch_method(method: str) -> bool:
    return method.strip().startswith(PREFIX)


def parse_torch_method(method: str) -> tuple[str, dict[str, int]]:
    """``torch:powersgd(rank=4)`` -> ("powersgd", {"rank": 4, "start_iter": 2})."""
    body = method.strip()[len(PREFIX):].strip()
    if body in ("none", "fp16", "bf16"):
        return body, {}
    m = _POWERSGD.match(body)
    if not m:
        raise ValueError(f"unknown PyTorch hook method {method!r}: use torch:none, "
                         "torch:fp16, torch:bf16 or torch:powersgd(rank=R[, start_iter=N])")
    params = {"rank": 1, "start_iter": 2}
    for item in filter(None, (p.strip() for p in (m.group(1) or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in params or not value.strip().isdigit():
            raise ValueError(f"{method!r}: expected rank=R and start_iter=N (integers), "
                             f"got {item!r}")
        params[key.strip()] = int(value)
    if params["rank"] < 1 or params["start_iter"] < 2:
        raise ValueError(f"{method!r}: rank must be >= 1 and start_iter >= 2 (PowerSGD's "
                         "error feedback needs DDP's bucket rebuild first)")
    return "powersgd", params


def describe(method: str) -> dict[str, Any]:
    """The method's JSON form for the results record."""
    kind, params = parse_torch_method(method)
    return {"torch_hook": HOOKS[kind], **params}


class _AllReduceCounter:
    """Bytes handed to ``dist.all_reduce`` on one group, since the last ``take``."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        self._original = dist.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") is self.group:
                with self._lock:
                    self._bytes["all_reduce"] += tensor.numel() * tensor.element_size()
                    self._calls["all_reduce"] += 1
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counted  # type: ignore[assignment]

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            out = dict(self._bytes), dict(self._calls)
            self._bytes.clear()
            self._calls.clear()
        return out

    def close(self) -> None:
        dist.all_reduce = self._original  # type: ignore[assignment]


class TorchHookHandle:
    """PyTorch's hook on a DDP model, with ``stats`` like ``gradzip.attach``'s handle."""

    def __init__(self, model: Any, method: str) -> None:
        self.method = method
        self.kind, self.params = parse_torch_method(method)
        backend = dist.get_backend()
        if self.kind == "bf16" and backend != "nccl":
            raise ValueError(f"torch:bf16 (PyTorch's bf16_compress_hook) needs NCCL; this "
                             f"group's backend is {backend}: use gradzip's bf16 instead")
        self.stats = CommStats()
        #: on CUDA each bucket's time is two events, read as the step closes: NCCL
        #: completes the hook's future (and runs ``done``) when the work is enqueued
        self.timings = EventTimings()
        self.stats.add_settler(self.timings.settle)
        self.group = new_group(list(range(dist.get_world_size())))
        self.world = dist.get_world_size(self.group)
        self.link_model = backend_model(backend)
        self._counter = _AllReduceCounter(self.group)
        self._hook, state = self._pytorch_hook()
        model.register_comm_hook(state, self._measured)

    def _pytorch_hook(self) -> tuple[Any, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.kind == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=self.group, matrix_approximation_rank=self.params["rank"],
                start_powerSGD_iter=self.params["start_iter"], use_error_feedback=True,
                warm_start=True)
            return powerSGD_hook.powerSGD_hook, state
        return getattr(default_hooks, HOOKS[self.kind]), self.group

    # No annotations: DDP checks the hook's signature against the real classes.
    def _measured(self, state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001
        """PyTorch's hook, timed from the call to its future's completion."""
        start = time.perf_counter()
        # powerSGD all-reduces the plain bucket until its start iteration
        plain = self.kind == "powersgd" and state.iter < state.start_powerSGD_iter
        buffer = bucket.buffer()
        numel, nbytes = buffer.numel(), buffer.numel() * buffer.element_size()
        events = event_pair() if buffer.is_cuda else None
        fut = self._hook(state, bucket)

        def done(f: torch.futures.Future) -> torch.Tensor:
            handed, calls = self._counter.take()
            r = Reduction(
                numel=numel, sent_values=numel,
                bytes_raw=link_bytes("all_reduce", nbytes, self.world, self.link_model),
                bytes_handed=sum(handed.values()),
                bytes_by_op={op: link_bytes(op, n, self.world, self.link_model)
                             for op, n in handed.items()},
                calls_by_op=calls, paths=["plain" if plain else "torch"],
                span=(start, time.perf_counter()))
            if events is None:
                self.stats.record(r)
            else:  # this stream waits for NCCL: the event lands when the hook's work ends
                events[1].record()
                self.timings.later(r, self.stats, span=events)
            return f.value()

        return fut.then(done)

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method}

    def load_state_dict(self, state: Any) -> None:
        if self.kind == "powersgd":
            raise ValueError("a torch:powersgd run cannot resume exactly: PyTorch's "
                             "PowerSGDState (error feedback, warm-start Q) is not "
                             "checkpointed; start a new run")

    def close(self) -> None:
        self._counter.close()


def attach_torch(model: Any, method: str) -> TorchHookHandle:
    """Register PyTorch's hook for ``method`` on the DDP ``model``, measured."""
    if dist.get_backend() == "gloo" and parse_torch_method(method)[0] == "powersgd" \
            and not one_bucket(model):
        raise ValueError(f"{method}: PyTorch's powerSGD_hook hangs or aborts on gloo with "
                         "several DDP buckets; set bucket_cap_mb above the model's gradient "
                         f"size ({gradient_bytes(model.module) / 2**20:.2f} MiB)")
    return TorchHookHandle(model, method)


def gradient_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def one_bucket(model: Any) -> bool:
    """Whether DDP puts every gradient in one bucket (also its small first bucket)."""
    if getattr(model, "bucket_bytes_cap_default", False):
        return gradient_bytes(model.module) <= dist._DEFAULT_FIRST_BUCKET_BYTES
    return gradient_bytes(model.module) <= model.bucket_bytes_cap
