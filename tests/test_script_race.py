"""``gradzip compare --script``: the user's own training script raced under torchrun.

The contract (``gradzip.integrations.script``): the method, seed and run directory in
the environment; ``gradzip.attach(model)`` without a spec; ``handle.log_eval`` and
``handle.close`` writing the record. The examples in ``examples/`` are raced for real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from event_helpers import FakeEvent
from test_results_schema import documented_fields

import gradzip
from gradzip.cli import main
from gradzip.comm.netns import netns_available
from gradzip.comm.stats import CommStats, Reduction
from gradzip.integrations.script import Launch, StepClock

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_launch_comes_from_the_environment(tmp_path: Path) -> None:
    assert Launch.from_env({}) is None
    env = {"GRADZIP_METHOD": " int8 ", "GRADZIP_SEED": "2", "GRADZIP_RUN_DIR": str(tmp_path),
           "GRADZIP_NODE_SIZE": "", "GRADZIP_START_STEP": "10"}
    assert Launch.from_env(env) == Launch("int8", 2, tmp_path, 0, 10)
    with pytest.raises(ValueError, match="GRADZIP_SEED must be an integer"):
        Launch.from_env({"GRADZIP_METHOD": "int8", "GRADZIP_SEED": "one"})


def test_attach_without_a_spec_outside_compare_says_what_to_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADZIP_METHOD", raising=False)
    with pytest.raises(ValueError, match="pass a spec"):
        gradzip.attach(torch.nn.Linear(2, 2))


def reduce_one(stats: CommStats) -> None:
    """What a hook records for one compressed bucket."""
    stats.record(Reduction(numel=2, sent_values=2, bytes_raw=8, bytes_by_op={"all_reduce": 2},
                           paths=["all_reduce"]))


def test_the_clock_tells_steps_apart_and_keeps_evaluation_off_it() -> None:
    model, stats = torch.nn.Linear(4, 4), CommStats()
    clock = StepClock(model, stats)
    x = torch.randn(2, 4)
    for _ in range(2):  # two micro-batches, one reduction: one step
        model(x).sum().backward()
    reduce_one(stats)
    model.eval()
    with torch.no_grad():
        model(x)  # the evaluation closes the step, and is not on the clock
        time_in_eval = clock.train_time_s
        model(x)
    assert clock.steps == 1 and clock.train_time_s == time_in_eval
    model.train()
    model(x).sum().backward()
    reduce_one(stats)
    model(x)  # the next step's forward closes this one
    assert clock.steps == 2 and stats.steps == 2
    assert stats.steady_bytes() == {"bytes_raw": 16, "bytes_wire": 4}
    model(x)  # no reduction since: the step stays open
    assert clock.steps == 2
    clock.close()
    assert clock.steps == 2  # nothing was reduced in the open step: not a step


@pytest.mark.parametrize("script_closes_steps", [False, True])
def test_a_script_that_closes_its_own_steps_keeps_the_clock(script_closes_steps: bool) -> None:
    """README's attach example calls ``handle.stats.end_step()`` every step: the clock
    still times every step, and the statistics' steps are closed once each."""
    model, stats = torch.nn.Linear(4, 4), CommStats()
    clock = StepClock(model, stats)
    x = torch.randn(2, 4)
    for _ in range(6):
        model(x).sum().backward()
        reduce_one(stats)
        if script_closes_steps:
            stats.end_step()
    clock.close()
    assert clock.steps == 6 and stats.steps == 6 and clock.train_time_s > 0
    assert stats.totals()["bytes_wire"] == 12


@pytest.mark.parametrize("argv, message", [
    (["--script", "no/such/train.py"], "no such file"),
    (["--script", str(EXAMPLES / "ddp_train.py"), "--model", "small"],
     "configure the built-in trainer"),
    (["--script-args", "--steps 3"], "--script-args needs --script"),
    (["--script", str(EXAMPLES / "ddp_train.py"), "--methods", "diloco(sync_every=4)"],
     "race them without --script"),
    (["--script", str(EXAMPLES / "ddp_train.py"), "--parallel", "hsdp"],
     "built-in trainer only"),
    (["--script", str(EXAMPLES / "ddp_train.py"), "--methods", "topk(ratio=7)"],
     "topk(ratio=7)"),
])
def test_bad_script_races_are_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        message: str) -> None:
    out = tmp_path / "race"
    assert main(["compare", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_train_options_pass_through_to_every_run(tmp_path: Path) -> None:
    from gradzip.cli import build_parser
    from gradzip.commands.compare import runs_of

    args = build_parser().parse_args([
        "compare", "--methods", "torch:fp16;int8", "--model", "small", "--lr", "0.002",
        "--max-tokens", "900000", "--train-args", "--warmup-steps 7", "--start-step", "20",
        "--out", str(tmp_path)])
    runs = runs_of(args)
    for r in runs:
        argv = r.argv(tmp_path, tmp_path)
        flags = " ".join(argv)
        assert "--model small" in flags and "--lr 0.002" in flags
        assert "--max-tokens 900000" in flags and "--warmup-steps 7" in flags
    assert "--codec-start-step" not in runs[0].argv(tmp_path, tmp_path)  # torch:fp16
    assert runs[1].compressed_from() == 20
    assert "--codec-start-step 20" in " ".join(runs[1].argv(tmp_path, tmp_path))


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_a_plain_ddp_script_is_raced(tmp_path: Path) -> None:
    out = tmp_path / "race"
    script = str(EXAMPLES / "ddp_train.py")
    rc = main(["compare", "--script", script, "--script-args", "--steps 30 --eval-every 10",
               "--methods", "torch:none;torch:fp16;ef | topk(ratio=0.05)", "--rate",
               "100mbit", "--out", str(out)])
    assert rc == 0
    records = _records(out)
    assert [r["compare"]["method"] for r in records] == [
        "torch:none", "torch:fp16", "ef | topk(ratio=0.05)"]
    shaped, _ = netns_available(shaping=True)
    for r in records:
        assert r["compare"]["shaped"] is shaped
        assert r["compare"]["train"][:2] == ["--script", script]
        assert r["model"] == "TinyLM" and r["world_size"] == 2 and r["steps"] == 30
        assert [h["step"] for h in r["eval_history"]] == [10, 20, 30]
        assert set(r) - {"compare"} <= documented_fields()  # the schema, as far as known
    none, fp16, topk = records
    assert none["codec_config"] == {"torch_hook": "allreduce_hook"}
    assert none["compression_ratio"] == 1.0
    assert 1.9 < fp16["compression_ratio"] <= 2.0 and topk["compression_ratio"] > 5
    assert none["compare"]["time_to_target_s"] is not None  # reaches its own target
    # the same seed starts from the same model: the first evaluation agrees closely
    assert abs(none["eval_history"][0]["val_loss"] - fp16["eval_history"][0]["val_loss"]) \
        < 0.05
    assert "torch:fp16" in (out / "report.md").read_text()
    # a rerun finds the runs by their script and arguments: nothing trains again
    rc = main(["compare", "--script", script, "--script-args", "--steps 30 --eval-every 10",
               "--methods", "torch:none;torch:fp16;ef | topk(ratio=0.05)", "--rate",
               "100mbit", "--out", str(out)])
    assert rc == 0 and [r["time"] for r in _records(out)] == [r["time"] for r in records]


@pytest.mark.dist
def test_a_hugging_face_trainer_script_is_raced(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    out = tmp_path / "race"
    rc = main(["compare", "--script", str(EXAMPLES / "hf_trainer.py"), "--script-args",
               "--steps 20 --eval-every 10", "--methods", "none;torch:fp16;int8;auto",
               "--rate", "none", "--out", str(out)])
    assert rc == 0
    records = _records(out)
    assert [r["compare"]["method"] for r in records] == ["none", "torch:fp16", "int8", "auto"]
    for r in records:
        assert r["model"] == "Qwen2ForCausalLM" and r["steps"] == 20
        assert [h["step"] for h in r["eval_history"]] == [10, 20]
        assert r["bytes_wire_total"] > 0 and r["train_time_s"] > 0
    assert records[2]["compression_ratio"] > 3  # int8 on the Trainer's DDP buckets
    assert records[0]["compare"]["time_to_target_s"] is not None
    # auto through the callback (GRADZIP_METHOD=auto): its trial decided at step 15
    decisions = records[3]["auto"]["decisions"]
    assert [d["from_step"] for d in decisions] == [15]
    assert set(decisions[0]["costs_ms"]) == {"fp16", "int8"}


def test_the_clock_counts_reductions_a_gpu_holds_until_the_step_settles() -> None:
    """On CUDA the chained path records its reductions only when the step closes (their
    times are CUDA events): held reductions must still close the step."""
    from gradzip.comm.stats import CommStats, Reduction

    stats = CommStats()
    held: list[Reduction] = []

    def settle() -> None:  # what PendingChecks.settle_timings does
        while held:
            stats.record(held.pop())
            stats.release()

    stats.add_settler(settle)
    model = torch.nn.Linear(4, 4)
    clock = StepClock(model, stats)
    model(torch.randn(2, 4)).sum().backward()
    held.append(Reduction(numel=20, sent_values=20, bytes_raw=80, paths=["all_reduce"]))
    stats.hold()
    assert stats.open_reductions() == 1
    model(torch.randn(2, 4))  # the next step closes this one
    assert clock.steps == 1 and stats.open_reductions() == 0
    assert stats.totals()["bytes_raw"] == 80


def test_the_chained_paths_timings_hold_their_reductions_until_the_step_settles() -> None:
    """CPU proxy of the CUDA chained path: ``EventTimings.later`` holds each reduction
    in the stats (the clock sees it) until ``settle`` records it with the events'
    times: the encode, the all-reduce and the decode each from its own pair."""
    from gradzip.comm.eventtimes import EventTimings
    from gradzip.comm.stats import CommStats, Reduction

    stats, timings = CommStats(), EventTimings()
    stats.add_settler(timings.settle)
    for start in (0.0, 10.0):
        encode, summed = FakeEvent(start + 3.0), FakeEvent(start + 4.0)
        timings.later(Reduction(numel=8, sent_values=8, bytes_raw=32,
                                calls_by_op={"all_reduce": 1}, paths=["all_reduce"]),
                      stats, span=(encode, summed), comm=(encode, summed),
                      encode=(FakeEvent(start), encode),
                      decode=(summed, FakeEvent(start + 6.0)))
    assert stats.open_reductions() == 2 and stats.totals()["bytes_raw"] == 0
    stats.end_step()
    assert stats.open_reductions() == 0
    totals = stats.totals()
    assert totals["bytes_raw"] == 64
    assert totals["comm_ms_by_op"]["all_reduce"] == pytest.approx(2.0)
    assert totals["encode_ms"] == pytest.approx(6.0)  # 3 ms each, not the host's enqueue
    assert totals["decode_ms"] == pytest.approx(4.0)


def test_a_cuda_step_closes_after_the_device_finished_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the host runs ahead of the GPU: the clock waits for the device once per
    step before it reads the time (a CPU model: the wait is a no-op, counted here)."""
    from gradzip.comm.stats import CommStats, Reduction
    from gradzip.integrations import script

    waits: list[int] = []
    monkeypatch.setattr(script, "wait_for_device", lambda module: waits.append(1))
    stats = CommStats()
    model = torch.nn.Linear(4, 4)
    clock = StepClock(model, stats)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        stats.record(Reduction(numel=20, sent_values=20, bytes_raw=80, paths=["all_reduce"]))
    clock.close()
    assert clock.steps == 3 and len(waits) == 3


def test_a_script_run_on_nodes_gets_the_node_size_and_a_flat_one_does_not(
        tmp_path: Path) -> None:
    from dataclasses import replace

    from gradzip.compare.matrix import Run

    run = Run("int8", 1, 4, "100mbit", link="nodes=2x2",
              script=(str(EXAMPLES / "ddp_train.py"),), start_step=5)
    env = run.env(tmp_path)
    assert env["GRADZIP_METHOD"] == "int8" and env["GRADZIP_SEED"] == "1"
    assert env["GRADZIP_NODE_SIZE"] == "2" and env["GRADZIP_START_STEP"] == "5"
    assert env["GRADZIP_RUN_DIR"] == str(tmp_path.resolve())
    assert replace(run, link="shared").env(tmp_path)["GRADZIP_NODE_SIZE"] == ""
    assert Run("torch:fp16", 0, 2, None, script=("x.py",),
               start_step=5).env(tmp_path)["GRADZIP_START_STEP"] == "0"
    assert Run("int8", 0, 2, None).env(tmp_path) == {}  # the built-in trainer: flags


def test_an_evaluation_after_training_ended_warns(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from gradzip.integrations.hf import GradzipCallback
    from gradzip.integrations.script import ScriptHandle

    callback = GradzipCallback(trainer=None)
    callback.handle = object.__new__(ScriptHandle)  # a closed launched handle
    callback.handle.record = {"steps": 3}
    with pytest.warns(UserWarning, match="not in the race's record"):
        callback.on_evaluate(None, None, None, metrics={"eval_loss": 2.0})


@pytest.mark.dist
def test_a_script_that_writes_no_record_is_a_clear_failure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "silent.py"
    script.write_text("import os\nassert os.environ['GRADZIP_METHOD'] == 'int8'\n")
    assert main(["compare", "--script", str(script), "--methods", "int8", "--rate", "none",
                 "--out", str(tmp_path / "race")]) == 1
    err = capsys.readouterr().err
    assert "exited cleanly but wrote no record" in err and "handle.close()" in err


@pytest.mark.dist
def test_a_script_that_closes_its_steps_is_timed_as_one_that_does_not(tmp_path: Path) -> None:
    """The race's clock does not depend on the script calling ``handle.stats.end_step()``
    (README's attach example does): the same steps are timed, the same bytes counted."""
    records = {}
    for close in (False, True):
        out = tmp_path / f"close-{close}"
        args = "--steps 24 --eval-every 12" + (" --close-steps" if close else "")
        assert main(["compare", "--script", str(EXAMPLES / "ddp_train.py"), "--script-args",
                     args, "--methods", "int8", "--rate", "none", "--out", str(out)]) == 0
        (records[close],) = _records(out)
    plain, closing = records[False], records[True]
    assert closing["steps"] == plain["steps"] == 24
    assert closing["timed_steps"] == plain["timed_steps"] == 24 - 5
    assert closing["bytes_wire_total"] == plain["bytes_wire_total"] > 0
    assert closing["compression_ratio_steady"] == plain["compression_ratio_steady"] > 3
    # a timing is not a test's verdict: only that neither lost its clock (the 10% bar is
    # measured in the note)
    assert closing["train_time_s"] > 0.3 * plain["train_time_s"] > 0


@pytest.mark.dist
def test_a_script_started_by_hand_writes_its_record_and_says_where(tmp_path: Path) -> None:
    """``GRADZIP_METHOD=int8 torchrun ... examples/ddp_train.py`` (the example's own
    docstring) outside compare: the record goes to runs/<script name>, said on stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADZIP_")}
    env["GRADZIP_METHOD"] = "int8"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", str(EXAMPLES / "ddp_train.py"), "--steps", "6", "--eval-every", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [record] = _records(tmp_path / "runs" / "ddp_train")
    assert record["method"] == "int8" and record["steps"] == 6
    assert "record was appended to runs/ddp_train/results.jsonl" in proc.stderr
