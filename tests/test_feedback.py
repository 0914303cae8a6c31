"""Error feedback: what is dropped is remembered, so nothing is lost over time."""

import pytest
import torch

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import Compressor, registered
from gradzip.collectives import run_simulated

#: the variant ``ef`` may wrap: signsgd's default +-1 is refused behind ``ef``
_UNDER_EF = {"signsgd": "signsgd(scale=l1)"}
LOSSY = sorted(
    _UNDER_EF.get(n, n) for n, c in registered().items()
    if issubclass(c, Compressor) and n != "none" and not c.own_feedback
)


@pytest.mark.parametrize("name", LOSSY)
def test_sent_sum_tracks_input_sum(name):
    """sum(sent) == sum(inputs) - residual, and the residual stays bounded."""
    c = gradzip.codec(f"ef | {name}")
    g = torch.Generator().manual_seed(0)
    total_in = torch.zeros(64, 16)
    total_out = torch.zeros(64, 16)
    norms = []
    for step in range(40):
        x = torch.randn(64, 16, generator=g) * (1 + step % 3)
        total_in += x
        total_out += c.decode(c.encode(x, key="w"))
        residual = c.state.slot(0, "w").data["residual"]
        torch.testing.assert_close(total_in - total_out, residual, rtol=1e-4, atol=1e-3)
        norms.append(float(residual.norm()))
    # bounded: the residual does not grow with the number of steps
    assert max(norms[20:]) <= 3 * max(norms[:20]) + 1e-6, (name, norms)


@pytest.mark.parametrize("name", ["dgc", "efsignsgd"])
def test_ef_refuses_codecs_with_their_own_memory(name):
    with pytest.raises(gradzip.SpecError, match="own error-feedback memory"):
        gradzip.codec(f"ef | {name}")


def test_beta_gamma_follow_the_formula():
    c = gradzip.codec("ef(beta=0.5, gamma=0.8) | bf16")
    x1, x2 = torch.randn(100), torch.randn(100)
    p1 = c.encode(x1, "k")
    e1 = 0.8 * x1 - c.decode(p1).float()
    p2 = c.encode(x2, "k")
    compensated = 0.8 * x2 + 0.5 * e1
    torch.testing.assert_close(c.decode(p2).float(), compensated.bfloat16().float())


def test_residual_is_per_key_and_shape_checked():
    c = gradzip.codec("ef | bf16")
    c.encode(torch.randn(4), "a")
    c.encode(torch.randn(7), "b")
    with pytest.raises(ValueError, match="changed shape"):
        c.encode(torch.randn(5), "a")


def test_reduce_with_feedback_keeps_local_residual():
    def work(rank, comm):
        c = gradzip.codec("ef | bf16", rank=rank)
        x = torch.full((8,), 1.0 + 1e-3 * (rank + 1))
        mean, _ = reduce(c, x, "w", comm)
        residual = c.state.slot(0, "w").data["residual"]
        return x, mean, residual

    for x, mean, residual in run_simulated(2, work):
        sent = x - residual
        assert torch.allclose(sent, sent.bfloat16().float())
        assert mean.shape == x.shape


def test_nonfinite_propagates_through_reduce_when_asked():
    def work(rank, comm):
        c = gradzip.codec("ef | fp16", rank=rank, nonfinite="propagate")
        x = torch.ones(6)
        if rank == 1:
            x[2] = float("inf")
        return reduce(c, x, "w", comm)[0]

    for out in run_simulated(2, work):
        assert torch.isnan(out).all()


#: the aggregate is not the mean of the ranks' own estimates (a majority vote)
_NOT_MEAN_OF_LOCALS = {"signsgd"}
#: relative rounding of an all-reduced sum in the wire dtype
_SUM_ROUNDING = {"bf16": 2.0**-8, "fp16": 2.0**-11}


@pytest.mark.parametrize("name", LOSSY + ["int8(shared=narrow)", "topk(ratio=0.05) | qsgd"])
def test_feedback_through_reduce_conserves_the_gradient_and_stays_bounded(name):
    """``ef | codec`` aggregated over 2 simulated ranks for 30 steps.

    Each rank's residual stays bounded, and what was applied in total is what came in
    minus what is still held back: sum_t mean_t == sum_t avg_r x_rt - avg_r e_r.
    """
    steps, world = 30, 2

    def work(rank, comm):
        c = gradzip.codec(f"ef | {name}", rank=rank)
        g = torch.Generator().manual_seed(rank)
        total_in, total_out, norms = torch.zeros(24, 20), torch.zeros(24, 20), []
        for step in range(steps):
            x = torch.randn(24, 20, generator=g) * (1 + step % 3)
            mean, _ = reduce(c, x, "w", comm)
            total_in += x / world
            total_out += mean
            norms.append(float(c.state.slot(0, "w").data["residual"].norm()))
        return total_in, total_out, c.state.slot(0, "w").data["residual"], norms

    results = run_simulated(world, work)
    for *_, norms in results:
        assert max(norms[steps // 2:]) <= 3 * max(norms[: steps // 2]) + 1e-6, (name, norms)
    if name.split("(")[0] in _NOT_MEAN_OF_LOCALS:
        return
    total_in = sum(r[0] for r in results)
    held_back = sum(r[2] for r in results) / world
    # summed casts also round the sum itself, once a step, which no rank's memory sees
    atol = steps * _SUM_ROUNDING.get(name, 0.0) + 1e-3 * float(total_in.abs().max())
    for _, total_out, _, _ in results:
        torch.testing.assert_close(total_out, total_in - held_back, rtol=1e-3, atol=atol)
