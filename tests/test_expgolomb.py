"""The ``eg`` stage: bit-exact round trips, exact lengths, reference bits, corruption."""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import Payload, PayloadError, registered
from gradzip.codecs.entropy import _frame, expgolomb, measures

INT_DTYPES = {torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int16: (-(2**15), 2**15 - 1),
              torch.int32: (-(2**31), 2**31 - 1), torch.int64: (-(2**63), 2**63 - 1)}


@st.composite
def int_tensors(draw):
    dtype = draw(st.sampled_from(list(INT_DTYPES)))
    lo, hi = INT_DTYPES[dtype]
    kind = draw(st.sampled_from(["small", "full", "zeros", "single", "extreme"]))
    n = draw(st.integers(0, 300))
    if kind == "small":
        values = draw(st.lists(st.integers(max(lo, -20), min(hi, 20)), min_size=n, max_size=n))
    elif kind == "full":
        values = draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    elif kind == "zeros":
        values = [0] * n
    elif kind == "single":
        values = [draw(st.integers(lo, hi))] * max(n, 1)
    else:
        values = [draw(st.sampled_from([lo, hi, 0, lo + 1, hi - 1])) for _ in range(max(n, 1))]
    shape = draw(st.sampled_from([(len(values),), (1, len(values))]))
    return torch.tensor(values, dtype=torch.int64).to(dtype).reshape(shape)


@st.composite
def skewed_int_tensors(draw, dtypes=tuple(INT_DTYPES)):
    """One dominant value and 1-10 rare ones, 1..10,000 values: the byte planes of sparse
    or mostly-zero gradients. A symbol above ~71% probability once broke the rANS coder."""
    dtype = draw(st.sampled_from(list(dtypes)))
    lo, hi = INT_DTYPES[dtype]
    value = st.one_of(st.integers(max(lo, -20), min(hi, 20)), st.integers(lo, hi),
                      st.sampled_from([lo, hi, 0]))
    n = draw(st.integers(1, 10_000))
    dominant = draw(value)
    rare = draw(st.lists(value, min_size=1, max_size=10))
    p_rare = draw(st.sampled_from([1e-4, 1e-3, 0.005, 0.01, 1 / 32, 0.05, 0.1, 0.25, 0.45]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    v = np.full(n, dominant, np.int64)
    hit = rng.random(n) < p_rare
    v[hit] = np.array(rare, np.int64)[rng.integers(0, len(rare), int(hit.sum()))]
    return torch.from_numpy(v).to(dtype)


def roundtrip(p: Payload) -> torch.Tensor:
    """Decode after a trip through the wire format."""
    outer = Payload.deserialize(Payload({"f": p}).serialize())
    return expgolomb.decode(outer.child("f"))


@given(int_tensors(), st.sampled_from(["auto", 0, 1, 3]),
       st.sampled_from(["auto", *measures.MAPPINGS]))
def test_roundtrip_is_bit_exact(t, k, mapping):
    p = expgolomb.encode(t, k, mapping)
    y = roundtrip(p)
    assert y.dtype == t.dtype and y.shape == t.shape and torch.equal(y, t)
    raw_wire = 8 + t.numel() * t.element_size()
    assert p.wire_bytes <= raw_wire + 64  # never much worse than stored


@settings(max_examples=150)
@given(skewed_int_tensors(), st.sampled_from(["auto", 0, 2]),
       st.sampled_from(["auto", *measures.MAPPINGS]))
def test_skewed_streams_roundtrip(t, k, mapping):
    y = roundtrip(expgolomb.encode(t, k, mapping))
    assert y.dtype == t.dtype and torch.equal(y, t)


def laplace_int8(n=50_000, scale=6.0, seed=0):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.clip(np.round(rng.laplace(size=n) * scale), -127, 127)
                            .astype(np.int8))


@pytest.mark.parametrize("mapping", measures.MAPPINGS)
@pytest.mark.parametrize("k", [0, 2, 5])
def test_encoder_writes_exactly_the_computed_length(mapping, k):
    t = laplace_int8() if mapping != "offset" else laplace_int8().abs()
    p = expgolomb.encode(t, k, mapping)
    assert p.meta["m"] == "eg" and p.meta["k"] == k and p.meta["map"] == mapping
    h = (t.numel() + 1) // 2  # two streams (halves), each padded to whole bytes
    assert t.numel() >= expgolomb.SPLIT_MIN and len(p.meta["cw"]) == 2
    lengths = measures.eg_code_lengths(t, k, mapping)  # the whole stream's mapping
    sizes = [(int(half.sum()) + 7) // 8 for half in (lengths[:h], lengths[h:])]
    assert list(p.meta["cw"]) == sizes and len(p.fields["d"]) == sum(sizes)
    one = expgolomb.encode(t[:1000], k, mapping)  # short streams: one stream, as before
    bits = int(measures.eg_code_lengths(t[:1000], k, mapping).sum())
    assert "cw" not in one.meta and len(one.fields["d"]) == (bits + 7) // 8
    assert torch.equal(roundtrip(p), t) and torch.equal(roundtrip(one), t[:1000])


@pytest.mark.parametrize("n", [expgolomb.SPLIT_MIN, expgolomb.SPLIT_MIN + 1, 100_001])
@pytest.mark.parametrize("mapping", ["zigzag", "sign", "rank"])
def test_two_streams_round_trip_and_refuse_damage(n, mapping):
    """Odd and even lengths, long codes (beyond the decoder's table) in both halves; a
    stream cut short or sizes that do not add up are refused."""
    rng = np.random.default_rng(n)
    x = rng.laplace(size=n) * 4
    x[rng.choice(n, 50, replace=False)] = rng.choice([-1, 1], 50) * 30_000  # long codes
    t = torch.from_numpy(np.round(x).astype(np.int16))
    p = expgolomb.encode(t, "auto", mapping)
    assert p.meta["map"] == mapping and len(p.meta["cw"]) == 2
    assert torch.equal(roundtrip(p), t)
    meta = {key: v for key, v in p.meta.items() if key != _frame.DIGEST}
    a, b = p.meta["cw"]
    for cw in ((a - 1, b + 1), (a + 1, b - 1), (a, b, 0), (a + b + 8, -8)):
        bad = _frame.seal(Payload(dict(p.fields), {**meta, "cw": cw}))
        with pytest.raises(PayloadError):
            expgolomb.decode(bad)


def test_bits_match_the_textbook_code():
    t = torch.tensor([0, 1, -1, 2, -7, 0, 40], dtype=torch.int16)
    for k in (0, 1, 3):
        want = ""
        for v in t.tolist():
            n = abs(v) + (1 << k)
            sign = "" if v == 0 else str(int(v < 0))
            want += "0" * (n.bit_length() - 1 - k) + bin(n)[2:] + sign
        p = expgolomb.encode(t.repeat(40), k, "sign")  # repeated so coding pays over raw
        got = "".join(f"{b:08b}" for b in p.fields["d"])
        assert got[: len(want)] == want


def test_auto_picks_the_cheapest_mapping_and_k():
    t = laplace_int8()
    p = expgolomb.encode(t)
    values, counts = measures.histogram(t)
    best = min(measures.best_k(values, counts, m).total_bits for m in measures.MAPPINGS)
    chosen = measures.best_k(values, counts, p.meta["map"])
    assert chosen.total_bits == best and p.meta["k"] == chosen.k


def test_long_codes_and_wide_streams_take_the_general_path():
    rng = np.random.default_rng(1)
    t = torch.from_numpy(rng.geometric(1e-4, size=5000).astype(np.int64) * 97)
    for mapping in ("offset", "zigzag", "sign"):
        p = expgolomb.encode(t, "auto", mapping)
        assert p.meta["m"] == "eg" and torch.equal(roundtrip(p), t)


def test_corrupt_or_truncated_payload_raises():
    t = laplace_int8(5000)
    p = expgolomb.encode(t)
    data = bytearray(p.fields["d"])
    data[len(data) // 2] ^= 0x10
    with pytest.raises(PayloadError, match="checksum"):
        expgolomb.decode(Payload({**p.fields, "d": bytes(data)}, p.meta))
    with pytest.raises(PayloadError):
        expgolomb.decode(Payload({**p.fields, "d": p.fields["d"][:-3]}, p.meta))
    with pytest.raises(PayloadError):
        expgolomb.decode(Payload(p.fields, {**p.meta, "k": p.meta["k"] + 1}))
    wire = Payload({"f": p}).serialize()
    with pytest.raises(PayloadError):
        Payload.deserialize(wire[:-5])


def test_parameters_are_validated():
    with pytest.raises(gradzip.SpecError):
        gradzip.codec("none | eg(mapping=gray)")
    with pytest.raises(gradzip.SpecError):
        gradzip.codec("none | eg(k=99)")
    assert str(gradzip.codec("none | eg(k=2, mapping=rank)")) == "none | eg(k=2, mapping=rank)"


CHAINS = [s for s, need in [
    ("int8 | eg", ("int8",)), ("qsgd | eg(mapping=sign)", ("qsgd",)),
    ("topk | qsgd | eg", ("topk", "qsgd")), ("terngrad(shared=false) | eg(k=0)", ("terngrad",)),
    ("natural | eg", ("natural",)), ("none | eg", ()),
] if all(n in registered() for n in need)]


@pytest.mark.parametrize("spec", CHAINS)
def test_eg_after_integer_codecs_is_exact(spec):
    lossy = gradzip.codec(spec.rsplit("|", 1)[0].strip())
    coded = gradzip.codec(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * torch.randn(4000, generator=g).exp()
    y = coded.decode(Payload.deserialize(coded.encode(x, "w").serialize()))
    assert torch.equal(y, lossy.decode(lossy.encode(x, "w")))


def reference_bits(values: list[int], k: int, mapping: str) -> str:
    """The bitstream written the straightforward way: symbol by symbol, as text.

    Each value is mapped to u >= 0 (see ``measures``), coded as ``u + 2**k`` in binary
    after ``bits - 1 - k`` zeros, then its sign bit where the mapping has one.
    """
    distinct = sorted(set(values))
    count = {v: values.count(v) for v in distinct}
    ranked = sorted(distinct, key=lambda v: (-count[v], v))
    out = []
    for v in values:
        u = {"sign": abs(v), "sign_always": abs(v), "zigzag": 2 * v if v >= 0 else -2 * v - 1,
             "offset": v - min(values), "rank": ranked.index(v)}[mapping]
        n = u + (1 << k)
        out.append("0" * (n.bit_length() - 1 - k) + bin(n)[2:])
        if mapping == "sign_always" or (mapping == "sign" and v != 0):
            out.append(str(int(v < 0)))
    return "".join(out)


@given(st.lists(st.integers(-40, 40), min_size=40, max_size=160), st.integers(0, 4),
       st.sampled_from(measures.MAPPINGS))
def test_bitstream_equals_the_reference_encoder(values, k, mapping):
    t = torch.tensor(values, dtype=torch.int32)  # raw int32 is dear, so coding pays
    p = expgolomb.encode(t, k, mapping)
    assert p.meta["m"] == "eg"
    want = reference_bits(values, k, mapping)
    got = "".join(f"{b:08b}" for b in p.fields["d"])
    assert len(got) == -(-len(want) // 8) * 8, "the encoder wrote another length"
    assert got == want.ljust(len(got), "0"), "the bits differ from the reference"
    assert torch.equal(roundtrip(p), t)


@pytest.mark.parametrize("mapping", ["zigzag", "sign", "rank"])
@pytest.mark.parametrize("codes", ["short", "long"])
@pytest.mark.parametrize("n", [999, expgolomb.SPLIT_MIN + 3])
def test_table_encoder_and_byte_wise_encoder_write_the_same_stream(mapping, codes, n,
                                                                    monkeypatch):
    """The table encoder (both halves written in place into one buffer; codes of at most
    16 bits two at a time, longer ones one at a time) and the generic encoder (wide
    alphabets, codes over 32 bits) write the same big-endian bitstream."""
    if codes == "short":
        t, k = laplace_int8(n=n), "auto"
    else:  # k = 0, 40% of the values spread over +-3,000: codes of up to 17-26 bits
        rng = np.random.default_rng(n)
        x = np.round(rng.laplace(size=n) * 3)
        wide = rng.random(n) < 0.4
        x[wide] = rng.integers(-3000, 3000, int(wide.sum()))
        t, k = torch.from_numpy(x.astype(np.int16)), 0
    fast = expgolomb.encode(t, k, mapping)
    lengths = measures.eg_code_lengths(t, fast.meta["k"], mapping)
    assert (int(lengths.max()) <= expgolomb.SHORT_CODE) == (codes == "short")
    assert int(lengths.max()) <= 32  # so the table encoder, not the generic one, ran
    monkeypatch.setattr(expgolomb, "_code_table", lambda *args: None)
    generic = expgolomb.encode(t, k, mapping)
    assert bytes(generic.fields["d"]) == bytes(fast.fields["d"])
    assert generic.meta == fast.meta


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 40),
       n=st.sampled_from([3001, expgolomb.SPLIT_MIN + 5]))
def test_damaged_payloads_fail_cleanly(seed, flips, n):
    """Bytes of one stream or of both halves damaged (and the checksum resealed, so the
    decoder itself must cope): a clean error or a tensor of the right shape, never a
    read outside the buffer. Long codes make the decoder leave its table path too."""
    rng = np.random.default_rng(seed)
    x = rng.laplace(size=n) * 5
    x[rng.choice(x.size, 20, replace=False)] = 20_000
    t = torch.from_numpy(np.round(x).astype(np.int16))
    p = expgolomb.encode(t, "auto", "zigzag")
    data = bytearray(p.fields["d"])
    for i in rng.integers(0, len(data), flips):
        data[i] ^= int(rng.integers(1, 256))
    meta = {key: v for key, v in p.meta.items() if key != _frame.DIGEST}
    bad = _frame.seal(Payload({**p.fields, "d": bytes(data)}, meta))
    try:
        y = expgolomb.decode(bad)
    except PayloadError:
        return
    assert y.shape == t.shape


def test_kept_prefix_tables_match_fresh_ones_and_cannot_be_changed():
    """The decoder keeps its prefix table per (k, mapping, lo): each kept table is the one
    a fresh build gives, shared read-only, and offset streams with different minima
    (different tables under one k) still decode one after the other."""
    for mapping in ("sign", "sign_always", "zigzag", "offset"):
        for k, lo in ((0, 0), (3, -7), (5, 100)):
            kept = expgolomb._peek_table(expgolomb._NO_TABLE, k, mapping, lo)
            fresh = expgolomb._build_peek_table(expgolomb._NO_TABLE, k, mapping, lo)
            assert np.array_equal(kept, fresh) and not kept.flags.writeable
            assert expgolomb._peek_table(expgolomb._NO_TABLE, k, mapping, lo) is kept
    base = laplace_int8(n=5000).abs().to(torch.int16)
    for shift in (0, 40, -300):
        t = base + shift
        p = expgolomb.encode(t, 2, "offset")
        assert p.meta["lo"] == int(t.min()) and torch.equal(roundtrip(p), t)


@pytest.mark.parametrize("n", [3001, expgolomb.SPLIT_MIN + 7])
def test_codes_past_the_window_are_read_byte_by_byte(n):
    """Codes over 56 bits (k = 0 on values near 2**40: ~81 bits) do not fit the decoder's
    window and are read from the byte position; those between 13 and 56 bits from the
    window's leading zeros. Both, mixed with table codes, in one stream and in two."""
    rng = np.random.default_rng(n)
    x = np.round(rng.laplace(size=n) * 3).astype(np.int64)
    x[rng.choice(n, 40, replace=False)] = rng.integers(1 << 39, 1 << 40, 40)
    x[rng.choice(n, 40, replace=False)] = rng.integers(1 << 12, 1 << 20, 40)
    t = torch.from_numpy(x)
    p = expgolomb.encode(t, 0, "zigzag")
    assert int(measures.eg_code_lengths(t, 0, "zigzag").max()) > 56
    assert torch.equal(roundtrip(p), t)


def _reference_choice(values, counts, k, mapping):
    """The choice the way ``eg`` made it before ``_eg_choice``: ``measures.best_k`` for
    each mapping whose span fits, the first of the fewest total bits."""
    lo, hi = int(values[0]), int(values[-1])
    fits = {"sign": max(-lo, hi) < measures.MAX_MAPPED,
            "sign_always": max(-lo, hi) < measures.MAX_MAPPED,
            "zigzag": max(-lo, hi) < measures.MAX_MAPPED // 2,
            "offset": hi - lo < measures.MAX_MAPPED, "rank": hi - lo < expgolomb._RANK_SPAN}
    best = None
    for m in measures.MAPPINGS if mapping == "auto" else (mapping,):
        if fits[m]:
            ks = None if k == "auto" else range(k, k + 1)
            choice = measures.best_k(values, counts, m, ks)
            if best is None or choice.total_bits < best.total_bits:
                best = choice
    return best


@settings(max_examples=300)
@given(t=st.one_of(int_tensors(), skewed_int_tensors()),
       k=st.one_of(st.just("auto"), st.integers(0, 12)),
       mapping=st.sampled_from(["auto", *measures.MAPPINGS]))
def test_compiled_choice_is_the_reference_choice(t, k, mapping):
    v = _frame.to_numpy(t).ravel()
    if v.size == 0:
        return
    values, counts = expgolomb._histogram(v)
    assert expgolomb._choose(values, counts, k, mapping) == _reference_choice(values, counts, k,
                                                                             mapping)
