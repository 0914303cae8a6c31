"""PowerSGD (Vogels et al. 2019): exactness, power iteration, the two-round reduce, EF."""

import pytest
import torch

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import Payload, PayloadError, SpecError
from gradzip.codecs.powersgd import matrix_view
from gradzip.collectives import run_simulated


def low_rank(n, m, r, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)) * scale


def decaying(n, m, seed=0):
    """A matrix with singular values 1, 1/2, 1/4, ...: power iteration converges fast."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, n, generator=g)).Q
    v = torch.linalg.qr(torch.randn(m, m, generator=g)).Q
    k = min(n, m)
    s = 0.5 ** torch.arange(k, dtype=torch.float32)
    return u[:, :k] @ torch.diag(s) @ v[:, :k].T


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def roundtrip(c, x, key="w"):
    p = c.encode(x, key=key)
    assert len(p.serialize()) == p.wire_bytes
    return c.decode(Payload.deserialize(p.serialize())), p


@pytest.mark.parametrize("r", [1, 2, 3])
def test_exact_for_matrices_of_rank_at_most_r(r):
    c = gradzip.codec(f"powersgd(rank={r})")
    for true_rank in range(1, r + 1):
        x = low_rank(40, 30, true_rank, seed=true_rank)
        y, p = roundtrip(c, x, key=f"r{true_rank}")
        assert set(p.fields) == {"p", "q"}
        assert rel_err(y, x) < 1e-5


def test_conv_kernel_is_out_by_rest_and_exact_at_low_rank():
    """A conv kernel (out, in, kh, kw) is compressed as out x (in*kh*kw)."""
    w = low_rank(16, 8 * 3 * 3, 2, seed=3).reshape(16, 8, 3, 3)
    assert matrix_view(w.shape, 2) == (16, 72)
    y, p = roundtrip(gradzip.codec("powersgd(rank=2)"), w)
    assert p.tensor("p").shape == (16, 2) and p.tensor("q").shape == (72, 2)
    assert rel_err(y, w) < 1e-5


def test_error_decreases_with_rank():
    x = decaying(48, 40)
    errors = []
    for r in (1, 2, 4, 8):
        c = gradzip.codec(f"powersgd(rank={r})")
        for _ in range(6):  # a few warm-started steps: near the best rank-r error
            y, _ = roundtrip(c, x)
        errors.append(rel_err(y, x))
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 50


def test_warm_start_is_power_iteration_on_a_fixed_matrix():
    g = torch.Generator().manual_seed(1)
    x = decaying(64, 48) + 1e-3 * torch.randn(64, 48, generator=g)
    s = torch.linalg.svdvals(x)
    best = float(s[2:].norm() / s.norm())  # the optimal rank-2 error (Eckart-Young)
    c = gradzip.codec("powersgd(rank=2)")
    errors = [rel_err(roundtrip(c, x)[0], x) for _ in range(12)]
    for before, after in zip(errors, errors[1:], strict=False):
        assert after <= before * (1 + 1e-4)
    assert errors[-1] < errors[0] and errors[-1] < best * 1.01
    # without warm start every step restarts from a fresh random Q: no convergence
    cold = gradzip.codec("powersgd(rank=2, warm_start=false)")
    cold_errors = [rel_err(roundtrip(cold, x)[0], x) for _ in range(12)]
    assert sum(cold_errors) / len(cold_errors) > errors[-1] * 1.3
    assert "q" not in cold.state.slot(0, "w").data


@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 3), (1, 1, 1, 9), (0, 5), (4, 2)])
def test_small_and_vector_tensors_go_uncompressed(shape):
    """Vectors, scalars, empty tensors and matrices where rank r saves nothing."""
    x = torch.randn(shape)
    y, p = roundtrip(gradzip.codec("powersgd(rank=2)"), x)
    assert set(p.fields) == {"values"}
    assert torch.equal(y, x)


def test_wire_bytes_are_the_factors():
    x = torch.randn(64, 48)
    _, p = roundtrip(gradzip.codec("powersgd(rank=2)"), x)
    factors = (64 + 48) * 2 * 4
    assert factors <= p.wire_bytes < factors + 80


def _work(spec, xs_by_step, want_local=True):
    def work(rank, comm):
        c = gradzip.codec(spec, rank=rank)
        out = []
        for xs in xs_by_step:
            mean, local = reduce(c, xs[rank], "w", comm, want_local=want_local)
            out.append((mean, local))
        return out, c, comm.counter

    return work


def test_reduce_equals_rank_r_approximation_of_the_mean():
    """Two all-reduces give exactly the standalone rank-r path run on the mean gradient."""
    steps = [[decaying(32, 24, seed=10 * t + r) for r in range(3)] for t in range(4)]
    results = run_simulated(3, _work("powersgd(rank=2)", steps))
    ref = gradzip.codec("powersgd(rank=2)")  # same seed: the same shared initial Q
    for t, xs in enumerate(steps):
        mean_x = sum(xs) / 3
        expected = ref.decode(ref.encode(mean_x, key="w"))
        for out, _, _ in results:
            mean, _ = out[t]
            torch.testing.assert_close(mean, expected, rtol=1e-4, atol=1e-5)
        # the local estimates P̂ Q_iᵀ average to the aggregate
        locals_mean = sum(out[t][1] for out, _, _ in results) / 3
        torch.testing.assert_close(locals_mean, results[0][0][t][0], rtol=1e-4, atol=1e-6)


def test_reduce_q_identical_across_ranks_and_bytes_counted():
    steps = [[torch.randn(20, 30, generator=torch.Generator().manual_seed(7 * t + r))
              for r in range(3)] for t in range(3)]
    results = run_simulated(3, _work("powersgd(rank=3)", steps))
    qs = [c.state.slot(0, "w").data["q"] for _, c, _ in results]
    for q in qs[1:]:
        assert torch.equal(q, qs[0])
    for out, _, counter in results:
        assert torch.equal(out[-1][0], results[0][0][-1][0])
        # P (20x3) and Q (30x3) in fp32 per step, nothing else
        assert counter.handed["all_reduce"] == 3 * (20 + 30) * 3 * 4
        assert counter.calls["all_reduce"] == 2 * 3


def test_reduce_exact_when_all_ranks_share_a_low_rank_column_space():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(24, 2, generator=g)
    xs = [a @ torch.randn(2, 16, generator=g) for _ in range(3)]
    results = run_simulated(3, _work("powersgd(rank=2)", [xs]))
    for out, _, _ in results:
        torch.testing.assert_close(out[0][0], sum(xs) / 3, rtol=1e-4, atol=1e-5)


def test_reduce_uncompressed_tensors_are_plain_means():
    xs = [torch.randn(9, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    results = run_simulated(3, _work("powersgd", [xs]))
    for rank, (out, _, counter) in enumerate(results):
        torch.testing.assert_close(out[0][0], sum(xs) / 3)
        assert torch.equal(out[0][1], xs[rank])
        assert counter.handed["all_reduce"] == 9 * 4


def test_error_feedback_residual_stays_bounded_and_nothing_is_lost():
    """``ef | powersgd``: residual is bounded and sum(sent) + residual == sum(gradients)."""
    steps_n = 60
    base = decaying(32, 32, seed=99)

    def grads(t):
        return [base + 0.3 * torch.randn(32, 32, generator=torch.Generator().manual_seed(
            1000 * t + r)) for r in range(3)]

    steps = [grads(t) for t in range(steps_n)]

    def work(rank, comm):
        c = gradzip.codec("ef | powersgd(rank=2)", rank=rank)
        sent, norms = torch.zeros(32, 32), []
        for xs in steps:
            mean, _ = reduce(c, xs[rank], "w", comm)
            sent += mean
            norms.append(float(c.state.slot(0, "w").data["residual"].norm()))
        return sent, c.state.slot(0, "w").data["residual"], norms

    results = run_simulated(3, work)
    total = sum(sum(xs) for xs in steps) / 3
    mean_residual = sum(res for _, res, _ in results) / 3
    torch.testing.assert_close(results[0][0] + mean_residual, total, rtol=1e-4, atol=1e-3)
    grad_norm = float(steps[0][0].norm())
    for _, _, norms in results:
        # noise-dominated full-rank gradients: the residual plateaus near 3x |g|
        assert max(norms) < 5 * grad_norm
        assert max(norms[40:]) < 1.1 * max(norms[20:40])  # not growing


@pytest.mark.parametrize("spec", ["powersgd(rank=0)", "powersgd(rank=-2)", "powersgd(rank=x)",
                                  "powersgd(warm_start=maybe)", "powersgd(ranks=2)"])
def test_bad_params_are_spec_errors(spec):
    with pytest.raises(SpecError, match="powersgd"):
        gradzip.codec(spec)


def test_spec_round_trips_and_flags():
    c = gradzip.codec("ef | powersgd(rank=4, warm_start=false)")
    assert str(c) == "ef | powersgd(rank=4, warm_start=false)"
    assert str(gradzip.codec(str(c))) == str(c)
    assert c.multi_round and not c.summable and not c.unbiased


def test_mismatched_factors_are_a_payload_error():
    c = gradzip.codec("powersgd(rank=2)")
    p = c.encode(torch.randn(16, 12), key="w")
    p.meta["shape"] = (12, 16)
    with pytest.raises(PayloadError, match="powersgd"):
        c.decode(p)


def test_a_whole_bucket_in_two_all_reduces():
    """``reduce_tensors``: all P in one all-reduce, all Q in another (as powerSGD_hook),
    vectors sent as they are inside the first; exact for rank <= r sums, and the
    same mean on every rank."""
    from gradzip.collectives import run_simulated

    shapes = [torch.Size((20, 30)), torch.Size((7,)), torch.Size((16, 8))]

    def bucket(rank):
        g = torch.Generator().manual_seed(rank)
        parts = [torch.outer(torch.randn(20, generator=g), torch.randn(30, generator=g)),
                 torch.randn(7, generator=g),
                 torch.outer(torch.randn(16, generator=g), torch.randn(8, generator=g))]
        return torch.cat([p.reshape(-1) for p in parts])

    def work(rank, comm):
        c = gradzip.codec("powersgd(rank=2)", rank=rank)
        mean, _ = reduce(c, bucket(rank), "b", comm, shapes=shapes)
        return mean, dict(comm.counter.calls)

    results = run_simulated(2, work)
    exact = (bucket(0) + bucket(1)) / 2
    for mean, calls in results:
        torch.testing.assert_close(mean, exact, rtol=1e-4, atol=1e-5)
        assert calls == {"all_reduce": 2}


def test_bucket_feedback_converges_like_per_tensor():
    """``ef | powersgd`` over a bucket: the residual stays bounded and what was applied
    is what came in minus what is held back (the EF bookkeeping per bucket)."""
    from gradzip.collectives import run_simulated

    shapes = [torch.Size((12, 10)), torch.Size((10,)), torch.Size((10, 6))]
    n = sum(s.numel() for s in shapes)

    def work(rank, comm):
        c = gradzip.codec("ef | powersgd(rank=1)", rank=rank)
        g = torch.Generator().manual_seed(rank)
        total_in, total_out = torch.zeros(n), torch.zeros(n)
        for _ in range(25):
            x = torch.randn(n, generator=g)
            mean, _ = reduce(c, x, "b", comm, shapes=shapes)
            total_in += x / 2
            total_out += mean
        return total_in, total_out, c.state.slot(0, "b").data["residual"]

    results = run_simulated(2, work)
    total_in = sum(r[0] for r in results)
    held = sum(r[2] for r in results) / 2
    for _, total_out, _ in results:
        torch.testing.assert_close(total_out, total_in - held, rtol=1e-4, atol=1e-3)


def test_min_compression_rate_sends_barely_smaller_matrices_whole():
    """PyTorch's min_compression_rate: a 10 x 10 matrix at rank 2 has factors 2.5x
    smaller, compressed at rate 2, sent whole at rate 3 (whole bucket and alone)."""
    assert matrix_view(torch.Size([10, 10]), 2, 2.0) == (10, 10)
    assert matrix_view(torch.Size([10, 10]), 2, 3.0) is None
    x = torch.randn(10, 10)
    _, p = roundtrip(gradzip.codec("powersgd(rank=2, min_compression_rate=3)"), x)
    assert set(p.fields) == {"values"}

    def work(rank, comm):
        c = gradzip.codec("powersgd(rank=2, min_compression_rate=3)", rank=rank)
        flat = torch.cat([x.reshape(-1), torch.ones(40, 30).reshape(-1)]) * (rank + 1)
        mean, _ = reduce(c, flat, "b", comm, shapes=[torch.Size([10, 10]),
                                                    torch.Size([40, 30])])
        return mean

    for mean in run_simulated(2, work):
        assert torch.allclose(mean[:100], x.reshape(-1) * 1.5)  # sent whole: exact mean
        assert torch.allclose(mean[100:], torch.full((1200,), 1.5), atol=1e-5)  # rank 1
