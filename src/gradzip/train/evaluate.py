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
    (val_loss,) = all_reduce_mean([total / steps], device)
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


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
