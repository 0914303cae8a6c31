"""``comm/divide.py``: the pre-division and the non-finite check in one pass."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.comm.divide import divide_checked


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), world=st.integers(1, 9), seed=st.integers(0, 2**16),
       double=st.booleans())
def test_the_quotient_is_div_s_bit_for_bit(n: int, world: int, seed: int,
                                          double: bool) -> None:
    dtype = torch.float64 if double else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.randn(n, generator=g).exp() * 1e30).to(dtype)
    expected = x.clone().div_(world)
    flag = divide_checked(x, world)
    assert flag is not None and not bool(flag)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [0, 1, 4097, -1])
def test_every_non_finite_value_is_flagged_wherever_it_is(bad: float, at: int) -> None:
    x = torch.randn(10_000)
    x[at] = bad
    assert bool(divide_checked(x, 3))


def test_the_largest_finite_values_are_not_flagged() -> None:
    x = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max,
                      torch.finfo(torch.float32).tiny / 4])
    assert not bool(divide_checked(x, 2))


@pytest.mark.parametrize("x", [torch.randn(8, dtype=torch.bfloat16),
                               torch.randn(8, dtype=torch.float16),
                               torch.randn(4, 4).t(), torch.randn(8, device="meta")])
def test_other_tensors_are_declined_untouched(x: torch.Tensor) -> None:
    before = x.clone()
    assert divide_checked(x, 2) is None
    if x.device.type != "meta":
        assert torch.equal(x, before)
