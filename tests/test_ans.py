"""The ``ans`` stage: bit-exact round trips, efficiency with the table counted, chunks."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_expgolomb import CHAINS, int_tensors, laplace_int8

import gradzip
from gradzip.codecs import Payload, PayloadError
from gradzip.codecs.entropy import _frame, _rans, ans, measures


def roundtrip(p: Payload) -> torch.Tensor:
    return ans.decode(Payload.deserialize(Payload({"f": p}).serialize()).child("f"))


@pytest.mark.parametrize("backend", ans.BACKENDS)
@given(t=int_tensors(), chunk=st.sampled_from([1024, 4096, ans.DEFAULT_CHUNK]))
def test_roundtrip_is_bit_exact(backend, t, chunk):
    p = ans.encode(t, chunk, backend)
    y = roundtrip(p)
    assert y.dtype == t.dtype and y.shape == t.shape and torch.equal(y, t)
    assert p.wire_bytes <= 8 + t.numel() * t.element_size() + 64


@pytest.mark.parametrize("backend", ans.BACKENDS)
def test_efficiency_with_the_table_counted(backend):
    t = laplace_int8(200_000)
    p = ans.encode(t, backend=backend)
    assert p.meta["m"] == {"rans": "rans", "constriction": "ans"}[backend]
    eta = measures.efficiency(measures.entropy_bits(t), 8 * p.wire_bytes)
    assert eta >= 0.99, eta
    assert torch.equal(roundtrip(p), t)


@pytest.mark.parametrize("backend", ans.BACKENDS)
def test_chunks_are_independent_and_exact(backend):
    t = laplace_int8(10_000)
    p = ans.encode(t, chunk=1024, backend=backend)
    assert len(p.meta["cw"]) == 10 and p.meta["ck"] == 1024
    assert torch.equal(roundtrip(p), t)


def test_many_distinct_symbols_use_byte_planes_in_rans():
    rng = np.random.default_rng(2)
    t = torch.from_numpy(np.round(rng.laplace(size=200_000) * 2000).astype(np.int16))
    p = ans.encode(t)
    assert p.meta["m"] == "planes" and p.wire_bytes < t.numel() * 2
    assert torch.equal(roundtrip(p), t)
    q = ans.encode(t, backend="constriction")
    assert q.meta["m"] == "ans" and torch.equal(roundtrip(q), t)


def test_quantized_frequencies_sum_to_the_scale():
    rng = np.random.default_rng(3)
    for size in (2, 17, 300, 4096):
        counts = rng.integers(1, 10**6, size) ** rng.integers(1, 3, size)
        f = _rans.quantize(counts)
        assert f.sum() == _rans.M and (f >= 1).all()
    with pytest.raises(ValueError):
        _rans.quantize(np.ones(_rans.M + 1, np.int64))


def test_constant_and_wide_streams():
    z = torch.zeros(1000, dtype=torch.int32)
    p = ans.encode(z)
    assert p.meta["m"] == "const" and p.wire_bytes < 48
    assert torch.equal(roundtrip(p), z)
    rng = np.random.default_rng(0)
    idx = torch.from_numpy(np.sort(rng.choice(10**7, 20_000, replace=False)).astype(np.int64))
    p = ans.encode(idx)
    assert p.meta["m"] == "planes" and p.wire_bytes < idx.numel() * 8
    assert ans.encode(idx, backend="constriction").wire_bytes < idx.numel() * 8
    assert torch.equal(roundtrip(p), idx)


@pytest.mark.parametrize("backend", ans.BACKENDS)
def test_corrupt_or_truncated_payload_raises(backend):
    p = ans.encode(laplace_int8(5000), backend=backend)
    data = bytearray(p.fields["d"])
    data[7] ^= 0x01
    with pytest.raises(PayloadError, match="checksum"):
        ans.decode(Payload({**p.fields, "d": bytes(data)}, p.meta))
    with pytest.raises(PayloadError):
        ans.decode(Payload({**p.fields, "t": p.fields["t"][:-1]}, p.meta))
    with pytest.raises(PayloadError):
        ans.decode(Payload(p.fields, {k: v for k, v in p.meta.items() if k != "crc"}))
    # even with a matching checksum, a damaged stream is caught by the coder itself
    bad = Payload({**p.fields, "d": bytes(data)}, {k: v for k, v in p.meta.items() if k != "crc"})
    with pytest.raises(PayloadError):
        ans.decode(_frame.seal(bad))


@pytest.mark.parametrize("spec", [s.replace("| eg(k=0)", "| ans").replace("| eg(mapping=sign)",
                                  "| ans").replace("| eg", "| ans") for s in CHAINS])
def test_ans_after_integer_codecs_is_exact(spec):
    lossy = gradzip.codec(spec.rsplit("|", 1)[0].strip())
    coded = gradzip.codec(spec)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    y = coded.decode(Payload.deserialize(coded.encode(x, "w").serialize()))
    assert torch.equal(y, lossy.decode(lossy.encode(x, "w")))
