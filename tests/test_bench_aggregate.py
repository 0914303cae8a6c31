"""`gradzip bench aggregate`: structure of the results and invariants of the byte model.

Tiny runs (a few thousand values, W = 2, 4, 8); no timing is asserted.
"""

import json

import pytest
import torch

from gradzip.bench import aggregate as bench
from gradzip.cli import main


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("agg") / "aggregate.json"
    rc = main(["bench", "aggregate", "--input", "synthetic", "--numel", "8k",
               "--worlds", "2,4,8", "--error-worlds", "2,4", "--seeds", "2",
               "--codecs", "none;qsgd;fp16", "--quiet", "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def _run(record, spec, path, world, seed=0):
    [r] = [r for r in record["runs"] if r["spec"].split(" | aggregate=")[0] == spec
           and r["path"] == path and r["world"] == world and r["seed"] == seed]
    return r


def test_structure(record):
    assert record["worlds"] == [2, 4, 8] and record["error_worlds"] == [2, 4]
    assert record["warmup"] == 2
    # seed 0 covers every W of both sweeps, later seeds only the error sweep
    paths = {"none": ["all_reduce", "two_phase"], "qsgd": ["gather", "two_phase"],
             "fp16": ["all_reduce", "two_phase"]}
    assert len(record["runs"]) == sum(len(p) for p in paths.values()) * (3 + 2)
    for spec, ps in paths.items():
        for p in ps:
            assert _run(record, spec, p, 8)["numel"] == 8192
            assert _run(record, spec, p, 4, seed=1)["rel_l2_error"] >= 0
    assert {s["spec"] for s in record["summary"]} == set(paths)
    errors = {(e["codec"], e["path"], e["world"]) for e in record["error_median"]}
    assert ("qsgd", "two_phase", 4) in errors and ("fp16", "all_reduce", 2) in errors
    assert not any(w == 8 for _, _, w in errors)


def test_none_all_reduce_is_the_fp32_baseline(record):
    for w in (2, 4, 8):
        r = _run(record, "none", "all_reduce", w)
        assert r["ratio_fp32"] == 1.0 and r["ratio_fp16"] == 0.5
        assert r["rel_l2_error"] < 1e-6


def test_two_phase_beats_gather_for_qsgd_at_w8_and_auto_picks_it(record):
    gather, two = _run(record, "qsgd", "gather", 8), _run(record, "qsgd", "two_phase", 8)
    assert two["wire_bytes"] < gather["wire_bytes"]
    # gather grows like (W-1) x payload, two-phase stays near 2(W-1)/W x payload
    assert gather["wire_bytes"] > 3 * _run(record, "qsgd", "gather", 2)["wire_bytes"]
    assert two["wire_bytes"] < 2 * _run(record, "qsgd", "two_phase", 2)["wire_bytes"]
    [qsgd] = [s for s in record["summary"] if s["spec"] == "qsgd"]
    assert qsgd["auto"] == {"2": "gather", "4": "two_phase", "8": "two_phase"}
    # qsgd (~4x vs fp32) gathered loses to an fp16 all-reduce from W = 4 on; auto never does
    assert qsgd["gather_stops_at"] == 4 and qsgd["auto_stops_at"] is None


def test_fp16_sum_in_fp32_at_the_owner_is_not_worse(record):
    [ar] = [e for e in record["error_median"] if e["codec"] == "fp16"
            and e["path"] == "all_reduce" and e["world"] == 4]
    [tp] = [e for e in record["error_median"] if e["codec"] == "fp16"
            and e["path"] == "two_phase" and e["world"] == 4]
    assert 0 < tp["rel_l2_error"] <= ar["rel_l2_error"]


def test_crossover_interpolates_in_log2_w():
    assert bench.crossover([(2, 3.0), (4, 2.0), (8, 1.5)]) == (None, None)
    assert bench.crossover([(2, 0.9), (4, 0.5)]) == (2, 2.0)
    at, est = bench.crossover([(2, 2.0), (8, 0.5)])
    assert at == 8 and est == pytest.approx(2 ** (1 + (1 / 1.5) * 2))


def test_reduce_once_counts_the_gather_of_every_payload():
    import gradzip
    from gradzip.aggregation.fixed import Frame
    from gradzip.collectives.linkmodel import link_bytes

    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    # sizes that depend on the values: exchanged first, payloads padded to the largest
    r = bench.reduce_once("threshold(v=1.0)", "gather", xs, None)
    sizes = [gradzip.codec("threshold(v=1.0)").encode_body(x, "k").wire_bytes for x in xs]
    assert len(set(sizes)) > 1
    assert r.wire_bytes == link_bytes("all_gather", max(sizes), 4) + link_bytes("all_gather", 8, 4)
    assert r.path == "gather" and r.spec.endswith("aggregate=gather")
    # a fixed layout: one buffer of a length every rank knows, no size exchange
    r = bench.reduce_once("topk(ratio=0.1)", "gather", xs, None)
    frame = Frame.of(gradzip.codec("topk(ratio=0.1)").encode_body(xs[0], "k"))
    assert r.wire_bytes == link_bytes("all_gather", frame.nbytes, 4)


def test_default_specs_cover_every_stage():
    from gradzip.codecs import Compressor, LosslessCoder, registered

    specs = bench.default_specs()
    for name, cls in registered().items():
        if issubclass(cls, Compressor):
            assert name in specs
        elif issubclass(cls, LosslessCoder):
            assert f"qsgd | {name}" in specs
    assert set(bench.EXTRA_SPECS) <= set(specs)


def test_bad_worlds_are_refused(capsys):
    assert main(["bench", "aggregate", "--worlds", "1,2", "--quiet"]) != 0
    assert "--worlds needs world sizes >= 2" in capsys.readouterr().err


def _small_real(world, warmup):
    inputs = bench.Inputs("real", 875_264, world + warmup, seed=0)
    warm = [inputs.for_world(world, 875_264, step=i)[0] for i in range(warmup)]
    xs, shapes = inputs.for_world(world, 875_264, step=warmup)
    return warm, xs, shapes


def test_warmup_measures_stateful_codecs_in_steady_state():
    # PowerSGD (per tensor, as DDP reduces it) and GradiVeQ compress after warm-up;
    # GradiVeQ's first reduction is its uncompressed refresh step
    warm, xs, shapes = _small_real(4, 2)
    ps = bench.reduce_once("powersgd", "multi_round", xs, shapes, warmup=warm)
    assert ps.ratio_fp32 > 1.5 and ps.rel_l2_error > 1e-3
    gv = bench.reduce_once("gradiveq", "multi_round", xs, shapes, warmup=warm)
    assert gv.ratio_fp32 > 1.5 and gv.rel_l2_error > 1e-3
    cold = bench.reduce_once("gradiveq", "multi_round", xs, shapes)
    assert cold.ratio_fp32 == pytest.approx(1.0, abs=0.01) and cold.rel_l2_error < 1e-6


def test_warmup_steps_carry_the_error_feedback_residual():
    xs0 = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(8)]
    warm, xs = [xs0[:4], xs0[1:5]], xs0[2:6]
    spec = "ef | topk(ratio=0.01)"
    cold = bench.reduce_once(spec, "gather", xs, None)
    hot = bench.reduce_once(spec, "gather", xs, None, warmup=warm)
    # bytes are the measured reduction's only; the mean now carries earlier residuals
    assert hot.wire_bytes == cold.wire_bytes
    assert hot.rel_l2_error != cold.rel_l2_error
    with pytest.raises(ValueError, match="warm-up"):
        bench.reduce_once(spec, "gather", xs, None, warmup=[xs0[:3]])


def test_bad_warmup_is_refused(capsys):
    assert main(["bench", "aggregate", "--warmup", "-1", "--quiet"]) != 0
    assert "--warmup must be >= 0" in capsys.readouterr().err
