"""`gradzip bench codecs`: sizes parse, every codec is measured honestly, output is written.

Timings are produced but never asserted (benchmarks measure, tests check behaviour).
"""

import json

import pytest
import torch

import gradzip
from gradzip.bench import codecs as bench
from gradzip.cli import main


@pytest.mark.parametrize("text,expected", [("16M", 16 * 2**20), ("4k", 4096), ("100", 100),
                                           ("0.5M", 2**19)])
def test_parse_size(text, expected):
    assert bench.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "0", "-3k"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="size"):
        bench.parse_size(text)


def test_default_specs_cover_every_compressor():
    from gradzip.codecs import Compressor, registered

    specs = bench.default_specs()
    names = [n for n, c in registered().items() if issubclass(c, Compressor)]
    assert set(names) <= set(specs)
    assert any("|" in s for s in specs)  # chains too
    for spec in specs:
        gradzip.codec(spec)  # every default spec parses


def test_measure_reports_wire_bytes_and_error_of_the_payload():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    r = bench.measure("topk(ratio=0.1)", {"x": x}, "t", repeats=2)
    p = gradzip.codec("topk(ratio=0.1)").encode(x, key="x")
    assert r.wire_bytes == p.wire_bytes == len(p.serialize())
    assert r.ratio_fp32 == pytest.approx(4 * x.numel() / p.wire_bytes)
    assert r.ratio_bf16 == pytest.approx(r.ratio_fp32 / 2)
    y = gradzip.codec("topk(ratio=0.1)").decode(p)
    assert r.rel_l2_error == pytest.approx(float((y - x).norm() / x.norm()), rel=1e-6)
    assert 0 < r.cosine < 1


def test_lossless_chains_and_exempt_codecs_are_outside_the_speed_bar():
    x = {"x": torch.randn(256)}
    assert bench.measure("int8 | ans", x, "t", 1).meets_speed_bar is None
    assert bench.measure("sketch", x, "t", 1).meets_speed_bar is None
    assert bench.measure("fp16", x, "t", 1, clock="wall").meets_speed_bar is not None


def test_bar_check_flags_a_sign_codec_below_30x():
    r = bench.CodecResult("signsgd", "heavy-tailed 1k", 1024, 1024, 4.0, 2.0, 1.0, 0.5,
                          1e3, 1e3, 500.0, True)
    assert any("ratio" in line for line in bench._bars([r]))


def test_command_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "codecs", "--size", "4k", "--no-real", "--codec", "fp16",
               "--codec", "topk(ratio=0.01) | qsgd(levels=16)", "--repeats", "1",
               "--quiet", "--out", str(out)])
    assert rc == 0
    record = json.loads((out / "codecs.json").read_text())
    assert [r["spec"] for r in record["results"]] == [
        "fp16", str(gradzip.codec("topk(ratio=0.01) | qsgd(levels=16)"))]
    assert record["results"][0]["ratio_fp32"] == pytest.approx(4096 * 4 / record["results"][0][
        "wire_bytes"])
    md = (out / "codecs.md").read_text()
    assert "\\|" in md  # the chain's bar is escaped inside the markdown table
    assert not list(out.glob("*.tmp"))


def test_command_rejects_a_bad_size(capsys):
    assert main(["bench", "codecs", "--size", "lots", "--no-real", "--quiet"]) == 2
    assert "size must look like" in capsys.readouterr().err


def test_bars_hold_the_flat_bucket_but_not_the_per_parameter_rows():
    slow = dict(numel=1024, wire_bytes=4096, ratio_fp32=1.0, ratio_bf16=0.5, rel_l2_error=0.0,
                cosine=1.0, encode_mbps=100.0, decode_mbps=100.0, roundtrip_mbps=50.0,
                meets_speed_bar=False)
    flat = bench.CodecResult(spec="fp16", input=bench.REAL_FLAT, **slow)
    per_param = bench.CodecResult(spec="fp16", input=bench.REAL_PER_PARAM, **slow)
    assert bench._bars([per_param]) == []
    assert "fp16 on " + bench.REAL_FLAT in bench._bars([flat])[0]
