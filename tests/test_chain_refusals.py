"""Specs that would build but silently do nothing useful are refused when the chain is built.

* ``ef | signsgd``: signsgd's default decodes +-1 in gradient units, so the residual
  ``ef`` keeps dwarfs the gradient; ``efsignsgd`` or ``ef | signsgd(scale=l1)`` instead.
* a stage with per-coordinate state (``positional_state``) anywhere but first: after
  a sparsifier its memory would mix coordinates from step to step.
"""

import pytest
import torch

import gradzip
from gradzip.codecs import Compressor, registered

POSITIONAL = sorted(n for n, c in registered().items()
                    if issubclass(c, Compressor) and c.positional_state)


def test_the_stages_with_per_coordinate_state_are_flagged():
    assert {"dgc", "efsignsgd", "powersgd", "gradiveq"} <= set(POSITIONAL)
    # stateless stages (or state not tied to positions: a hash seed) are not
    for name in ("topk", "randomk", "threshold", "qsgd", "signsgd", "sketch", "none"):
        assert not registered()[name].positional_state, name


# ---------------------------------------------------------------- ef | signsgd
@pytest.mark.parametrize("spec", ["ef | signsgd", "ef | signsgd(vote=false)",
                                  "ef(beta=0.5) | signsgd", "ef | topk | signsgd(vote=false)"])
def test_ef_refuses_signsgd_with_unit_scale_and_names_the_fix(spec):
    with pytest.raises(gradzip.SpecError, match="decodes to \\+-1") as e:
        gradzip.codec(spec)
    assert "'efsignsgd'" in str(e.value)
    assert "scale=l1" in str(e.value)


@pytest.mark.parametrize("spec", ["signsgd", "signsgd(vote=false)", "efsignsgd",
                                  "ef | signsgd(scale=l1)", "ef | signsgd(scale=l1, vote=false)",
                                  "ef | topk | signsgd(scale=l1, vote=false)",
                                  "topk | signsgd(vote=false)"])
def test_sign_specs_that_work_still_build(spec):
    assert str(gradzip.codec(str(gradzip.codec(spec)))) == str(gradzip.codec(spec))


def _least_squares(spec: str | None, lr: float, steps: int = 200) -> float:
    """Relative error of gradient descent on a 128 x 16 least-squares problem."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(128, 16, generator=g)
    x_true = torch.randn(16, 4, generator=g)
    b = a @ x_true
    w = torch.zeros(16, 4)
    codec = gradzip.codec(spec) if spec else None
    for _ in range(steps):
        grad = a.T @ (a @ w - b) / a.shape[0]
        if codec is not None:
            grad = codec.decode(codec.encode(grad, key="w"), key="w")
        w -= lr * grad
    return float((w - x_true).norm() / x_true.norm())


def test_ef_with_the_l1_scale_solves_least_squares_like_efsignsgd():
    # the scale follows the gradient, so the residual stays in its units and the
    # iterate converges; without ef the same scaled sign stalls far from the solution
    with_ef = _least_squares("ef | signsgd(scale=l1, vote=false)", lr=0.8)
    assert with_ef < 1e-2
    assert with_ef == pytest.approx(_least_squares("efsignsgd", lr=0.8), rel=1e-4)
    assert _least_squares("signsgd(scale=l1, vote=false)", lr=0.8) > 10 * with_ef
    assert _least_squares(None, lr=0.8) < 1e-2  # the problem itself is solvable at this lr


# ---------------------------------------------------------------- state after a sparsifier
REFUSED_AFTER = ["topk", "topk(ratio=0.1)", "randomk", "threshold", "none", "dgc"]


@pytest.mark.parametrize("first", REFUSED_AFTER)
@pytest.mark.parametrize("name", POSITIONAL)
def test_positional_stage_is_refused_after_another_compressor(first, name):
    # multi-round stages (powersgd, gradiveq) are refused earlier: they stand alone
    multi = registered()[name].multi_round
    reason = "cannot be chained" if multi else f"'{name}' cannot follow '{first.split('(')[0]}'"
    with pytest.raises(gradzip.SpecError, match=reason) as e:
        gradzip.codec(f"{first} | {name}")
    if not multi:
        assert "per coordinate" in str(e.value) and f"put '{name}' first" in str(e.value)


@pytest.mark.parametrize("spec", ["topk | dgc", "topk | efsignsgd", "threshold | efsignsgd",
                                  "randomk | dgc", "topk | dgc | ans",
                                  "topk | efsignsgd | zstd"])
def test_the_issue_examples_are_refused(spec):
    with pytest.raises(gradzip.SpecError, match="per coordinate"):
        gradzip.codec(spec)


@pytest.mark.parametrize("spec", ["dgc", "dgc | qsgd", "dgc | qsgd | ans", "efsignsgd",
                                  "efsignsgd | zstd", "ef | powersgd", "ef | gradiveq",
                                  "ef | topk | qsgd", "topk(ratio=0.01) | qsgd(levels=16)"])
def test_positional_stage_first_still_builds(spec):
    gradzip.codec(spec)


def test_why_refused_after_a_sparsifier():
    """What the refusal prevents: positions of kept values change, the memory does not."""
    from gradzip.codecs.base import CodecState

    dgc = registered()["dgc"](ratio=1.0, momentum=0.0)
    slot = CodecState().slot(0, "w")
    dgc.encode(torch.tensor([1.0, 0.0]), slot)  # memory: nothing held back at ratio 1
    with pytest.raises(ValueError, match="changed size"):
        dgc.encode(torch.tensor([1.0, 2.0, 3.0]), slot)  # a sparsifier kept 3 this time
