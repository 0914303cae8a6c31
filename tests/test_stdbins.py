"""``stdbins``: templar's bins over a multiple of the std, and its untrusted payloads."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.codecs.validation import deferred_checks


def test_bins_span_the_stated_width_and_decode_to_their_means() -> None:
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * 3 + 1
    codec = gradzip.codec("stdbins(bins=4, sigmas=6)")
    p = codec.encode(x)
    q, table = p.tensor("q").long(), p.tensor("table")
    # bins 1.5 std wide from the mean: the two inner ones hold 86.6% of a Gaussian
    inner = float(((q == 1) | (q == 2)).float().mean())
    assert 0.85 < inner < 0.88
    for b in range(4):
        torch.testing.assert_close(table[b], x[q == b].mean(), rtol=1e-5, atol=1e-5)
    assert torch.equal(codec.decode(p), table[q])


def test_a_received_code_past_the_bins_is_refused_or_flagged() -> None:
    codec = gradzip.codec("stdbins")
    p = codec.encode(torch.randn(100))
    p.fields["q"] = p.tensor("q").clone()
    p.fields["q"][7] = 9
    with pytest.raises(gradzip.PayloadError, match="stdbins.*a code of 9 exceeds 3"):
        codec.decode(p)
    with deferred_checks() as checks:
        out = codec.decode(p)
    assert bool(checks.failed(torch.device("cpu")))
    assert bool(torch.isin(out, p.tensor("table")).all())  # only valid rows were read


def test_a_wrong_table_and_bad_parameters_are_refused() -> None:
    codec = gradzip.codec("stdbins")
    p = codec.encode(torch.randn(10))
    p.fields["table"] = p.tensor("table")[:3]
    with pytest.raises(gradzip.PayloadError, match="a table of 3"):
        codec.decode(p)
    with pytest.raises(gradzip.SpecError, match="power of two"):
        gradzip.codec("stdbins(bins=6)")


def test_a_constant_tensor_decodes_to_itself() -> None:
    x = torch.full((50,), 2.5)
    codec = gradzip.codec("stdbins")
    assert torch.equal(codec.decode(codec.encode(x)), x)
