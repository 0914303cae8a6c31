"""``gradzip train`` across nodes on 4 gloo ranks as 2 nodes x 2 (``--node-size 2``):
HSDP (``--parallel hsdp``) and hierarchical DDP (``--parallel ddp --hierarchical``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from train_helpers import flags, last_result, launch

pytestmark = pytest.mark.dist


def _train(cache: Path, out: Path, *extra: str, parallel: str = "hsdp") -> dict:
    argv = [*launch(4), "-m", "gradzip", "train",
            *flags(cache, out, "--parallel", parallel, "--node-size", "2", "--max-steps", "4",
                   "--eval-every", "0", *extra)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_result(out)


def test_hsdp_none_is_fsdps_native_hsdp(cache: Path, tmp_path: Path) -> None:
    rec = _train(cache, tmp_path / "none")
    # FSDP2's own collectives, counted from outside: the shard reduce-scatter and the
    # replicate all-reduce, each as the link model counts it
    assert set(rec["links"]) == {"shard", "replicate"}
    assert rec["bytes_wire_total"] == rec["bytes_raw_total"] > 0
    assert set(rec["comm_time_ms_by_op"]) == {"reduce_scatter", "all_reduce"}
    assert rec["val_loss"] is not None


def test_a_node_size_that_does_not_divide_the_world_is_refused(cache: Path,
                                                               tmp_path: Path) -> None:
    argv = [*launch(4), "-m", "gradzip", "train",
            *flags(cache, tmp_path / "bad", "--parallel", "hsdp", "--node-size", "3",
                   "--max-steps", "2", "--codec", "int8")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "must divide the world size" in proc.stderr


def test_hierarchical_ddp_compresses_between_nodes_only(cache: Path, tmp_path: Path) -> None:
    rec = _train(cache, tmp_path / "hier", "--hierarchical", "--codec", "int8",
                 parallel="ddp")
    links = rec["links"]
    assert set(links) == {"intra_node", "inter_node"}
    assert links["inter_node"]["compression_ratio"] > 3.5
    assert links["intra_node"]["compression_ratio"] == pytest.approx(1.0)
    assert rec["replicas_identical"] is True


def test_hierarchical_auto_records_the_choice_of_each_link(cache: Path,
                                                          tmp_path: Path) -> None:
    rec = _train(cache, tmp_path / "hier-auto", "--hierarchical", "--codec",
                 "auto(trial_steps=2, every=8)", "--max-steps", "9", parallel="ddp")
    assert set(rec["links"]) == {"intra_node", "inter_node"}
    assert rec["links"]["intra_node"]["compression_ratio"] == pytest.approx(1.0)
    auto = rec["auto"]
    assert auto["links"] == {"intra_node": "none", "inter_node": auto["current"]}
    assert auto["decisions"] and 0.0 <= auto["overhead"]["fraction"] < 1.0
    assert rec["replicas_identical"] is True


def test_hsdp_auto_chooses_for_the_replicate_link(cache: Path, tmp_path: Path) -> None:
    rec = _train(cache, tmp_path / "hsdp-auto", "--codec", "auto(trial_steps=2, every=8)",
                 "--max-steps", "9")
    assert set(rec["links"]) == {"shard", "replicate"}
    assert rec["links"]["shard"]["compression_ratio"] == pytest.approx(1.0)
    auto = rec["auto"]
    assert auto["links"] == {"shard": "none", "replicate": auto["current"]}
    [decision] = auto["decisions"]  # one controller step per training step
    assert decision["from_step"] == 7 and set(decision["costs_ms"]) == {"fp16", "int8"}


def test_hsdp_records_each_link_and_resumes_exactly(cache: Path, tmp_path: Path) -> None:
    """The record has each link, the replicate one compressed; and 8 steps straight
    against 4 + resume: the replicate link's error-feedback residuals (in each rank's
    checkpoint state) and the DCP shards come back exactly."""
    codec = ("--codec", "ef | topk(ratio=0.05)")
    straight = _train(cache, tmp_path / "a", *codec, "--max-steps", "8")
    links = straight["links"]
    assert set(links) == {"replicate", "shard"}
    assert links["replicate"]["compression_ratio"] > 3
    # uncompressed; its wire also carries the non-finite agreement (a 4-byte all-reduce
    # per unit and step: under 1% on this small model)
    assert links["shard"]["compression_ratio"] == pytest.approx(1.0, rel=0.01)
    assert straight["bytes_wire_total"] == sum(v["bytes_wire"] for v in links.values())
    assert straight["compression_ratio"] < links["replicate"]["compression_ratio"]
    assert straight["world_size"] == 4 and straight["val_loss"] is not None
    _train(cache, tmp_path / "b", *codec, "--max-steps", "4", "--decay-steps", "8")
    proc = subprocess.run([*launch(4), "-m", "gradzip", "train", "--resume", "--out",
                           str(tmp_path / "b"), "--max-steps", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = last_result(tmp_path / "b")
    assert resumed["resumed_from_step"] == 4
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
