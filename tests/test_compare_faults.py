"""``gradzip compare --kill`` and ``--ft`` (issue 42): ranks die at chosen steps in a
race; runs under torchrun restart from their newest checkpoint, local-update methods
under ``--ft`` go on as torchft replica groups; the report says where each death fell
and what it cost, and the race's clock charges it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradzip.comm.ft import torchft_available
from gradzip.compare.matrix import KILL_CKPT_EVERY, Run
from gradzip.compare.runs import parse_run

needs_torchft = pytest.mark.skipif(not torchft_available(),
                                   reason="torchft is not installed (the ft extra)")

DILOCO = "diloco(sync_every=5) | int8"


def test_a_killed_run_restarts_under_torchrun_from_a_checkpoint(tmp_path: Path) -> None:
    run = Run("int8", 0, 2, "100mbit", ("--max-steps", "60"), kill="1@30")
    argv = run.argv(tmp_path / "run", tmp_path / "cache")
    assert argv[argv.index("--nproc_per_node") + 1:][:3] == ["2", "--max-restarts", "1"]
    assert argv[argv.index("--ckpt-every") + 1] == KILL_CKPT_EVERY
    assert run.env(tmp_path) == {"GRADZIP_KILL_AT": "1@30"}
    assert run.what[-2:] == ("--kill", "1@30")  # a rerun with other kills is another run
    assert "--ft" not in Run("int8", 0, 2, None, ft=True).what  # torchrun either way
    assert "torchrun --max-restarts 1" in (run.survival() or "")
    own = Run("int8", 0, 2, None, ("--ckpt-every=7",), kill="1@30,0@50")
    argv = own.argv(tmp_path / "run", tmp_path / "cache")
    assert argv[argv.index("--max-restarts") + 1] == "2"
    # the run's own interval comes after compare's default, so argparse keeps it
    assert argv.index("--ckpt-every") < argv.index("--ckpt-every=7")
    assert "--ckpt-every 7" in (own.survival() or "")


def test_under_ft_local_update_methods_start_replica_groups(tmp_path: Path) -> None:
    run = Run(DILOCO, 0, 3, "100mbit", ("--max-steps", "60"), ft=True, kill="2@30")
    argv = run.argv(tmp_path / "run", tmp_path / "cache")
    assert "torch.distributed.run" not in argv and argv[1:4] == ["-m", "gradzip", "train"]
    assert argv[argv.index("--ft") + 1] == "3" and "--ckpt-every" not in argv
    assert run.uses_ft() and "torchft" in (run.survival() or "")
    ddp = Run("int8", 0, 3, "100mbit", ft=True)  # per-step methods: torchrun as usual
    assert not ddp.uses_ft() and ddp.survival() is None
    assert "torch.distributed.run" in ddp.argv(tmp_path, tmp_path)


@pytest.mark.parametrize("extra, message", [
    (["--kill", "2@30"], "rank 2 does not exist in a run of 2 ranks"),
    (["--kill", "1@x"], "is not RANK@STEP"),
    (["--kill", ","], "give RANK@STEP"),
    (["--kill", "1@200,0@100"], "the steps must increase"),
    (["--kill", "1@300", "--steps", "300"], "below the run's 300 steps"),
    (["--kill", "1@30", "--link", "per-rank"], "shared link"),
    (["--kill", "1@30", "--rate", "100mbit@5>down@8>100mbit"], "one fault at a time"),
    (["--ft", "--methods", "int8"], "none of the methods is one"),
])
def test_compare_refuses_faults_it_cannot_run(tmp_path: Path, capsys: Any,
                                              extra: list[str], message: str) -> None:
    from gradzip.cli import main

    args = ["compare", "--methods", "int8", "--out", str(tmp_path), "--dry-run", *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_script_race_cannot_kill_ranks(tmp_path: Path, capsys: Any) -> None:
    from gradzip.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["compare", "--script", str(script), "--methods", "int8", "--kill", "1@3",
                 "--out", str(tmp_path), "--dry-run"]) == 2
    assert "built-in trainer" in capsys.readouterr().err


def _record(restarts: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"compare": {"method": "int8", "seed": 0, "ranks": 2, "rate": "100mbit",
                        "link": "shared"},
            "restarts": {"count": len(restarts), "each": restarts}, "steps": 100,
            "eval_history": [{"step": s, "train_time_s": s / 10, "val_loss": 5.0 - s / 100}
                             for s in (25, 50, 75, 100)], **extra}


def test_the_race_clock_charges_what_each_restart_cost() -> None:
    restarts = [{"attempt": 1, "from_step": 25, "lost_steps": 10, "lost_train_s": 1.0,
                 "down_s": 4.0},
                {"attempt": 2, "from_step": 75, "lost_steps": 0, "lost_train_s": 0.0,
                 "down_s": 2.5}]
    run = parse_run(_record(restarts), "record 1")
    assert [t for _, t, _ in run.history()] == [2.5, 10.0, 12.5, 17.5]
    assert [t for _, t, _ in parse_run(_record([]), "r").history()] == [2.5, 5.0, 7.5, 10.0]
    # a torchft group's clock is the job's: a group that healed took its peer's
    group = parse_run(_record(restarts, ft={"replica": 0}), "r")
    assert [t for _, t, _ in group.history()] == [2.5, 5.0, 7.5, 10.0]


def test_the_report_says_where_each_death_fell_and_what_it_cost() -> None:
    from gradzip.compare.report import _deaths

    restart = {"attempt": 1, "from_step": 25, "lost_steps": 10, "lost_train_s": 1.0,
               "down_s": 4.0}
    (line,) = _deaths(_record([restart]))
    assert "after step 35" in line and "checkpoint of step 25" in line
    assert "5.0 s on the race's clock" in line
    failure = {"replica": 1, "attempt": 0, "exit_code": -9, "died_s": 6.6, "last_step": 50,
               "restarted": True, "back_s": 5.1, "failed_rounds": 1, "survivor_lost_s": 4.2}
    (line,) = _deaths(_record([], ft_job={"failures": [failure]}))
    assert line.startswith("replica group 1 died 6.6 s into the job (after step 50")
    assert "back 5.1 s later" in line and "lost 4.2 s each (1 round(s) rolled back)" in line
    both = _record([restart], ft={"replica": 0}, ft_job={"failures": [failure]})
    assert len(_deaths(both)) == 1  # the group's own restart is that failure


def test_the_ft_job_record_is_a_group_that_never_died() -> None:
    from gradzip.train.ft_launch import record_source

    assert record_source([1, 0, 2], {0}) == 1
    assert record_source([2, 1], set()) == 1
    assert record_source([2, 0], {0, 2}) == 2  # every group died once: the first to finish
    assert record_source([], set()) == 0


def _compare(out: Path, *extra: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "gradzip", "compare", "--methods", f"int8;{DILOCO}",
           "--steps", "60", "--train-args", "--eval-every 20 --log-every 10",
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.dist
@needs_torchft
def test_a_race_goes_on_through_killed_ranks(tmp_path: Path) -> None:
    ddp, diloco = _compare(tmp_path, "--ft", "--kill", "1@30")
    for r in (ddp, diloco):
        assert r["steps"] == 60 and r["compare"]["faults"]["kill"] == "1@30"
    assert ddp["restarts"]["count"] == 1 and ddp["resumed_from_step"] == 25
    (failure,) = diloco["ft_job"]["failures"]
    assert failure["replica"] == 1 and failure["restarted"]
    assert diloco["ft_job"]["rounds_agree"]["identical"]
    assert diloco["ft_job"]["record_of"] == 0  # the group that never died
    report = (tmp_path / "report.md").read_text()
    assert "**Faults**" in report and "torchrun restarted every worker" in report
    assert "replica group 1 died" in report
    # the race's clock: the restart's down time is charged after the checkpoint
    charged = parse_run(ddp, "ddp").history()[-1][1] - ddp["eval_history"][-1]["train_time_s"]
    assert charged == pytest.approx(ddp["restarts"]["down_s"]
                                    + ddp["restarts"]["lost_train_s"], abs=1e-6)


@pytest.mark.dist
@needs_torchft
def test_a_group_that_heals_takes_the_jobs_clock(tmp_path: Path) -> None:
    """Every group dies once, so the job's record is one that came back: its clock and
    evaluations are the job's (taken from its peer when it healed), not restarted."""
    from train_helpers import flags

    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "gradzip", "train", "--ft", "2", "--parallel", "ddp",
           "--outer", "diloco", "--outer-codec", "int8", "--sync-every", "5",
           *flags(tmp_path / "cache", out, "--max-steps", "120", "--eval-every", "10",
                  "--ft-timeout", "10")]
    proc = subprocess.run(cmd, env={**os.environ, "RUST_LOG": "warn",
                                    "GRADZIP_KILL_AT": "1@30,0@70"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert len(job["ft_job"]["failures"]) == 2
    steps = [h["step"] for h in job["eval_history"]]
    assert steps[0] == 10 and steps[-1] == 120  # the evaluations before its death too
    times = [h["train_time_s"] for h in job["eval_history"]]
    assert times == sorted(times) and times[-1] == pytest.approx(job["train_time_s"])
    # one clock for the job: both groups end on it, each wait for a dead peer included
    ends = [json.loads((out / f"replica_{k}" / "results.jsonl").read_text().splitlines()[-1])
            ["train_time_s"] for k in (0, 1)]
    assert abs(ends[0] - ends[1]) < 1.0, ends
    assert min(ends) > sum(f["survivor_lost_s"] for f in job["ft_job"]["failures"])
    # and one position in the data: a group that healed reads on from its peer's batch
    # (not from where its own checkpoint, or the start, left it)
    import torch

    position = [{k: v for k, v in torch.load(
        next((out / f"replica_{k}" / "checkpoints").glob("step_*120")) / "rank0.pt",
        weights_only=False)["loader"].items() if k in ("epoch", "step")} for k in (0, 1)]
    assert position[0] == position[1], position
