"""``centroid``: sign plus a magnitude bin per value, each bin decoded to its mean."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip import Payload, PayloadError


def _roundtrip(spec: str, x: torch.Tensor) -> tuple[torch.Tensor, Payload]:
    codec = gradzip.codec(spec)
    p = codec.encode(x, key="k")
    return codec.decode(Payload.deserialize(p.serialize())), p


def test_two_bits_start_from_halves_and_decode_bins_to_their_means() -> None:
    x = torch.tensor([0.1, -0.2, 0.3, -1.0, 2.0, 0.0, -0.5, 0.4])
    y, p = _roundtrip("centroid(bucket=8, lloyd=0)", x)
    order = x.abs().argsort()
    small = torch.zeros(8, dtype=torch.bool)
    small[order[:4]] = True  # the smaller half of the magnitudes (the zero among them)
    small_mean = x.abs()[small & (x != 0)].mean()
    expected = torch.where(small, small_mean, x.abs()[~small].mean()) * x.sign()
    assert torch.allclose(y, expected)
    assert y[5] == 0  # an exact zero stays zero
    assert p.tensor("q").dtype == torch.int8 and int(p.tensor("q").abs().max()) == 2


def test_lloyd_steps_move_edges_halfway_between_the_bin_means() -> None:
    x = torch.tensor([1.0, 1.1, 1.2, 10.0])  # halves {1, 1.1} {1.2, 10}: means 1.05, 5.6
    y, _ = _roundtrip("centroid(bucket=4, lloyd=1)", x)  # edge 3.325: 1.2 moves down
    assert torch.allclose(y, torch.tensor([1.1, 1.1, 1.1, 10.0]))


def test_one_bit_is_the_sign_times_the_mean_magnitude_per_bucket() -> None:
    x = torch.randn(1000)
    y, _ = _roundtrip("centroid(bits=1, bucket=100)", x)
    scale = x.abs().view(10, 100).mean(1).repeat_interleave(100)
    assert torch.allclose(y, x.sign() * scale, rtol=1e-6)


@pytest.mark.parametrize("tails", ["gaussian", "heavy"])
def test_more_bits_and_lloyd_steps_mean_less_error_and_l1_mass_is_kept(tails: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 15, generator=g)
    if tails == "heavy":
        x *= torch.randn(1 << 15, generator=g).exp()
    errors = []
    for spec in ["centroid(bits=1)", "centroid(lloyd=0)", "centroid", "centroid(bits=3)",
                 "centroid(bits=4)"]:
        y, _ = _roundtrip(spec, x)
        errors.append(float((y - x).norm() / x.norm()))
        # bin means keep each bin's L1 mass: the decoded total equals the input's
        assert float(y.abs().sum()) == pytest.approx(float(x.abs().sum()), rel=1e-4)
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.5 * errors[0], errors


def test_after_a_chunked_topk_the_values_cost_about_two_bits() -> None:
    """SparseLoCo's chain: 64 of every 4096 kept, their values in 2 bits, ANS-coded."""
    torch.manual_seed(0)
    x = torch.randn(1 << 20)
    codec = gradzip.codec("topk(k=64, chunk=4096) | centroid | ans")
    p = codec.encode(x, key="k")
    kept = (1 << 20) // 4096 * 64
    values = p.child("values").wire_bytes * 8 / kept
    assert 1.5 < values < 2.5, values
    y = codec.decode(Payload.deserialize(p.serialize()))
    assert int((y != 0).sum()) == kept


@pytest.mark.parametrize("field, value, message", [
    ("q", torch.full((8,), 3, dtype=torch.int8), "exceeds"),
    ("q", torch.zeros(8, dtype=torch.int16), "int8"),
    ("q", torch.zeros(7, dtype=torch.int8), "needs 8"),
    ("centroids", torch.zeros(3), "bin means"),
    ("centroids", torch.zeros(2, dtype=torch.float64), "float32"),
])
def test_forged_payloads_are_payload_errors(field: str, value: torch.Tensor,
                                            message: str) -> None:
    codec = gradzip.codec("centroid(bucket=8)")
    p = codec.encode(torch.randn(8), key="k")
    p.fields[field] = value
    with pytest.raises(PayloadError, match=message):
        codec.decode(Payload.deserialize(p.serialize()))
