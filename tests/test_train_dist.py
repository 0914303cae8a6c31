"""The trainer on 2 gloo ranks under torchrun: exact resume with a codec, honest bytes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from train_helpers import flags, last_result, launch

pytestmark = pytest.mark.dist


def torchrun(*argv: str) -> None:
    """``torchrun --nproc_per_node 2 -m gradzip train ARGV``; fail with both ranks' output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*launch(2), "-m", "gradzip", "train", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"


def resume_matches(cache: Path, tmp: Path, *extra: str) -> tuple[dict, dict]:
    """Train 20 steps straight, and 10 + resume to 20; return both results records."""
    torchrun(*flags(cache, tmp / "a", "--max-steps", "20", "--eval-every", "0", *extra))
    torchrun(*flags(cache, tmp / "b", "--max-steps", "10", "--decay-steps", "20",
                    "--eval-every", "0", *extra))
    torchrun("--resume", "--out", str(tmp / "b"), "--max-steps", "20")
    return last_result(tmp / "a"), last_result(tmp / "b")


# slow: make test resumes DDP with error feedback (``ef | int8``) twice, bit for bit, in
# test_restart.py::test_a_rank_killed_twice_under_torchrun_finishes_with_the_same_weights
@pytest.mark.slow
def test_ddp_error_feedback_resume_equals_uninterrupted(cache: Path, tmp_path: Path) -> None:
    straight, resumed = resume_matches(cache, tmp_path, "--parallel", "ddp",
                                       "--codec", "ef | topk(ratio=0.01)")
    assert resumed["resumed_from_step"] == 10 and straight["world_size"] == 2
    # Error-feedback residuals, data positions and RNG all came back: identical losses.
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    assert straight["compression_ratio"] > 5 and straight["residual_norm"] > 0
    assert straight["bytes_wire_total"] < straight["bytes_raw_total"]
    assert (tmp_path / "a" / "logs" / "rank1.log").is_file()
    assert (tmp_path / "b" / "checkpoints" / "step_0000020" / "rank1.pt").is_file()


def test_plain_ddp_counts_every_all_reduce_byte(cache: Path, tmp_path: Path) -> None:
    torchrun(*flags(cache, tmp_path / "r", "--parallel", "ddp", "--max-steps", "5",
                    "--grad-accum", "2"))
    rec = last_result(tmp_path / "r")
    # One fp32 all-reduce of every gradient per optimizer step (no_sync skips the first
    # micro-batch): at 2 ranks a ring all-reduce sends its input once, so the link bytes
    # are 4 x parameters x steps plus gloo's per-call transport, and nothing is compressed.
    assert rec["bytes_raw_total"] == rec["bytes_wire_total"]
    assert 4 * rec["params"] * 5 < rec["bytes_wire_total"] < 1.05 * 4 * rec["params"] * 5
    assert rec["compression_ratio"] == 1.0
    # gradzip's ``none``: DDP's first step plain (buckets not yet rebuilt), then all-reduce
    assert rec["aggregation"]["plain"] >= 1 and rec["aggregation"]["all_reduce"] >= 4
    assert rec["compression_ratio_steady"] == 1.0 and rec["comm_time_ms_total"] > 0
    assert rec["comm_time_ms_total"] > 0 and list(rec["comm_time_ms_by_op"]) == ["all_reduce"]


@pytest.mark.slow
def test_fsdp_error_feedback_resume_equals_uninterrupted(cache: Path, tmp_path: Path) -> None:
    straight, resumed = resume_matches(cache, tmp_path, "--parallel", "fsdp",
                                       "--codec", "ef | topk(ratio=0.05)")
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    assert (tmp_path / "b" / "checkpoints" / "step_0000020" / "dcp").is_dir()


def test_diloco_resume_across_a_sync_boundary_equals_uninterrupted(
        cache: Path, tmp_path: Path) -> None:
    """--outer diloco with an int8 codec on the pseudo-gradients: 20 steps straight against
    10 + resume (mid-interval: syncs at 6, 12, 18); the same losses, bytes per sync."""
    straight, resumed = resume_matches(cache, tmp_path, "--parallel", "ddp", "--outer",
                                       "diloco", "--sync-every", "6", "--outer-codec", "int8")
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    outer = straight["outer"]
    assert (outer["kind"], outer["syncs"], outer["codec"]) == ("diloco", 3, "int8")
    # int8 pseudo-gradients: ~1 byte a value per sync, against 4 for the fp32 all-reduce
    assert outer["bytes_wire_per_sync"] < 1.2 * straight["params"]
    assert straight["bytes_raw_total"] / straight["bytes_wire_total"] > 3
    assert resumed["outer"]["syncs"] == 3  # counted since the run began, as steps are
    assert resumed["outer"]["bytes_wire_per_sync"] == pytest.approx(
        outer["bytes_wire_per_sync"], rel=0.01)  # 2 syncs' bytes over the 2 it ran


def test_streaming_diloco_fragments_resume_exactly(cache: Path, tmp_path: Path) -> None:
    """--fragments 2 (the tiny model's 2 blocks, one each) with H = 6 and 2 overlapped
    steps: fragment 1's exchanges start at 3, 9, 15 (applied at 5, 11, 17), fragment 0's
    at 6, 12, 18 (8, 14, 20); resumed at 10, with fragment 1's exchange in flight."""
    straight, resumed = resume_matches(cache, tmp_path, "--parallel", "ddp", "--outer",
                                       "diloco", "--sync-every", "6", "--fragments", "2",
                                       "--overlap-steps", "2", "--outer-codec", "ef | int8")
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    outer = straight["outer"]
    assert (outer["syncs"], outer["fragments"], outer["overlap_steps"]) == (6, 2, 2)
    # each exchange carries about half the model
    assert straight["outer"]["bytes_wire_per_sync"] < 0.7 * straight["params"]


def test_demo_trains_with_plain_sgd_through_the_trainer(cache: Path, tmp_path: Path) -> None:
    """--codec demo on 2 ranks with --optimizer sgd: the loss falls, and DeMo's packed
    top-k sends a fraction of the fp32 all-reduce's bytes (its 1-D tensors dominate)."""
    torchrun(*flags(cache, tmp_path / "d", "--parallel", "ddp", "--codec", "demo(topk=8)",
                    "--optimizer", "sgd", "--grad-clip", "0", "--lr", "0.002",
                    "--max-steps", "12", "--eval-every", "3"))
    final = last_result(tmp_path / "d")
    losses = [e["val_loss"] for e in final["eval_history"]]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert final["bytes_raw_total"] / final["bytes_wire_total"] > 5  # 11x on the tiny model


def test_snoo_resume_across_an_outer_step_equals_uninterrupted(
        cache: Path, tmp_path: Path) -> None:
    """--outer snoo: DDP every step, a Nesterov outer step at 6, 12, 18; its anchor and
    momentum survive the checkpoint at 10, and it sends exactly DDP's bytes."""
    straight, resumed = resume_matches(cache, tmp_path, "--parallel", "ddp", "--outer",
                                       "snoo", "--sync-every", "6")
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    assert straight["method"] == "snoo(sync_every=6, lr=0.7, momentum=0.9)"
    assert (straight["outer"]["kind"], straight["outer"]["syncs"]) == ("snoo", 3)
    assert straight["compression_ratio"] == 1.0 and straight["replicas_identical"]


def test_sparseloco_resume_and_its_bits_per_kept_value(cache: Path, tmp_path: Path) -> None:
    """SparseLoCo's codec (error feedback with decay, 64 of 4096, 2-bit values, ANS) on
    the pseudo-gradients every 6 steps: its residuals survive the checkpoint; the record
    splits the payload bits per kept value into indices and values."""
    from gradzip.comm.method import parse_method

    method = parse_method("sparseloco(sync_every=6)")
    straight, resumed = resume_matches(cache, tmp_path, "--parallel", "ddp",
                                       *method.train_flags())
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    assert straight["method"] == str(method) and straight["outer"]["kind"] == "sparseloco"
    bits = straight["bits_per_kept_value"]
    assert 6 < bits["indices"] < 14 and 2 < bits["values"] < 5, bits
    assert 0.012 < straight["density"] < 0.03 and straight["residual_norm"] > 0
    # ~1.6% of the values at ~13 bits against fp32: well over 100x per sync
    assert straight["bytes_raw_total"] / straight["bytes_wire_total"] > 100
    assert straight["replicas_identical"]


def test_a_usage_error_under_torchrun_is_said_once(tmp_path: Path) -> None:
    """A bad spec stops every rank; the error is printed once (local rank 0), with a
    line saying that the launcher's report adds nothing."""
    cmd = [*launch(2), "-m", "gradzip", "train", "--parallel", "ddp", "--codec",
           "ef | tpok(ratio=0.01)", "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("unknown codec stage 'tpok'") == 1, proc.stderr
    assert "every rank stopped on this error" in proc.stderr


def test_train_nproc_checks_before_any_rank_starts_then_launches(cache: Path,
                                                                  tmp_path: Path) -> None:
    from gradzip.cli import main

    bad = subprocess.run([*launch(1)[:2], "gradzip", "train", "--nproc", "2", "--parallel",
                          "ddp", "--codec", "ef | tpok(ratio=0.01)"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "unknown codec stage 'tpok'" in bad.stderr
    assert main(["train", "--nproc", "2", "--parallel", "none", "--codec", "none"]) == 2
    good = subprocess.run([*launch(1)[:2], "gradzip", "train", "--nproc=2", *flags(
        cache, tmp_path / "run", "--parallel", "ddp", "--max-steps", "2", "--eval-every", "0")],
        capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr[-2000:]
    assert last_result(tmp_path / "run")["world_size"] == 2


def test_eval_of_a_two_rank_checkpoint_prints_its_recorded_loss(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gradzip eval --ckpt`` reads the batches each of the run's 2 ranks read at its
    end and averages them as they did: the recorded val_loss, to 1e-4."""
    import json

    from gradzip.cli import main

    torchrun(*flags(cache, tmp_path / "run", "--parallel", "ddp", "--max-steps", "4",
                    "--eval-every", "0", "--eval-steps", "3"))
    recorded = last_result(tmp_path / "run")["val_loss"]
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(tmp_path / "run"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert abs(result["val_loss"] - recorded) < 1e-4, (result, recorded)
    assert (result["ranks"], result["batches"]) == (2, 6)
    assert main(["eval", "--ckpt", str(tmp_path / "run")]) == 0
    assert "the run's evaluation: 2 rank(s) x 3 batches" in capsys.readouterr().out
