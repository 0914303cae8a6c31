"""``zstd`` and ``lz4`` stages: exact on integer and float fields, honest on failure."""

import pytest
import torch
from hypothesis import given
from test_expgolomb import int_tensors

import gradzip
from gradzip.codecs import Payload, PayloadError
from gradzip.codecs.entropy.bytecoders import Lz4, Zstd

CODERS = [Zstd(), Zstd(level=19), Lz4(), Lz4(level=9)]


def roundtrip(coder, p: Payload) -> torch.Tensor:
    return coder.decode_field(Payload.deserialize(Payload({"f": p}).serialize()).child("f"))


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.spec)
@given(t=int_tensors())
def test_integer_roundtrip(coder, t):
    y = roundtrip(coder, coder.encode_field(t, None))
    assert y.dtype == t.dtype and y.shape == t.shape and torch.equal(y, t)


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.spec)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.bool])
def test_float_and_bool_roundtrip(coder, dtype):
    x = torch.randn(3000).to(dtype) if dtype != torch.bool else torch.rand(3000) > 0.9
    x = x.reshape(30, 100)
    assert coder.accepts(x)
    p = coder.encode_field(x, None)
    y = roundtrip(coder, p)
    assert y.dtype == x.dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_compressible_field_shrinks_and_random_is_stored():
    z = torch.zeros(10_000, dtype=torch.int8)
    assert Zstd().encode_field(z, None).wire_bytes < 100
    noise = torch.randint(-128, 128, (10_000,), dtype=torch.int8)
    p = Lz4().encode_field(noise, None)
    assert p.meta["m"] == "raw" and p.wire_bytes <= 10_000 + 48


@pytest.mark.parametrize("coder", [Zstd(), Lz4()], ids=lambda c: c.spec)
def test_corrupt_payload_raises(coder):
    p = coder.encode_field(torch.zeros(5000, dtype=torch.int16), None)
    data = bytearray(p.fields["d"])
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(PayloadError):
        coder.decode_field(Payload({"d": bytes(data)}, p.meta))
    with pytest.raises(PayloadError):
        coder.decode_field(Payload({"d": p.fields["d"][:-2]}, p.meta))


@pytest.mark.parametrize("spec", ["none | zstd", "bf16 | lz4", "zstd(level=19)",
                                  "fp16 | zstd | lz4"])
def test_chains_are_exact(spec):
    c = gradzip.codec(spec)
    base = gradzip.codec(spec.split("|")[0].strip() if "|" in spec else "none")
    x = torch.randn(2000, generator=torch.Generator().manual_seed(3))
    y = c.decode(Payload.deserialize(c.encode(x).serialize()))
    assert torch.equal(y, base.decode(base.encode(x)))
