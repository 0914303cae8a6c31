"""The ``ans`` stage: bit-exact round trips, efficiency with the table counted, chunks."""

import base64

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit
from test_expgolomb import CHAINS, int_tensors, laplace_int8, skewed_int_tensors

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


#: the backends of the host formats (chunks, a table of varints, the frame's checksum);
#: the lanes format's own tests are test_ans_lanes.py
HOST_BACKENDS = [b for b in ans.BACKENDS if b != "lanes"]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_efficiency_with_the_table_counted(backend):
    t = laplace_int8(200_000)
    p = ans.encode(t, backend=backend)
    assert p.meta["m"] == {"rans": ans.RANS, "constriction": "ans"}[backend]
    eta = measures.efficiency(measures.entropy_bits(t), 8 * p.wire_bytes)
    assert eta >= 0.99, eta
    assert torch.equal(roundtrip(p), t)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
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


@njit(cache=False)
def _encode_steps(xs, syms, table):
    """The encoder's own step (``_rans._step``) on each (state, symbol) pair."""
    out = np.empty(2, np.uint16)
    res = np.empty(xs.size, np.uint64)
    for i in range(xs.size):
        res[i], _ = _rans._step(xs[i], table, np.uint64(syms[i]), out, np.uint64(2))
    return res


def test_encoder_step_is_exact_for_every_frequency():
    """x -> (x // f) * M + start + x % f for every frequency 1..2**15 and the states the
    encoder divides, up to x_max = 2**17 * f (up to 2**32). The reciprocal once was
    exact only below 2**31 and gave quotients one too large for f > ~23,300."""
    freq = np.arange(1, _rans.M + 1, dtype=np.int64)  # one "symbol" per frequency
    table = _rans.encoder_table(freq)
    x_max = (freq << 17).astype(np.int64)
    k = np.concatenate([np.arange(1, 5), -np.arange(0, 96)])  # low and top multiples of f
    top = x_max[:, None] // freq[:, None]
    mult = np.where(k > 0, k[None, :], top + k[None, :])
    xs = np.concatenate([mult * freq[:, None] - 1, mult * freq[:, None]], axis=1)
    syms = np.broadcast_to(np.arange(freq.size)[:, None], xs.shape)
    ok = (xs >= 1) & (xs < x_max[:, None])
    xs, syms = xs[ok].astype(np.uint64), syms[ok].astype(np.int64)
    f, start = freq[syms].astype(np.uint64), table[syms, _rans.START]
    want = xs // f * np.uint64(_rans.M) + start + xs % f
    got = _encode_steps(xs, syms, table.ravel())
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} wrong steps, e.g. f={f[bad[0]]} x={xs[bad[0]]}"


@settings(max_examples=200)
@given(f=st.one_of(st.integers(1, _rans.M), st.integers(_rans.M // 2, _rans.M)), data=st.data())
def test_encoder_step_property(f, data):
    """The same for any frequency and state x = k * f + r (k < 2**17, r < f), weighted
    towards where a reciprocal errs: frequent symbols, large states, remainder f - 1."""
    top = (1 << 17) - 1
    k = data.draw(st.one_of(st.integers(0, top), st.integers(top - 1000, top)))
    r = data.draw(st.one_of(st.just(f - 1), st.integers(0, f - 1)))
    x = max(1, k * f + r)
    table = _rans.encoder_table(np.array([f], np.int64))
    got = _encode_steps(np.array([x], np.uint64), np.zeros(1, np.int64), table.ravel())
    assert int(got[0]) == x // f * _rans.M + x % f


#: an ``ans`` payload of the first rans format (mode ``rans``, two interleaved states),
#: written by gradzip 0a56344: 701 int8 symbols (round(3 * Laplace), seed 7) in chunks of 256
V1_PAYLOAD = (
    "R1oBAAEBZgIIAmR0AAICc2gDAfoKAW0CBHJhbnMCbG8A/wEBdgA+AmN3AwOGAYIBYgJjawCABANjcmMAuLDKphYC"
    "AXQBUnEAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAANdXS+MAYwB6gGOBfYCyQaxBMIN/xLQEtceuie0H7wY"
    "uBDkDNYHjgWCBNMDXV1dLy9dLy8BZAHqAgsAZkp4A3x0fKSV6JadY7UGzuGGcwTzRaPWHRGhHv/uYaeyNPl9YZBa"
    "voiakw7VDnUaUcspBTY4doQ8uh1ufvl5AJMyRMsmFNHDI6sDQ1pOV0YBxvJ9HRgVdsVPg30Q4g5sTnYuhiccCUam"
    "+bVRzT1KBrTnK+wY85mLuTHY9P/5+aZMV7PmAQCKirkCo1vSSaUR4JKWlZI6hWsnz430upB8a4rc6F23sXVZOHYT"
    "EBpjMA8HF/bYbQh3vOoGpq3ng72T58xUbaMUrCNjNafNRUhFYTLgQXcU+Iq8UOdXL/6wmoF/MZfgIgPhRH4fOMhv"
    "083iVmE6OJAmsVMjH7WmJE0lWPQJb7hsXpwF/YW1Q79jzx41x7gUfmIxW6TJdVF3TrCQOxyGvgcZg+U9dNfZrplP"
    "9JTYqPtbwcFWxRfAMu6wNAD0lPoeZ73lcq6s9snsWIWsPGBlcDwI10WCQEi7mU3NAIVnFTgBDct6"
)


def test_payloads_of_the_first_rans_format_still_decode():
    rng = np.random.default_rng(7)
    want = np.clip(np.round(rng.laplace(size=701) * 3), -127, 127).astype(np.int8)
    p = Payload.deserialize(base64.b64decode(V1_PAYLOAD)).child("f")
    assert p.meta["m"] == "rans" and len(p.meta["cw"]) == 3
    assert torch.equal(ans.decode(p), torch.from_numpy(want))
    now = ans.encode(torch.from_numpy(want), chunk=256)  # today's format codes it anew
    assert now.meta["m"] == ans.RANS and torch.equal(roundtrip(now), torch.from_numpy(want))
    # its CRC-32 is still checked: a flipped byte is refused (today's fields use XXH3)
    assert _frame.CRC in p.meta and _frame.DIGEST in now.meta
    data = bytearray(p.fields["d"])
    data[5] ^= 0x10
    with pytest.raises(PayloadError, match="checksum"):
        ans.decode(Payload({**p.fields, "d": bytes(data)}, p.meta))


@pytest.mark.parametrize("n", [*range(18), 1023, 1025, 1031])
def test_every_tail_length_of_the_interleaved_states(n):
    """Streams whose length leaves 0-7 symbols after the last full group of eight, in
    one chunk and across chunks (of 4, 8 and 9 symbols), round-trip."""
    assert _rans.STATES == 8
    rng = np.random.default_rng(n)
    t = torch.from_numpy(rng.integers(-5, 6, n).astype(np.int8))
    for chunk in (4, 8, 9, 1024):
        assert torch.equal(roundtrip(ans.encode(t, chunk)), t)


def test_a_stream_missing_its_last_word_is_refused():
    t = laplace_int8(1001)
    p = ans.encode(t)
    assert p.meta["m"] == ans.RANS
    data = bytes(p.fields["d"])[:-2]
    meta = {**p.meta, "cw": (p.meta["cw"][0] - 1,)}
    meta.pop(_frame.DIGEST)
    with pytest.raises(PayloadError, match="corrupt or truncated"):
        ans.decode(_frame.seal(Payload({**p.fields, "d": data}, meta)))


def mostly_zero(seed: int, n: int = 4096, nnz: int = 128, dtype=np.int8) -> torch.Tensor:
    """n values, n - nnz of them zero (3968 of 4096 by default: a quantized frequency of
    31744 / 2**15 for zero, one the old reciprocal got wrong near the top of the state)."""
    rng = np.random.default_rng(seed)
    x = np.zeros(n, dtype)
    idx = rng.choice(n, nnz, replace=False)
    if np.issubdtype(dtype, np.floating):
        x[idx] = rng.standard_normal(nnz) * 1e-3
    else:
        x[idx] = rng.integers(1, 8, nnz)
    return torch.from_numpy(x)


@pytest.mark.parametrize("backend", ans.BACKENDS)
def test_mostly_zero_streams_roundtrip(backend):
    # seed 261 failed with "rANS stream is corrupt or truncated" before the fix; the long
    # stream (exactly 31/32 zeros) failed for any seed
    for t in (mostly_zero(261), mostly_zero(0, n=1 << 20, nnz=1 << 15)):
        for chunk in (1024, ans.DEFAULT_CHUNK):
            assert torch.equal(roundtrip(ans.encode(t, chunk, backend)), t)


@pytest.mark.parametrize("backend", ans.BACKENDS)
@settings(max_examples=150)
@given(t=skewed_int_tensors(), chunk=st.sampled_from([1024, ans.DEFAULT_CHUNK]))
def test_skewed_streams_roundtrip(backend, t, chunk):
    p = ans.encode(t, chunk, backend)
    y = roundtrip(p)
    assert y.dtype == t.dtype and y.shape == t.shape and torch.equal(y, t)


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


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_corrupt_or_truncated_payload_raises(backend):
    p = ans.encode(laplace_int8(5000), backend=backend)
    data = bytearray(p.fields["d"])
    data[7] ^= 0x01
    with pytest.raises(PayloadError, match="checksum"):
        ans.decode(Payload({**p.fields, "d": bytes(data)}, p.meta))
    with pytest.raises(PayloadError):
        ans.decode(Payload({**p.fields, "t": p.fields["t"][:-1]}, p.meta))
    with pytest.raises(PayloadError):
        ans.decode(Payload(p.fields, {k: v for k, v in p.meta.items() if k != _frame.DIGEST}))
    # even with a matching checksum, a damaged stream is caught by the coder itself
    unsealed = {k: v for k, v in p.meta.items() if k != _frame.DIGEST}
    bad = Payload({**p.fields, "d": bytes(data)}, unsealed)
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


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099])
def test_byte_indexed_encoder_writes_the_words_of_the_general_one(dtype, n):
    """One-byte streams index the encoder's table by their raw bytes (``base`` None);
    the words must be those of the general path, rows indexed by ``v - base``."""
    rng = np.random.default_rng(n)
    v = np.clip(np.round(rng.laplace(size=n) * 9), -128, 127).astype(np.int16)
    v = (v if dtype == np.int8 else v + 128).astype(dtype)
    base = -128 if dtype == np.int8 else 0
    counts = np.bincount(v.astype(np.int64) - base, minlength=256)
    present = np.nonzero(counts)[0]
    freq = _rans.quantize(counts[present])
    general = np.zeros((256, _rans.ROW), np.uint64)
    general[present] = _rans.encoder_table(freq)
    u, row_base, by_byte = ans._rans_rows(v, base, present, freq, 256, encoder=_rans)
    assert row_base is None and u.dtype == np.uint8
    a, b = np.empty(n + 16, np.uint16), np.empty(n + 16, np.uint16)
    begin_a = _rans.encode(v, base, general.ravel(), a, a.size)
    begin_b = _rans.encode(u, None, by_byte, b, b.size)
    assert begin_a == begin_b and np.array_equal(a[begin_a:], b[begin_b:])
