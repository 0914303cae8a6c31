"""``gradzip bench gpu --smoke``: the GPU check's structure, run on the CPU over gloo."""

from __future__ import annotations

import json

import pytest

from gradzip.cli import main

pytestmark = pytest.mark.dist

SPECS = "none;fp16;ef | int8;topk(ratio=0.01);none | zstd;powersgd(rank=2)"


def test_smoke_mode_runs_every_part_and_writes_its_tables(tmp_path) -> None:
    assert main(["bench", "gpu", "--smoke", "--out", str(tmp_path), "--codecs", SPECS,
                 "--repeat", "2"]) == 0
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["smoke"] and record["backend"] == "gloo" and record["ok"]
    assert record["stream_order"] == []  # needs CUDA
    ddp = {r["codec"]: r for r in record["ddp"]}
    assert list(ddp) == SPECS.split(";")
    assert ddp["none"]["max_diff_to_eager"] == 0.0 and ddp["none"]["path"] == "chained"
    assert ddp["none | zstd"]["max_diff_to_eager"] == 0.0
    assert ddp["ef | int8"]["path"] == "comm thread"
    assert all(r["finite"] and r["reductions"] > 0 for r in ddp.values())
    assert [r["error_step"] for r in record["nonfinite"]] == [2] * 4  # CPU: at once
    resumed = {r["state"]: r for r in record["resume"]}
    assert len(resumed) == 7 and all(r["ok"] for r in resumed.values()), resumed
    assert all(r["max_diff_to_kept"] == 0.0 for r in resumed.values()), resumed
    hsdp = {r["replicate"]: r for r in record["hsdp"]}
    assert all(r["ok"] for r in hsdp.values()), hsdp
    assert hsdp["none"]["max_diff_to_native"] == 0.0
    # no unit's hook reads the host; every unit's flags in one read as backward ends
    assert all(r["syncs_per_backward"] == 1 for r in hsdp.values()), hsdp
    for row in record["speed"]:
        assert row["encode_gbps"] > 0 and row["decode_gbps"] > 0
        assert row["encode_syncs"] >= 0 and row["decode_syncs"] >= 0
    launch = {r["call"]: r["host_us"] for r in record["launch"]}
    assert set(launch) >= {"none decode through Codec.decode",
                           "int8 decode through Codec.decode"}, launch
    assert all(us > 0 for us in launch.values())
    ranks = {r["case"]: r for r in record["ranks"]}
    assert len(ranks) == 19 and all(r["ok"] for r in ranks.values()), ranks
    assert all(r["checked_collectives"] > 50 for r in ranks.values())  # the shim ran
    assert ranks["negative control: unequal all-gather"]["detail"].startswith(
        "StrictViolation")
    assert [r["ok"] for r in record["overlap"]] == [True, True], record["overlap"]
    assert record["overlap"][0]["equal_to_uncached"]
    md = (tmp_path / "gpu.md").read_text()
    assert "skipped (needs CUDA)" in md and "ef \\| int8" in md


def test_break_evens_follow_the_stated_time_model() -> None:
    """W = 8, each rank on its own link: fp16 all-reduces 2 (W-1)/W x 2n bytes; a
    summable codec one encode and decode and its wire all-reduced; any other codec two
    phases, (1 + 1/W) encodes and 2 decodes for about 2 (W-1)/W x its wire."""
    from gradzip.bench.gpu_speed import add_break_evens, add_copy_shares

    n = 1_000_000

    def row(codec, enc, dec, wire, summable=False, multi=False, gbps=(1.0, 1.0)):
        return {"codec": codec, "ok": True, "encode_s": enc, "decode_s": dec,
                "wire_bytes": wire, "summable": summable, "multi_round": multi,
                "encode_gbps": gbps[0], "decode_gbps": gbps[1]}

    rows = [row("none", 5e-5, 5e-5, 4 * n, True, gbps=(200.0, 400.0)),
            row("fp16", 1e-4, 1e-4, 2 * n, True, gbps=(100.0, 100.0)),
            row("int8", 2e-4, 1e-4, n), row("slow", 1.0, 1.0, 4 * n),
            row("powersgd", 1e-4, 1e-4, n, multi=True)]
    add_break_evens(rows, n)
    add_copy_shares(rows)
    got = {r["codec"]: r["wins_vs_fp16"] for r in rows}
    # int8 saves 2 (7/8) x (2n - n) bytes = 14 Mbit for (1.125 x 2e-4 + 2e-4) - 2e-4 s
    assert got["int8"] == "wins below 62.2 Gbit/s", got
    assert got["fp16"] == "baseline" and got["powersgd"] == "n/a (multi-round)"
    assert got["slow"] == "never wins"  # more bytes and more time
    assert got["none"].startswith("wins only above")  # more bytes, less codec time
    assert rows[1]["encode_of_copy"] == "50%" and rows[1]["decode_of_copy"] == "25%"


def test_a_chain_with_a_device_format_is_compared_with_that_format_on_the_cpu() -> None:
    """On a GPU ``ans`` writes its lanes format: ``equal_cpu`` encodes the CPU's payload
    with ``ans(backend=lanes)``, and a chain counts as deterministic (and as having a
    kernel) by all of its stages, not by the first name of the spec."""
    from gradzip.bench.gpu_speed import DETERMINISTIC, KERNEL_STAGES, cpu_twin, stage_names

    assert stage_names("ef | topk(ratio=0.01) | ans") == ["ef", "topk", "ans"]
    assert cpu_twin("int8 | ans") == "int8 | ans(backend=lanes)"
    assert cpu_twin("int8(block=64) | ans(chunk=4096)") == \
        "int8(block=64) | ans(backend=lanes, chunk=4096)"
    assert cpu_twin("int8 | ans(backend=constriction)") == "int8 | ans(backend=constriction)"
    assert set(stage_names("int8 | ans")) <= set(DETERMINISTIC)
    assert not set(stage_names("qsgd | eg")) <= set(DETERMINISTIC)
    assert {"ans", "lossless"} <= set(KERNEL_STAGES)


def test_a_centroid_payload_that_differs_by_its_sums_is_counted_not_failed() -> None:
    """``centroid``'s kernel adds its bin means in a tree: a mean that rounds the other
    way is reported as what differs (``SUM_ORDER``); any other stage's is False."""
    import torch

    import gradzip
    from gradzip.bench.gpu_speed import payload_equals_cpu

    shapes = [torch.Size((1000,))]
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for spec, field in (("centroid", "centroids"), ("int8", "scale")):
        payload = gradzip.codec(spec).encode(x, "b", shapes)
        assert payload_equals_cpu(spec, x, shapes, payload) is True
        payload.fields[field] = payload.tensor(field).clone()
        payload.tensor(field)[1] = payload.tensor(field)[1].nextafter(torch.tensor(9.0))
        expected = "sum order: centroids 1 of 8" if spec == "centroid" else False
        assert payload_equals_cpu(spec, x, shapes, payload) == expected
