"""Ending a run early: Ctrl-C and a failed rank stop every process, quietly and promptly.

The runs are real processes (``python -m gradzip train``, ``torchrun``); a run is found
by its unique ``--out`` in ``/proc/*/cmdline``, which also catches torchrun's workers
(they live in sessions of their own, so the launcher's process group does not hold them).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from train_helpers import default_sigint, flags, launch

from gradzip.train import checkpoint as ckpt


def processes_of(out: Path) -> list[int]:
    """Pids of live processes whose command line names the run directory ``out``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # ended while we looked
            continue
        if str(out).encode() in argv:
            pids.append(int(entry.name))
    return pids



class Run:
    """A training process whose output is read line by line on a thread (never blocks)."""

    def __init__(self, argv: list[str], out: Path) -> None:
        self.out = out
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True,
                                     preexec_fn=default_sigint)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.text: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, needle: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.text.append(line)
            if needle in line:
                return
        self.kill()
        pytest.fail(f"no {needle!r} in the output:\n{''.join(self.text)}")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        """Exit code and the whole output; fails if the run does not end in ``timeout``."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout} s after the signal:\n{''.join(self.text)}")
        while (line := self.lines.get(timeout=10)) is not None:
            self.text.append(line)
        return self.proc.returncode, "".join(self.text)

    def kill(self) -> None:
        for pid in [self.proc.pid, *processes_of(self.out)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def gone(out: Path, within: float = 10) -> bool:
    """True once no process of the run is left (a killed child may take a moment)."""
    deadline = time.monotonic() + within
    while processes_of(out):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _stopped_record(out: Path) -> dict:
    """The run's last results record, which a stopped run writes (marked interrupted)."""
    return json.loads((out / "results.jsonl").read_text().splitlines()[-1])


def test_ctrl_c_finishes_the_step_checkpoints_records_and_resumes(cache: Path,
                                                                  tmp_path: Path) -> None:
    """With the default --ckpt-every 0 nothing used to be kept at a Ctrl-C."""
    out = tmp_path / "run"
    run = Run([sys.executable, "-m", "gradzip", "train",
               *flags(cache, out, "--max-steps", "100000")], out)
    run.wait_for("tok/s")  # mid-run, prefetch thread busy, TensorBoard/log files open
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    code, text = run.finish()
    assert code == 130, text
    assert "Traceback" not in text and "Exception in thread" not in text, text
    assert gone(out)
    record = _stopped_record(out)
    step = record["steps"]
    assert record["interrupted"] == "SIGINT" and 0 < step < 100000
    assert f"stopped by SIGINT at step {step}" in text
    assert f"go on with: gradzip train --resume --out {out}" in text, text
    assert [d.name for d in ckpt.step_dirs(out)] == [f"step_{step:07d}"]

    run = Run([sys.executable, "-m", "gradzip", "train", "--resume", "--out", str(out),
               "--max-steps", str(step + 3), "--decay-steps", "100000"], out)
    code, text = run.finish(timeout=120)
    assert code == 0 and f"resuming {out}" in text, text
    resumed = _stopped_record(out)
    assert resumed["steps"] == step + 3 and resumed["resumed_from_step"] == step
    assert resumed["interrupted"] is None


def test_sigterm_stops_a_run_the_same_way(cache: Path, tmp_path: Path) -> None:
    """What a cluster scheduler sends before it kills a job."""
    out = tmp_path / "run"
    run = Run([sys.executable, "-m", "gradzip", "train",
               *flags(cache, out, "--max-steps", "100000")], out)
    run.wait_for("tok/s")
    os.kill(run.proc.pid, signal.SIGTERM)
    code, text = run.finish()
    assert code == 130 and "Traceback" not in text, text
    assert _stopped_record(out)["interrupted"] == "SIGTERM"
    assert ckpt.step_dirs(out)


@pytest.mark.dist
@pytest.mark.parametrize("extra", [["--codec", "ef | topk(ratio=0.1)"],
                                   ["--outer", "diloco", "--sync-every", "3"]],
                         ids=["ddp", "diloco"])
def test_ctrl_c_under_torchrun_stops_every_rank_at_the_same_step(
        cache: Path, tmp_path: Path, extra: list[str]) -> None:
    """Every rank stops at the same logged step (--log-every 5; DiLoCo too), checkpoints
    and exits 130; the launcher's own SignalException is torchrun's."""
    out = tmp_path / "run"
    torchrun = [*launch(2), "-m", "gradzip", "train"]
    run = Run([*torchrun, *flags(cache, out, "--max-steps", "100000", "--parallel", "ddp",
                                 *extra)], out)
    run.wait_for("tok/s")
    os.killpg(run.proc.pid, signal.SIGINT)  # the launcher forwards it to its workers
    code, text = run.finish()
    assert code != 0 and gone(out), text
    tracebacks = text.split("Traceback")[1:]  # the launcher's, none of a rank's
    assert all("SignalException" in tb and "gradzip/" not in tb for tb in tracebacks), text
    record = _stopped_record(out)
    step = record["steps"]
    assert record["interrupted"] == "SIGINT" and record["replicas_identical"] is not False
    assert step % 5 == 0, step  # the log step whose all-reduce carried the flag
    [saved] = ckpt.step_dirs(out)
    assert saved.name == f"step_{step:07d}"
    assert sorted(p.name for p in saved.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    assert "torchrun --nproc_per_node 2 -m gradzip train --resume" in text


@pytest.mark.dist
def test_a_failed_rank_on_resume_ends_every_torchrun_process(cache: Path, tmp_path: Path
                                                             ) -> None:
    out = tmp_path / "run"
    torchrun = [*launch(2), "-m", "gradzip", "train"]
    run = Run([*torchrun, *flags(cache, out, "--max-steps", "5", "--decay-steps", "100000",
                                 "--parallel", "ddp", "--codec", "ef | topk(ratio=0.1)")], out)
    code, text = run.finish(timeout=120)
    assert code == 0, text

    # Rank 1 fails on resume (its checkpoint file is garbage) while rank 0 goes on into a
    # collective: the launcher must notice and end rank 0 too, not leave it waiting. (With
    # checksums rank 0 would refuse the checkpoint for every rank before loading, so the
    # checkpoint is made one from before checksums, which is loaded unverified.)
    damaged = out / "checkpoints" / "step_0000005"
    meta = json.loads((damaged / "meta.json").read_text())
    del meta["files"]
    (damaged / "meta.json").write_text(json.dumps(meta))
    (damaged / "rank1.pt").write_bytes(b"not a checkpoint")
    run = Run([*torchrun, "--resume", "--out", str(out), "--max-steps", "10",
               "--decay-steps", "100000"], out)  # the saved schedule: no lr jump
    code, text = run.finish(timeout=120)
    assert code != 0 and "cannot read checkpoint file" in text and "rank1.pt" in text, text
    assert gone(out)
