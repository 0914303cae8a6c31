"""The audit's findings, one test each: tiny hostile payloads neither allocate what they
declare nor make the receiver compile kernels, and every one fails as PayloadError."""

from __future__ import annotations

import lz4.frame
import pytest
import torch
from fuzz_payloads import reseal  # the forger's re-sealing, shared with the fuzz test

import gradzip
from gradzip import Payload, PayloadError
from gradzip.codecs.limits import decode_budget

X = torch.randn(19_200, generator=torch.Generator().manual_seed(0))


def test_an_ans_const_field_declaring_2_27_values_is_refused_before_allocating() -> None:
    codec = gradzip.codec("int8 | ans")
    p = codec.encode(torch.zeros(19_200), "k")  # q is all zeros: an ANS 'const' field
    q = p.fields["q"]
    assert isinstance(q, Payload) and q.meta["m"] == "const"
    q.meta["sh"] = (1 << 27,)
    forged = Payload.deserialize(reseal(p).serialize())
    with pytest.raises(PayloadError, match="declares"):
        codec.decode(forged, expected=(19_200,))


def test_an_ans_table_size_is_checked_against_its_bytes() -> None:
    codec = gradzip.codec("int8 | ans")
    p = codec.encode(X, "k")
    p.fields["q"].meta["v"] = 1 << 29  # type: ignore[union-attr]
    with pytest.raises(PayloadError, match="table"):
        codec.decode(Payload.deserialize(reseal(p).serialize()), expected=X.shape)


def test_an_lz4_field_that_inflates_past_its_size_stops_there() -> None:
    codec = gradzip.codec("none | lz4")
    p = codec.encode(X, "k")
    field = p.fields["values"] if "values" in p.fields else next(
        v for v in p.fields.values() if isinstance(v, Payload))
    assert isinstance(field, Payload)
    field.fields["d"] = lz4.frame.compress(bytes(256 << 20))  # 256 MiB of zeros, ~1 MB
    with pytest.raises(PayloadError):
        codec.decode(Payload.deserialize(reseal(p).serialize()), expected=X.shape)


def test_a_declared_nan_tensor_is_bounded_by_max_numel() -> None:
    codec = gradzip.codec("fp16")
    tiny = Payload({}, {"shape": (1 << 28,), "dtype": 7, "nan": 1})
    with pytest.raises(PayloadError, match="max_numel"):
        codec.decode(Payload.deserialize(tiny.serialize()))
    with pytest.raises(PayloadError, match="expects"):
        codec.decode(tiny, expected=(100,))
    assert codec.decode(Payload({}, {"shape": (3,), "dtype": 7, "nan": 1})).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.bool])
def test_a_coded_field_cannot_name_a_dtype_its_coder_never_writes(dtype) -> None:
    """Before: numba compiled new decoders inside the receiver (18 s for float32)."""
    codec = gradzip.codec("int8 | ans")
    p = codec.encode(X, "k")
    p.fields["q"].meta["dt"] = gradzip.codecs.payload.DTYPE_CODE[dtype]  # type: ignore
    codec.decode(Payload.deserialize(reseal(codec.encode(X, "k2")).serialize()))  # warm
    before = compiled_signatures()
    assert sum(before.values()) > 0  # the kernels are found, so the check can fail
    with pytest.raises(PayloadError, match="dtype"):
        codec.decode(Payload.deserialize(reseal(p).serialize()), expected=X.shape)
    assert compiled_signatures() == before  # nothing was compiled for the sender's dtype


def compiled_signatures() -> dict[str, int]:
    """How many type signatures each of gradzip's numba kernels has compiled so far."""
    import sys

    from numba.core.dispatcher import Dispatcher

    return {f"{name}.{attr}": len(obj.signatures)
            for name, module in list(sys.modules.items()) if name.startswith("gradzip.")
            for attr, obj in vars(module).items() if isinstance(obj, Dispatcher)}


def test_deep_nesting_is_a_payload_error_not_a_recursion_error() -> None:
    deep = b"GZ\x01" + b"\x00\x01\x01v\x02" * 5000 + b"\x00\x00"
    with pytest.raises(PayloadError, match="nested"):
        Payload.deserialize(deep)


def test_a_flipped_bit_in_the_top_level_meta_is_caught_by_the_digest() -> None:
    codec = gradzip.codec("topk(ratio=0.05)")
    blob = codec.encode(X.reshape(64, 300), "k").serialize()
    caught = 0
    for i in range(3, 24):  # the top-level meta: shape, dtype, the positions' form
        for bit in range(8):
            b = bytearray(blob)
            b[i] ^= 1 << bit
            try:
                out = codec.decode(Payload.deserialize(bytes(b)), expected=(64, 300))
            except PayloadError:
                caught += 1
                continue
            assert out.shape == (64, 300)
    assert caught == 8 * 21  # every one (before: 21 of them decoded to another shape)


def test_version_1_payloads_still_decode() -> None:
    p = gradzip.codec("none").encode(X, "k")
    v2 = p.serialize()
    v1 = b"GZ\x01" + v2[3:-4]  # the same tree, no digest
    assert torch.equal(gradzip.codec("none").decode(Payload.deserialize(v1)), X)


def test_the_decode_budget_bounds_nested_fields() -> None:
    codec = gradzip.codec("topk(ratio=0.05) | qsgd")
    p = codec.encode(X, "k")
    p.fields["values"].meta["n"] = 1 << 30  # type: ignore[union-attr]
    with pytest.raises(PayloadError, match="declares"):
        codec.decode(Payload.deserialize(p.serialize()), expected=X.shape)
    coded = gradzip.codec("int8 | ans").encode(torch.randn(200_000), "k").fields["q"]
    with decode_budget(10), pytest.raises(PayloadError, match="declares"):
        gradzip.codec("ans").coders[0][1].decode_field(coded)  # a coder on its own
