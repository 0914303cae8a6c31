"""The training loop in one process: learning, exact resume, checkpoints, records, commands."""

from __future__ import annotations

import json
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
from train_helpers import flags, last_result

from gradzip.cli import main
from gradzip.train.config import OptimConfig
from gradzip.train.loop import lr_at


def train(cache: Path, out: Path, *extra: str) -> dict:
    assert main(["train", *flags(cache, out, *extra)]) == 0
    return last_result(out)


def logged(run_dir: Path, key: str) -> list[float]:
    """The values of one metric in rank 0's log, in step order."""
    rows = [json.loads(line) for line in (run_dir / "logs" / "rank0.log").read_text().splitlines()
            if line.startswith("{")]  # the JSON lines; the others are the human-readable log
    return [r[key] for r in rows if key in r]


def test_lr_schedule_warmup_cosine_floor() -> None:
    o = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(5, o, 110) == 0.5 and lr_at(10, o, 110) == 1.0
    assert lr_at(60, o, 110) == pytest.approx(0.55)  # halfway down the cosine
    assert lr_at(110, o, 110) == pytest.approx(0.1) and lr_at(500, o, 110) == pytest.approx(0.1)
    o.decay_steps = 210  # the schedule of a longer run, trained in pieces
    assert lr_at(110, o, 110) == pytest.approx(0.55)


def test_tiny_model_learns_and_writes_a_complete_run_dir(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rec = train(cache, out, "--max-steps", "30", "--eval-every", "10", "--tensorboard",
                "--results-file", str(tmp_path / "shared.jsonl"), "--target-loss", "50")
    losses = logged(out, "loss/train")
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    assert rec["val_loss"] < math.log(384)  # better than uniform over the vocabulary
    # the target 50 is met at the first evaluation (step 10 of 30), before the run ends
    assert 0 < rec["time_to_target_s"] < rec["train_time_s"]
    for key in ("run_name", "world_size", "model", "dataset", "seq_len", "batch_size", "codec",
                "codec_config", "seed", "train_loss", "step_time_ms_mean", "step_time_ms_p50",
                "step_time_ms_p90", "tokens_per_s", "comm_time_ms_total", "comm_ratio",
                "comm_time_ms_by_op", "bytes_raw_total", "bytes_wire_total",
                "compression_ratio", "val_loss", "val_ppl", "encode_ms", "decode_ms",
                "extra_collectives", "index_bytes", "density", "residual_norm",
                "grad_rel_error", "grad_cos_sim", "mem_peak", "time_to_target_s",
                "git_commit", "gradzip_source", "torch_version", "device"):
        assert key in rec, key
    assert rec["world_size"] == 1 and rec["timed_steps"] == 27 and rec["mem_peak"] > 0
    shared = (tmp_path / "shared.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in shared] == [rec]  # the shared file got the same line
    for path in ("config.json", "tokenizer.json", "logs/rank0.log", "plots/loss.png",
                 "checkpoints/step_0000030/model.pt"):
        assert (out / path).exists(), path
    assert list((out / "tb").glob("events.out.tfevents.*"))


def test_resume_equals_uninterrupted_run(cache: Path, tmp_path: Path) -> None:
    straight = train(cache, tmp_path / "a", "--max-steps", "20", "--eval-every", "0")
    train(cache, tmp_path / "b", "--max-steps", "10", "--decay-steps", "20",
          "--eval-every", "0", "--ckpt-every", "5", "--keep-ckpts", "1")
    assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["step_0000010"]
    assert main(["train", "--resume", "--out", str(tmp_path / "b"), "--max-steps", "20"]) == 0
    resumed = last_result(tmp_path / "b")
    assert resumed["resumed_from_step"] == 10 and resumed["steps"] == 20
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]


def test_bf16_grad_accum_and_max_time(cache: Path, tmp_path: Path) -> None:
    rec = train(cache, tmp_path / "r", "--dtype", "bf16", "--grad-accum", "2",
                "--max-steps", "50", "--max-time", "1e-9", "--target-loss", "0.01")
    # any step takes longer than a nanosecond: the run stops (and saves) after step 1
    assert rec["steps"] == 1 and rec["global_batch_tokens"] == 2 * 4 * 32
    assert rec["target_loss"] == 0.01 and rec["time_to_target_s"] is None  # not reached
    assert math.isfinite(rec["train_loss"])
    assert (tmp_path / "r" / "checkpoints" / "step_0000001" / "meta.json").is_file()


def test_profiler_writes_traces_and_summary(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    # steps 4-5: DDP's bucket rebuild (its own broadcasts) is over by then
    train(cache, out, "--max-steps", "5", "--profile", "--profile-steps", "4:5",
          "--parallel", "ddp", "--codec", "ef | topk(ratio=0.1)")
    assert list((out / "profile").glob("rank0*.pt.trace.json"))
    summary = (out / "profile" / "summary_rank0.txt").read_text()
    assert "communication" in summary and "backward" in summary
    # the codec's collectives run on gradzip's communication thread: recorded too
    assert "allgather" in summary
    assert "broadcast" not in summary  # DDP does not re-send the RoPE table every forward


def test_eval_and_generate_commands(cache: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    rec = train(cache, out, "--max-steps", "4")
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # by default the batches the run evaluated at its end: the same loss
    assert result["val_loss"] == pytest.approx(rec["val_loss"], rel=1e-6)
    assert result["recorded_val_loss"] == rec["val_loss"] and result["selection"] == "run"
    assert main(["eval", "--ckpt", str(out), "--whole-split", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["selection"] == "split" and whole["batches"] >= result["batches"]
    assert main(["eval", "--ckpt", str(out), "--split", "train", "--steps", "1"]) == 0
    assert "train loss" in capsys.readouterr().out
    other = tmp_path / "other.txt"  # any text: evaluated whole, with the run's tokenizer
    other.write_text(Path(json.__file__).read_text())
    assert main(["eval", "--ckpt", str(out), "--dataset", str(other), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "all" and result["batches"] > 1 and result["val_loss"] > 0
    assert main(["generate", "--ckpt", str(out), "--prompt", "def f(", "--max-new-tokens",
                 "5", "--num-samples", "2"]) == 0
    text = capsys.readouterr().out
    assert text.count("def f(") == 2


def test_run_directory_mistakes_are_clear_errors(cache: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    train(cache, out, "--max-steps", "2")
    capsys.readouterr()
    assert main(["train", *flags(cache, out, "--max-steps", "2")]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "2"]) == 2
    assert "raise --max-steps" in capsys.readouterr().err
    assert main(["train", *flags(cache, tmp_path / "x", "--codec", "topk(ratio=0.1)")]) == 2
    assert "needs --parallel ddp or fsdp" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(tmp_path / "nothing")]) == 2
    assert "no such run or checkpoint" in capsys.readouterr().err


def test_damaged_checkpoints_are_clear_errors(cache: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    train(cache, out, "--max-steps", "2", "--decay-steps", "4")
    ckpt = out / "checkpoints" / "step_0000002"
    backup = tmp_path / "backup"
    shutil.copytree(ckpt, backup)
    (ckpt / "rank0.pt").unlink()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "4"]) == 2
    assert "missing" in capsys.readouterr().err
    (ckpt / "meta.json").write_text("{not json")
    assert main(["eval", "--ckpt", str(ckpt)]) == 2
    assert "unreadable checkpoint metadata" in capsys.readouterr().err
    shutil.rmtree(ckpt)
    shutil.copytree(backup, ckpt)
    (ckpt / "model.pt").unlink()
    assert main(["generate", "--ckpt", str(out), "--prompt", "x"]) == 2
    assert "missing" in capsys.readouterr().err


def test_a_crashed_save_is_never_resumed_from_and_is_cleaned_up(cache: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(cache, out, "--max-steps", "2", "--decay-steps", "4", "--eval-every", "0")
    ckpts = out / "checkpoints"
    # A save killed midway leaves its temp directory (model written, meta.json not yet).
    crashed = ckpts / ".tmp-step_0000003"
    crashed.mkdir()
    shutil.copy(ckpts / "step_0000002" / "model.pt", crashed / "model.pt")
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "4"]) == 0
    assert last_result(out)["resumed_from_step"] == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000002", "step_0000004"]


@pytest.mark.parametrize("source,match", [("missing.txt", "not found"),
                                          ("bad.jsonl", "malformed JSON")])
def test_missing_and_malformed_data_are_clear_errors(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str,
        match: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    argv = flags(cache, tmp_path / "run", "--max-steps", "2")
    argv[argv.index("stdlib")] = str(tmp_path / source)
    assert main(["train", *argv]) == 2
    assert match in capsys.readouterr().err


def test_codec_in_one_process_and_resume_with_another_codec(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    # --parallel ddp without torchrun: a 1-rank group, so a codec runs end to end
    rec = train(cache, out, "--parallel", "ddp", "--codec", "ef | topk(ratio=0.1)",
                "--max-steps", "3", "--decay-steps", "6", "--diagnose")
    assert rec["world_size"] == 1 and rec["codec_config"][1]["name"] == "topk"
    # one rank: nothing crosses a link, and the record says so instead of a ratio
    assert rec["bytes_wire_total"] == rec["bytes_raw_total"] == 0
    # --diagnose compares with the exact mean gradient: top-10% loses some of it
    assert 0 < rec["grad_rel_error"] < 1 and 0 < rec["grad_cos_sim"] < 1
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "6",
                 "--codec", "topk(ratio=0.2)"]) == 2
    assert "was written with codec" in capsys.readouterr().err


def test_wandb_logs_offline_without_a_key(cache: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}
    fake = types.ModuleType("wandb")  # wandb is not a dependency: a stand-in records the calls
    fake.init = lambda **kw: calls["init"].append(kw) or fake
    fake.log = lambda data, step: calls["log"].append((step, data))
    fake.finish = lambda: calls["finish"].append(True)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key either
    train(cache, tmp_path / "run", "--max-steps", "5", "--decay-steps", "10", "--wandb",
          "--wandb-project", "p")
    (init,) = calls["init"]
    assert init["mode"] == "offline" and init["project"] == "p"
    assert init["config"]["train"]["max_steps"] == 5
    assert [step for step, _ in calls["log"]] == [5, 5]  # train metrics, then val metrics
    assert "loss/train" in calls["log"][0][1] and calls["finish"] == [True]
    # --resume continues the same W&B run: the same id, resume allowed, later steps
    assert main(["train", "--resume", "--out", str(tmp_path / "run"), "--max-steps", "10"]) == 0
    first, again = calls["init"]
    assert again["id"] == first["id"] and again["resume"] == "allow"
    assert [step for step, _ in calls["log"]] == [5, 5, 10, 10]


def test_wandb_requested_but_missing_is_a_clear_error(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes ``import wandb`` fail
    assert main(["train", *flags(cache, tmp_path / "run", "--max-steps", "2", "--wandb")]) == 2
    assert "pip install wandb" in capsys.readouterr().err


def test_codec_policy_flags(cache: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """--codec-groups leaves the norms uncompressed, --codec-start-step delays the codec;
    the record carries the whole policy. Bad groups fail before any work."""
    rec = train(cache, tmp_path / "run", "--parallel", "ddp", "--codec", "ef | topk(ratio=0.1)",
                "--codec-groups", "*norm*=none", "--codec-start-step", "2", "--max-steps", "3")
    assert rec["codec_config"] == {
        "codec": "ef | topk(ratio=0.1)", "start_step": 2,
        "groups": [{"params": ["*norm*"], "codec": "none"}]}
    argv = flags(cache, tmp_path / "bad", "--parallel", "ddp", "--codec", "qsgd",
                 "--codec-groups", "*norm*", "--max-steps", "2")
    assert main(["train", *argv]) == 2
    assert "PATTERNS=SPEC" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("extra", [["--val-fraction", "0"], ["--max-tokens", "3000"]])
def test_no_validation_data_trains_without_evaluation(cache: Path, tmp_path: Path,
                                                      extra: list[str]) -> None:
    """What the data error message recommends (--val-fraction 0) and a tiny dataset
    whose validation split has no full batch: the run ends, checkpoints, and says so."""
    out = tmp_path / "r"
    rec = train(cache, out, "--max-steps", "5", "--eval-every", "2", *extra)
    assert rec["steps"] == 5 and rec["val_loss"] is None and rec["val_ppl"] is None
    assert rec["evaluation"].startswith("skipped: ")
    assert (out / "checkpoints" / "step_0000005" / "meta.json").is_file()
    assert "training without evaluation" in (out / "logs" / "rank0.log").read_text()


def test_every_record_is_strict_json_even_when_no_step_is_timed(cache: Path,
                                                                tmp_path: Path) -> None:
    """Steps <= --timing-warmup leave the timing statistics empty: null, never NaN."""
    out = tmp_path / "r"
    rec = train(cache, out, "--max-steps", "2", "--timing-warmup", "5",
                "--ppl-budget-s", "1e-9")
    line = (out / "results.jsonl").read_text().splitlines()[-1]
    strict = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in results.jsonl"))
    assert strict == rec and rec["timed_steps"] == 0
    assert rec["step_time_ms_p50"] is None and rec["tokens_per_s"] is None
    # the budget is reached after step 1: evaluated there, at a fixed training time
    assert rec["ppl_at_fixed_time_step"] == 1 and rec["ppl_at_fixed_time"] > 1
    assert rec["nonfinite_grad_steps"] == 0 and rec["clipped_steps"] >= 0
