"""Non-finite gradients: the error, and the words every rank raises it with."""

from __future__ import annotations


class NonFiniteGradientError(ValueError):
    """A tensor handed to a codec holds NaN or Inf."""


def agreed_nonfinite_error(key: str) -> NonFiniteGradientError:
    """The error every rank raises, with the same words, when any rank's ``key`` held
    NaN or Inf under ``nonfinite='error'`` (the ranks learn it from the reduction itself,
    so none of them is left waiting in a collective the others skipped)."""
    return NonFiniteGradientError(
        f"tensor {key!r} held non-finite values (NaN/Inf) on at least one rank; every "
        "rank stops at this reduction. Fix the loss (or lower the learning rate), or pass "
        "nonfinite='propagate' to send NaN through so a GradScaler can skip the step")
