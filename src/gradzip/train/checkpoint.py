"""Checkpoints: everything needed to continue a run exactly where it stopped.

One directory per saved step, ``<run>/checkpoints/step_0000010/``:

* ``model.pt``, ``optim.pt`` — written by rank 0 (single process and DDP, where every
  rank holds the same replica), or ``dcp/`` — written by all ranks through
  ``torch.distributed.checkpoint`` (FSDP, where each rank holds a shard);
* ``rank<r>.pt`` — what differs per rank: RNG states, the data loader's position, the
  codec state (error-feedback residuals etc.), the grad scaler;
* ``meta.json`` — step, world size, format and the trainer's counters; written last.

A checkpoint is written into ``.tmp-step_...`` and renamed into place by rank 0 after
every rank has finished, so a crash mid-save never leaves a directory that looks
complete. Only the last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

CKPT_DIR = "checkpoints"
PREFIX = "step_"


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp directories are skipped)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the latest checkpoint of a run directory."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"no such run or checkpoint directory: {path}")
    found = step_dirs(path)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {path} (expected {path}/{CKPT_DIR}/"
                                f"{PREFIX}NNNNNNN/meta.json)")
    return found[-1]


def read_meta(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable checkpoint metadata {ckpt}/meta.json: {e}") from None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(
    run_dir: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state: dict[str, Any],
    meta: dict[str, Any],
    rank: int,
    world_size: int,
    sharded: bool,
    keep: int,
) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank must call it).

    ``model`` is the unwrapped module (not the DDP wrapper) unless ``sharded``, in which
    case it is the FSDP2 module and the model/optimizer go through DCP.
    """
    root = Path(run_dir) / CKPT_DIR
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        # Debris of saves that crashed (only rank 0 renames, one save at a time): never
        # loaded, since step_dirs wants a step_* name with meta.json, but it takes space.
        for debris in root.glob(".tmp-*") if root.is_dir() else ():
            shutil.rmtree(debris, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    elif rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(optimizer.state_dict(), tmp / "optim.pt")
    torch.save(rank_state, tmp / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        info = {"step": step, "world_size": world_size,
                "format": "dcp" if sharded else "torch", **meta}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2))
        if final.exists():  # saving the same step again (e.g. a re-run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic on POSIX: the checkpoint appears complete or not at all
        for old in step_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(
    ckpt: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    world_size: int,
    sharded: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore model (and optimizer) in place; return (meta, this rank's state)."""
    meta = read_meta(ckpt)
    if meta.get("world_size") != world_size:
        raise ValueError(f"checkpoint {ckpt} was written by {meta.get('world_size')} ranks; "
                         f"this run has {world_size} (data position and codec state are "
                         f"per rank, so an exact resume needs the same number)")
    load_weights(ckpt, model, optimizer, sharded=sharded, meta=meta)
    rank_file = ckpt / f"rank{rank}.pt"
    if not rank_file.is_file():
        raise FileNotFoundError(f"checkpoint is missing {rank_file}")
    # Our own file from our own run directory: it holds Python/NumPy RNG states, which
    # the weights_only unpickler refuses.
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
    return meta, rank_state


def load_weights(
    ckpt: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    sharded: bool = False,
    meta: dict[str, Any] | None = None,
) -> None:
    """Load model (and optimizer) state from either checkpoint format into ``model``.

    A DCP (FSDP) checkpoint can be loaded into an unsharded model in one process (eval,
    generate): DCP reshards to whatever layout the target state dict has.
    """
    meta = meta or read_meta(ckpt)
    if meta.get("format") == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        state: dict[str, Any]
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": model.state_dict()}
        with warnings.catch_warnings():  # loading without a process group is intended here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load")
            dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            model.load_state_dict(state["model"])
        return
    if sharded:
        raise ValueError(f"{ckpt} is a single-file checkpoint; an FSDP run resumes only "
                         f"from an FSDP (DCP) checkpoint")
    for name in ("model.pt",) + (("optim.pt",) if optimizer is not None else ()):
        if not (ckpt / name).is_file():
            raise FileNotFoundError(f"checkpoint is missing {ckpt / name}")
    device = next(model.parameters()).device
    model.load_state_dict(torch.load(ckpt / "model.pt", map_location=device, weights_only=True))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(ckpt / "optim.pt", map_location=device,
                                             weights_only=True))
