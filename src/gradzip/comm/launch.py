"""Run a function on N local gloo ranks (tests and ``gradzip bench comm``).

``run_ranks(fn, 2, *args)`` spawns two fresh processes, initializes a gloo process
group through a ``FileStore`` in a private temporary directory (no ports to pick),
calls ``fn(rank, *args)`` in each and returns their results in rank order. A rank
that fails or a group that hangs past ``timeout`` ends every rank and raises here,
so a broken collective can never hang a test run.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple,
           threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    try:
        result: Any = ("ok", fn(rank, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(Path(tmp) / f"result{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    if result[0] == "ok":
        # the ranks leave together: a rank that exits first closes its end of groups a
        # slower peer may still be connecting ("connectFullMesh ... closed by peer")
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(1)  # peers may be blocked in a collective; don't wait for them


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 300.0,
              threads: int = 1) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each in its own gloo rank.

    ``fn`` must be importable by name (a module-level function); results must pickle.
    """
    tmp = tempfile.mkdtemp(prefix="gradzip-ranks-")
    try:
        ctx = mp.start_processes(_entry, args=(fn, world_size, tmp, args, threads),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        failure: BaseException | None = None
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout:.0f} s")
        except BaseException as e:  # noqa: BLE001 - re-raised below with rank errors
            failure = e
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results: list[Any] = []
        errors: list[str] = []
        for rank in range(world_size):
            path = Path(tmp) / f"result{rank}.pkl"
            if not path.exists():
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        if failure is not None or len(results) != world_size:
            raise RuntimeError(f"distributed run failed: {failure}")
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class CollectiveRecorder:
    """Counts the bytes every torch.distributed collective on ``group`` is handed.

    An independent check of ``CommStats``: while active (``with``), the module-level
    ``all_reduce``/``all_gather``/``all_to_all(_single)``/``reduce_scatter_tensor`` of
    ``torch.distributed`` are wrapped, and calls whose ``group=`` is ``group`` add
    the input tensors' sizes to ``bytes``. ``group=None`` matches every call.
    """

    _INPUTS = {
        "all_reduce": lambda args: [args[0]],
        "all_gather": lambda args: [args[1]],
        "all_to_all": lambda args: list(args[1]),
        "all_to_all_single": lambda args: [args[1]],
        "reduce_scatter_tensor": lambda args: [args[1]],
    }

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.bytes = 0
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str) -> Any:
        fn = getattr(dist, name)
        inputs = self._INPUTS[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.group is None or kwargs.get("group") is self.group:
                self.bytes += sum(t.numel() * t.element_size() for t in inputs(args))
                self.calls += 1
            return fn(*args, **kwargs)

        return counted

    def __enter__(self) -> CollectiveRecorder:
        for name in self._INPUTS:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}
