"""The training loop, as torchtitan's ``train.py`` reads: ``Trainer.forward_backward_step``
(one micro-batch), ``Trainer.train_step`` (one optimizer step) and ``Trainer.train``
(steps, evaluation, checkpoints, the results record). One optimizer step is:

    for each of grad_accum micro-batches:      (gradients are synchronized on the last only)
        data -> forward -> backward            (DDP/FSDP communicate inside backward)
    unscale -> clip -> AdamW step -> zero grads

Setup is in ``Trainer.__init__``; the parallelism is one ``Parallelism`` object
(``parallel.parallelize``), so the loop has no branch on the strategy; every number
comes from one ``RunMetrics`` (``metrics.py``), whose communication source is the
codec's ``CommStats``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradzip.comm import replicas
from gradzip.comm.method import LocalUpdateMethod, Method, SnooMethod, every_codec
from gradzip.figures import figure
from gradzip.train import checkpoint as ckpt
from gradzip.train import restart
from gradzip.train.checks import capture_schedule, method_of, nonfinite_policy, parse_profile_steps
from gradzip.train.components import Components
from gradzip.train.config import JobConfig, OptimConfig
from gradzip.train.configure import model_label
from gradzip.train.evaluate import autocast_for, evaluate, evaluate_as_ranks
from gradzip.train.interrupt import StopRequest
from gradzip.train.metrics import (
    MetricLogger,
    PhaseTimer,
    RunMetrics,
    append_results,
    format_line,
    git_commit,
    peak_memory,
    require_wandb,
    source_digest,
)
from gradzip.train.parallel import (
    DistInfo,
    Parallelism,
    all_reduce_mean,
    any_rank,
    destroy_distributed,
    init_distributed,
    replicas_identical,
)
from gradzip.train.profiling import maybe_enable_profiling


def lr_at(step: int, o: OptimConfig, max_steps: int) -> float:
    """Linear warm-up to lr, then cosine decay to lr * min_lr_ratio at decay_steps."""
    if step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    decay_steps = o.decay_steps or max_steps
    floor = o.lr * o.min_lr_ratio
    if step >= decay_steps:
        return floor
    progress = (step - o.warmup_steps) / (decay_steps - o.warmup_steps)
    return floor + (o.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def load_data(cfg: JobConfig, info: DistInfo) -> Any:
    """Tokenizer and train/val token shards (rank 0 builds the cache, others wait)."""
    from gradzip.train.data import DataConfig, prepare_data

    d = cfg.data
    dcfg = DataConfig(sources=list(d.sources), cache_dir=d.cache_dir,
                      tokenizer=d.tokenizer or None, vocab_size=d.vocab_size,
                      val_fraction=d.val_fraction, max_tokens=d.max_tokens or None)
    return prepare_data(dcfg, rank=info.rank, world_size=info.world_size)


def train(cfg: JobConfig, *, components: Components | None = None, data: Any = None,
          make_loader: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Run (or resume) a training run; returns its results record.

    ``components`` builds the model, optimizer, parallelism and data (default: what
    ``gradzip train`` uses; ``components.py``); ``data`` (tokenizer, train, val) and
    ``make_loader`` are shorthands for those two of its fields.
    """
    parts = dataclasses.replace(components or Components(),
                                **({"data": data} if data is not None else {}),
                                **({"make_loader": make_loader}
                                   if make_loader is not None else {}))
    was_initialized = torch.distributed.is_initialized()
    info = init_distributed(cfg.train.parallel, cfg.train.device, cfg.train.comm_timeout)
    try:
        # ``cleanup`` stops the loader's prefetch thread and closes the log files and
        # TensorBoard writer however the run ends (an error included).
        with contextlib.ExitStack() as cleanup:
            return Trainer(cfg, info, parts, cleanup).train()
    finally:
        if not was_initialized:
            destroy_distributed()


def _check_environment(cfg: JobConfig, info: DistInfo, method: Method) -> None:
    """Fail before any work on what the configuration alone could not tell (and on what
    ``JobConfig.validate`` checks, for a configuration built without it)."""
    t = cfg.train
    if t.dtype == "fp16" and info.device.type != "cuda":
        raise ValueError("--dtype fp16 needs CUDA (its grad scaler); use bf16 on CPU")
    method.check(parallel=t.parallel, optimizer=cfg.optim.optimizer,
                 grad_clip=cfg.optim.grad_clip, blocks=cfg.model.n_layer)
    if cfg.run.wandb and info.is_main:
        require_wandb()  # fail now, not after the data is prepared


def _set_seeds(seed: int) -> None:
    """Same seed on every rank: FSDP shards identical initial weights (DDP would broadcast
    rank 0's anyway); data order and codec randomness derive from it too."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def validation_problem(data: Any, make_loader: Callable[..., Any], cfg: JobConfig,
                       info: DistInfo) -> str | None:
    """Why this run cannot evaluate (no validation data, too little of it), or None."""
    d = cfg.data
    if d.val_fraction == 0:
        return "--val-fraction 0: no validation data"
    try:
        make_loader(data.val, batch_size=d.batch_size, seq_len=d.seq_len, rank=info.rank,
                    world_size=info.world_size, seed=0, prefetch=0).close()
    except ValueError as e:
        return f"the validation split is too small ({e})"
    return None


class Trainer:
    """One run: its setup, and the loop in three levels (micro-batch, step, run)."""

    def __init__(self, cfg: JobConfig, info: DistInfo, parts: Components,
                 cleanup: contextlib.ExitStack) -> None:
        self.cfg, self.info, self.device = cfg, info, info.device
        source_digest()  # of the code this run starts on, not of later edits to the tree
        t, o, r, d = cfg.train, cfg.optim, cfg.run, cfg.data
        #: how gradients cross the link, parsed once for the whole run
        self.method = method_of(t, cfg.optim.optimizer)
        _check_environment(cfg, info, self.method)
        if self.device.type == "cpu":
            # Denormal floats in backward made a small GPT 35x slower on CPU; flush to 0.
            torch.set_flush_denormal(True)
        if t.threads:
            torch.set_num_threads(t.threads)
        self.run_dir = Path(r.out)
        self.skipped_checkpoints: list[str] = []
        #: which start of the workers this is (torchrun restarts them after a failure)
        self.attempt = restart.Attempt.from_env()
        self.kill_step = self._planned_kill()
        self.resume_from = self._find_resume()
        with replicas.one_at_a_time():  # not while another replica draws its model
            _set_seeds(t.seed)
        seeded = torch.Generator().manual_seed(t.seed).get_state()
        self.data = parts.data if parts.data is not None else load_data(cfg, info)
        make_loader = parts.make_loader
        if make_loader is None:
            from gradzip.train.data import BatchLoader

            make_loader = BatchLoader
        self.make_loader = make_loader
        self.no_eval = validation_problem(self.data, make_loader, cfg, info)
        self._size_vocab()
        self._write_run_files()
        raw = self._build_model(parts, seeded)
        self.n_params = sum(p.numel() for p in raw.parameters())  # tied weights once
        self.capture = self._make_capture(cleanup)
        self.par: Parallelism = parts.parallelize(
            raw, info, parallel=t.parallel, method=self.method,
            bucket_cap_mb=t.bucket_cap_mb, seed=t.seed, diagnose=t.diagnose,
            nonfinite=nonfinite_policy(t), capture=self.capture, node_size=t.node_size,
            hierarchical=t.hierarchical)
        self.model = self.par.model
        #: seconds compiling the codecs' kernels, before the clock starts (not training)
        self.compile_s = warm_codecs(self.method)
        self.optimizer = parts.optimizer(self.model, o)
        self.par.bind_optimizer(self.optimizer, cleanup)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.dtype == "fp16")
        shard, shards = train_shard(info)
        self.loader = make_loader(self.data.train, batch_size=d.batch_size, seq_len=d.seq_len,
                                  rank=shard, world_size=shards, seed=t.seed,
                                  prefetch=d.prefetch)
        cleanup.callback(self.loader.close)
        #: what a checkpoint carries beyond weights: training time, history
        self.progress: dict[str, Any] = {"train_time_s": 0.0, "time_to_target_s": None,
                                         "ppl_at_fixed_time": None, "history": []}
        # torchft: a group that heals takes its peer's clock and evaluations (the job's)
        self.step_began: float | None = None  # when the step in progress began
        self.healed_at: float | None = None  # when this group last took a peer's clock
        self.par.share_job_progress(self._job_progress, self._take_job_progress)
        self.start_step = (self._resume(self.resume_from) if self.resume_from is not None
                           else 0)
        #: what the failure before this attempt cost (measured before this attempt logs)
        self.restart = (restart.measure(self.run_dir, self.attempt, self.start_step,
                                        self.progress["train_time_s"])
                        if self.attempt.restarted else None)
        if self.start_step >= t.max_steps:
            raise ValueError(f"checkpoint is at step {self.start_step}, not before "
                             f"--max-steps {t.max_steps}: raise --max-steps to train further")
        self.log = MetricLogger(self.run_dir, info.rank, cfg, total_steps=t.max_steps,
                                start_step=self.start_step)
        cleanup.callback(self.log.close)
        # the job's: every rank, and under torchft every replica group (each has a shard)
        self.tokens_per_step = d.batch_size * d.seq_len * o.grad_accum * train_shard(info)[1]
        self._start_clocks()
        self._announce()
        self._note_restart()

    # ------------------------------------------------------------ setup helpers
    def _build_model(self, parts: Components, seeded: torch.Tensor) -> torch.nn.Module:
        """The model on this rank's device; replica threads build theirs in turns from the
        seed's generator state (they share torch's one random generator: a replica that
        seeds, or draws, while another draws its model must wait for it)."""
        with replicas.one_at_a_time():
            if replicas.current() is not None:
                torch.set_rng_state(seeded)
            return parts.model(self.cfg.model).to(self.device)

    def _start_clocks(self) -> None:
        """Step and phase timing: the wall, or under --replicas this replica's CPU time
        (its link's time is the link model's, added per step by ``metrics``)."""
        self.replica = replicas.current()
        self.clock = self.replica.clock.now if self.replica is not None else time.perf_counter
        self.metrics = RunMetrics(self.cfg.run.timing_warmup, self.tokens_per_step,
                                  self.par.comm_stats, self.cfg.optim.grad_clip,
                                  link=self.replica.link if self.replica else None)
        self.timer = PhaseTimer(self.device, self.clock)

    def _find_resume(self) -> Path | None:
        """The checkpoint to resume from (``--resume``, or a restart by torchrun of a run
        that saved one); a fresh run must not mix with an old one."""
        has_checkpoint = bool(ckpt.step_dirs(self.run_dir))
        if restart.resumes(self.cfg.run.resume, has_checkpoint, self.attempt):
            # the newest that verifies (a collective: rank 0 decides)
            path, self.skipped_checkpoints = ckpt.select_checkpoint(self.run_dir)
            return path
        if has_checkpoint:
            raise ValueError(f"{self.run_dir} already holds checkpoints: pass --resume to "
                             "continue that run, or choose another --out")
        return None

    def _job_progress(self) -> dict[str, Any]:
        """What a healing peer takes: this group's progress, its clock read now (the
        step in progress so far included: a peer that waited for the healing group in
        this step waited on the job's clock), and the position in the data (every group
        has read as many batches of its own shard)."""
        progress = copy.deepcopy(self.progress)
        if self.step_began is not None:
            progress["train_time_s"] += time.perf_counter() - self.step_began
        return {"progress": progress, "loader": self.loader.state_dict()}

    def _take_job_progress(self, job: dict[str, Any]) -> None:
        self.progress.update(job["progress"])
        self.loader.load_state_dict(job["loader"])  # not the batches it read before dying
        self.healed_at = time.perf_counter()

    def _step_seconds(self, t0: float, step_ms: float) -> float:
        """The step's time on the clock: all of it, or since the heal in it (the peer's
        clock taken then already counts the rest)."""
        healed, self.healed_at = self.healed_at, None
        if healed is not None and healed > t0:
            return max(0.0, t0 + step_ms / 1e3 - healed)
        return step_ms / 1e3

    def _planned_kill(self) -> int | None:
        """The step after which ``GRADZIP_KILL_AT`` kills this rank in this attempt."""
        planned = restart.kills()
        if self.attempt.number < len(planned):
            rank, step = planned[self.attempt.number]
            return step if rank == self.info.rank else None
        return None

    def _note_restart(self) -> None:
        """Say what the failure before this attempt cost, and keep it (rank 0)."""
        if self.restart is None:
            return
        if self.info.is_main:
            restart.append(self.run_dir, self.restart)
        self.log.info(restart.describe(self.restart, self.attempt))

    def _make_capture(self, cleanup: contextlib.ExitStack) -> Any:
        """The gradient capture of --capture (closed however the run ends: what was
        queued is written, the steps that ended are committed)."""
        if not self.cfg.run.capture:
            return None
        from gradzip.capture.capture import Capture

        capture = Capture(self.cfg.run.capture, **capture_schedule(self.cfg.run))
        cleanup.callback(capture.close)
        return capture

    def _size_vocab(self) -> None:
        vocab = self.data.tokenizer.vocab_size
        m = self.cfg.model
        if m.vocab_size == 0:
            m.vocab_size = vocab
        elif m.vocab_size < vocab:
            raise ValueError(f"--model-vocab-size {m.vocab_size} is smaller than the "
                             f"tokenizer's vocabulary ({vocab})")

    def _write_run_files(self) -> None:
        """config.json (atomically: --resume reads it back) and the tokenizer, rank 0."""
        if not self.info.is_main:
            return
        from gradzip.train.data.atomic import atomic_write_bytes

        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.run_dir / "config.json",
                           (json.dumps(self.cfg.to_dict(), indent=2) + "\n").encode())
        self.data.tokenizer.save(self.run_dir / "tokenizer.json")

    def _resume(self, path: Path) -> int:
        """Weights, optimizer, and everything that makes the next step identical."""
        t, d, info = self.cfg.train, self.cfg.data, self.info
        meta, rank_state = ckpt.load(path, model=self.par.raw,
                                     optimizer=self.optimizer, rank=info.rank,
                                     world_size=info.world_size, sharded=self.par.sharded)
        self.progress.update(meta.get("trainer", {}))
        ckpt.set_rng_state(rank_state["rng"])
        self.loader.load_state_dict(rank_state["loader"])
        self.scaler.load_state_dict(rank_state["scaler"])
        if meta.get("codec", t.codec) != t.codec:
            raise ValueError(f"checkpoint {path} was written with codec "
                             f"{meta.get('codec')!r} but this run uses {t.codec!r}")
        sample = torch.zeros(d.batch_size, d.seq_len, dtype=torch.long, device=self.device)
        self.par.resume_codec(rank_state["codec"], sample)
        return int(meta["step"])

    def _announce(self) -> None:
        cfg, info, d, o, t = self.cfg, self.info, self.cfg.data, self.cfg.optim, self.cfg.train
        where = (f"resuming {self.resume_from}" if self.resume_from else f"run {self.run_dir}")
        self.log.info(f"{where}: model {model_label(cfg.model)} "
                      f"({self.n_params / 1e6:.2f}M params), "
                      f"{info.world_size} {'replicas' if self.replica else 'rank(s)'} x "
                      f"{d.batch_size}x{d.seq_len} tokens x "
                      f"{o.grad_accum} accum, parallel {t.parallel}, codec {t.codec!r}, "
                      f"{t.dtype} on {self.device}")
        for message in self.skipped_checkpoints:
            self.log.info(f"warning: {message}")
        if self.no_eval:
            self.log.info(f"training without evaluation: {self.no_eval}; val_loss will be "
                          "null in the results")

    # ------------------------------------------------------------ the loop
    def forward_backward_step(self, x: torch.Tensor, y: torch.Tensor,
                              sync: bool) -> torch.Tensor:
        """One micro-batch: forward, backward (communicating only when ``sync``)."""
        accum = self.cfg.optim.grad_accum
        with self.par.no_sync(enabled=not sync):
            with self.timer.phase("forward"), autocast_for(self.device, self.cfg.train.dtype):
                _, loss = self.model(x, y)
                loss = loss / accum  # so the accumulated gradient is a mean
            with self.timer.phase("backward"):
                self.scaler.scale(loss).backward()
        return loss.detach()

    def train_step(self, step: int) -> tuple[torch.Tensor, float, float | None]:
        """One optimizer step; returns (summed micro-batch loss, lr, gradient norm)."""
        o = self.cfg.optim
        lr = lr_at(step, o, self.cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(o.grad_accum):
            with self.timer.phase("data"):
                x, y = next(self.loader)
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
            loss_sum += self.forward_backward_step(x, y, sync=micro == o.grad_accum - 1)
        with self.timer.phase("optimizer"):
            self.scaler.unscale_(self.optimizer)  # clip the true gradient, not the scaled one
            # the norm always (inf: measure, do not clip): counts non-finite/clipped steps
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  o.grad_clip if o.grad_clip > 0 else math.inf)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return loss_sum, lr, float(full)

    def train(self) -> dict[str, Any]:
        """Steps until --max-steps or --max-time, evaluating, logging and checkpointing."""
        t, r = self.cfg.train, self.cfg.run
        self.model.train()
        step, train_loss, val = self.start_step, math.nan, {}
        clock0 = saved_at = time.perf_counter()
        every = restart.Every.parse(r.ckpt_every)
        several = self.info.world_size > 1
        stop = StopRequest(announce=self.info.is_main, when=(
            f"up to the next logged step (--log-every {r.log_every})" if several
            else "this step")).install()
        self.par.join()  # torchft: align with the other replica groups, or heal
        step = self.par.current_step(step)
        self._log_rounds()
        self.completed_step = step  # the last step whose optimizer step was taken
        try:
            with contextlib.ExitStack() as scope:
                scope.callback(stop.restore)
                profiler = scope.enter_context(maybe_enable_profiling(
                    r.profile, parse_profile_steps(r.profile_steps), self.run_dir,
                    self.info.rank, self.start_step, self.log.info))
                while step < t.max_steps:
                    step += 1
                    t0 = self.step_began = time.perf_counter()
                    c0 = self.clock()
                    if self.capture is not None:
                        self.capture.begin_step(step, epoch=getattr(self.loader, "epoch", 0))
                    loss_sum, lr, grad_norm = self.train_step(step)
                    self.completed_step = step
                    self.par.after_optimizer_step()
                    step = self.par.current_step(step)  # torchft: a healed group jumps ahead
                    self._log_rounds()
                    if self.capture is not None:
                        self.capture.end_step()
                    phases = self.timer.end_step()
                    step_ms = self.metrics.end_step((self.clock() - c0) * 1e3, phases,
                                                    grad_norm)
                    self.progress["train_time_s"] += self._step_seconds(t0, step_ms)
                    profiler.step(step, phases, step_ms)
                    last = step == t.max_steps or self._out_of_time(clock0)
                    interrupted = save_due = False
                    if step % r.log_every == 0 or last or (stop.requested and not several):
                        # every rank learns here whether any was signalled (see interrupt.py)
                        # and whether a timed checkpoint is due (rank 0's clock decides)
                        timed = bool(every.seconds) and self.info.is_main and \
                            time.perf_counter() - saved_at >= every.seconds
                        train_loss, interrupted, save_due = self._log_interval(
                            step, loss_sum, lr, step_ms, phases, grad_norm, stop.requested,
                            timed)
                        interrupted = interrupted and step < t.max_steps  # else it finished
                        last = last or interrupted
                    if self._evaluation_due(step, last and not interrupted):  # stop promptly
                        val = self._evaluate(step, train_loss)
                        self.par.not_a_step()
                    if every.steps and step % every.steps == 0 or save_due or last:
                        self._save_checkpoint(step)
                        self.par.not_a_step()
                        saved_at = time.perf_counter()
                    if self.kill_step is not None and step >= self.kill_step:
                        # (>=: a torchft group that healed may have jumped past it)
                        restart.kill_if_due(self.info.rank, self.kill_step, self.attempt)
                    self.log.advance()
                    if last:
                        break
        except RuntimeError as e:
            if not collective_failure(e):
                raise
            return self._end_on_failure(step, e)
        return self._finish(step, train_loss, val,
                            interrupted=stop.signal_name if interrupted else None)

    # ------------------------------------------------------------ loop helpers
    def _end_on_failure(self, step: int, error: RuntimeError) -> dict[str, Any]:
        """A collective failed in ``step`` (past --comm-timeout, or a peer gone): on
        every rank one line says so; a checkpoint of the last completed step is written
        with no collective (``checkpoint.rescue``; not exact: each rank's loader and
        codec state are as the failure left them), and rank 0 writes the record."""
        done, info = self.completed_step, self.info
        reason = one_line(error)
        path = None
        if not self.par.sharded and (done > 0 or info.world_size > 1):
            rank_state = {"rng": ckpt.rng_state(), "loader": self.loader.state_dict(),
                          "scaler": self.scaler.state_dict(), "codec": self.par.codec_state()}
            path = ckpt.rescue(self.run_dir, done, model=self.par.checkpoint_model,
                               optimizer=self.optimizer, rank_state=rank_state,
                               meta={"codec": self.cfg.train.codec, "trainer": self.progress,
                                     "exact": False,
                                     "rescued": f"a collective failed in step {step}: "
                                                f"{reason}"},
                               rank=info.rank, world_size=info.world_size,
                               since=self.start_step,
                               skew_s=max(60.0, 2 * self.cfg.train.comm_timeout))
        failed = {"step": step, "error": reason, "rank": info.rank,
                  "comm_timeout_s": self.cfg.train.comm_timeout,
                  "checkpoint": None if path is None else str(path)}
        saved = (f"checkpoint of step {done} (not exact: the failed step's batch is "
                 f"skipped) in {path}; go on with: {resume_command(self.run_dir, info)}"
                 if path is not None else "checkpoint: written by rank 0" if info.rank else
                 "no checkpoint could be completed (see the other ranks' lines)")
        print(f"gradzip train: rank {info.rank}: a collective failed in step {step} "
              f"({reason}); stopping. {saved}", file=sys.stderr, flush=True)
        record = {**self.results_record(done, math.nan, {}, collective=False),
                  "interrupted": None, "failed": failed}
        if info.is_main:
            r = self.cfg.run
            append_results(record, [self.run_dir / "results.jsonl"]
                           + ([Path(r.results_file)] if r.results_file else []))
        return record

    def _log_rounds(self) -> None:
        """Append torchft's new rounds to ``ft_rounds.jsonl`` (--ft): each round's step,
        outcome and digests, which the replica groups' files must agree on."""
        rounds = self.par.new_rounds()
        if rounds:
            with open(self.run_dir / "ft_rounds.jsonl", "a") as f:
                f.writelines(json.dumps({"train_step": self.par.current_step(0), **r}) + "\n"
                             for r in rounds)

    def _out_of_time(self, clock0: float) -> bool:
        """--max-time reached (all ranks stop at the same step)."""
        if self.cfg.train.max_time <= 0:
            return False
        done = time.perf_counter() - clock0 >= self.cfg.train.max_time
        return any_rank(done, self.device)

    def _log_interval(self, step: int, loss_sum: torch.Tensor, lr: float, step_ms: float,
                      phases: dict[str, float], grad_norm: float | None,
                      stop_requested: bool = False,
                      save_requested: bool = False) -> tuple[float, bool, bool]:
        """Log the interval that ends at ``step``; returns the mean train loss, whether
        any rank was asked to stop and whether any asked for a checkpoint (one all-reduce
        carries all three; .item() syncs)."""
        train_loss, stops, saves = all_reduce_mean(
            [loss_sum.item(), float(stop_requested), float(save_requested)], self.device)
        if not math.isfinite(train_loss):
            raise RuntimeError(f"training loss is {train_loss} at step {step}; "
                               f"try a lower --lr or --dtype fp32")
        self._interval = self.metrics.interval(train_loss, lr, step_ms, phases, grad_norm,
                                               self.device)
        self.progress["history"].append({"step": step, "train_time_s":
                                         self.progress["train_time_s"],
                                         "train_loss": train_loss})
        self.log.scalars(step, {**self._interval,
                                restart.TRAIN_TIME_KEY: self.progress["train_time_s"]})
        if not self._evaluation_due(step, step == self.cfg.train.max_steps):
            self.log.info(format_line(step, self.cfg.train.max_steps, self._interval))
        return train_loss, stops > 0, saves > 0

    def _evaluation_due(self, step: int, last: bool) -> bool:
        t = self.cfg.train
        if self.no_eval:
            return False
        budget = (t.ppl_budget_s and self.progress["ppl_at_fixed_time"] is None
                  and self.progress["train_time_s"] >= t.ppl_budget_s)
        return bool(t.eval_every and step % t.eval_every == 0 or last or budget)

    def _evaluate(self, step: int, train_loss: float) -> dict[str, float]:
        t, d, info = self.cfg.train, self.cfg.data, self.info
        kw: dict[str, Any] = {"make_loader": self.make_loader, "batch_size": d.batch_size,
              "seq_len": d.seq_len, "steps": t.eval_steps, "device": self.device,
              "dtype": t.dtype}
        shards = train_shard(info)[1]
        with self.par.evaluation_weights():  # DiLoCo: the synchronized model only
            if shards != info.world_size:
                # torchft: the batches of every rank of the job, as a run of that many
                # ranks evaluates them (the groups' synchronized models are equal)
                val = evaluate_as_ranks(self.model, self.data.val, world_size=shards, **kw)
            else:
                val = evaluate(self.model, self.data.val, rank=info.rank,
                               world_size=info.world_size, **kw)
        p = self.progress
        if t.target_loss and p["time_to_target_s"] is None and val["val_loss"] <= t.target_loss:
            p["time_to_target_s"] = p["train_time_s"]
        if t.ppl_budget_s and p["ppl_at_fixed_time"] is None \
                and p["train_time_s"] >= t.ppl_budget_s:
            p["ppl_at_fixed_time"] = {"val_ppl": val["val_ppl"], "step": step,
                                      "train_time_s": p["train_time_s"]}
        p["history"].append({"step": step, "train_time_s": p["train_time_s"], **val})
        self.log.scalars(step, {"loss/val": val["val_loss"], "loss/val_ppl": val["val_ppl"]})
        interval = getattr(self, "_interval", None)
        if interval is not None and interval.get("loss/train") == train_loss:
            self.log.info(format_line(step, t.max_steps, {
                **interval, "loss/val": val["val_loss"], "loss/val_ppl": val["val_ppl"]}))
        else:
            self.log.info(f"step {step}: val loss {val['val_loss']:.4f} "
                          f"(ppl {val['val_ppl']:.1f})")
        return val

    def _save_checkpoint(self, step: int) -> None:
        rank_state = {"rng": ckpt.rng_state(), "loader": self.loader.state_dict(),
                      "scaler": self.scaler.state_dict(), "codec": self.par.codec_state()}
        path = ckpt.save(self.run_dir, step, model=self.par.checkpoint_model,
                         optimizer=self.optimizer, rank_state=rank_state,
                         meta={"codec": self.cfg.train.codec, "trainer": self.progress},
                         rank=self.info.rank, world_size=self.info.world_size,
                         sharded=self.par.sharded, keep=self.cfg.run.keep_ckpts)
        self.log.info(f"checkpoint {path}")

    def _finish(self, step: int, train_loss: float, val: dict[str, float], *,
                interrupted: str | None = None) -> dict[str, Any]:
        """Write the results record (rank 0) and the loss plot; returns the record.
        ``interrupted``: the signal that stopped the run (the record says so, and the
        last line says how to go on)."""
        record = {**self.results_record(step, train_loss, val), "interrupted": interrupted}
        if self.info.is_main:
            r = self.cfg.run
            paths = [self.run_dir / "results.jsonl"] + (
                [Path(r.results_file)] if r.results_file else [])
            append_results(record, paths)
            plot_history(self.progress["history"], self.run_dir / "plots" / "loss.png")
            val_text = (f"{record['val_loss']:.4f}" if record["val_loss"] is not None
                        else "not evaluated")
            tok = record["tokens_per_s"]
            p50 = record["step_time_ms_p50"]
            self.log.info(f"done at step {step}: train loss {train_loss:.4f}, val loss "
                          f"{val_text}, "
                          + (f"{tok:,.0f} tok/s, step {p50:.1f} ms (p50); " if tok else "")
                          + f"results in {self.run_dir / 'results.jsonl'}")
            if interrupted:
                self.log.info(f"stopped by {interrupted} at step {step} of "
                              f"{self.cfg.train.max_steps}: checkpoint and record written; "
                              f"go on with: {resume_command(self.run_dir, self.info)}")
        return record

    def results_record(self, step: int, train_loss: float, val: dict[str, float],
                       collective: bool = True) -> dict[str, Any]:
        """The one JSON line this run appends to results.jsonl (docs/results.md).

        Timing and communication totals cover the steps this process ran (after a
        resume: since the resume); the losses are those at the final step. The byte
        totals are what this process sent, so a DDP run resumed with a codec also counts
        the one uncompressed synchronization that rebuilds DDP's buckets
        (``settle_ddp_buckets``), as an uninterrupted run counts its uncompressed first
        step. FSDP without a codec keeps FSDP2's own collectives, counted from outside
        (``gradzip.comm.native``). Without ``collective`` (the process group failed) it
        asks the other ranks nothing: ``replicas_identical`` is then null.
        """
        cfg, info, t, d = self.cfg, self.info, self.cfg.train, self.cfg.data
        p = self.progress
        return {
            "run_name": cfg.run.run_name or Path(cfg.run.out).name,
            "world_size": info.world_size,
            "parallel": t.parallel,
            "model": model_label(cfg.model),
            "params": self.n_params,
            "dataset": "+".join(d.sources),
            "seq_len": d.seq_len,
            "batch_size": d.batch_size,
            "grad_accum": cfg.optim.grad_accum,
            "global_batch_tokens": self.tokens_per_step,
            "dtype": t.dtype,
            "method": str(self.method),
            "codec": t.codec,
            "codec_config": (None if isinstance(self.method, LocalUpdateMethod)
                             else self.method.to_json()),
            "nonfinite_policy": nonfinite_policy(t),
            "seed": t.seed,
            "steps": step,
            "resumed_from_step": self.start_step or None,
            # torchrun's restarts of this run's workers: how many, what they cost
            "restarts": restart.summary(self.run_dir),
            "train_loss": train_loss,
            "val_loss": val.get("val_loss"),
            "val_ppl": val.get("val_ppl"),
            "evaluation": "skipped: " + self.no_eval if self.no_eval else "done",
            **self.metrics.timing(),
            **self.metrics.communication(),
            **self.metrics.counters(),
            "ef_memory_bytes": _state_bytes(self.par.codec_state()),
            "auto": self.par.auto_report(),
            # collective: every rank's weights digest (the synchronized weights)
            "replicas_identical": (replicas_identical(self.par.replica_digest())
                                   if collective else None),
            # a collective that failed and ended the run (``_end_on_failure``)
            "failed": None,
            # --replicas: simulated ranks, and how their time was measured
            "replicas": replica_summary(self.replica),
            "compile_s": round(self.compile_s, 3),
            "capture": _capture_summary(self.capture),
            "outer": _outer_summary(self.par, self.method),
            # torchft's rounds on this replica group (--ft)
            "ft": self.par.ft_report(),
            **peak_memory(info.device),
            "target_loss": t.target_loss or None,
            "time_to_target_s": p["time_to_target_s"],
            "ppl_budget_s": t.ppl_budget_s or None,
            "ppl_at_fixed_time": (p["ppl_at_fixed_time"] or {}).get("val_ppl"),
            "ppl_at_fixed_time_step": (p["ppl_at_fixed_time"] or {}).get("step"),
            "train_time_s": p["train_time_s"],
            "eval_history": [{k: h[k] for k in ("step", "train_time_s", "val_loss")}
                             for h in p["history"] if "val_loss" in h and "train_time_s" in h],
            # when each step of this process ended (Unix seconds): places a change of
            # the link, logged by the namespace with the same clock, at a step
            "step_clock": self.metrics.step_clock(self.start_step + 1),
            "git_commit": git_commit(),
            "gradzip_source": source_digest(),
            "torch_version": torch.__version__,
            "device": str(info.device) if info.device.type == "cpu"
            else torch.cuda.get_device_name(info.device),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }


def replica_summary(replica: replicas.Replica | None) -> dict[str, Any] | None:
    """What the record says of a run of replicas (None: real ranks)."""
    if replica is None:
        return None
    link = replica.link
    return {"count": replica.world_size, "simulated": True,
            "link": None if link is None else link.rate,
            "latency_us": None if link is None else round(link.latency_s * 1e6, 3),
            "time": "each step: one replica's CPU time (its training and communication "
                    "threads, one torch thread) plus the link model's time for its bytes "
                    "and collectives"}


def warm_codecs(method: Method) -> float:
    """Compile (or load from numba's disk cache) the kernels of every codec this run uses,
    on codecs of their own (the run's state is untouched); returns the seconds. A cold
    cache took ~26 s for ``qsgd | eg`` on 2 cores, which used to land in the first steps'
    times, the codec's encode_ms and the time to target."""
    from gradzip.aggregation.warm import warm

    return warm(every_codec([method]))


def collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed (a timeout, a peer gone), not a
    bug: torch's DistError, or gloo's RuntimeError (its messages name gloo's sources)."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or "/gloo/" in text or "Connection closed by " \
        "peer" in text or "Connection reset by peer" in text


def one_line(error: BaseException) -> str:
    """The first line of ``error``, without gloo's source path."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    line = re.sub(r"\[[^\]]*gloo[^\]]*\]\s*", "", line)  # gloo's source file and line
    return line.split(" This is typically caused")[0][:300]


def train_shard(info: DistInfo) -> tuple[int, int]:
    """Which shard of the training data this process reads, of how many: its rank's, or
    under torchft (``gradzip train --ft``) its replica group's."""
    from gradzip.comm.ft import FtJob

    job = FtJob.from_env()
    if job is None:
        return info.rank, info.world_size
    return job.replica * info.world_size + info.rank, job.replicas * info.world_size


def resume_command(run_dir: Path, info: DistInfo) -> str:
    """The command that continues this run where it stopped (its options are read back
    from the run directory's config.json, --replicas included)."""
    if replicas.current() is not None:
        return f"gradzip train --resume --out {run_dir}"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    nodes = f"--nnodes {info.world_size // per_node} ... " if per_node < info.world_size else ""
    launch = (f"torchrun {nodes}--nproc_per_node {per_node} -m gradzip train"
              if info.world_size > 1 else "gradzip train")
    return f"{launch} --resume --out {run_dir}"


def _outer_summary(par: Any, method: Method) -> dict[str, Any] | None:
    """What --outer did on this rank: syncs and link bytes per sync (rank 0's record);
    SNOO's outer steps (it sends nothing of its own)."""
    if isinstance(method, SnooMethod):
        return {"kind": "snoo", "sync_every": method.sync_every, "lr": method.lr,
                "momentum": method.momentum, "syncs": par.outer.outer_steps,
                "codec": str(method.step_method), "bytes_wire_per_sync": 0}
    if not isinstance(method, LocalUpdateMethod):
        return None
    outer, totals = par.handle, par.handle.stats.totals()
    here = outer.syncs_here  # the byte totals cover this process's syncs
    return {"kind": method.outer, "sync_every": method.sync_every,
            "codec": method.codec_text,
            "fragments": method.fragments, "overlap_steps": method.overlap_steps,
            "sync_ramp": method.ramp, "syncs": outer.syncs,
            "bytes_wire_per_sync": totals["bytes_wire"] / here if here else None}


def _capture_summary(capture: Any) -> dict[str, Any] | None:
    """What --capture wrote from this rank (rank 0's record), None without capture."""
    if capture is None:
        return None
    st = capture.stats
    return {"dir": str(capture.directory), "buckets": st.buckets, "bytes": st.bytes,
            "queued_buckets_dropped": st.dropped, "step_wait_s": round(st.wait_s, 4),
            "writer_busy_s": round(st.write_s, 4)}


def _state_bytes(state: Any) -> int | None:
    """Bytes of the tensors in a codec's state (error-feedback residuals, warm starts)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) or 0 for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_bytes(v) or 0 for v in state)
    return 0


def plot_history(history: list[dict[str, Any]], path: Path) -> None:
    """Train and val loss against step, as a PNG in the run directory."""
    fig, ax = figure(6, 4)
    path.parent.mkdir(parents=True, exist_ok=True)
    for key, label in (("train_loss", "train"), ("val_loss", "val")):
        pts = [(h["step"], h[key]) for h in history if key in h]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="." if key == "val_loss" else None,
                    label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
