"""The ``lossless`` float codec: bit-exact for every float dtype, smaller than raw."""

import base64

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ans import mostly_zero
from test_expgolomb import skewed_int_tensors

import gradzip
from gradzip.codecs import Payload, PayloadError
from gradzip.codecs.entropy import _frame, _kernels, ans, bytecoders, measures
from gradzip.codecs.entropy.floatcodec import LosslessFloat, join_planes, split_planes
from gradzip.codecs.payload import DTYPE_CODE

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def grad_like(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.randn(n, generator=g).mul(1.5).exp() * 1e-3
    return x.to(dtype)


def bits(x):
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return x.contiguous().reshape(-1).view(torch.uint8)


def roundtrip(c, x):
    p = c.encode(x, None)
    p = Payload.deserialize(p.serialize())
    return c.decode(p, x.shape, None), p


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rest", ["auto", "zstd", "raw"])
def test_bit_exact_including_special_values(dtype, rest):
    x = grad_like(5000, dtype=dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    x[:5] = specials
    x[5] = torch.finfo(dtype).max
    x[6] = torch.finfo(dtype).tiny / 4  # subnormal
    c = LosslessFloat(rest=rest)
    y, _ = roundtrip(c, x.reshape(50, 100))
    assert y.dtype == dtype and y.shape == (50, 100)
    assert torch.equal(bits(y.reshape(-1)), bits(x))


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=0, max_size=400),
       st.sampled_from(DTYPES))
def test_property_roundtrip(values, dtype):
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    y, _ = roundtrip(LosslessFloat(), x)
    assert torch.equal(bits(y), bits(x))


#: float dtype -> the integer dtype of its bit patterns
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float64: torch.int64}


@pytest.mark.parametrize("seed", [16, 141, 437])
def test_mostly_zero_gradients_roundtrip(seed):
    """4096 fp32 values, 3968 of them zero: these seeds raised "rANS stream is corrupt or
    truncated" before the encoder's division was made exact for frequent symbols."""
    x = mostly_zero(seed, dtype=np.float32)
    c = gradzip.codec("lossless")
    y = c.decode(Payload.deserialize(c.encode(x, "w").serialize()))
    assert torch.equal(bits(y), bits(x))
    lossy, coded = gradzip.codec("qsgd"), gradzip.codec("qsgd | ans")
    y = coded.decode(Payload.deserialize(coded.encode(x, "w").serialize()))
    assert torch.equal(y, lossy.decode(lossy.encode(x, "w")))
    for dtype in DTYPES:
        z = x.to(dtype)
        assert torch.equal(bits(roundtrip(LosslessFloat(), z)[0]), bits(z))


@settings(max_examples=150)
@given(st.sampled_from(DTYPES), st.data())
def test_skewed_bit_patterns_roundtrip(dtype, data):
    """One dominant float (often zero) and 1-10 rare ones, any bit patterns (NaN payloads,
    infinities, subnormals included), 1..10,000 values."""
    words = data.draw(skewed_int_tensors(dtypes=(_BITS[dtype],)))
    x = words.view(dtype)
    y, _ = roundtrip(LosslessFloat(), x)
    assert y.dtype == dtype and torch.equal(bits(y), bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_plane_split_is_invertible(dtype):
    x = grad_like(1000, dtype=dtype)
    words = join_planes(split_planes(x), dtype)
    assert words.tobytes() == bits(x).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_beats_raw_and_zstd_on_gradient_like_values(dtype):
    x = grad_like(100_000, seed=1, dtype=dtype)
    _, p = roundtrip(LosslessFloat(), x)
    raw = x.numel() * x.element_size()
    zstd = bytecoders.Zstd().encode_field(x, None).wire_bytes
    assert p.wire_bytes < 0.95 * raw and p.wire_bytes < zstd


def test_through_the_chain_and_with_error_feedback():
    x = grad_like(3000).reshape(30, 100).to(torch.bfloat16)
    c = gradzip.codec("lossless")
    y = c.decode(Payload.deserialize(c.encode(x, "w").serialize()))
    assert y.dtype == torch.bfloat16 and torch.equal(bits(y), bits(x))
    ef = gradzip.codec("ef | lossless")
    x32 = grad_like(3000)
    assert torch.equal(ef.decode(ef.encode(x32, "w")), x32)


def test_corrupt_planes_raise():
    c = LosslessFloat()
    p = c.encode(grad_like(4000), None)
    plane = p.child("p0")
    data = bytearray(plane.fields["d"])
    data[3] ^= 0x40
    bad = Payload({**p.fields, "p0": Payload({**plane.fields, "d": bytes(data)}, plane.meta)},
                  p.meta)
    with pytest.raises(PayloadError):
        c.decode(bad, torch.Size([4000]), None)
    with pytest.raises(PayloadError):
        c.decode(p, torch.Size([4001]), None)
    with pytest.raises(PayloadError):
        c.decode(Payload(p.fields, {"fl": 1}), torch.Size([4000]), None)


@pytest.mark.parametrize("n", [40, 4000])  # the raw path for small tensors, and planes
def test_every_flipped_bit_is_caught(n):
    """Flip one bit anywhere in the serialized payload: decoding raises, or (if the flip
    hit something that does not change the result) gives back the exact input."""
    c = LosslessFloat()
    x = grad_like(n)
    wire = bytearray(c.encode(x, None).serialize())
    positions = range(len(wire)) if len(wire) < 600 else range(0, len(wire), len(wire) // 500)
    for i in positions:
        bad = bytearray(wire)
        bad[i] ^= 1 << (i % 8)
        try:
            y = c.decode(Payload.deserialize(bytes(bad)), x.shape, None)
        except PayloadError:
            continue
        assert torch.equal(bits(y), bits(x)), f"bit flip at byte {i} decoded to other values"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("params", [{"exponent": "ans"}, {"exponent": "zstd"},
                                    {"exponent": "huff"}, {"rest": "zstd"}, {"rest": "raw"}])
def test_payloads_of_every_plane_coding_decode_with_the_default_codec(dtype, params):
    """Earlier payloads (ANS exponent planes, checksummed zstd planes) stay decodable:
    the decoder follows each plane's own mode, whatever the encoder's settings were."""
    x = grad_like(20_000, seed=3, dtype=dtype)
    p = Payload.deserialize(LosslessFloat(**params).encode(x, None).serialize())
    modes = {p.child(k).meta.get("m") for k in p.fields}
    assert (ans.RANS in modes) == (params.get("exponent") == "ans")
    assert torch.equal(bits(LosslessFloat().decode(p, x.shape, None)), bits(x))


def test_fast_zstd_exponent_plane_beats_ans_on_runs():
    """Runs of equal exponents (zeroed rows, as in embeddings of unseen tokens) are what
    the zstd plane coder finds and an order-0 coder cannot."""
    x = grad_like(40_000, seed=4)
    x[5_000:25_000] = 0.0
    fast = LosslessFloat(exponent="zstd").encode(x, None).wire_bytes
    order0 = LosslessFloat(exponent="ans").encode(x, None).wire_bytes
    assert fast < order0


#: a ``lossless`` fp16 payload of the first layout (three planes: exponent, sign + two
#: mantissa bits, low mantissa byte), written by gradzip 0a56344, and its input's bytes
FP16_V1_PAYLOAD = (
    "R1oBAgJmbAAKA2NyYwD4opyZFgMCcDACBQFtAgR6c3RkAmR0AAACc2gDAYAEA2x2bAACA2NyYwCqo9OZCwEBZAGLASi1"
    "L/1gAAANBAAGUB8MQE3zw49vy9khJDoCHAAaABkAw6bpSoomZbp/SAe3/Wa4P09SpD3eyKEDgKIoAhP4uJElFx+l6zCw"
    "nTDwmaPlcdahbglSiyP77aKXf2iSVWoig0M0N9vpruhtzEtxHX3rFuzK/ZNJKzLFrTnKOkbD31G5oTBh5dFNDAMOBwAC"
    "cDECBQFtAgR6c3RkAmR0AAACc2gDAYAEA2x2bAACA2NyYwDOia7vFQEBZAF7KLUv/WAAAI0DAAZQG4YyISIgGAAYABkA"
    "a0Jb1IL3XAOkMhcef2N06dLCJBDiZVs7kmYjiwCZ6KBijRyslt9Ab7E2+aHfh3YoLdWNIShtfAS9jQjyAyXtZ53YsptgZ"
    "dBQBDoOwJSNZbRofU8yCFUjhN+08EACIbwsEQUAAnAyAgQBbQIDcmF3AmR0AAACc2gDAYAEA2NyYwCm1IuzDwEBZAGAAg"
    "AAAAAAzlUd8UWZObVxidDfgl0uHFYOWDuOBRkmnSM3fFUXWHp/eCiphQcXKkQpvbQkEPmPEQ4hTcQ2ZHQQyHdh+34m5HJO"
    "M8C2PTD9TnzFqZdOY6nBe79vavDqDYt/OVRnvo1Z4SBzToz/UWAtxKRnrdgmRRIERoVhMA8kfW30k8joiQdLwI4akkNfBv"
    "+Q+VyY7mfWdL+cbhA1Z2O6ok6pugLfOGkYWsKL64PsX5qXNGyi2p+cA2JbJgd9BlIahaVnVPeRRSH/LSLS1S6yze5vPyjN"
    "HQF++VF0Lz79zUqnFY5Y5HW2iyGcLAg58t9BhD6CJRxPCLoLv4Ql95dnLhM="
)


def test_fp16_payloads_of_the_first_layout_still_decode():
    rng = np.random.default_rng(11)
    x = torch.from_numpy((rng.standard_normal(256) * np.exp(rng.standard_normal(256)))
                         .astype(np.float16))
    x[:5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    old = Payload.deserialize(base64.b64decode(FP16_V1_PAYLOAD))
    assert sorted(old.fields) == ["p0", "p1", "p2"]
    got = LosslessFloat().decode(old, x.shape, None)
    assert torch.equal(got.view(torch.int16), x.view(torch.int16))
    new = LosslessFloat().encode(x, None)
    assert sorted(new.fields) == ["p0", "p1"]  # today's layout: two planes
    assert new.wire_bytes < old.wire_bytes
    back = LosslessFloat().decode(Payload.deserialize(new.serialize()), x.shape, None)
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


def test_planes_of_different_lengths_are_refused():
    planes = split_planes(grad_like(1000, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="different lengths"):
        join_planes([planes[0], planes[1][:-1]], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exponent_plane_search_is_accelerated_for_16_bit_floats_only(dtype):
    """bf16/fp16 exponent planes take zstd's accelerated match search (half the input,
    no long runs to find); fp32 keeps the full search, whose matches keep its ratio."""
    from gradzip.codecs.entropy import _zstd_plane
    from gradzip.codecs.entropy.floatcodec import ACCELERATION

    if not _zstd_plane.accelerated():
        pytest.skip("cffi is not installed: no accelerated search")
    g = torch.Generator().manual_seed(5)  # runs of 8 values of one magnitude, a zero run
    scale = torch.randn(7_500, generator=g).mul(1.5).exp().repeat_interleave(8)
    x = torch.randn(60_000, generator=g) * scale * 1e-3
    x[20_000:26_000] = 0
    x = x.to(dtype)
    plane = split_planes(x)[0]
    full, fast = _zstd_plane.compress(plane, 0), _zstd_plane.compress(plane, 4)
    assert full != fast  # the input tells the two searches apart
    sent = bytes(LosslessFloat(exponent="zstd").encode(x, None).child("p0").fields["d"])
    assert sent == (full if dtype == torch.float32 else fast)
    assert (ACCELERATION[dtype] > 0) == (dtype != torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_codes_exponents_by_huffman_but_for_fp16(dtype):
    """``exponent=auto`` (the default) sends bf16 and fp32 exponent planes Huffman-coded
    and fp16's wider first plane through zstd, the faster of the two on each."""
    x = grad_like(100_000, seed=6, dtype=dtype)
    p = LosslessFloat().encode(x, None)
    assert p.child("p0").meta["m"] == ("zstd" if dtype == torch.float16 else "huf1")
    assert torch.equal(bits(LosslessFloat().decode(p, x.shape, None)), bits(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_sends_planes_of_repeated_rows_through_zstd(dtype):
    """Rows that are scalar multiples of one vector (a tied embedding's gradient rows for
    tokens a batch did not contain) repeat one exponent pattern: zstd's matches take
    them and an order-0 coder cannot, so ``auto`` picks zstd there, and the payload is
    as small as ``exponent=zstd``'s."""
    g = torch.Generator().manual_seed(8)
    row = torch.randn(256, generator=g)
    scales = 2.0 ** torch.randint(-30, -10, (600, 1), generator=g).float()
    x = torch.cat([torch.randn(60_000, generator=g) * 1e-3, (scales * row).reshape(-1)])
    x = x.to(dtype)
    auto = LosslessFloat().encode(x, None)
    assert auto.child("p0").meta["m"] == "zstd"
    assert auto.wire_bytes < LosslessFloat(exponent="huff").encode(x, None).wire_bytes
    assert torch.equal(bits(LosslessFloat().decode(auto, x.shape, None)), bits(x))


def test_huffman_exponents_follow_each_tensors_scale():
    """A bucket of tensors of different scales: the Huffman plane's tables fit groups
    of blocks, so it is smaller than zstd's (one table per 128 KB block) and than one
    table for the whole plane (``ans``)."""
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(33_000, generator=g) * 10.0 ** -k for k in range(2, 8)])
    x = x.to(torch.bfloat16)
    sizes = {c: LosslessFloat(exponent=c).encode(x, None).child("p0").wire_bytes
             for c in ("huff", "zstd", "ans")}
    assert sizes["huff"] < sizes["zstd"] and sizes["huff"] < sizes["ans"], sizes


@settings(max_examples=200)
@given(counts=st.lists(st.integers(0, 10**9), min_size=0, max_size=300))
def test_entropy_kernel_matches_the_numpy_measure(counts):
    c = np.array(counts, np.int64)
    assert _kernels.entropy_bits(c) == pytest.approx(measures.entropy_of_counts(c), abs=1e-9)


@pytest.mark.parametrize("size", [200, 5000])
def test_exponent_planes_that_do_not_shrink_are_stored(size):
    """Uniform exponent bytes: zstd cannot shrink them, so the plane is stored, as
    ``_frame.pick`` decides when the coded data is not clearly smaller."""
    rng = np.random.default_rng(size)
    words = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    words[(words & 0x7F80) == 0x7F80] = 0x3F80  # no inf/NaN: any bits round-trip anyway
    x = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    p = LosslessFloat().encode(x, None)
    assert p.child("p0").meta["m"] == _frame.STORED
    assert torch.equal(LosslessFloat().decode(p, x.shape, None).view(torch.int16),
                       x.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@given(data=st.data())
def test_the_device_split_is_the_host_split(dtype, data):
    """``floatcodec_device`` splits and joins by torch ops what numba does on the host:
    the same planes for any bit pattern (NaN payloads, infinities, subnormals, -0)."""
    from gradzip.codecs.entropy import floatcodec_device

    width = torch.empty(0, dtype=dtype).element_size()
    raw = data.draw(st.binary(min_size=0, max_size=64 * width))
    raw = raw[: len(raw) // width * width]
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else \
        torch.empty(0, dtype=dtype)
    planes = floatcodec_device.split(x)
    assert [p.numpy().tobytes() for p in planes] == [p.tobytes() for p in split_planes(x)]
    assert torch.equal(bits(floatcodec_device.join(planes, dtype)), bits(x))


def test_a_payload_with_device_planes_decodes_on_the_host():
    """A plane in the device's raw form (``rawt``) beside host-coded ones decodes, and a
    flipped bit in it is caught."""
    from gradzip.codecs.entropy import ans_lanes, floatcodec_device

    x = grad_like(5000)
    fields = floatcodec_device.encode_planes(x)  # on a CPU: ans's host format for p0
    assert [fields[f"p{i}"].meta["m"] for i in range(1, 4)] == [ans_lanes.RAW] * 3
    c = LosslessFloat()
    meta = {"fl": DTYPE_CODE[torch.float32]}
    p = _frame.seal(Payload(dict(fields), meta))
    wire = Payload.deserialize(p.serialize())
    assert torch.equal(bits(c.decode(wire, x.shape, None)), bits(x))
    data = fields["p3"].fields["d"].clone()
    data[10] ^= 1
    bad = {**fields, "p3": Payload({**fields["p3"].fields, "d": data}, fields["p3"].meta)}
    with pytest.raises(PayloadError):
        c.decode(_frame.seal(Payload(bad, meta)), x.shape, None)


def test_a_device_format_payload_with_a_short_plane_is_refused():
    """Every plane in a device format (lanes or raw), one of them shorter than the
    tensor: a clear PayloadError, not a join of mismatched planes."""
    from gradzip.codecs.entropy import ans_lanes, floatcodec_device

    x = grad_like(3000)
    planes = floatcodec_device.split(x)
    fields = {f"p{i}": ans_lanes.raw(plane[:-1] if i == 2 else plane)
              for i, plane in enumerate(planes)}
    assert floatcodec_device.is_device_format(Payload(dict(fields)), 4)
    p = _frame.seal(Payload(dict(fields), {"fl": DTYPE_CODE[torch.float32]}))
    with pytest.raises(PayloadError, match="wrong size"):
        LosslessFloat().decode(p, x.shape, None)
    whole = {f"p{i}": ans_lanes.raw(plane) for i, plane in enumerate(planes)}
    good = _frame.seal(Payload(whole, {"fl": DTYPE_CODE[torch.float32]}))
    assert torch.equal(bits(LosslessFloat().decode(good, x.shape, None)), bits(x))
