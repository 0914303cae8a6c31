"""Gradient capture into HDF5 archives: layout, round trips, crash safety, verify."""

from __future__ import annotations

import copy
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from archive_helpers import damage_root_heap
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import gradzip
from gradzip.capture import Archive, index, parse_size, verify
from gradzip.capture.capture import Capture
from gradzip.capture.layout import StepKey, dataset_path, escape, parse_pt_name, unescape
from gradzip.capture.packs import PackWriter
from gradzip.capture.repair import repair
from gradzip.comm.launch import run_ranks


@given(st.text())
def test_escaped_names_map_back_and_hold_no_slash(name: str) -> None:
    assert "/" not in escape(name) and unescape(escape(name)) == name


def test_names_sizes_and_pt_files() -> None:
    assert dataset_path(StepKey(1, 2, 3), 4, "a/b.w") == "/R_1_E_2_S_3/B_4/a%2Fb.w"
    assert dataset_path(StepKey(0, 0, 7), 1, "w", "aggregated") == "/R_0_E_0_S_7/A_1/w"
    assert parse_size("10GB") == 10**10 and parse_size("512KiB") == 512 * 1024
    assert parse_size("1.8TB") == int(1.8e12) and parse_size(4096) == 4096
    with pytest.raises(ValueError, match="looks like"):
        parse_size("lots")
    assert parse_pt_name("R_1_E_0_S_25_B_3.pt") == (StepKey(1, 0, 25), 3)
    assert parse_pt_name("notes.txt") is None


def _capture_steps(directory: Path, count: int = 5, **options: object) -> Capture:
    capture = Capture(directory, **options)  # type: ignore[arg-type]
    capture.start(0, codec="none")
    for step in range(count):
        capture.begin_step(step)
        capture.record(0, ["a.w", "b/x"], [(2, 3), (4,)],
                       torch.arange(10, dtype=torch.float32) + step)
        capture.record(1, ["c"], [(5,)], torch.full((5,), float(step), dtype=torch.bfloat16))
        capture.end_step()
    capture.close()
    return capture


def test_round_trip_of_buckets_dtypes_and_schedules(tmp_path: Path) -> None:
    _capture_steps(tmp_path, every=2)
    with Archive(tmp_path) as a:
        assert a.steps() == [(0, 0, 0), (0, 0, 2), (0, 0, 4)]
        np.testing.assert_array_equal(a.bucket(0, 0, 4, 0), np.arange(10) + 4)
        [c] = a.entries(step=2, bucket=1)
        assert c.dtype == "bfloat16" and torch.equal(a.tensor(c), torch.full((5,), 2.0,
                                                                          dtype=torch.bfloat16))
        [w] = a.entries(step=0, name="b/x")
        assert (w.shape, w.bucket_offset) == ((4,), 6)
    with h5py.File(tmp_path / "rank0" / "pack_0.h5") as f:  # readable by any HDF5 tool
        ds = f["/R_0_E_0_S_2/B_0/b%2Fx"]
        assert list(ds[:]) == [8, 9, 10, 11] and ds.attrs["dtype"] == "float32"
        assert ds.attrs["crc32"] > 0 and ds.attrs["offset"] == 6
        assert ds.parent.attrs["torch_version"] == str(torch.__version__)
        assert ds.parent.attrs["codec"] == "none" and f.attrs["gradzip_version"]
    assert verify(tmp_path) == (9, [])


def test_explicit_steps_and_byte_budget(tmp_path: Path) -> None:
    _capture_steps(tmp_path / "s", count=6, steps=[1, 4])
    with Archive(tmp_path / "s") as a:
        assert [s for _, _, s in a.steps()] == [1, 4]
    _capture_steps(tmp_path / "b", count=6, budget=100)  # 50 bytes a step
    with Archive(tmp_path / "b") as a:
        assert [s for _, _, s in a.steps()] == [0, 1]


def test_packs_roll_over_at_the_cap(tmp_path: Path) -> None:
    _capture_steps(tmp_path, count=6, pack_cap=60)
    packs = sorted((tmp_path / "rank0").glob("pack_*.h5"))
    assert len(packs) >= 5
    with Archive(tmp_path) as a:
        assert len(a.steps()) == 6 and len({e.pack for e in a}) == len(packs)
        np.testing.assert_array_equal(a.bucket(0, 0, 5, 0), np.arange(10) + 5)
    assert verify(tmp_path)[1] == []


def test_verify_tells_steps_captured_again_after_a_resume_from_unfinished_ones(
        tmp_path: Path) -> None:
    """A run resumed from an earlier checkpoint captures its last steps again: the first
    captures are superseded, not "never completed"."""
    _capture_steps(tmp_path, count=4)  # steps 0-3; the run is then resumed from step 1
    capture = Capture(tmp_path)
    capture.start(0, codec="none")
    for step in (2, 3):
        capture.begin_step(step)
        capture.record(0, ["a.w", "b/x"], [(2, 3), (4,)], torch.zeros(10))
        capture.end_step()
    capture.begin_step(4)  # and this one never ends (the writer gets its bucket)
    capture.record(0, ["a.w", "b/x"], [(2, 3), (4,)], torch.zeros(10))
    capture._writer.close()  # type: ignore[union-attr]  # killed: no commit of step 4
    checked, problems = verify(tmp_path)
    notes = "\n".join(str(p) for p in problems)
    assert not [p for p in problems if p.fatal], notes
    assert "4 dataset(s) of steps captured again after a resume" in notes  # 2 steps x 2
    assert "R_0_E_0_S_2" in notes
    assert "never completed" in notes and "R_0_E_0_S_4" in notes, notes
    with Archive(tmp_path) as a:
        np.testing.assert_array_equal(a.bucket(0, 0, 3, 0), np.zeros(10))  # the later one


def test_a_step_that_never_ended_is_not_committed_by_close(tmp_path: Path) -> None:
    """An error in the middle of a step (a NaN, Ctrl-C twice) closes the capture with
    the step half recorded: its buckets must not enter the index as a whole step."""
    capture = Capture(tmp_path)
    capture.start(0, codec="none")
    capture.begin_step(1)
    capture.record(0, ["a.w"], [(4,)], torch.ones(4))
    capture.end_step()
    capture.begin_step(2)
    capture.record(0, ["a.w"], [(4,)], torch.ones(4))  # bucket 1 of step 2 never comes
    capture.close()
    with Archive(tmp_path) as a:
        assert [s for _, _, s in a.steps()] == [1]
    checked, problems = verify(tmp_path)
    assert checked == 1 and not [p for p in problems if p.fatal]
    assert any("never completed" in str(p) and "S_2" in str(p) for p in problems), problems


def test_verify_names_the_corrupt_dataset(tmp_path: Path) -> None:
    _capture_steps(tmp_path, count=2)
    with Archive(tmp_path) as a:
        [entry] = a.entries(step=1, name="a.w")
    with open(tmp_path / entry.pack, "r+b") as f:
        f.seek(entry.file_offset + 4)
        f.write(b"\xff\xff")
    checked, problems = verify(tmp_path)
    assert checked == 6 and len(problems) == 1
    assert "rank0/pack_0.h5:/R_0_E_0_S_1/B_0/a.w" in str(problems[0])
    assert "checksum mismatch" in str(problems[0])


def test_a_full_queue_waits_by_default_and_drops_only_when_asked(tmp_path: Path,
                                                                 monkeypatch) -> None:
    slow = PackWriter.write_bucket

    def write_slowly(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(PackWriter, "write_bucket", write_slowly)
    waited = _capture_steps(tmp_path / "wait", count=4, queue_size=1)
    assert waited.stats.dropped == 0 and waited.stats.buckets == 8
    dropped = _capture_steps(tmp_path / "drop", count=4, queue_size=1, on_full="drop")
    assert dropped.stats.dropped > 0
    assert dropped.stats.buckets + dropped.stats.dropped == 8


def test_a_writer_error_reaches_the_training_thread(tmp_path: Path) -> None:
    capture = Capture(tmp_path)
    capture.start(0)
    capture.begin_step(0)
    capture.record(0, ["w"], [(3,)], torch.zeros(3, dtype=torch.float32))
    capture.record(0, ["w"], [(3,)], torch.zeros(3, dtype=torch.float32))  # same dataset
    with pytest.raises(RuntimeError, match="the writer failed"):
        capture.close()


def test_verify_notes_a_killed_steps_group_past_the_recorded_end_of_file(
        tmp_path: Path) -> None:
    """A kill can flush a new step's link before the superblock's end-of-file address:
    HDF5 then refuses that group (``visititems`` on the root gave up and verify raised).
    Made here by adding a group and writing the old end-of-file address back."""
    _capture_steps(tmp_path, count=2)
    pack = next(tmp_path.glob("*/pack_*.h5"))
    raw = pack.read_bytes()
    assert raw[8] == 0  # superblock version 0: end-of-file address at bytes 40-48
    with h5py.File(pack, "a") as f:
        f.create_group("R_0_E_0_S_7").create_dataset("w", data=np.ones(64))
    grown = bytearray(pack.read_bytes())
    grown[40:48] = raw[40:48]
    pack.write_bytes(bytes(grown))
    checked, problems = verify(tmp_path)
    assert checked > 0 and [p for p in problems if p.fatal] == []
    assert any("S_7" in p.where and "never completed" in p.what for p in problems)


def test_a_damaged_structure_with_intact_bytes_is_repaired(tmp_path: Path) -> None:
    _capture_steps(tmp_path, count=3)
    pack = next(tmp_path.glob("*/pack_*.h5"))
    with Archive(tmp_path) as a:
        before = {(e.step, e.bucket, e.name): a.load(e, copy=True) for e in a}
    damage_root_heap(pack)
    with pytest.raises(KeyError, match="free block size"), h5py.File(pack, "r") as f:
        f["R_0_E_0_S_0/B_0/a.w"]
    checked, problems = verify(tmp_path)
    assert checked == 9 and [p for p in problems if p.fatal] == []
    assert [p.where for p in problems if p.repairable] == ["rank0/pack_0.h5"]

    assert repair(tmp_path, report=lambda _: None) == ["rank0/pack_0.h5"]
    assert not pack.exists()
    checked, problems = verify(tmp_path)
    assert checked == 9 and problems == []
    with Archive(tmp_path) as a:
        assert {e.pack for e in a} == {"rank0/pack_1.h5"}
        assert a.steps() == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
        after = {(e.step, e.bucket, e.name): a.load(e, copy=True) for e in a}
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with h5py.File(tmp_path / "rank0/pack_1.h5", "r") as f:  # HDF5 tools read it again
        assert np.array_equal(f["R_0_E_0_S_2/B_0/a.w"][()], np.arange(6.0).reshape(2, 3) + 2)
    assert repair(tmp_path, report=lambda _: None) == []


def test_a_damaged_structure_over_wrong_bytes_stays_an_error(tmp_path: Path) -> None:
    _capture_steps(tmp_path, count=2)
    pack = next(tmp_path.glob("*/pack_*.h5"))
    with Archive(tmp_path) as a:
        entry = a.entries(step=1, name="c")[0]
    damage_root_heap(pack)
    raw = bytearray(pack.read_bytes())
    raw[entry.file_offset] ^= 0xFF
    pack.write_bytes(bytes(raw))
    _, problems = verify(tmp_path)
    fatal = [p for p in problems if p.fatal]
    assert any("checksum mismatch" in p.what for p in fatal)
    assert any("not in the pack" in p.what for p in fatal) and not any(
        p.repairable for p in problems)
    assert repair(tmp_path, report=lambda _: None) == [] and pack.exists()


def test_a_repair_cut_short_is_finished_and_a_locked_pack_refused(tmp_path: Path) -> None:
    """Killed before the index moved, a repair leaves its copy; after, the damaged pack:
    the next repair removes whichever the index does not point at. A pack a writer holds
    (HDF5's flock) is neither verified nor rewritten."""
    _capture_steps(tmp_path, count=2)
    pack = next(tmp_path.glob("*/pack_*.h5"))
    damage_root_heap(pack)
    damaged = pack.read_bytes()
    fd = os.open(pack, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _, problems = verify(tmp_path)
    assert [(p.fatal, p.repairable) for p in problems] == [(False, False)]
    assert "in use by a writer" in problems[0].what
    assert repair(tmp_path, report=lambda _: None) == []
    os.close(fd)
    assert pack.exists() and len(list(pack.parent.iterdir())) == 1

    pack.with_name("pack_1.h5").write_bytes(damaged)  # a copy cut off before the move
    db = index.connect(tmp_path)
    index.record_repair(db, "rank0/pack_0.h5", "rank0/pack_1.h5")
    said: list[str] = []
    assert repair(tmp_path, report=said.append) == ["rank0/pack_0.h5"]
    assert said[0].startswith("rank0/pack_1.h5: removed")
    assert not pack.exists() and [p.name for p in (tmp_path / "rank0").iterdir()] == [
        "pack_1.h5"]  # the fresh copy took the freed name
    pack.write_bytes(damaged)  # the damaged pack a kill after the move left
    index.record_repair(db, "rank0/pack_0.h5", "rank0/pack_1.h5")
    db.close()
    said.clear()
    assert repair(tmp_path, report=said.append) == []
    assert said == ["rank0/pack_0.h5: removed, left by a repair a kill cut short"]
    assert not pack.exists() and verify(tmp_path) == (6, [])


def test_repair_refuses_a_pack_a_writer_took_after_verify(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that opens the pack between verify and the rewrite holds HDF5's lock:
    the rewrite refuses it rather than delete a file a writer has open."""
    _capture_steps(tmp_path, count=2)
    pack = next(tmp_path.glob("*/pack_*.h5"))
    damage_root_heap(pack)
    _, problems = verify(tmp_path)
    monkeypatch.setattr("gradzip.capture.repair.verify", lambda _: (6, problems))
    fd = os.open(pack, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="a process is writing it"):
            repair(tmp_path, report=lambda _: None)
    finally:
        os.close(fd)
    assert [f.name for f in pack.parent.iterdir()] == ["pack_0.h5"]


_KILL_ME = """
import sys, torch
from gradzip.capture.capture import Capture
capture = Capture(sys.argv[1])
capture.start(0)
step = 0
while True:
    capture.begin_step(step)
    for b in range(4):
        capture.record(b, ["layer.w", "layer.b"], [(256, 64), (64,)],
                       torch.randn(256 * 64 + 64))
    capture.end_step()
    if step == 3:
        print("running", flush=True)
    step += 1
"""


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.1])
def test_kill_9_leaves_every_completed_step_readable(tmp_path: Path, delay: float) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILL_ME, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    checked, problems = verify(tmp_path)
    assert [p for p in problems if p.fatal] == [] and checked > 0
    if any(p.repairable for p in problems):  # killed during a flush (about 1 run in 200)
        repair(tmp_path, report=lambda _: None)
        assert not any(p.fatal or p.repairable for p in verify(tmp_path)[1])
    with Archive(tmp_path) as a:
        steps = [s for _, _, s in a.steps()]
        assert steps == list(range(len(steps)))  # completed steps, in order, no holes
        for step in steps:
            assert all(a.bucket(0, 0, step, b).size == 256 * 64 + 64 for b in range(4))


# ---- 2 gloo ranks ------------------------------------------------------------------------

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 1))


def _train(rank: int, directory: str | None, spec: str) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(copy.deepcopy(_model()), bucket_cap_mb=0.002)  # several buckets
    capture = Capture(directory, aggregated=True) if directory else None
    handle = gradzip.attach(model, spec, capture=capture)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if capture is not None:
            capture.begin_step(step, epoch=0)
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        handle.stats.end_step()
        if capture is not None:
            capture.end_step()
    handle.close()
    return [p.detach().clone() for p in model.parameters()]


def _captured_and_plain(rank: int, directory: str, spec: str) -> bool:
    captured = _train(rank, directory, spec)
    plain = _train(rank, None, spec)
    return all(torch.equal(a, b) for a, b in zip(captured, plain, strict=True))


@pytest.mark.dist
@pytest.mark.parametrize("spec", ["none", "int8"])
def test_two_rank_ddp_capture_round_trip(tmp_path: Path, spec: str) -> None:
    assert run_ranks(_captured_and_plain, 2, str(tmp_path), spec) == [True, True]  # no bit
    with Archive(tmp_path) as a:
        assert sorted(a.steps()) == [(r, 0, s) for r in (0, 1) for s in range(4)]
        names = {e.name for e in a.entries(rank=0, step=2)}
        assert names == {f"{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")}
        buckets = sorted({e.bucket for e in a.entries(rank=0, step=2)})
        assert len(buckets) > 1
        for b in buckets:
            local = [a.bucket(r, 0, 2, b) for r in (0, 1)]
            mean = [a.bucket(r, 0, 2, b, kind="aggregated") for r in (0, 1)]
            assert not np.array_equal(local[0], local[1])  # each rank's own gradient
            np.testing.assert_array_equal(mean[0], mean[1])  # the same mean on both
            if spec == "none":
                np.testing.assert_allclose(mean[0], (local[0] + local[1]) / 2, rtol=1e-6)
        assert all(e.codec == spec for e in a)
    assert verify(tmp_path)[1] == []


def _fsdp_capture(rank: int, directory: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    capture = Capture(directory, aggregated=True)
    handle = gradzip.attach(model, "none", capture=capture)
    for step in range(2):
        capture.begin_step(step)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        capture.end_step()
        model.zero_grad()
    handle.close()


@pytest.mark.dist
def test_two_rank_fsdp2_capture_records_every_shard(tmp_path: Path) -> None:
    run_ranks(_fsdp_capture, 2, str(tmp_path))
    with Archive(tmp_path) as a:
        assert sorted(a.steps()) == [(r, 0, s) for r in (0, 1) for s in range(2)]
        local = a.entries(rank=0, step=1, kind="local")
        assert {"0.weight@shard0", "0.weight@shard1"} <= {e.name for e in local}
        for unit in sorted({e.bucket for e in local}):
            sent = [a.bucket(r, 0, 1, unit) for r in (0, 1)]
            for r in (0, 1):  # rank r keeps the mean of chunk r of what both sent
                mean = a.bucket(r, 0, 1, unit, kind="aggregated")
                chunk = slice(r * mean.size, (r + 1) * mean.size)
                np.testing.assert_allclose(mean, (sent[0][chunk] + sent[1][chunk]) / 2,
                                           rtol=1e-5, atol=1e-7)
                assert all(e.name.endswith(f"@shard{r}") for e in a.entries(
                    rank=r, step=1, bucket=unit, kind="aggregated"))
    assert verify(tmp_path)[1] == []
