import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradzip.codecs.payload import DTYPES, Payload, PayloadError

meta_values = st.one_of(
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False, allow_subnormal=False),
    st.text(max_size=8),
    st.tuples(st.integers(0, 10**6), st.integers(-5, 5)),
)


@st.composite
def payloads(draw, depth=2):
    meta = draw(st.dictionaries(st.text(min_size=1, max_size=6), meta_values, max_size=3))
    fields = {}
    for i in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["tensor", "bytes", "child"] if depth else ["tensor", "bytes"]))
        if kind == "tensor":
            dtype = draw(st.sampled_from(DTYPES))
            shape = draw(st.lists(st.integers(0, 4), max_size=3))
            fields[f"f{i}"] = (torch.randn(shape) * 100).to(dtype)
        elif kind == "bytes":
            fields[f"f{i}"] = draw(st.binary(max_size=40))
        else:
            fields[f"f{i}"] = draw(payloads(depth=depth - 1))
    return Payload(fields, meta)


def same(a: Payload, b: Payload) -> bool:
    if a.meta != b.meta or list(a.fields) != list(b.fields):
        return False
    for k, v in a.fields.items():
        w = b.fields[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and v.shape == w.shape):
                return False
            if not torch.equal(v.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
                return False
        elif isinstance(v, Payload):
            if not same(v, w):
                return False
        elif v != w:
            return False
    return True


@given(payloads())
def test_roundtrip_and_exact_size(p):
    data = p.serialize()
    assert len(data) == p.wire_bytes
    assert same(Payload.deserialize(data), p)
    t = p.to_tensor()
    assert t.dtype == torch.uint8 and t.numel() == p.wire_bytes
    assert same(Payload.deserialize(t), p)


@given(payloads(), st.data())
def test_truncation_is_detected(p, data):
    raw = p.serialize()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(PayloadError):
        Payload.deserialize(raw[:cut])


def test_foreign_bytes_rejected():
    with pytest.raises(PayloadError, match="magic"):
        Payload.deserialize(b"PK\x03\x04junk")
    with pytest.raises(PayloadError, match="trailing"):
        Payload.deserialize(Payload({"a": torch.ones(2)}).serialize() + b"\x00")


def test_leaves_roundtrip():
    p = Payload({"a": torch.ones(2), "c": Payload({"b": torch.zeros(3)}), "z": b"x"})
    names = [n for n, _ in p.leaves()]
    assert names == ["a", "c.b"]
    q = p.with_leaves([torch.full((2,), 5.0), torch.full((3,), 7.0)])
    assert q.child("c").tensor("b").tolist() == [7.0] * 3
    assert p.child("c").tensor("b").tolist() == [0.0] * 3
