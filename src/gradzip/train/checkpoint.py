"""Checkpoints: everything needed to continue a run exactly where it stopped.

One directory per saved step, ``<run>/checkpoints/step_0000010/``:

* ``model.pt``, ``optim.pt`` — written by rank 0 (single process and DDP, where every
  rank holds the same replica), or ``dcp/`` — written by all ranks through
  ``torch.distributed.checkpoint`` (FSDP, where each rank holds a shard);
* ``rank<r>.pt`` — what differs per rank: RNG states, the data loader's position, the
  codec state (error-feedback residuals etc.), the grad scaler;
* ``meta.json`` — step, world size, format, the trainer's counters and ``files``: the
  size and SHA-256 of every other file of the checkpoint; written last.

A checkpoint is written into ``.tmp-step_...`` and renamed into place by rank 0 after
every rank has finished, so a crash mid-save never leaves a directory that looks
complete. Only the last ``keep`` checkpoints are kept, the one just written among them.

Integrity. A crash cannot leave a half-written checkpoint, but a disk, a copy or a
person can damage one later. So rank 0, after the barrier that follows every rank's
writes, hashes every file in the temp directory (its own, the other ranks'
``rank<r>.pt``, all of ``dcp/``) and lists them in ``meta.json``. Rank 0 hashing all
files is the simplest correct design: the rename already needs every rank's files
visible to rank 0 (one machine or a shared filesystem), and it needs no knowledge of
which ranks wrote which DCP files nor a gather of per-rank results; it costs one read
of the checkpoint just written (mostly from the page cache). ``verify`` checks a
checkpoint against that list; ``find_checkpoint`` resumes from the newest checkpoint
that verifies, with a warning naming each newer one it skipped and why. Rank 0 alone
decides and broadcasts the choice (or the error), so every rank loads the same
checkpoint and a damaged one stops every rank, not one. Checkpoints written before
checksums existed (no ``files``) are accepted unverified: only that their files exist
is checked. Any failure to read a file at load time is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

CKPT_DIR = "checkpoints"
PREFIX = "step_"
META = "meta.json"
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint is damaged or unreadable; the message names the file and the fault."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


def _step_of(p: Path) -> int | None:
    """N of a ``step_N`` directory, None for any other name (``.tmp-step_N`` included)."""
    digits = p.name[len(PREFIX):]
    return int(digits) if p.name.startswith(PREFIX) and digits.isdigit() else None


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp directories are skipped)."""
    return [p for p in _all_step_dirs(run_dir) if (p / META).is_file()]


def _all_step_dirs(run_dir: Path) -> list[Path]:
    """Every ``step_N`` directory of a run, oldest first, with or without meta.json."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=lambda p: _step_of(p) or 0)


def _is_checkpoint_dir(path: Path) -> bool:
    """``path`` names one checkpoint (rather than a run): it has meta.json, or it is a
    ``checkpoints/step_N`` directory (whose meta.json may be the damaged part)."""
    return (path / META).is_file() or (path.parent.name == CKPT_DIR
                                       and _step_of(path) is not None)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the newest checkpoint of a run directory that
    verifies (``select_checkpoint``), warning about each newer one it skipped.

    Collective when a process group is initialized: every rank must call it.
    """
    chosen, skipped = select_checkpoint(path)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        for message in skipped:
            warnings.warn(message, CheckpointWarning, stacklevel=2)
    return chosen


def select_checkpoint(path: str | Path) -> tuple[Path, list[str]]:
    """(checkpoint to load, one message per newer checkpoint skipped as damaged).

    A checkpoint directory must verify, or it is a ``CheckpointError``: who names one
    checkpoint means that one. A run directory yields its newest checkpoint that
    verifies; if none does, a ``CheckpointError`` lists each one and its problems.
    Rank 0 decides and every rank gets its answer (collective under a process group).
    """
    return _decided_by_rank0(_select, Path(path))


def _select(path: Path) -> tuple[Path, list[str]]:
    if _is_checkpoint_dir(path):
        problems = verify(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
        return path, []
    if not path.exists():
        raise FileNotFoundError(f"no such run or checkpoint directory: {path}")
    candidates = _all_step_dirs(path)[::-1]  # newest first
    if not candidates:
        raise FileNotFoundError(f"no checkpoint in {path} (expected {path}/{CKPT_DIR}/"
                                f"{PREFIX}NNNNNNN/{META})")
    damaged: list[tuple[Path, list[str]]] = []
    for candidate in candidates:
        problems = verify(candidate)
        if not problems:
            return candidate, [f"skipping damaged checkpoint {p} (using {candidate.name} "
                               f"instead): " + "; ".join(probs)
                               for p, probs in damaged]
        damaged.append((candidate, problems))
    listing = "\n".join(f"  {p}: " + "; ".join(probs) for p, probs in damaged)
    raise CheckpointError(f"no checkpoint in {path} verifies:\n{listing}")


def _decided_by_rank0(fn: Callable[[Path], T], path: Path) -> T:
    """``fn(path)`` run on rank 0 and its result, or its error, handed to every rank.

    Without a process group (or with one rank) it is just ``fn(path)``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn(path)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn(path))
        except Exception as e:  # noqa: BLE001 - handed to every rank, then raised
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks (checkpoint files can be gigabytes).
    ``sha256sum`` computes the same, so a checkpoint can also be checked by hand."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_checksums(ckpt: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "bytes"}}`` of every file in ``ckpt`` but meta.json."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p != ckpt / META:
            out[p.relative_to(ckpt).as_posix()] = {"sha256": sha256_file(p),
                                                   "bytes": p.stat().st_size}
    return out


def verify(ckpt: str | Path) -> list[str]:
    """Problems that make ``ckpt`` unfit to load, each naming the file; [] if none.

    Checked: meta.json reads as a JSON object; every file it lists exists with its
    size and SHA-256. A checkpoint from before checksums (no ``files`` in meta.json)
    is unverified but acceptable, so runs saved by older versions still resume: only
    the files its format needs must exist.
    """
    ckpt = Path(ckpt)
    try:
        meta = read_meta(ckpt)
    except CheckpointError as e:
        return [str(e)]
    files = meta.get("files")
    if files is None:
        return [f"{ckpt / rel} is missing" for rel in _expected_files(meta)
                if not (ckpt / rel).exists()]
    if not isinstance(files, dict):
        return [f"{ckpt / META}: 'files' is not an object"]
    return [problem for rel, want in sorted(files.items())
            for problem in _check_file(ckpt / rel, want)]


def _expected_files(meta: dict[str, Any]) -> list[str]:
    """What a checkpoint of this format and world size holds (for old checkpoints)."""
    weights = ["dcp"] if meta.get("format") == "dcp" else ["model.pt", "optim.pt"]
    ranks = meta.get("world_size")
    return weights + [f"rank{r}.pt" for r in range(ranks if isinstance(ranks, int) else 0)]


def _check_file(path: Path, want: Any) -> list[str]:
    """[] if ``path`` has the size and SHA-256 of ``want``, else what differs."""
    if not (isinstance(want, dict) and isinstance(want.get("bytes"), int)
            and isinstance(want.get("sha256"), str)):
        return [f"{path}: its entry in {META} is malformed ({want!r})"]
    if not path.is_file():
        return [f"{path} is missing"]
    try:
        size = path.stat().st_size
        if size != want["bytes"]:
            return [f"{path} has {size} bytes, {want['bytes']} were written (truncated "
                    f"or overwritten)"]
        digest = sha256_file(path)
    except OSError as e:
        return [f"{path} cannot be read: {e}"]
    if digest != want["sha256"]:
        return [f"{path} fails its checksum (sha256 {digest[:16]}..., {want['sha256'][:16]}"
                f"... was written): its contents are damaged"]
    return []


def read_meta(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's meta.json; a ``CheckpointError`` naming it if it cannot be used."""
    path = Path(ckpt) / META
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON, and bytes that are not UTF-8
        raise CheckpointError(f"unreadable checkpoint metadata {path}: {e}") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"unreadable checkpoint metadata {path}: not a JSON object "
                              f"with an integer 'step'")
    return meta


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Re-raise a failure to read ``path`` (torch.load, DCP) as a ``CheckpointError``
    that names it; the original error is chained."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {path} (damaged, truncated or "
                              f"not a checkpoint?): {type(e).__name__}: {e}") from e


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
    _barrier()  # every rank's files are complete: rank 0 can hash them all
    if rank == 0:
        _publish(tmp, final, {"step": step, "world_size": world_size,
                              "format": "dcp" if sharded else "torch", **meta})
        _prune(run_dir, keep, final)
    _barrier()
    return final


def rescue(run_dir: Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
           rank_state: dict[str, Any], meta: dict[str, Any], rank: int, world_size: int,
           since: int = 0, skew_s: float = 60.0, wait_s: float = 30.0) -> Path | None:
    """Write a checkpoint with no collective, after the process group failed (a link
    down, a peer gone): every rank writes its own state, and rank 0, once every rank's
    is there (it polls the directory for ``wait_s`` seconds), the weights, the
    optimizer and the manifest, as the checkpoint of ``step``, its own last completed
    step. Returns it on rank 0 when it is complete, else None.

    The ranks may have stopped a step apart (a collective can finish on one rank and
    not on its peer), so the checkpoint is not exact: the weights and optimizer are rank
    0's after ``step``, each rank's loader and codec state as the failure left it;
    ``meta`` should say so. The ranks meet in a directory named after the step this
    process started from (``since``); files older than ``skew_s`` before this rank's
    failure (an earlier failure's) are not taken. Needs a directory every rank can see
    (one machine, or a shared file system).
    """
    root = Path(run_dir) / CKPT_DIR
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".rescue-from-{since:07d}"
    tmp.mkdir(parents=True, exist_ok=True)
    failed_at = time.time()
    _write_then_rename(lambda p: torch.save(rank_state, p), tmp / f"rank{rank}.pt")
    if rank != 0:
        return None
    torch.save(model.state_dict(), tmp / "model.pt")
    torch.save(optimizer.state_dict(), tmp / "optim.pt")
    deadline = time.monotonic() + wait_s

    def fresh(r: int) -> bool:
        f = tmp / f"rank{r}.pt"
        return f.is_file() and f.stat().st_mtime >= failed_at - skew_s

    while not all(fresh(r) for r in range(world_size)):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    _publish(tmp, final, {"step": step, "world_size": world_size, "format": "torch", **meta})
    return final


def _publish(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """The manifest (``info`` and every file's checksum), then ``tmp`` renamed to
    ``final``: atomic on POSIX, so the checkpoint appears complete or not at all (saving
    the same step again, e.g. a re-run, replaces it)."""
    (tmp / META).write_text(json.dumps({**info, "files": file_checksums(tmp)}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _write_then_rename(write: Any, path: Path) -> None:
    part = path.with_name(path.name + ".part")
    write(part)
    os.replace(part, path)


def _prune(run_dir: Path, keep: int, newest: Path) -> None:
    """Delete all but the last ``keep`` checkpoints, ``newest`` (just written) among them.

    After resuming behind a damaged checkpoint, that one has a higher step than the
    checkpoints now written; counting by step alone would delete those instead.
    """
    others = [p for p in step_dirs(run_dir) if p != newest]
    for old in others[:max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def load(
    ckpt: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    world_size: int,
    sharded: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore model (and optimizer) in place; return (meta, this rank's state).

    It does not check checksums (``find_checkpoint`` does, once, on rank 0), but a file
    that cannot be read is a ``CheckpointError`` naming it.
    """
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
    with _reading(rank_file):
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
            with _reading(ckpt / "dcp"):
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
    with _reading(ckpt / "model.pt"):
        model_sd = torch.load(ckpt / "model.pt", map_location=device, weights_only=True)
    model.load_state_dict(model_sd)
    if optimizer is not None:
        with _reading(ckpt / "optim.pt"):
            optim_sd = torch.load(ckpt / "optim.pt", map_location=device, weights_only=True)
        optimizer.load_state_dict(optim_sd)
