"""``ans``'s lanes format (the GPU's) on the CPU: exact, near the entropy, and safe.

The kernels' bit-for-bit equality with this reference is in ``test_kernels.py``; here
the format itself: round trips for every integer dtype and for streams cut short at a
block's end, the table's integer construction, the raw form, payloads from a peer
(hostile headers, tables, counts, flipped bits), and deferred checks.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import Payload, PayloadError
from gradzip.codecs.entropy import ans, ans_lanes, lanes
from gradzip.codecs.validation import deferred_checks

INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def _peaked(n: int, dtype: torch.dtype = torch.int8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 4).round().clamp(-100, 100).to(dtype)


def _wire(t: torch.Tensor) -> Payload:
    """``t`` coded in the lanes format, through its serialized bytes (as a peer's)."""
    return Payload.deserialize(Payload({"f": ans.encode(t, backend="lanes")}).serialize()
                               ).child("f")


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("n", [1, 31, 33, 5000, lanes.BLOCK, lanes.BLOCK + 77])
def test_round_trip_every_dtype_and_length(dtype, n):
    t = _peaked(n, dtype, seed=n)
    assert torch.equal(ans.decode(_wire(t)), t)


@given(data=st.data())
def test_property_any_integer_stream_round_trips(data):
    dtype = data.draw(st.sampled_from(INTS))
    info = torch.iinfo(dtype)
    n = data.draw(st.integers(0, 3000))
    lo = data.draw(st.integers(info.min, info.max - 1))
    span = data.draw(st.sampled_from([1, 3, 200, 70000, 1 << 40]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    hi = min(lo + span, info.max - 1)  # randint's bound is exclusive: hi + 1 must fit
    t = torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)
    if n and data.draw(st.booleans()):
        t[0] = info.max  # the extremes of the dtype
        t[-1] = info.min
    shape = data.draw(st.sampled_from([(n,), (1, n)]))
    t = t.reshape(shape)
    y = ans.decode(_wire(t))
    assert y.dtype == t.dtype and y.shape == t.shape and torch.equal(y, t)
    # coding is kept only where it is smaller than the raw form, sized exactly
    assert ans.encode(t, backend="lanes").wire_bytes <= ans_lanes.raw(t).wire_bytes


def test_tables_are_integer_and_sum_to_the_scale():
    counts = torch.zeros(3, 256, dtype=torch.int64)
    counts[0, 7] = 10**9  # one symbol: all of the scale
    counts[1] = torch.arange(256) + 1  # every symbol present
    counts[2, :2] = torch.tensor([1, 10**12])  # a rare one keeps a slot
    freq = lanes.quantize(counts)
    assert (freq.sum(1) == lanes.M).all()
    assert ((freq > 0) == (counts > 0)).all()
    assert freq[0, 7] == lanes.M and freq[2, 0] == 1
    assert bool(lanes.table_ok(freq))


def test_the_cost_is_near_the_entropy():
    t = _peaked(200_000)
    p = ans.encode(t, backend="lanes")
    assert p.meta["m"] == ans_lanes.LANES
    counts = torch.bincount(t.to(torch.int64) + 128).double()
    prob = counts[counts > 0] / t.numel()
    entropy_bytes = float(-(prob * prob.log2()).sum()) * t.numel() / 8
    # the 12-bit table, each block's 32 final states, word count and checksum
    blocks = lanes.blocks_of(t.numel())
    overhead = 512 + blocks * (4 * lanes.LANES + 8) + 64
    assert entropy_bytes < p.wire_bytes < entropy_bytes * 1.01 + overhead
    host = ans.encode(t)  # the host format, for scale: within 2% of each other
    assert abs(p.wire_bytes / host.wire_bytes - 1) < 0.02


def test_a_stream_that_does_not_compress_travels_raw_and_checked():
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, 256, (3000,), generator=g, dtype=torch.uint8)
    p = ans.encode(t, backend="lanes")
    assert p.meta["m"] == ans_lanes.RAW and p.wire_bytes < t.numel() + 64
    wire = Payload({"f": p}).serialize()
    assert torch.equal(ans.decode(Payload.deserialize(wire).child("f")), t)
    bad = bytearray(wire)
    bad[len(wire) // 2] ^= 4  # inside the raw bytes: the tensor data
    with pytest.raises(PayloadError, match="corrupt"):
        ans.decode(Payload.deserialize(bytes(bad)).child("f"))


def test_flipped_bits_in_a_coded_field_raise_or_change_nothing():
    t = _peaked(4000)
    wire = Payload({"f": ans.encode(t, backend="lanes")}).serialize()
    g = torch.Generator().manual_seed(2)
    for i in torch.randint(0, len(wire), (150,), generator=g).tolist():
        bad = bytearray(wire)
        bad[i] ^= 1 << (i % 8)
        try:
            y = ans.decode(Payload.deserialize(bytes(bad)).child("f"))
        except PayloadError:
            continue
        assert torch.equal(y, t), f"a flip at byte {i} decoded silently"


def _hostile(t: torch.Tensor, name: str, value: torch.Tensor) -> Payload:
    p = ans.encode(t, backend="lanes")
    return Payload({**p.fields, name: value}, dict(p.meta))


@pytest.mark.parametrize("field, make", [
    ("t", lambda f: f.flip(1)),  # a table that does not sum to M
    ("t", lambda f: -f),
    ("w", lambda w: w + 3),  # counts that do not match the words
    ("w", lambda w: torch.full_like(w, -(2**31))),
    ("w", lambda w: torch.full_like(w, 2**31 - 1)),
    ("s", lambda s: torch.zeros_like(s)),
    ("h", lambda h: h ^ 1),
    ("d", lambda d: d[: d.numel() // 2]),
    ("d", lambda d: d[:0]),
])
def test_hostile_fields_raise_a_payload_error(field, make):
    t = _peaked(lanes.BLOCK + 500)
    p = ans.encode(t, backend="lanes")
    with pytest.raises(PayloadError):
        ans.decode(_hostile(t, field, make(p.fields[field])))


@pytest.mark.parametrize("meta, value", [("np", 2), ("ck", 4096), ("sh", (10**12,)),
                                         ("dt", 7), ("m", "lanes2")])
def test_hostile_headers_raise_a_payload_error(meta, value):
    p = ans.encode(_peaked(5000), backend="lanes")
    with pytest.raises(PayloadError):
        ans.decode(Payload(dict(p.fields), {**p.meta, meta: value}))


def test_wrongly_shaped_fields_are_refused():
    p = ans.encode(_peaked(5000), backend="lanes")
    with pytest.raises(PayloadError, match="'s'"):
        ans.decode(Payload({**p.fields, "s": p.fields["s"].reshape(-1)}, dict(p.meta)))
    with pytest.raises(PayloadError, match="'d'"):
        ans.decode(Payload({**p.fields, "d": b"\x00" * 8}, dict(p.meta)))


def test_deferred_checks_flag_a_corrupt_field_instead_of_reading_it():
    t = _peaked(3000)
    p = ans.encode(t, backend="lanes")
    bad = _hostile(t, "h", p.fields["h"] ^ 1)
    with deferred_checks() as checks:
        y = ans.decode(bad)  # no host read: a tensor of the right shape, a flag
        assert y.shape == t.shape and y.dtype == t.dtype
    assert bool(checks.failed(torch.device("cpu")))
    with deferred_checks() as checks:
        assert torch.equal(ans.decode(p), t)
    assert not bool(checks.failed(torch.device("cpu")))


def test_in_a_chain_it_decodes_to_the_host_formats_result():
    x = torch.randn(40_000)
    for lossy in ("int8", "ef | topk(ratio=0.01)", "qsgd"):
        lanes_codec = gradzip.codec(f"{lossy} | ans(backend=lanes)")
        host_codec = gradzip.codec(f"{lossy} | ans")
        a = lanes_codec.decode(Payload.deserialize(lanes_codec.encode(x, "k").serialize()))
        b = host_codec.decode(host_codec.encode(x, "k"))
        assert torch.equal(a, b), lossy


def test_checksum_sees_any_one_flipped_bit():
    raw = torch.arange(70_000, dtype=torch.int64).remainder(251).to(torch.uint8)
    want = lanes.byte_checksum(raw)
    for i in (0, 65_520, 65_521, 69_999):
        for bit in range(8):
            bad = raw.clone()
            bad[i] ^= 1 << bit
            assert not torch.equal(lanes.byte_checksum(bad), want)
    assert math.isfinite(float(want))
