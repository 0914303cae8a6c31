"""``gradzip compare``: the race harness, end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_results_schema import documented_compare_fields

from gradzip.cli import main
from gradzip.comm.netns import netns_available
from gradzip.compare.matrix import PRESETS, Run, plan


def test_plan_orders_settings_then_seeds_then_methods() -> None:
    runs = plan(["a", "b"], ["100mbit", None], [2], 2, ("--model", "tiny"))
    assert [(r.rate, r.seed, r.method) for r in runs] == [
        ("100mbit", 0, "a"), ("100mbit", 0, "b"), ("100mbit", 1, "a"), ("100mbit", 1, "b"),
        (None, 0, "a"), (None, 0, "b"), (None, 1, "a"), (None, 1, "b")]
    assert Run("ef | topk(ratio=0.01)", 1, 2, "100mbit").slug == \
        "100mbit-w2/ef_topk_ratio=0.01/seed1"
    assert Run("int8", 0, 4, "1gbit", link="per-rank").slug == "1gbit-w4-per-rank/int8/seed0"
    assert "torch:none" in PRESETS["quick"].methods  # the race includes PyTorch's own


def test_a_bad_spec_fails_before_any_training(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "race"
    assert main(["compare", "--methods", "none;topk(ratio=7)", "--out", str(out)]) == 2
    assert "topk(ratio=7)" in capsys.readouterr().err
    assert not out.exists()  # nothing trained, nothing written


@pytest.mark.parametrize("argv, says", [
    (["--rate", "1gbit>25mbit"], "needs '@SECONDS'"),
    (["--rate", "1gbit@60>25mbit", "--link", "per-rank"], "shapes the shared link"),
])
def test_a_bad_rate_schedule_fails_before_any_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    out = tmp_path / "race"
    assert main(["compare", "--methods", "fp16;int8", *argv, "--out", str(out)]) == 2
    assert says in capsys.readouterr().err and not out.exists()


@pytest.mark.dist
def test_race_of_two_methods_writes_records_report_and_plots(tmp_path: Path) -> None:
    """2 ranks, a few steps, shaped to 100 Mbit/s where namespaces work (else unshaped,
    and the records say so)."""
    out = tmp_path / "race"
    rc = main(["compare", "--methods", "torch:none;ef | topk(ratio=0.05)", "--rate", "100mbit",
               "--steps", "12", "--out", str(out)])
    assert rc == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["compare"]["method"] for r in records] == ["torch:none", "ef | topk(ratio=0.05)"]
    shaped, _ = netns_available(shaping=True)
    for r in records:
        c = r["compare"]
        assert c["shaped"] is shaped and c["rate"] == "100mbit" and c["ranks"] == 2
        if shaped:
            assert 0.5e8 < c["achieved_rate_bits_per_s"] < 1.5e8
            assert "shared by all ranks" in c["link_model"]
        assert set(c) == documented_compare_fields()  # docs/results.md lists each field
        assert c["unmeasured"] is None
        assert r["eval_history"] and r["bytes_wire_total"] > 0
    baseline = records[0]
    assert baseline["codec_config"] == {"torch_hook": "allreduce_hook"}  # PyTorch's own
    assert baseline["compare"]["time_to_target_s"] is not None  # reaches its own target
    assert baseline["compression_ratio"] == 1.0 and records[1]["compression_ratio"] > 2
    report = (out / "report.md").read_text()
    assert "ef \\| topk(ratio=0.05)" in report or "ef | topk(ratio=0.05)" in report
    pngs = list(out.glob("*.png"))
    assert len(pngs) >= 4 and all(p.stat().st_size > 1000 for p in pngs)
    # a rerun into the same --out keeps both records (runs nothing again) and runs only
    # the method it adds; the report covers the three
    rc = main(["compare", "--methods", "torch:none;ef | topk(ratio=0.05);fp16", "--rate",
               "100mbit", "--steps", "12", "--out", str(out)])
    assert rc == 0
    again = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["compare"]["method"] for r in again] == ["torch:none", "ef | topk(ratio=0.05)",
                                                       "fp16"]
    assert [r["time"] for r in again[:2]] == [r["time"] for r in records]  # not rerun
    assert "fp16" in (out / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--rate", "fast"], "--rate 'fast'"),
    (["--rate", "100mbps"], "bytes per second"),
    (["--ranks", "two"], "--ranks must be integers"),
    (["--seeds", "0"], "--ranks and --seeds must be >= 1"),
    (["--link", "nic"], "--link must be shared, per-rank, nodes=NxL"),
    (["--replicas", "2", "--rate", "none"], "replicas model a link of fixed --rate"),
    (["--replicas", "2", "--ranks", "2"], "--replicas W is --link replicas --ranks W"),
    (["--replicas", "eight"], "--replicas must be integers"),
    (["--link", "nodes=2"], "nodes=NxL (N nodes of L ranks"),
    (["--link", "nodes=1x1"], "nodes=NxL"),
    (["--methods", "torch:qsgd"], "unknown PyTorch hook"),
])
def test_bad_options_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      argv: list[str], message: str) -> None:
    assert main(["compare", *argv, "--out", str(tmp_path / "race")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "race").exists()


def test_dry_run_lists_the_matrix_and_trains_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "race"
    assert main(["compare", "--preset", "quick", "--rate", "100mbit,none", "--seeds", "2",
                 "--dry-run", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 2 * len(PRESETS["quick"].methods)
    assert lines[0].startswith("100mbit  shared link  2 ranks  seed 0  torch:none")
    assert not out.exists()


def test_per_rank_runs_start_each_rank_without_torchrun() -> None:
    shared, per_rank = (Run("int8", 0, 2, "100mbit", ("--model", "tiny"), link)
                        for link in ("shared", "per-rank"))
    assert "torch.distributed.run" in shared.argv(Path("o"), Path("c"))
    argv = per_rank.argv(Path("o"), Path("c"))
    assert "torch.distributed.run" not in argv  # rank_links sets RANK etc. itself
    assert argv[1:4] == ["-m", "gradzip", "train"]


@pytest.mark.dist
def test_race_on_per_rank_links(tmp_path: Path) -> None:
    """Each rank behind its own shaped link where that works (else unshaped, said so)."""
    from gradzip.comm import rank_links

    out = tmp_path / "race"
    assert main(["compare", "--methods", "int8", "--link", "per-rank", "--steps", "6",
                 "--out", str(out)]) == 0
    [record] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    c = record["compare"]
    shaped, _ = rank_links.available()
    assert c["shaped"] is shaped and c["link"] == ("per-rank" if shaped else "unshaped")
    if shaped:
        assert 0.5e8 < c["achieved_rate_bits_per_s"] < 1.5e8
        assert "one network namespace per rank" in c["link_model"]
    assert record["world_size"] == 2 and record["steps"] == 6
    assert "per-rank link" in (out / "report.md").read_text()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_is_a_valid_matrix(tmp_path: Path, preset: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each preset's every method resolves as its `gradzip train` would (a dry run)."""
    assert main(["compare", "--preset", preset, "--dry-run", "--out", str(tmp_path)]) == 0
    p = PRESETS[preset]
    runs = len(p.methods) * len(p.rates) * len(p.ranks) * p.seeds
    assert len(capsys.readouterr().out.splitlines()) == runs


def test_local_update_methods_map_to_the_outer_flags() -> None:
    from gradzip.compare.matrix import method_flags

    assert method_flags("ef | topk(ratio=0.01)") == ["--codec", "ef | topk(ratio=0.01)"]
    # DeMo steps with the sign it sends: plain SGD without clipping, as DeMo runs
    assert method_flags("demo(topk=8)") == ["--codec", "demo(topk=8)", "--optimizer", "sgd",
                                            "--grad-clip", "0"]
    assert method_flags("diloco(sync_every=8, fragments=2)")[-4:-2] == ["--fragments", "2"]
    # every outer option is spelled out, defaults (DiLoCo's) included
    assert method_flags("diloco(sync_every=16, lr=0.5) | int8") == [
        "--outer", "diloco", "--outer-codec", "int8", "--sync-every", "16", "--outer-lr", "0.5",
        "--outer-momentum", "0.9", "--fragments", "1", "--overlap-steps", "0"]
    assert method_flags("average(sync_every=8)")[:6] == [
        "--outer", "average", "--outer-codec", "none", "--sync-every", "8"]
    with pytest.raises(ValueError, match="takes sync_every="):
        method_flags("diloco(H=3)")


def test_a_local_update_method_is_checked_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "race"
    assert main(["compare", "--methods", "torch:none;diloco(sync_every=0)", "--dry-run",
                 "--out", str(out)]) == 2
    assert "sync_every (H) must be >= 1" in capsys.readouterr().err


def test_nodes_links_run_every_node_and_compress_between_nodes() -> None:
    """``nodes=NxL``: N x L ranks whatever --ranks says, L per node; gradzip codecs under
    DDP compress between nodes only (--hierarchical), PyTorch's hooks run as they are."""
    from gradzip.compare.matrix import plan

    runs = plan(["torch:none", "int8"], ["100mbit"], [2], 1, ("--model", "tiny"),
                ("nodes=2x2",))
    assert [r.ranks for r in runs] == [4, 4]
    torch_argv, int8_argv = (r.argv(Path("o"), Path("c")) for r in runs)
    assert "torch.distributed.run" not in int8_argv  # rank_links starts the ranks
    assert torch_argv[torch_argv.index("--node-size") + 1] == "2"
    assert "--hierarchical" not in torch_argv and "--hierarchical" in int8_argv
    [auto] = plan(["auto"], ["100mbit"], [2], 1, (), ("nodes=2x2",))
    assert "--hierarchical" in auto.argv(Path("o"), Path("c"))  # per link: inter-node
    [hsdp] = plan(["ef | topk(ratio=0.05)"], ["100mbit"], [2], 1, (), ("nodes=2x2",), "hsdp")
    argv = hsdp.argv(Path("o"), Path("c"))
    assert argv[argv.index("--parallel") + 1] == "hsdp" and "--hierarchical" not in argv
    assert hsdp.slug.startswith("100mbit-w4-nodes=2x2-hsdp/")


@pytest.mark.dist
def test_race_between_nodes_counts_each_uplink(tmp_path: Path) -> None:
    """Two nodes of two ranks: the record carries what each node's uplink carried (the
    kernel's count) and the report shows it per step."""
    from gradzip.comm import rank_links

    out = tmp_path / "race"
    assert main(["compare", "--methods", "int8", "--link", "nodes=2x2", "--steps", "4",
                 "--out", str(out)]) == 0
    [record] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    c = record["compare"]
    assert record["world_size"] == 4 and c["parallel"] == "ddp"
    assert set(record["links"]) == {"intra_node", "inter_node"}
    if rank_links.available()[0]:
        assert c["shaped"] and len(c["uplink_bytes"]["sent"]) == 2
        assert min(c["uplink_bytes"]["sent"]) > 0
        assert "uplink bytes/step (kernel)" in (out / "report.md").read_text()


def test_the_frontier_race_runs_as_the_issue_writes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gradzip compare --preset long --methods "torch:fp16;sparseloco"``: both resolve
    as their ``gradzip train`` runs would, 3 seeds each (the runs themselves are on
    docs/benchmarks/frontier.md)."""
    assert main(["compare", "--preset", "long", "--methods", "torch:fp16;sparseloco",
                 "--dry-run", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[-1] for line in lines] == ["torch:fp16", "sparseloco"] * 3


@pytest.mark.parametrize("kind", ["shared", "per-rank", "nodes=2x2"])
def test_a_shaped_run_sees_no_gpu(kind: str) -> None:
    """NCCL between ranks of one host bypasses the namespace's qdisc (P2P, shared
    memory): a shaped run hides the GPUs, so it trains over gloo through the link."""
    from gradzip.compare.harness import SHAPED_RUN_ENV, namespace_command

    _, env = namespace_command(["true"], "100mbit", kind, ranks=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "" == SHAPED_RUN_ENV["CUDA_VISIBLE_DEVICES"]
