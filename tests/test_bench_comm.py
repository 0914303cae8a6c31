"""``gradzip bench comm``: pairing gradzip's rows with PyTorch's hooks, and a tiny real run."""

import json
from types import SimpleNamespace

import pytest

from gradzip.bench import comm
from gradzip.cli import main


def test_pairs_by_algorithm_not_by_spelling():
    pairs = comm.pair_rows(
        ["none", "fp16", "bf16", "ef|powersgd(rank=4)", "ef | powersgd(rank=2)",
         "ef | topk(ratio=0.01)", "efsignsgd"],
        ["torch:none", "torch:fp16", "torch:bf16", "torch:powersgd(rank=4)"],
    )
    assert pairs == {
        "none": "torch:none", "fp16": "torch:fp16", "bf16": "torch:bf16",
        "ef|powersgd(rank=4)": "torch:powersgd(rank=4)",
        "ef | powersgd(rank=2)": None,  # no PyTorch row at rank 2 was run
        "ef | topk(ratio=0.01)": None, "efsignsgd": None,
    }


def test_powersgd_without_error_feedback_is_not_pytorchs_algorithm():
    assert comm.pair_rows(["powersgd(rank=4)"], ["torch:powersgd(rank=4)"]) == {
        "powersgd(rank=4)": None}


def test_default_torch_rows_are_the_counterparts_of_the_specs():
    assert comm.default_torch_methods(comm.DEFAULT_SPECS) == [
        "torch:none", "torch:fp16", "torch:bf16", "torch:powersgd(rank=4)"]
    assert comm.default_torch_methods(["ef | powersgd(rank=2)", "qsgd"]) == [
        "torch:powersgd(rank=2)"]


def test_unknown_torch_method_is_refused():
    with pytest.raises(ValueError, match="torch:powersgd"):
        comm.torch_equivalent("torch:qsgd")


def test_comparisons_and_table():
    rows = [
        {"method": "compute-only", "params": 10, "buckets": 0, "step_ms": 10.0},
        {"method": "torch:none", "params": 10, "buckets": 2, "step_ms": 20.0},
        {"method": "torch:bf16", "params": 10, "buckets": 2,
         "unsupported": "not supported on gloo"},
        {"method": "torch:powersgd(rank=4)", "params": 10, "buckets": 1, "step_ms": 30.0,
         "note": "one bucket"},
        {"method": "none", "params": 10, "buckets": 2, "step_ms": 25.0,
         "encode_decode_ms": 0.1, "comm_ms": 5.0, "ratio": 1.0},
        {"method": "bf16", "params": 10, "buckets": 2, "step_ms": 15.0,
         "encode_decode_ms": 1.0, "comm_ms": 5.0, "ratio": 2.0},
        {"method": "ef | powersgd(rank=4)", "params": 10, "buckets": 2, "step_ms": 15.0,
         "encode_decode_ms": 1.0, "comm_ms": 5.0, "ratio": 50.0},
    ]
    comm.add_comparisons(rows)
    by = {r["method"]: r for r in rows}
    assert by["none"]["vs_torch"] == pytest.approx(1.25)
    assert by["none"]["vs_compute_only"] == pytest.approx(2.5)
    assert by["torch:none"]["vs_compute_only"] == pytest.approx(2.0)
    assert by["ef | powersgd(rank=4)"]["vs_torch"] == pytest.approx(0.5)
    assert "vs_torch" not in by["bf16"]
    args = SimpleNamespace(ranks=2, batch=4, steps=2, warmup=1, one_bucket=False,
                           bucket_cap_mb=None, link_note=None)
    table = comm.format_table(rows, args)
    assert "| `torch:bf16` | 2 | not supported on gloo |" in table
    assert "- (torch:bf16: not supported on gloo)" in table
    assert ("| `ef \\| powersgd(rank=4)` | 2 | 15.0 | 1.50x "
            "| 0.50x (torch:powersgd(rank=4), 1 vs 2 buckets)") in table
    assert "1.25x (torch:none) |" in table
    assert "`torch:powersgd(rank=4)` *" in table
    assert "\\* torch:powersgd(rank=4): one bucket" in table


def test_vs_torch_is_the_median_of_per_step_ratios():
    """Interleaved steps pair up: a slow round slows both rows and cancels out."""
    rows = [
        {"method": "torch:none", "params": 1, "buckets": 1, "step_ms": 20.0,
         "step_times_ms": [10.0, 20.0, 40.0]},
        {"method": "none", "params": 1, "buckets": 1, "step_ms": 22.0,
         "step_times_ms": [11.0, 22.0, 100.0], "encode_decode_ms": 0.0, "comm_ms": 0.0,
         "ratio": 1.0},
    ]
    comm.add_comparisons(rows)
    assert rows[1]["vs_torch"] == pytest.approx(1.1)  # ratios 1.1, 1.1, 2.5
    assert comm.paired_ratio({"step_ms": 3.0}, {"step_ms": 2.0}) == pytest.approx(1.5)


def test_rate_reinvokes_the_same_command_without_rate():
    args = main.__globals__["build_parser"]().parse_args(
        ["bench", "comm", "--rate", "100mbit", "--one-bucket", "--steps", "4", "--spec", "fp16",
         "--spec", "torch:powersgd(rank=2)"])
    argv = comm._netns_argv(args)
    assert "--rate" not in argv and "--one-bucket" in argv
    assert argv[argv.index("--steps") + 1] == "4"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--spec"] == [
        "fp16", "torch:powersgd(rank=2)"]


@pytest.mark.dist
def test_tiny_real_run(capsys):
    rc = main(["bench", "comm", "--width", "32", "--depth", "2", "--batch", "4", "--steps", "2",
               "--warmup", "3", "--bucket-cap-mb", "0.001", "--spec", "none", "--spec", "fp16",
               "--spec", "bf16", "--spec", "ef | powersgd(rank=2)", "--json"])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["compute-only", "torch:none", "torch:fp16", "torch:bf16",
                          "torch:powersgd(rank=2)", "none", "fp16", "bf16",
                          "ef | powersgd(rank=2)"]
    assert rows["torch:bf16"]["unsupported"] == "not supported on gloo"
    assert rows["none"]["buckets"] > 1  # the tiny cap makes several buckets ...
    assert rows["torch:powersgd(rank=2)"]["buckets"] == 1  # ... but PowerSGD gets one
    assert "one bucket" in rows["torch:powersgd(rank=2)"]["note"]
    for name in ["compute-only", "torch:none", "torch:fp16", "torch:powersgd(rank=2)", "none",
                 "fp16", "bf16"]:
        assert rows[name]["step_ms"] > 0
    assert rows["none"]["torch_pair"] == "torch:none" and rows["none"]["vs_torch"] > 0
    assert rows["fp16"]["ratio"] > 1.5
    assert rows["torch:fp16"]["payload_ratio"] == pytest.approx(2.0)
    assert "payload_ratio" not in rows["torch:none"]  # its C++ all-reduce isn't counted
    assert rows["ef | powersgd(rank=2)"]["torch_pair"] == "torch:powersgd(rank=2)"
    assert rows["bf16"]["torch_pair_missing"] == "not supported on gloo"
