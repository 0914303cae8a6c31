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


def _steps(count, shape=(64, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(shape, generator=g)} for _ in range(count)]


def test_measure_reports_wire_bytes_and_error_of_the_last_payload():
    steps = _steps(3)
    x = steps[-1]["x"]
    r = bench.measure("topk(ratio=0.1)", steps, "t")
    assert r.steps == 2 and r.protocol == "encode+decode"
    p = gradzip.codec("topk(ratio=0.1)").encode(x, key="x")
    assert r.wire_bytes == p.wire_bytes == len(p.serialize())
    assert r.ratio_fp32 == pytest.approx(4 * x.numel() / p.wire_bytes)
    assert r.ratio_bf16 == pytest.approx(r.ratio_fp32 / 2)
    y = gradzip.codec("topk(ratio=0.1)").decode(p)
    assert r.rel_l2_error == pytest.approx(float((y - x).norm() / x.norm()), rel=1e-6)
    assert 0 < r.cosine < 1


def test_lossless_chains_and_exempt_codecs_are_outside_the_speed_bar():
    x = _steps(2, shape=(256,))
    assert bench.measure("int8 | ans", x, "t").meets_speed_bar is None
    assert bench.measure("sketch", x, "t").meets_speed_bar is None
    assert bench.measure("fp16", x, "t", clock="wall").meets_speed_bar is not None


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


# ---------------------------------------------------------------- successive gradients
def test_measure_needs_a_warm_up_and_a_timed_step():
    with pytest.raises(ValueError, match="warm-up step and at least one timed step"):
        bench.measure("fp16", _steps(1), "t")


def test_stateful_codecs_see_successive_gradients_not_one_tensor_again():
    """``ef | topk``: the last round's error is that of the last gradient plus the residual
    of the steps before, which a codec fed one tensor over and over never shows."""
    steps = _steps(4)
    r = bench.measure("ef | topk(ratio=0.1)", steps, "t")
    codec = gradzip.codec("ef | topk(ratio=0.1)")
    for step in steps[:-1]:
        codec.decode(codec.encode(step["x"], key="x"))
    x = steps[-1]["x"]
    y = codec.decode(codec.encode(x, key="x"))
    assert r.rel_l2_error == pytest.approx(float((y - x).norm() / x.norm()), rel=1e-6)
    # ... which differs from encoding the same tensor on every round
    same = bench.measure("ef | topk(ratio=0.1)", [steps[-1]] * 4, "t")
    assert abs(same.rel_l2_error - r.rel_l2_error) > 1e-3


def test_real_gradient_steps_are_a_training_sequence():
    from gradzip.bench.samples import real_gradient_steps, real_gradients

    steps = real_gradient_steps(seed=0, first=1, count=2, batch=2, seq=16)
    assert len(steps) == 2 and steps[0].keys() == steps[1].keys()
    assert not all(torch.equal(steps[0][k], steps[1][k]) for k in steps[0])
    first = real_gradients(seed=0, steps=1, batch=2, seq=16)
    assert all(torch.equal(first[k], steps[0][k]) for k in first)


def test_heavy_tailed_steps_keep_each_coordinates_scale():
    from gradzip.bench.samples import heavy_tailed, heavy_tailed_steps

    steps = heavy_tailed_steps(50_000, 3, seed=1)
    assert torch.equal(steps[0], heavy_tailed(50_000, 1))
    assert not torch.equal(steps[1], steps[2])
    big = steps[0].abs() > steps[0].abs().quantile(0.99)
    # coordinates with a large scale stay large (an independent draw would not)
    assert float(steps[1][big].abs().mean()) > 5 * float(steps[1].abs().mean())


# ---------------------------------------------------------------- sketch by its protocol
def _planted_steps(count, n=20_000, world=2):
    """Gradients with 10 heavy coordinates (the same on every step) in small noise."""
    g = torch.Generator().manual_seed(0)
    heavy = torch.arange(10) * 1999
    out = []
    for _ in range(count):
        x = 0.01 * torch.randn(n, generator=g)
        x[heavy] = 20.0
        out.append({"w": x})
    return out, heavy


def test_sketch_is_measured_by_its_two_round_reduce():
    steps, heavy = _planted_steps(3)
    spec = "sketch(ratio=0.0005)"  # k = 10: a 5 x 120 sketch, 40 candidates
    r = bench.measure(spec, steps, "t")
    assert r.protocol == "reduce, 2 ranks" and r.steps == 2
    assert r.encode_mbps is None and r.decode_mbps is None and r.roundtrip_mbps > 0
    # link bytes of the rounds: the sketch, the candidate check, the candidates' values
    # (a ring all-reduce of 2 ranks puts its input size on the link)
    from gradzip.collectives.agreement import CHECK_BYTES

    assert r.wire_bytes == (5 * 120 + 40) * 4 + CHECK_BYTES
    assert r.ratio_fp32 == pytest.approx(20_000 * 4 / r.wire_bytes)
    # the exact round finds the heavy hitters: the error is the noise left out
    truth = (steps[2]["w"] + steps[0]["w"]) / 2
    kept = torch.zeros_like(truth)
    kept[heavy] = truth[heavy]
    assert r.rel_l2_error == pytest.approx(float((kept - truth).norm() / truth.norm()),
                                           rel=1e-4)
    row = bench._row(r)
    assert row[6] == row[7] == "-" and row[-1] == "reduce, 2 ranks, 2 steps"


def test_other_codecs_are_measured_by_encode_and_decode():
    steps, _ = _planted_steps(2)
    r = bench.measure("topk(ratio=0.0005)", steps, "t")
    assert r.protocol == "encode+decode" and r.encode_mbps is not None


def test_help_explains_the_measurement(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "codecs", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "successive gradients" in text and "two-round protocol" in text
    assert "--repeats" in text and "untimed warm-up step" in text


def test_command_rejects_zero_repeats(capsys):
    assert main(["bench", "codecs", "--size", "4k", "--no-real", "--quiet",
                 "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_flat_bucket_is_measured_with_its_tensor_shapes():
    """As in the DDP hook, per-tensor codecs see the bucket's tensors: a layer ~1e-3
    next to a layer ~1 keeps its own scale, so the error is far lower with shapes."""
    g = torch.Generator().manual_seed(0)
    steps = [{"bucket": torch.cat([torch.randn(4096, generator=g),
                                   1e-3 * torch.randn(4096, generator=g)])} for _ in range(3)]
    shapes = {"bucket": [torch.Size((64, 64)), torch.Size((4096,))]}
    small = slice(4096, None)

    def small_error(layouts):
        import gradzip
        c = gradzip.codec("efsignsgd")
        x = steps[-1]["bucket"]
        y = c.decode(c.encode(x, key="b", shapes=(layouts or {}).get("bucket")),
                     key="b", shapes=(layouts or {}).get("bucket"))
        return float((y[small] - x[small]).norm() / x[small].norm())

    assert small_error(shapes) < small_error(None) / 10
    with_shapes = bench.measure("efsignsgd", steps, "t", shapes=shapes)
    without = bench.measure("efsignsgd", steps, "t")
    assert with_shapes.rel_l2_error != without.rel_l2_error
