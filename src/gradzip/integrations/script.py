"""The contract between ``gradzip compare --script`` and the user's training script.

For each run, compare launches ``torchrun --nproc_per_node W SCRIPT ARGS`` inside the
shaped link with:

- ``GRADZIP_METHOD``: the method, in compare's grammar (a codec spec or ``torch:...``);
- ``GRADZIP_SEED``: the run's seed (seed k of every method is the same: the script
  seeds its model and data order with it);
- ``GRADZIP_RUN_DIR``: the run's directory, where the record goes (``results.jsonl``);
  a script started by hand without it writes to ``runs/<script name>`` and says so;
- ``GRADZIP_NODE_SIZE`` (``--link nodes=NxL`` only): ranks per node, so that gradzip's
  codecs compress between nodes only;
- ``GRADZIP_START_STEP`` (``--start-step``): gradzip's codecs send plain until then.

In the script, ``handle = gradzip.attach(ddp_model)`` without a spec takes the method
from the environment, PyTorch's own hooks included; ``handle.log_eval(step, val_loss)``
records an evaluation, and ``handle.close()`` (also run at exit) writes the run's record
in the schema of docs/results.md, with the fields it can measure.

Training time without the script's help: the optimizer step is what happens between
two forward passes with reductions in between. A step starts at the first training
forward (grad enabled, module in training mode) and ends at the next forward of any
kind once the step's gradients were reduced; an evaluation's forwards (``no_grad`` or
``eval()``) then run off the clock until training resumes. Data loading before the
first forward of a step is thus counted in the previous step, the optimizer step too.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ENV_METHOD = "GRADZIP_METHOD"
ENV_SEED = "GRADZIP_SEED"
ENV_RUN_DIR = "GRADZIP_RUN_DIR"
ENV_NODE_SIZE = "GRADZIP_NODE_SIZE"
ENV_START_STEP = "GRADZIP_START_STEP"
#: steps left out of the timing statistics (allocator and cache warm-up)
TIMING_WARMUP = 5


@dataclass(frozen=True)
class Launch:
    """What ``gradzip compare`` told this process through the environment."""

    method: str
    seed: int
    run_dir: Path | None
    node_size: int = 0
    start_step: int = 0

    @classmethod
    def from_env(cls, environ: Any = os.environ) -> Launch | None:
        """The launch, or None when no ``GRADZIP_METHOD`` is set; ValueError for values
        that are not what compare writes."""
        method = environ.get(ENV_METHOD, "").strip()
        if not method:
            return None
        numbers = {}
        for name in (ENV_SEED, ENV_NODE_SIZE, ENV_START_STEP):
            try:
                numbers[name] = int(environ.get(name) or 0)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {environ.get(name)!r}"
                                 ) from None
        run_dir = environ.get(ENV_RUN_DIR)
        return cls(method, numbers[ENV_SEED], Path(run_dir) if run_dir else None,
                   numbers[ENV_NODE_SIZE], numbers[ENV_START_STEP])


def attach(model: Any, spec: Any = None, **options: Any) -> Any:
    """``gradzip.attach``: with a spec, ``gradzip.comm.attach`` (the library call);
    without one, the method ``gradzip compare --script`` put in the environment, as a
    ``ScriptHandle`` that also records evaluations and writes the run's record."""
    from gradzip.comm.attach import attach as attach_spec

    if spec is not None:
        return attach_spec(model, spec, **options)
    launch = Launch.from_env()
    if launch is None:
        raise ValueError(f"gradzip.attach(model) without a spec reads the method from "
                         f"{ENV_METHOD}, which gradzip compare --script sets; it is not "
                         "set here: pass a spec, e.g. gradzip.attach(model, 'int8')")
    return ScriptHandle(model, launch, **options)


def default_run_dir() -> Path:
    """Where a script run outside ``gradzip compare`` writes its record:
    ``runs/<script name>`` under the working directory."""
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return Path("runs") / (script if script and script != "-c" else "script")


def wait_for_device(module: torch.nn.Module) -> None:
    """Wait for the work queued on ``module``'s CUDA device (nothing on the CPU): a
    script's host runs ahead of the GPU, so a step timed on the host alone would time
    how fast its kernels and collectives are queued, not how fast they run."""
    device = next((p.device for p in module.parameters()), None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Training time per optimizer step, from the forward calls of ``module`` and the
    reductions ``stats`` saw (the module docstring says how steps are told apart).
    On CUDA a step closes after the device finished it (``wait_for_device``, once per
    step, at the next step's first forward).

    A script may close its steps itself (``handle.stats.end_step()``, as README's
    ``attach`` example does): the clock then closes its own step without closing the
    statistics' step again, so both kinds of script time the same steps."""

    def __init__(self, module: torch.nn.Module, stats: Any) -> None:
        self.module, self.stats = module, stats
        self.step_ms: list[float] = []
        self._start: float | None = None
        self._carried = 0.0  # ms of a step interrupted by an evaluation
        self._seen = stats.reductions_seen()  # when the clock last closed a step
        self._hook = module.register_forward_pre_hook(self._on_forward)

    @property
    def steps(self) -> int:
        return len(self.step_ms)

    @property
    def train_time_s(self) -> float:
        return sum(self.step_ms) / 1e3

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.settle()
        if torch.is_grad_enabled() and module.training:
            if self._start is None:
                self._start = time.perf_counter()
        elif self._start is not None:  # an evaluation in the middle of a step
            self._carried += (time.perf_counter() - self._start) * 1e3
            self._start = None

    def settle(self) -> None:
        """Close the open step if gradients were reduced since the last one closed
        (before an evaluation is logged, and at the end)."""
        if self.stats.reductions_seen() == self._seen:
            return
        wait_for_device(self.module)
        now = time.perf_counter()
        ms = self._carried + ((now - self._start) * 1e3 if self._start is not None else 0.0)
        self._start, self._carried = None, 0.0
        if self.stats.open_reductions():  # the script did not close it itself
            self.stats.end_step()
        self._seen = self.stats.reductions_seen()
        self.step_ms.append(ms)

    def close(self) -> None:
        self.settle()
        self._hook.remove()


class ScriptHandle:
    """``gradzip.attach(model)`` under ``gradzip compare --script``: the method of the
    environment on ``model`` (a DDP module), evaluations, and the run's record."""

    def __init__(self, model: Any, launch: Launch, **options: Any) -> None:
        import torch.distributed as dist

        from gradzip.comm.method import AutoMethod, CodecMethod, TorchHookMethod, parse_method
        from gradzip.train.metrics import source_digest

        source_digest()  # of the code this run starts on (see build_record)
        self.launch = launch
        self.run_dir = launch.run_dir or default_run_dir()
        self.method = parse_method(launch.method)
        if isinstance(self.method, TorchHookMethod):
            if options:
                raise ValueError(f"{launch.method} is PyTorch's own hook: attach options "
                                 f"{sorted(options)} apply to gradzip codecs only")
            from gradzip.comm.torch_hooks import attach_torch

            self.handle: Any = attach_torch(model, str(self.method))
        elif isinstance(self.method, CodecMethod | AutoMethod):
            from gradzip.comm.attach import attach as attach_spec

            options.setdefault("seed", launch.seed)
            if launch.start_step:
                options.setdefault("start_step", launch.start_step)
            if launch.node_size and launch.node_size < dist.get_world_size():
                options.setdefault("node_size", launch.node_size)
            self.handle = attach_spec(model, self.method, **options)
        else:
            raise ValueError(f"{launch.method} is a local-update method: its outer loop is "
                             "gradzip's trainer's; race it without --script (gradzip "
                             "compare's built-in trainer)")
        self.stats = self.handle.stats
        module = getattr(model, "module", model)
        self.clock = StepClock(module, self.stats)
        self.params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        self.model_name = type(module).__name__
        self.device = next(module.parameters()).device
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.evals: list[dict[str, float | None]] = []
        self.record: dict[str, Any] | None = None
        atexit.register(self.close)

    def log_eval(self, step: int, val_loss: float) -> None:
        """Record an evaluation of the model after ``step`` optimizer steps (the same
        validation batches every time; with several ranks, their mean or rank 0's)."""
        self.clock.settle()
        loss = float(val_loss)
        self.evals.append({"step": int(step), "train_time_s": self.clock.train_time_s,
                           "val_loss": loss if math.isfinite(loss) else None})
        self.restart_clock()

    def restart_clock(self) -> None:
        """The time until the next step (the evaluation just logged) is no step's:
        ``auto`` leaves it out of what it measures (other methods measure nothing)."""
        restart = getattr(self.handle, "restart_clock", None)
        if callable(restart):
            restart()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.handle.state_dict())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.handle.load_state_dict(sd)

    def close(self) -> None:
        """Stop the hook and, on rank 0, append the run's record to
        ``GRADZIP_RUN_DIR/results.jsonl`` (once; safe to call again)."""
        if self.record is not None:
            return
        self.clock.close()
        self.handle.close()
        self.record = build_record(self)
        if self.rank == 0:
            from gradzip.train.metrics import append_results

            path = self.run_dir / "results.jsonl"
            append_results(self.record, [path])
            if self.launch.run_dir is None:  # outside compare: say where it went
                print(f"gradzip: the run's record was appended to {path} (set "
                      f"{ENV_RUN_DIR} to choose the directory)", file=sys.stderr, flush=True)

    def __repr__(self) -> str:
        return f"gradzip.ScriptHandle({self.launch.method!r}, seed={self.launch.seed})"


def build_record(h: ScriptHandle) -> dict[str, Any]:
    """The record of docs/results.md, with the fields a script run can measure (no
    tokens, data or phase breakdown: those are the script's own)."""
    from gradzip.train.metrics import (
        communication_fields,
        git_commit,
        peak_memory,
        percentile,
        source_digest,
    )

    timed = h.clock.step_ms[TIMING_WARMUP:]
    total = sum(timed)
    comm = communication_fields(h.stats)
    comm_ms = h.stats.totals()["comm_ms"]
    last = h.evals[-1]["val_loss"] if h.evals else None
    run_name = h.run_dir.name
    return {
        "run_name": run_name, "world_size": h.world_size, "parallel": "ddp",
        "model": h.model_name, "params": h.params, "method": str(h.method),
        "codec": str(h.method), "codec_config": h.method.to_json(), "seed": h.launch.seed,
        "steps": h.clock.steps,  # optimizer steps whose gradients were reduced
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
        "gradzip_source": source_digest(), "torch_version": torch.__version__,
        "device": "cpu" if h.device.type != "cuda" else torch.cuda.get_device_name(h.device),
        "val_loss": last, "val_ppl": math.exp(min(last, 50.0)) if last is not None else None,
        "evaluation": "done" if h.evals else "skipped: the script logged no evaluation",
        "train_time_s": h.clock.train_time_s,
        "eval_history": h.evals,
        "timed_steps": len(timed),
        "step_time_ms_mean": total / len(timed) if timed else None,
        "step_time_ms_p50": percentile(timed, 50),
        "step_time_ms_p90": percentile(timed, 90),
        "step_time_ms_p95": percentile(timed, 95),
        "phase_ms_mean": {"comm": comm_ms / h.clock.steps} if h.clock.steps else {},
        "comm_ratio": comm_ms / sum(h.clock.step_ms) if sum(h.clock.step_ms) else None,
        "auto": h.handle.report() if hasattr(h.handle, "report") else None,
        **comm,
        **peak_memory(h.device),
    }
