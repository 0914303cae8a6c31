"""GradiVeQ (Yu et al. 2018): span exactness, refresh schedule, summable codes, bytes."""

import pytest
import torch

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import Payload, PayloadError, SpecError
from gradzip.codecs.gradiveq import fit_basis
from gradzip.collectives import run_simulated
from gradzip.collectives.agreement import CHECK_BYTES, StateDivergenceError

D, K = 16, 3


def subspace(d=D, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, k, generator=g)).Q


def in_span(u, m, seed, tail=0):
    """A flat gradient whose m slices lie in span(u), plus ``tail`` free values."""
    g = torch.Generator().manual_seed(seed)
    body = torch.randn(m, u.shape[1], generator=g) @ u.T
    return torch.cat([body.reshape(-1), torch.randn(tail, generator=g)])


def roundtrip(c, x, key="w"):
    p = c.encode(x, key=key)
    assert len(p.serialize()) == p.wire_bytes
    return c.decode(Payload.deserialize(p.serialize())), p


SPEC = f"gradiveq(dim={D}, rank={K}, refresh=4)"


@pytest.mark.parametrize("tail", [0, 5])
def test_exact_when_the_data_lies_in_the_basis_span(tail):
    u0 = subspace()
    c = gradzip.codec(SPEC)
    x0 = in_span(u0, 200, seed=1, tail=tail)
    y0, p0 = roundtrip(c, x0)
    assert set(p0.fields) == {"values"} and torch.equal(y0, x0)  # refresh step: raw
    u = c.state.slot(0, "w").data["basis"]
    torch.testing.assert_close(u @ (u.T @ u0), u0, rtol=0, atol=1e-5)  # span(U) == span(u0)
    for step in range(1, 4):
        x = in_span(u0, 200, seed=10 + step, tail=tail)
        y, p = roundtrip(c, x)
        assert "coeffs" in p.fields and p.tensor("coeffs").shape == (200, K)
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_off_span_component_is_projected_out():
    u0 = subspace()
    c = gradzip.codec(SPEC)
    c.encode(in_span(u0, 100, seed=1), key="w")
    x = in_span(u0, 100, seed=2)
    noise = in_span(torch.linalg.qr(torch.eye(D) - u0 @ u0.T).Q[:, :1], 100, seed=3)
    torch.testing.assert_close(c.decode(c.encode(x + noise, key="w")), x, rtol=1e-4, atol=1e-4)


def test_refresh_schedule():
    c = gradzip.codec(f"gradiveq(dim={D}, rank={K}, refresh=3)")
    kinds, fitted = [], []
    for step in range(8):
        p = c.encode(torch.randn(40 * D, generator=torch.Generator().manual_seed(step)), key="w")
        kinds.append("raw" if "values" in p.fields else "codes")
        fitted.append(c.state.slot(0, "w").data["fitted_step"])
    assert kinds == ["raw", "codes", "codes", "raw", "codes", "codes", "raw", "codes"]
    assert fitted == [0, 0, 0, 3, 3, 3, 6, 6]


def test_standalone_payload_carries_its_basis_and_bytes_are_honest():
    n = 300 * D + 7
    c = gradzip.codec(SPEC)
    c.encode(torch.randn(n), key="w")
    p = c.encode(torch.randn(n), key="w")
    assert p.tensor("basis").shape == (D, K) and p.tensor("tail").numel() == 7
    data = (300 * K + D * K + 7) * 4
    assert data <= p.wire_bytes < data + 100 < 4 * n
    # decodable without the slot: a fresh codec with no state
    y = gradzip.codec(SPEC).decode(Payload.deserialize(p.serialize()))
    assert y.shape == (n,)


@pytest.mark.parametrize("n", [0, 1, D - 1, D, 3 * D])
def test_small_tensors_go_uncompressed(n):
    """Coefficients + basis would not be smaller than the tensor."""
    c = gradzip.codec(SPEC)
    for _ in range(2):
        x = torch.randn(n)
        y, p = roundtrip(c, x)
        assert set(p.fields) == {"values"} and torch.equal(y, x)


def test_codes_are_summable_under_the_shared_basis():
    """reduce: codes of different ranks are summed; the sum decodes to the mean's projection."""
    u0 = subspace(seed=4)
    m = 64
    steps = [[in_span(u0, m, seed=100 * t + r, tail=3) + 0.1 * torch.randn(
        m * D + 3, generator=torch.Generator().manual_seed(7 + 100 * t + r)) for r in range(3)]
        for t in range(3)]

    def work(rank, comm):
        c = gradzip.codec(SPEC, rank=rank)
        out = []
        for xs in steps:
            before = comm.counter.handed["all_reduce"]
            mean, local = reduce(c, xs[rank], "w", comm, want_local=True)
            out.append((mean, local, comm.counter.handed["all_reduce"] - before))
        return out, c.state.slot(0, "w").data["basis"]

    results = run_simulated(3, work)
    bases = [b for _, b in results]
    assert all(torch.equal(b, bases[0]) for b in bases)  # identical: never sent
    # step 0: uncompressed, exact mean; the basis is fitted on the aggregate
    mean0 = sum(steps[0]) / 3
    torch.testing.assert_close(results[0][0][0][0], mean0)
    torch.testing.assert_close(bases[0], fit_basis(mean0[: m * D].reshape(m, D), K))
    assert results[0][0][0][2] == (m * D + 3) * 4 + CHECK_BYTES  # + the basis check
    u = bases[0]
    for t in (1, 2):
        mean_x = sum(steps[t]) / 3
        want = torch.cat([((mean_x[: m * D].reshape(m, D) @ u) @ u.T).reshape(-1), mean_x[-3:]])
        for out, _ in results:
            mean, _, nbytes = out[t]
            torch.testing.assert_close(mean, want, rtol=1e-5, atol=1e-5)
            assert nbytes == (m * K + 3) * 4  # codes and tail only, no basis
        locals_mean = sum(out[t][1] for out, _ in results) / 3
        torch.testing.assert_close(locals_mean, results[0][0][t][0], rtol=1e-5, atol=1e-5)


def test_error_feedback_conserves_the_gradient_sum():
    steps = [[torch.randn(32 * D, generator=torch.Generator().manual_seed(10 * t + r))
              for r in range(2)] for t in range(6)]

    def work(rank, comm):
        c = gradzip.codec(f"ef | {SPEC}", rank=rank)
        sent = torch.zeros(32 * D)
        for xs in steps:
            sent += reduce(c, xs[rank], "w", comm)[0]
        return sent, c.state.slot(0, "w").data["residual"]

    results = run_simulated(2, work)
    total = sum(sum(xs) for xs in steps) / 2
    mean_residual = sum(r for _, r in results) / 2
    torch.testing.assert_close(results[0][0] + mean_residual, total, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["gradiveq(rank=64)", "gradiveq(dim=8, rank=9)",
                                  "gradiveq(dim=1)", "gradiveq(rank=0)", "gradiveq(refresh=0)",
                                  "gradiveq(refresh=x)"])
def test_bad_params_are_spec_errors(spec):
    with pytest.raises(SpecError, match="gradiveq"):
        gradzip.codec(spec)


def test_flags_and_bad_payload():
    c = gradzip.codec(SPEC)
    assert c.multi_round and not c.summable and not c.unbiased
    assert str(gradzip.codec(str(c))) == str(c) == SPEC
    c.encode(torch.randn(50 * D), key="w")
    p = c.encode(torch.randn(50 * D), key="w")
    p.meta["shape"] = (49 * D,)
    with pytest.raises(PayloadError, match="gradiveq"):
        c.decode(p)


@pytest.mark.parametrize("scale", [1e-30, 1e18])
def test_basis_fit_is_scale_invariant(scale):
    """The basis of x * scale is the basis of x (a float32 Gram matrix of raw values
    would underflow to a useless basis, or overflow to NaN)."""
    g = torch.Generator().manual_seed(0)
    noise = 0.01 * torch.randn(500, D, generator=g)
    slices = torch.randn(500, K, generator=g) @ subspace().T + noise
    u1 = fit_basis(slices, K)
    us = fit_basis(slices * scale, K)
    assert torch.isfinite(us).all()
    torch.testing.assert_close(us, u1, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- ranks must agree
def _refresh_twice(perturb_rank: int | None):
    """Two refresh steps of ``gradiveq(refresh=1)`` on 2 ranks; one rank's basis nudged."""
    xs = [torch.randn(32 * D, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    spec = f"gradiveq(dim={D}, rank={K}, refresh=1)"

    def work(rank, comm):
        c = gradzip.codec(spec, rank=rank)
        stage = c.compressors[0][1]
        if rank == perturb_rank:  # as if this rank's eigensolver rounded differently
            refit = stage._refit

            def nudged(slot, flat):
                refit(slot, flat)
                slot.data["basis"][0, 0] += 1e-6

            stage._refit = nudged
        return [reduce(c, xs[rank], "w", comm)[0] for _ in range(2)]

    return run_simulated(2, work)


def test_ranks_whose_bases_differ_fail_loudly():
    with pytest.raises(StateDivergenceError, match="gradiveq.*PCA basis for key 'w'"):
        _refresh_twice(perturb_rank=1)


def test_agreeing_bases_pass_the_check():
    r0, r1 = _refresh_twice(perturb_rank=None)
    assert all(torch.equal(a, b) for a, b in zip(r0, r1, strict=True))
