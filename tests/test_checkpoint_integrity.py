"""Damaged checkpoints: checksums at save, errors that name the file, resume falls back.

Checkpoints are written with the real ``checkpoint.save`` (one process, a tiny model),
then damaged the ways disks, copies and people do: truncated, bytes flipped, a file
deleted, meta.json no longer UTF-8 or JSON.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from train_helpers import flags, last_result

from gradzip.cli import main
from gradzip.comm.launch import run_ranks
from gradzip.train import checkpoint as ckpt
from gradzip.train.checkpoint import CheckpointError, CheckpointWarning


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _save(run: Path, step: int, keep: int = 5) -> Path:
    """A real checkpoint of a tiny model after one Adam step (so optim.pt has state)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return ckpt.save(run, step, model=model, optimizer=opt,
                     rank_state={"rng": ckpt.rng_state(), "step": step},
                     meta={"trainer": {"history": []}}, rank=0, world_size=1,
                     sharded=False, keep=keep)


def _load(path: Path) -> tuple[dict, dict]:
    model = _model()
    return ckpt.load(path, model=model, optimizer=torch.optim.Adam(model.parameters()),
                     rank=0, world_size=1, sharded=False)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    """Same size, some bytes changed: only a checksum sees it (a torch zip may not)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _old_format(path: Path) -> None:
    """What a checkpoint saved before checksums looks like: no ``files`` in meta.json."""
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))


def test_save_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    files = json.loads((path / "meta.json").read_text())["files"]
    assert sorted(files) == ["model.pt", "optim.pt", "rank0.pt"]
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert ckpt.verify(path) == []
    assert ckpt.find_checkpoint(tmp_path) == path


@pytest.mark.parametrize("name,damage,what", [
    ("model.pt", _truncate, "bytes"),
    ("model.pt", _flip, "checksum"),
    ("optim.pt", _flip, "checksum"),
    ("rank0.pt", _truncate, "bytes"),
    ("rank0.pt", Path.unlink, "missing"),
])
def test_a_damaged_file_is_named_with_what_is_wrong(tmp_path: Path, name: str, damage,
                                                    what: str) -> None:
    path = _save(tmp_path, 1)
    damage(path / name)
    (problem,) = ckpt.verify(path)
    assert str(path / name) in problem and what in problem
    # Named explicitly, a damaged checkpoint is an error (no fallback to another one).
    with pytest.raises(CheckpointError, match=name) as e:
        ckpt.find_checkpoint(path)
    assert what in str(e.value)


def test_meta_json_that_is_not_utf8_or_json_is_named(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    meta = path / "meta.json"
    meta.write_bytes(b'{"step": 1, \xff\xfe}')
    with pytest.raises(CheckpointError, match="meta.json") as e:
        ckpt.read_meta(path)
    assert "utf-8" in str(e.value) and isinstance(e.value.__cause__, UnicodeDecodeError)
    (problem,) = ckpt.verify(path)
    assert str(meta) in problem
    with pytest.raises(CheckpointError, match="meta.json"):
        ckpt.find_checkpoint(path)
    meta.write_text('{"step": 1,')
    (problem,) = ckpt.verify(path)
    assert str(meta) in problem and "Expecting" in problem  # the JSON error itself
    meta.write_text("[1, 2]")
    assert "integer 'step'" in ckpt.verify(path)[0]


def test_a_checkpoint_dir_without_meta_json_is_named_not_mistaken_for_a_run(
        tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_0000001/meta\.json"):
        ckpt.find_checkpoint(path)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    first, second, third = (_save(tmp_path, s) for s in (1, 2, 3))
    _flip(third / "model.pt")
    (second / "rank0.pt").unlink()
    with pytest.warns(CheckpointWarning) as caught:
        assert ckpt.find_checkpoint(tmp_path) == first
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert str(third) in messages[0] and "model.pt" in messages[0]
    assert str(second) in messages[1] and "rank0.pt is missing" in messages[1]
    assert all("using step_0000001 instead" in m for m in messages)
    assert ckpt.select_checkpoint(tmp_path) == (first, messages)
    meta, rank_state = _load(first)
    assert meta["step"] == 1 and rank_state["step"] == 1


def test_resume_with_no_checkpoint_that_verifies_names_each(tmp_path: Path) -> None:
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    _truncate(first / "optim.pt")
    (second / "meta.json").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies") as e:
        ckpt.find_checkpoint(tmp_path)
    assert str(first / "optim.pt") in str(e.value)
    assert str(second / "meta.json") in str(e.value)


def test_a_checkpoint_without_checksums_still_loads(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    _old_format(path)
    assert ckpt.verify(path) == []  # unverified but acceptable
    assert ckpt.find_checkpoint(tmp_path) == path
    meta, rank_state = _load(path)
    assert meta["step"] == 1 and rank_state["step"] == 1
    (path / "rank0.pt").unlink()  # the files its format needs must still be there
    assert ckpt.verify(path) == [f"{path / 'rank0.pt'} is missing"]


@pytest.mark.parametrize("name", ["model.pt", "optim.pt", "rank0.pt"])
def test_a_file_that_cannot_be_loaded_is_named(tmp_path: Path, name: str) -> None:
    """load() does not hash, so an unverified (old-format) checkpoint reaches torch.load:
    its failure names the file, with torch's error chained."""
    path = _save(tmp_path, 1)
    _old_format(path)
    _truncate(path / name)
    with pytest.raises(CheckpointError, match="cannot read checkpoint file") as e:
        _load(path)
    assert str(path / name) in str(e.value) and e.value.__cause__ is not None
    assert str(e.value.__cause__) in str(e.value)  # what torch said, e.g. PytorchStreamReader


def test_a_save_after_falling_back_is_not_pruned_for_the_damaged_newer_one(
        tmp_path: Path) -> None:
    _save(tmp_path, 5, keep=2)
    damaged = _save(tmp_path, 10, keep=2)
    _truncate(damaged / "model.pt")
    with pytest.warns(CheckpointWarning, match="step_0000010"):
        assert ckpt.find_checkpoint(tmp_path).name == "step_0000005"
    # The resumed run (now with --keep-ckpts 1) saves before it reaches step 10: counted
    # by step alone, the damaged step 10 would be kept and the new checkpoint deleted.
    saved = _save(tmp_path, 7, keep=1)
    assert ckpt.step_dirs(tmp_path) == [saved] and ckpt.verify(saved) == []


# ---------------------------------------------------------------- several ranks
def _two_ranks(rank: int, run: str) -> dict:
    """Save replicated (DDP-like) and sharded (FSDP2) checkpoints on 2 ranks; damage the
    newest's rank1.pt on rank 0; every rank must pick the same older checkpoint."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    out: dict = {}
    run_dir = Path(run)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    for step in (1, 2):
        ckpt.save(run_dir, step, model=model, optimizer=opt, rank_state={"rank": rank},
                  meta={}, rank=rank, world_size=2, sharded=False, keep=5)
    sharded = fully_shard(_model())
    ckpt.save(run_dir, 3, model=sharded, optimizer=torch.optim.Adam(sharded.parameters()),
              rank_state={"rank": rank}, meta={}, rank=rank, world_size=2, sharded=True,
              keep=5)
    meta = ckpt.read_meta(run_dir / "checkpoints" / "step_0000003")
    out["files"] = sorted(meta["files"])
    if rank == 0:
        _truncate(run_dir / "checkpoints" / "step_0000003" / "rank1.pt")
        (run_dir / "checkpoints" / "step_0000002" / "model.pt").unlink()
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["chosen"] = ckpt.find_checkpoint(run_dir).name
    out["warnings"] = [str(w.message) for w in caught]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(run_dir / "checkpoints" / "step_0000001")
    dist.barrier()
    try:
        ckpt.find_checkpoint(run_dir)
    except CheckpointError as e:
        out["error"] = str(e)
    return out


@pytest.mark.dist
def test_ranks_agree_on_the_checkpoint_and_share_the_error(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_two_ranks, 2, str(tmp_path))
    # rank 0 hashed every rank's file and every DCP file of the sharded save
    assert "rank0.pt" in r0["files"] and "rank1.pt" in r0["files"]
    assert any(f.startswith("dcp/") and f.endswith(".distcp") for f in r0["files"])
    assert "dcp/.metadata" in r0["files"]
    assert r0["chosen"] == r1["chosen"] == "step_0000001"
    assert len(r0["warnings"]) == 2 and "rank1.pt" in r0["warnings"][0]
    assert r1["warnings"] == []  # rank 0 reports
    assert r0["error"] == r1["error"] and "model.pt is missing" in r0["error"]


# ---------------------------------------------------------------- the trainer
def test_train_resume_skips_a_damaged_latest_checkpoint(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", *flags(cache, out, "--max-steps", "4", "--decay-steps", "6",
                                 "--ckpt-every", "2", "--eval-every", "0")]) == 0
    _flip(out / "checkpoints" / "step_0000004" / "model.pt")
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "6"]) == 0
    assert last_result(out)["resumed_from_step"] == 2
    # the run's own log says which checkpoint was skipped and why
    log = (out / "logs" / "rank0.log").read_text()
    assert re.search(r"warning: .*step_0000004.*model\.pt", log), log[-2000:]
    # the damaged step 4 was rewritten by the resumed run
    assert [p.name for p in ckpt.step_dirs(out)] == ["step_0000004", "step_0000006"]
    assert all(ckpt.verify(p) == [] for p in ckpt.step_dirs(out))
