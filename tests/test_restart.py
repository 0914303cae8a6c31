"""Restart without a person (issue 42, item 1): a run torchrun restarts resumes by itself
from its newest checkpoint, says what the failure cost, and ends with the uninterrupted
run's weights bit for bit; ``--ckpt-every`` in steps or time."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from train_helpers import flags, last_result, launch

from gradzip.cli import main
from gradzip.train import restart
from gradzip.train.restart import Attempt, Every


# ---------------------------------------------------------------- pieces
def test_ckpt_every_is_steps_or_a_time() -> None:
    assert Every.parse("100") == Every(steps=100) and Every.parse(25) == Every(steps=25)
    assert Every.parse("30s").seconds == 30.0 and Every.parse("10m").seconds == 600.0
    assert Every.parse("1.5h").seconds == 5400.0 and Every.parse(" 2 min ").seconds == 120.0
    assert not Every.parse("0") and not Every.parse("0s")
    for bad, why in (("1.5", "whole"), ("ten", "number of steps"), ("5d", "number of steps"),
                     ("-3", "number of steps")):
        with pytest.raises(ValueError, match=why):
            Every.parse(bad)


def test_only_a_restart_of_a_run_that_saved_resumes_by_itself() -> None:
    first, again = Attempt.from_env({}), Attempt.from_env(
        {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert (first.number, again.number, again.max_restarts) == (0, 2, 3)
    assert not restart.resumes(False, True, first)  # a fresh run never mixes with an old
    assert restart.resumes(False, True, again)
    assert not restart.resumes(False, False, again)  # died before its first save: step 0
    assert restart.resumes(True, True, first)


def test_kills_are_planned_per_attempt() -> None:
    env = {"GRADZIP_KILL_AT": "1@7, 0@12"}
    assert restart.kills(env) == [(1, 7), (0, 12)]
    assert restart.kills({}) == []
    with pytest.raises(ValueError, match="RANK@STEP"):
        restart.kills({"GRADZIP_KILL_AT": "1:7"})
    # not this rank, not this step, an attempt past the plan: no kill (we are alive)
    restart.kill_if_due(0, 7, Attempt(0), env)
    restart.kill_if_due(1, 8, Attempt(0), env)
    restart.kill_if_due(1, 7, Attempt(2), env)


def test_what_a_failure_cost_is_read_from_the_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = [{"step": s, restart.TRAIN_TIME_KEY: 0.5 * s} for s in range(1, 9)]
    (logs / "rank0.log").write_text("12:00:00 a line for people\n"
                                    + "".join(json.dumps(r) + "\n" for r in rows)
                                    + '{"step": 9, "time/tr')  # cut by the kill
    r = restart.measure(tmp_path, Attempt(1, 3), from_step=5, from_train_s=2.5)
    assert (r.attempt, r.from_step, r.lost_steps, r.lost_train_s) == (1, 5, 3, 1.5)
    assert 0.0 <= r.down_s < 60.0
    assert "restart 1 of at most 3" in restart.describe(r, Attempt(1, 3))
    assert "3 step(s) lost" in restart.describe(r, Attempt(1, 3))
    restart.append(tmp_path, r)
    restart.append(tmp_path, restart.Restart(2, 10, 2, 1.0, 4.0))
    with open(tmp_path / restart.RESTARTS_FILE, "a") as f:
        f.write('{"attempt": 3, "from')  # a line cut short
    s = restart.summary(tmp_path)
    assert (s["count"], s["lost_steps"], s["lost_train_s"]) == (2, 5, 2.5)
    assert restart.summary(tmp_path / "none")["count"] == 0


def test_a_config_file_from_before_keeps_its_steps(tmp_path: Path) -> None:
    """``ckpt_every`` was an int: config.json files written then still read."""
    from gradzip.train.config import JobConfig
    from gradzip.train.configure import apply_overrides

    cfg = JobConfig()
    apply_overrides(cfg, {"run": {"ckpt_every": 5}}, "config.json")
    assert cfg.run.ckpt_every == "5" and Every.parse(cfg.run.ckpt_every).steps == 5
    with pytest.raises(ValueError, match="run.log_every must be int"):
        apply_overrides(cfg, {"run": {"log_every": "5"}}, "config.json")


def test_checkpoints_by_time(cache: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """A time span saves at the logged steps once it has passed (here at every one)."""
    out = tmp_path / "timed"
    assert main(["train", *flags(cache, out, "--max-steps", "12", "--eval-every", "0",
                                 "--log-every", "4", "--ckpt-every", "0.001s",
                                 "--keep-ckpts", "5")]) == 0
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [
        "step_0000004", "step_0000008", "step_0000012"]
    assert last_result(out)["restarts"]["count"] == 0
    assert main(["train", *flags(cache, tmp_path / "bad", "--ckpt-every", "3x")]) == 2
    assert "--ckpt-every '3x': give a number of steps (100) or a time" in capsys.readouterr().err


# ---------------------------------------------------------------- torchrun
def _torchrun(cache: Path, out: Path, max_restarts: int, kill_at: str) -> None:
    cmd = [*launch(2)[:3], "--max-restarts", str(max_restarts), *launch(2)[3:], "-m",
           "gradzip", "train", *flags(cache, out, "--parallel", "ddp", "--codec", "ef | int8",
                                      "--max-steps", "18", "--eval-every", "9",
                                      "--ckpt-every", "4", "--log-every", "1",
                                      "--keep-ckpts", "2", "--no-progress")]
    env = {**os.environ, "GRADZIP_KILL_AT": kill_at}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoints" / "step_0000018" / "model.pt", weights_only=True)


@pytest.mark.dist
def test_a_rank_killed_twice_under_torchrun_finishes_with_the_same_weights(
        cache: Path, tmp_path: Path) -> None:
    """DDP on 2 ranks, rank 1 killed (SIGKILL) after step 7 and, in the restarted run,
    after step 14: torchrun restarts the workers, each attempt resumes from the newest
    checkpoint by itself, and the final weights equal the uninterrupted run's."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _torchrun(cache, straight, 0, "")
    began = time.time()
    _torchrun(cache, killed, 3, "1@7,1@14")
    rec = last_result(killed)
    assert rec["steps"] == 18 and rec["resumed_from_step"] == 12
    r = rec["restarts"]
    assert r["count"] == 2 and [e["from_step"] for e in r["each"]] == [4, 12]
    assert [e["lost_steps"] for e in r["each"]] == [3, 2]  # steps 5-7, then 13-14
    assert r["lost_train_s"] > 0 and 0 < r["down_s"] < time.time() - began
    want, got = _final_weights(straight), _final_weights(killed)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert rec["val_loss"] == last_result(straight)["val_loss"]
    log = (killed / "logs" / "rank0.log").read_text()
    assert "restart 2 of at most 3 (torchrun restarted the workers): resuming from step 12" \
        in log
