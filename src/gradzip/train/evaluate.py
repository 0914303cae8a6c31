"""Validation loss and perplexity, during training and from a checkpoint.

Evaluation reads the same batches every time (a fresh loader with a fixed seed), so
val loss at different steps — or from different runs — is measured on identical data.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradzip.train.config import JobConfig
from gradzip.train.configure import resolve
from gradzip.train.model import GPT
from gradzip.train.parallel import all_reduce_mean

EVAL_SEED = 1234  # fixed: the validation batches must not depend on the training seed


def autocast_for(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Autocast for bf16/fp16, a no-op for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    shards: Any,
    *,
    make_loader: Callable[..., Any],
    batch_size: int,
    seq_len: int,
    steps: int,
    rank: int,
    world_size: int,
    device: torch.device,
    dtype: str = "fp32",
) -> dict[str, float]:
    """Mean loss over ``steps`` batches per rank, averaged over ranks; and its perplexity."""
    mean = rank_mean_loss(model, shards, make_loader=make_loader, batch_size=batch_size,
                          seq_len=seq_len, steps=steps, rank=rank, world_size=world_size,
                          device=device, dtype=dtype)
    (val_loss,) = all_reduce_mean([mean], device)
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


@torch.no_grad()
def evaluate_as_ranks(model: nn.Module, shards: Any, *, world_size: int,
                      **kw: Any) -> dict[str, float]:
    """In one process, what ``evaluate`` gives on ``world_size`` ranks: each rank's own
    batches (its loader), each rank's mean, then their float64 mean as the ranks'
    all-reduce computes it. So a checkpoint reproduces the loss its run recorded."""
    means = torch.tensor([rank_mean_loss(model, shards, rank=r, world_size=world_size, **kw)
                          for r in range(world_size)], dtype=torch.float64)
    val_loss = float(means.sum() / world_size)
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


@torch.no_grad()
def rank_mean_loss(model: nn.Module, shards: Any, *, make_loader: Callable[..., Any],
                   batch_size: int, seq_len: int, steps: int, rank: int, world_size: int,
                   device: torch.device, dtype: str = "fp32") -> float:
    """Mean loss over the ``steps`` validation batches rank ``rank`` of ``world_size``
    reads (a fresh loader with ``EVAL_SEED``: the same batches every time)."""
    was_training = model.training
    model.eval()
    total = 0.0
    with make_loader(shards, batch_size=batch_size, seq_len=seq_len, rank=rank,
                     world_size=world_size, seed=EVAL_SEED) as loader:
        for _ in range(steps):
            x, y = next(loader)
            with autocast_for(device, dtype):
                _, loss = model(x.to(device), y.to(device))
            total += loss.item()  # .item() syncs; fine, evaluation is not the hot loop
    model.train(was_training)
    return total / steps


def load_run(ckpt: str | Path, device: torch.device) -> tuple[GPT, JobConfig, Path, Any]:
    """(model with checkpoint weights, the run's config, checkpoint dir, tokenizer).

    ``ckpt`` is a run directory (its latest checkpoint) or one checkpoint directory;
    the run's ``config.json`` and ``tokenizer.json`` live in the run directory.
    """
    import json

    from gradzip.train.checkpoint import find_checkpoint, load_weights
    from gradzip.train.tokenizer import Tokenizer

    path = find_checkpoint(ckpt)
    run_dir = path.parent.parent
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing: the checkpoint's run configuration "
                                f"is needed to rebuild the model")
    cfg = resolve(base=json.loads(cfg_file.read_text()))
    tokenizer = Tokenizer.load(run_dir / "tokenizer.json")
    model = GPT(cfg.model).to(device)
    load_weights(path, model)
    model.eval()
    return model, cfg, path, tokenizer
