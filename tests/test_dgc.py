"""dgc: Deep Gradient Compression (Lin et al. 2018) against a plain re-implementation."""

import math

import pytest
import torch

import gradzip
from gradzip.codecs import Payload, SpecError, indices
from gradzip.codecs.dgc import MIN_SAMPLE, REFINE_ABOVE, density_at, warmup_densities


def heavy_tailed(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.randn(n, generator=g).exp()


def reference_dgc(grads, ratio, momentum, clip):
    """Algorithm 1 + momentum correction/masking + clipping, with exact top-k.

    On tensors no larger than MIN_SAMPLE the codec's sampled threshold uses every
    entry, so it must match this step for step.
    """
    u = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    sent = []
    for g in grads:
        if clip > 0 and float(g.norm()) > clip:
            g = g * (clip / float(g.norm()))
        u = momentum * u + g
        v = v + u
        k = max(1, round(ratio * g.numel()))
        top = v.abs().topk(k).indices
        out = torch.zeros_like(v)
        out[top] = v[top]
        sent.append(out)
        u[top] = 0
        v[top] = 0
    return sent, u, v


@pytest.mark.parametrize("momentum, clip", [(0.9, 0.0), (0.0, 0.0), (0.5, 3.0)])
def test_matches_the_paper_algorithm(momentum, clip):
    n = 600
    grads = [heavy_tailed(n, s) for s in range(12)]
    c = gradzip.codec(f"dgc(ratio=0.05, momentum={momentum}, clip={clip})")
    ref_sent, ref_u, ref_v = reference_dgc(grads, 0.05, momentum, clip)
    for g, expected in zip(grads, ref_sent, strict=True):
        p = c.encode(g, key="w")
        got = c.decode(Payload.deserialize(p.serialize()))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    data = c.state.slot(0, "w").data
    torch.testing.assert_close(data["v"], ref_v, rtol=1e-5, atol=1e-5)
    if momentum:
        torch.testing.assert_close(data["u"], ref_u, rtol=1e-5, atol=1e-5)
    else:
        assert "u" not in data  # no momentum buffer to keep


def test_momentum_factor_masking_zeroes_u_and_v_where_sent():
    c = gradzip.codec("dgc(ratio=0.01, momentum=0.9)")
    for step in range(3):
        x = heavy_tailed(5000, step)
        sent = c.decode(c.encode(x, key="w")) != 0
        data = c.state.slot(0, "w").data
        assert int(sent.sum()) > 0
        assert bool((data["u"][sent] == 0).all()) and bool((data["v"][sent] == 0).all())
        assert bool((data["u"][~sent] != 0).all()) and bool((data["v"][~sent] != 0).all())


def test_warmup_schedule_is_the_papers():
    # Lin et al.: 75% -> 93.75% -> 98.4375% -> 99.6% sparsity, then 99.9%
    assert warmup_densities(0.001) == [0.25, 0.0625, 0.015625, 0.00390625]
    schedule = [density_at(s, 0.001, 8) for s in range(10)]
    assert schedule == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                        0.00390625, 0.00390625, 0.001, 0.001]
    assert [density_at(s, 0.001, 0) for s in range(2)] == [0.001, 0.001]
    assert warmup_densities(0.3) == [] and density_at(0, 0.3, 100) == 0.3
    # phases that do not divide evenly still cover the warm-up in order
    assert [density_at(s, 0.01, 7) for s in range(8)] == [
        0.25, 0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01]


def test_warmup_controls_how_much_is_sent():
    c = gradzip.codec("dgc(ratio=0.001, warmup_steps=4, momentum=0)")
    n = 1000  # no bigger than MIN_SAMPLE: exact selection, so the counts are exact
    counts = [int((c.decode(c.encode(heavy_tailed(n, s), key="w")) != 0).sum()) for s in range(6)]
    assert counts == [250, 62, 16, 4, 1, 1]


def test_sampled_threshold_on_a_large_tensor(monkeypatch):
    """Above the sample floor DGC sends about k of the largest |v|, never over 1.3k."""
    for fast in (True, False):
        monkeypatch.setattr(indices, "NUMPY_FAST", fast)
        c = gradzip.codec("dgc(ratio=0.01, momentum=0)")
        n = 200_000
        k = round(0.01 * n)
        for step in range(3):
            x = heavy_tailed(n, step)
            before = c.state.slot(0, "w").data.get("v", torch.zeros(n)) + x
            sent = c.decode(c.encode(x, key="w"))
            kept = sent != 0
            count = int(kept.sum())
            assert 0.5 * k <= count <= REFINE_ABOVE * k, count
            torch.testing.assert_close(sent[kept], before[kept])
            # a threshold selection: everything sent is at least as large as anything kept back
            assert float(before[kept].abs().min()) >= float(before[~kept].abs().max())


def test_refines_when_far_too_many_pass():
    """With a badly low estimate, the exact top-k among the selected is sent (paper §2)."""
    x = heavy_tailed(50_000, 3)
    assert MIN_SAMPLE < 50_000  # the sampled path
    x[: 25_000] = 1e4  # half the tensor ties at the top: any estimate selects >= 25000
    c = gradzip.codec("dgc(ratio=0.01, momentum=0)")
    sent = c.decode(c.encode(x, key="w"))
    assert int((sent != 0).sum()) == 500
    assert bool((sent[:500] == 1e4).all())  # ties go to the lowest positions


def test_accumulated_error_bounded_and_sent_tracks_inputs():
    """Without momentum v is DGC's error memory: sent + v == sum of inputs, v stays bounded."""
    c = gradzip.codec("dgc(ratio=0.02, momentum=0)")
    n = 800
    sent, total = torch.zeros(n), torch.zeros(n)
    norms = []
    for step in range(300):
        g = heavy_tailed(n, step) + 0.2
        total += g
        sent += c.decode(c.encode(g, key="w"))
        v = c.state.slot(0, "w").data["v"]
        torch.testing.assert_close(sent + v, total, rtol=1e-4, atol=1e-3)
        norms.append(float(v.norm()))
    assert max(norms[150:]) < 1.5 * max(norms[:150])
    assert norms[-1] < 0.1 * float(total.norm())


def test_with_momentum_sent_tracks_accumulated_velocity():
    """With momentum, sent + v == the sum of the velocities u, and v stays bounded."""
    m = 0.9
    c = gradzip.codec(f"dgc(ratio=0.02, momentum={m})")
    n = 800
    sent, velocity = torch.zeros(n), torch.zeros(n)
    norms = []
    for step in range(300):
        g = heavy_tailed(n, step) + 0.2
        u_before = c.state.slot(0, "w").data.get("u", torch.zeros(n)).clone()
        velocity += m * u_before + g  # momentum correction: v accumulates u, not g
        sent += c.decode(c.encode(g, key="w"))
        v = c.state.slot(0, "w").data["v"]
        torch.testing.assert_close(sent + v, velocity, rtol=1e-4, atol=1e-2)
        norms.append(float(v.norm()))
    assert max(norms[150:]) < 1.5 * max(norms[:150])
    assert norms[-1] < 0.25 * float(velocity.norm())


def test_clipping_limits_the_local_gradient_norm():
    c = gradzip.codec("dgc(ratio=1.0, momentum=0, clip=2.5)")
    x = heavy_tailed(300, 1) * 10
    sent = c.decode(c.encode(x, key="w"))
    torch.testing.assert_close(float(sent.norm()), 2.5)
    torch.testing.assert_close(sent, x * (2.5 / float(x.norm())))
    small = heavy_tailed(300, 2) * 1e-3  # under the limit: untouched
    c2 = gradzip.codec("dgc(ratio=1.0, momentum=0, clip=2.5)")
    torch.testing.assert_close(c2.decode(c2.encode(small, key="w")), small)


def test_state_is_per_key_and_size_changes_fail():
    c = gradzip.codec("dgc")
    c.encode(heavy_tailed(100, 1), key="a")
    c.encode(heavy_tailed(50, 2), key="b")
    assert c.state.slot(0, "a").data["v"].numel() == 100
    assert c.state.slot(0, "b").data["v"].numel() == 50
    with pytest.raises(ValueError, match="changed size 100 -> 50"):
        c.encode(heavy_tailed(50, 3), key="a")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dgc(ratio=0)", r"dgc: parameter 'ratio' must be in \(0.0, 1.0\]"),
        ("dgc(momentum=1)", r"dgc: parameter 'momentum' must be in \[0.0, 1.0\)"),
        ("dgc(clip=-1)", r"dgc: parameter 'clip' must be >= 0"),
        ("dgc(warmup_steps=-2)", r"dgc: parameter 'warmup_steps' must be >= 0"),
        ("dgc(sample_ratio=0)", r"dgc: parameter 'sample_ratio' must be in \(0.0, 1.0\]"),
    ],
)
def test_bad_parameters_are_spec_errors(spec, message):
    with pytest.raises(SpecError, match=message):
        gradzip.codec(spec)


def test_flags_and_values_field():
    c = gradzip.codec("dgc(ratio=0.01) | fp16")
    assert not c.summable and not c.unbiased
    x = heavy_tailed(10_000, 5)
    p = c.encode(x, key="w")
    assert p.child("values").tensor("values").dtype == torch.float16
    assert math.isclose(float((c.decode(p) != 0).sum()), 100, rel_tol=0.5)
