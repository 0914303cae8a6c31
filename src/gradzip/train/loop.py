"""The training loop, top to bottom: setup, resume, steps, evaluation, checkpoints, results.

One optimizer step is:

    for each of grad_accum micro-batches:      (gradients are synchronized on the last only)
        data -> forward -> backward            (DDP/FSDP communicate inside backward)
    unscale -> clip -> AdamW step -> zero grads

and every phase is timed (``metrics.PhaseTimer``); communication time comes from the
codec's stats or, for uncompressed DDP, a timing all-reduce hook.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradzip.train import checkpoint as ckpt
from gradzip.train.config import JobConfig, OptimConfig, codec_policy, parse_profile_steps
from gradzip.train.evaluate import autocast_for, evaluate
from gradzip.train.metrics import (
    MetricLogger,
    PhaseTimer,
    RunStats,
    append_results,
    format_line,
    git_commit,
    peak_memory,
    require_wandb,
)
from gradzip.train.model import GPT
from gradzip.train.parallel import (
    DistInfo,
    all_reduce_mean,
    any_rank,
    apply_ddp,
    apply_fsdp,
    attach_codec,
    destroy_distributed,
    init_distributed,
    no_sync,
    settle_ddp_buckets,
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


def build_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (and embeddings) only, not on norms and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def load_data(cfg: JobConfig, info: DistInfo) -> Any:
    """Tokenizer and train/val token shards (rank 0 builds the cache, others wait)."""
    from gradzip.train.data import DataConfig, prepare_data

    d = cfg.data
    dcfg = DataConfig(sources=list(d.sources), cache_dir=d.cache_dir,
                      tokenizer=d.tokenizer or None, vocab_size=d.vocab_size,
                      val_fraction=d.val_fraction, max_tokens=d.max_tokens or None)
    return prepare_data(dcfg, rank=info.rank, world_size=info.world_size)


def train(cfg: JobConfig, *, data: Any = None,
          make_loader: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Run (or resume) a training run; returns its results record.

    ``data`` (tokenizer, train, val) and ``make_loader`` default to
    ``gradzip.train.data``; tests pass small in-memory ones.
    """
    was_initialized = torch.distributed.is_initialized()
    info = init_distributed(cfg.train.parallel, cfg.train.device)
    try:
        # ``cleanup`` stops the loader's prefetch thread and closes the log files and
        # TensorBoard writer however the run ends (an error included).
        with contextlib.ExitStack() as cleanup:
            return _train(cfg, info, data, make_loader, cleanup)
    finally:
        if not was_initialized:
            destroy_distributed()


def _train(cfg: JobConfig, info: DistInfo, data: Any, make_loader: Callable[..., Any] | None,
           cleanup: contextlib.ExitStack) -> dict[str, Any]:
    t, o, r, d = cfg.train, cfg.optim, cfg.run, cfg.data
    device = info.device
    if t.dtype == "fp16" and device.type != "cuda":
        raise ValueError("--dtype fp16 needs CUDA (its grad scaler); use bf16 on CPU")
    if device.type == "cpu":
        # Denormal floats in backward made a small GPT 35x slower on CPU; flush them to 0.
        torch.set_flush_denormal(True)
    if t.threads:
        torch.set_num_threads(t.threads)
    if r.wandb and info.is_main:
        require_wandb()  # fail now, not after the data is prepared
    if t.codec != "none" and t.parallel == "none":
        raise ValueError("--codec compresses communication between ranks: it needs "
                         "--parallel ddp or fsdp (ddp also runs as a single process)")

    # ---- run directory: a fresh run must not silently mix with an old one
    run_dir = Path(r.out)
    resume_from = ckpt.find_checkpoint(run_dir) if r.resume else None
    if not r.resume and ckpt.step_dirs(run_dir):
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume to continue "
                         f"that run, or choose another --out")

    # Same seed on every rank: FSDP shards identical initial weights (DDP would
    # broadcast rank 0's anyway); data order and codec randomness derive from it too.
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)

    # ---- data and model
    if data is None:
        data = load_data(cfg, info)
    if make_loader is None:
        from gradzip.train.data import BatchLoader

        make_loader = BatchLoader
    vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = vocab
    elif cfg.model.vocab_size < vocab:
        raise ValueError(f"--model-vocab-size {cfg.model.vocab_size} is smaller than the "
                         f"tokenizer's vocabulary ({vocab})")
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        from gradzip.train.data.atomic import atomic_write_bytes

        # atomic: --resume reads it back, and a resumed run rewrites it
        atomic_write_bytes(run_dir / "config.json",
                           (json.dumps(cfg.to_dict(), indent=2) + "\n").encode())
        data.tokenizer.save(run_dir / "tokenizer.json")

    raw_model = GPT(cfg.model).to(device)  # unwrapped: checkpoints, parameter counts
    model: nn.Module = raw_model  # what forward/backward run on (maybe DDP/FSDP-wrapped)
    n_params = raw_model.num_params()
    comm_timer = handle = None
    if t.parallel == "ddp":
        model, comm_timer = apply_ddp(raw_model, info, bucket_cap_mb=t.bucket_cap_mb,
                                      timed=t.codec == "none")
    elif t.parallel == "fsdp":
        model = apply_fsdp(raw_model, info)
    if t.codec != "none":
        handle = attach_codec(model, codec_policy(t.codec, t.codec_groups, t.codec_start_step),
                              seed=t.seed, diagnose=t.diagnose)
    sharded = t.parallel == "fsdp"
    optimizer = build_optimizer(model, o)
    scaler = torch.amp.GradScaler(device.type, enabled=t.dtype == "fp16")
    loader = make_loader(data.train, batch_size=d.batch_size, seq_len=d.seq_len,
                         rank=info.rank, world_size=info.world_size, seed=t.seed,
                         prefetch=d.prefetch)
    cleanup.callback(loader.close)

    # ---- resume: weights, optimizer, and everything that makes the next step identical
    start_step = 0
    trainer: dict[str, Any] = {"train_time_s": 0.0, "time_to_target_s": None, "history": []}
    if resume_from is not None:
        meta, rank_state = ckpt.load(resume_from, model=raw_model, optimizer=optimizer,
                                     rank=info.rank, world_size=info.world_size,
                                     sharded=sharded)
        start_step = meta["step"]
        trainer.update(meta.get("trainer", {}))
        ckpt.set_rng_state(rank_state["rng"])
        loader.load_state_dict(rank_state["loader"])
        scaler.load_state_dict(rank_state["scaler"])
        if meta.get("codec", t.codec) != t.codec:
            raise ValueError(f"checkpoint {resume_from} was written with codec "
                             f"{meta.get('codec')!r} but this run uses {t.codec!r}")
        if handle is not None:
            handle.load_state_dict(rank_state["codec"])
            if t.parallel == "ddp":
                sample = torch.zeros(d.batch_size, d.seq_len, dtype=torch.long, device=device)
                settle_ddp_buckets(model, sample)
                handle.stats.end_step()  # the warm-up's all-reduce is a step of its own
    if start_step >= t.max_steps:
        raise ValueError(f"checkpoint is at step {start_step}, not before --max-steps "
                         f"{t.max_steps}: raise --max-steps to train further")

    log = MetricLogger(run_dir, info.rank, cfg, total_steps=t.max_steps, start_step=start_step)
    cleanup.callback(log.close)
    tokens_per_step = d.batch_size * d.seq_len * o.grad_accum * info.world_size
    log.info(f"{'resuming ' + str(resume_from) if resume_from else 'run ' + str(run_dir)}: "
             f"model {cfg.model.name} ({n_params / 1e6:.2f}M params), {info.world_size} "
             f"rank(s) x {d.batch_size}x{d.seq_len} tokens x {o.grad_accum} accum, "
             f"parallel {t.parallel}, codec {t.codec!r}, {t.dtype} on {device}")

    timer = PhaseTimer(device)
    stats = RunStats(warmup=r.timing_warmup)
    val: dict[str, float] = {}
    train_loss = float("nan")
    interval_ms, interval_tokens = 0.0, 0
    clock0 = time.perf_counter()

    def save_checkpoint(step: int) -> None:
        rank_state = {"rng": ckpt.rng_state(), "loader": loader.state_dict(),
                      "scaler": scaler.state_dict(),
                      "codec": handle.state_dict() if handle is not None else None}
        path = ckpt.save(run_dir, step, model=model if sharded else raw_model,
                         optimizer=optimizer, rank_state=rank_state,
                         meta={"codec": t.codec, "trainer": trainer}, rank=info.rank,
                         world_size=info.world_size, sharded=sharded, keep=r.keep_ckpts)
        log.info(f"checkpoint {path}")

    model.train()
    step = start_step
    with maybe_enable_profiling(r.profile, parse_profile_steps(r.profile_steps), run_dir,
                                info.rank, start_step, log.info) as profiler:
        while step < t.max_steps:
            step += 1
            t0 = time.perf_counter()
            lr = lr_at(step, o, t.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr

            loss_sum = torch.zeros((), device=device)
            for micro in range(o.grad_accum):
                with timer.phase("data"):
                    x, y = next(loader)
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with no_sync(model, t.parallel, enabled=micro < o.grad_accum - 1):
                    with timer.phase("forward"), autocast_for(device, t.dtype):
                        _, loss = model(x, y)
                        loss = loss / o.grad_accum  # so the accumulated gradient is a mean
                    with timer.phase("backward"):
                        scaler.scale(loss).backward()
                loss_sum += loss.detach()

            with timer.phase("optimizer"):
                scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
                grad_norm = None
                if o.grad_clip > 0:
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

            # Communication happened inside backward; take its time and bytes now.
            comm: dict[str, Any] = {}
            if handle is not None:
                handle.stats.end_step()
                comm = handle.stats.summary()
            elif comm_timer is not None:
                comm = comm_timer.end_step()
            if comm:
                timer.add("comm", comm["comm_ms"])
            phases = timer.end_step()
            step_ms = (time.perf_counter() - t0) * 1e3
            stats.add_step(step_ms, phases, tokens_per_step)
            trainer["train_time_s"] += step_ms / 1e3
            interval_ms += step_ms
            interval_tokens += tokens_per_step
            profiler.step(step, phases, step_ms)

            out_of_time = t.max_time > 0 and time.perf_counter() - clock0 >= t.max_time
            if t.max_time > 0:
                out_of_time = any_rank(out_of_time, device)  # all ranks stop at the same step
            last = step == t.max_steps or out_of_time

            if step % r.log_every == 0 or last:
                # .item() waits for the device; only once per log interval.
                (train_loss,) = all_reduce_mean([loss_sum.item()], device)
                if not math.isfinite(train_loss):
                    raise RuntimeError(f"training loss is {train_loss} at step {step}; "
                                       f"try a lower --lr or --dtype fp32")
                metrics = {
                    "loss/train": train_loss, "optim/lr": lr,
                    "throughput/tokens_per_s": interval_tokens / (interval_ms / 1e3),
                    "time/step(ms)": step_ms,
                    **{f"time/{k}(ms)": v for k, v in phases.items()},
                    "mem/peak(MiB)": peak_memory(device)["mem_peak"] / 2**20,
                }
                if grad_norm is not None:
                    gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                    metrics["optim/grad_norm"] = float(gn)
                if comm:
                    metrics["comm/time(ms)"] = comm["comm_ms"]
                    metrics["comm/share(%)"] = 100 * comm["comm_ms"] / step_ms
                    metrics["comm/bytes_raw"] = comm["bytes_raw"]
                    metrics["comm/bytes_wire"] = comm["bytes_wire"]
                    if comm["bytes_wire"]:
                        metrics["comm/compression_ratio"] = comm["bytes_raw"] / comm["bytes_wire"]
                    for k in ("density", "residual_norm", "grad_rel_error", "grad_cos_sim",
                              "encode_ms", "decode_ms"):
                        if comm.get(k) is not None:
                            metrics[f"comm/{k}"] = comm[k]
                interval_ms, interval_tokens = 0.0, 0
                if not (t.eval_every and step % t.eval_every == 0 or last):
                    log.info(format_line(step, t.max_steps, metrics))
                trainer["history"].append({"step": step, "train_loss": train_loss})
                log.scalars(step, metrics)

            if t.eval_every and step % t.eval_every == 0 or last:
                val = evaluate(model, data.val, make_loader=make_loader,
                               batch_size=d.batch_size, seq_len=d.seq_len, steps=t.eval_steps,
                               rank=info.rank, world_size=info.world_size, device=device,
                               dtype=t.dtype)
                if t.target_loss and trainer["time_to_target_s"] is None \
                        and val["val_loss"] <= t.target_loss:
                    trainer["time_to_target_s"] = trainer["train_time_s"]
                trainer["history"].append({"step": step, **val})
                log.scalars(step, {"loss/val": val["val_loss"], "loss/val_ppl": val["val_ppl"]})
                if step % r.log_every == 0 or last:
                    log.info(format_line(step, t.max_steps, {
                        **metrics, "loss/val": val["val_loss"], "loss/val_ppl": val["val_ppl"]}))
                else:
                    log.info(f"step {step}: val loss {val['val_loss']:.4f} "
                             f"(ppl {val['val_ppl']:.1f})")

            if r.ckpt_every and step % r.ckpt_every == 0 or last:
                save_checkpoint(step)
            log.advance()
            if last:
                break

    record = results_record(cfg, info, n_params, step, start_step, train_loss, val, stats,
                            handle, comm_timer, trainer)
    if info.is_main:
        paths = [run_dir / "results.jsonl"] + ([Path(r.results_file)] if r.results_file else [])
        append_results(record, paths)
        plot_history(trainer["history"], run_dir / "plots" / "loss.png")
        s = stats.summary()
        log.info(f"done at step {step}: train loss {train_loss:.4f}, val loss "
                 f"{record['val_loss']:.4f}, {s['tokens_per_s']:,.0f} tok/s, step "
                 f"{s['step_time_ms_p50']:.1f} ms (p50); results in {run_dir / 'results.jsonl'}")
    return record


def results_record(cfg: JobConfig, info: DistInfo, n_params: int, step: int, start_step: int,
                   train_loss: float, val: dict[str, float], stats: RunStats, handle: Any,
                   comm_timer: Any, trainer: dict[str, Any]) -> dict[str, Any]:
    """The one JSON line this run appends to results.jsonl.

    Timing and communication totals cover the steps this process ran (after a resume:
    since the resume); the losses are those at the final step. The byte totals are what
    this process sent, so a DDP run resumed with a codec also counts the one uncompressed
    synchronization that rebuilds DDP's buckets (``settle_ddp_buckets``), as an
    uninterrupted run counts its uncompressed first step. FSDP without a codec has
    no communication figures (None): its collectives run inside FSDP, visible only in
    ``--profile`` traces.
    """

    t, d = cfg.train, cfg.data
    s = stats.summary()
    comm_totals: dict[str, Any] = {}
    if handle is not None:
        comm_totals = handle.stats.totals()
    elif comm_timer is not None:
        comm_totals = {"bytes_raw": comm_timer.bytes_total, "bytes_wire": comm_timer.bytes_total,
                       "aggregation": {"plain": comm_timer.calls_total},
                       "compression_ratio": 1.0, "comm_ms_by_op": {"all_reduce":
                                                                   comm_timer.comm_ms_total},
                       "index_bytes": 0, "density": 1.0, "encode_ms": 0.0, "decode_ms": 0.0,
                       "extra_collectives": 0}
    return {
        "run_name": cfg.run.run_name or Path(cfg.run.out).name,
        "world_size": info.world_size,
        "parallel": t.parallel,
        "model": cfg.model.name,
        "params": n_params,
        "dataset": "+".join(d.sources),
        "seq_len": d.seq_len,
        "batch_size": d.batch_size,
        "grad_accum": cfg.optim.grad_accum,
        "global_batch_tokens": d.batch_size * d.seq_len * cfg.optim.grad_accum * info.world_size,
        "dtype": t.dtype,
        "codec": t.codec,
        "codec_config": _codec_config(t),
        "seed": t.seed,
        "steps": step,
        "resumed_from_step": start_step or None,
        "train_loss": train_loss,
        "val_loss": val.get("val_loss"),
        "val_ppl": val.get("val_ppl"),
        "step_time_ms_mean": s["step_time_ms_mean"],
        "step_time_ms_p50": s["step_time_ms_p50"],
        "step_time_ms_p90": s["step_time_ms_p90"],
        "timed_steps": s["timed_steps"],
        "tokens_per_s": s["tokens_per_s"],
        "phase_ms_mean": s["phase_ms_mean"],
        "phase_share": s["phase_share"],
        "comm_time_ms_total": s["comm_time_ms_total"] if comm_totals else None,
        "comm_ratio": s["comm_ratio"] if comm_totals else None,
        "comm_time_ms_by_op": comm_totals.get("comm_ms_by_op"),
        "bytes_raw_total": comm_totals.get("bytes_raw"),
        "bytes_wire_total": comm_totals.get("bytes_wire"),
        "bytes_handed_total": comm_totals.get("bytes_handed"),
        "aggregation": comm_totals.get("aggregation"),
        "compression_ratio": comm_totals.get("compression_ratio"),
        "encode_ms": comm_totals.get("encode_ms"),
        "decode_ms": comm_totals.get("decode_ms"),
        "extra_collectives": comm_totals.get("extra_collectives"),
        "index_bytes": comm_totals.get("index_bytes"),
        "density": comm_totals.get("density"),
        "residual_norm": comm_totals.get("residual_norm"),
        "grad_rel_error": comm_totals.get("grad_rel_error"),
        "grad_cos_sim": comm_totals.get("grad_cos_sim"),
        **peak_memory(info.device),
        "target_loss": t.target_loss or None,
        "time_to_target_s": trainer["time_to_target_s"],
        "train_time_s": trainer["train_time_s"],
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "device": str(info.device) if info.device.type == "cpu"
        else torch.cuda.get_device_name(info.device),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def plot_history(history: list[dict[str, Any]], path: Path) -> None:
    """Train and val loss against step, as a PNG in the run directory."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
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
    plt.close(fig)


def _codec_config(t: Any) -> Any:
    """The codec's JSON form for the record; a policy's when groups or a start step."""
    if t.codec == "none":
        return None
    policy = codec_policy(t.codec, t.codec_groups, t.codec_start_step)
    if not policy.groups and not policy.start_step:
        import gradzip

        return gradzip.codec(policy.spec).to_json()
    return policy.to_json()
