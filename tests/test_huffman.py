"""The block-adaptive Huffman coder of exponent planes (``_huffman``): exact on any bytes,
optimal length-limited codes, decoder tables equal to symbol-by-symbol decoding, and
damaged planes refused without a write outside the output."""

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.codecs.entropy import _huffman as H
from gradzip.codecs.entropy._frame import EntropyCodingError

SENTINEL = 0xA5
PAD = 16


def encode(plane):
    """(coded bytes, the scratch around them untouched beyond the 8-byte slack)."""
    out = np.full(H.bound(plane.size) + PAD, SENTINEL, np.uint8)
    n = H.encode(np.ascontiguousarray(plane, np.uint8), out[:-PAD])
    assert n <= H.bound(plane.size) - 8
    assert (out[n + 8:] == SENTINEL).all(), "encode wrote past its slack"
    return out[:n].copy()


def decode(data, size):
    """(status, symbols), decoding into the middle of a sentinel-filled buffer."""
    buf = np.full(size + 2 * PAD, SENTINEL, np.uint8)
    status = H.decode(np.asarray(data, np.uint8), buf[PAD:PAD + size])
    assert (buf[:PAD] == SENTINEL).all() and (buf[PAD + size:] == SENTINEL).all(), \
        "decode wrote outside its output"
    return status, buf[PAD:PAD + size]


def skewed(rng, n, alphabet, decay):
    p = decay ** np.arange(alphabet, dtype=float)
    return rng.choice(alphabet, n, p=p / p.sum()).astype(np.uint8) + rng.integers(0, 200)


@st.composite
def planes(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.one_of(st.integers(0, 300), st.sampled_from(
        [H.BLOCK - 1, H.BLOCK, H.BLOCK + 1, 3 * H.BLOCK + 5]), st.integers(0, 5 * H.BLOCK)))
    kind = draw(st.sampled_from(["uniform", "skewed", "constant", "two", "mixed", "steep"]))
    if kind == "uniform":
        return rng.integers(0, 256, n).astype(np.uint8)
    if kind == "skewed":
        return skewed(rng, n, draw(st.integers(2, 56)), draw(st.floats(0.3, 0.95)))
    if kind == "constant":
        return np.full(n, draw(st.integers(0, 255)), np.uint8)
    if kind == "two":
        return rng.choice(np.array([3, 250], np.uint8), n, p=[0.999, 0.001])
    if kind == "steep":  # geometric halves: an optimal code deeper than MAX_BITS
        return skewed(rng, n, 40, 0.5)
    parts = [skewed(rng, H.BLOCK // 2, 30, rng.uniform(0.4, 0.9)) for _ in range(7)]
    parts.append(np.zeros(H.BLOCK + 7, np.uint8))
    rng.shuffle(parts)
    return np.concatenate(parts)[:n]


@settings(max_examples=80, deadline=None)
@given(plane=planes())
def test_roundtrip_is_exact_on_any_bytes(plane):
    data = encode(plane)
    status, got = decode(data, plane.size)
    assert status == H.OK
    assert np.array_equal(got, plane)
    assert np.array_equal(H.decompress(H.compress(plane), plane.size), plane)


def huffman_cost(counts):
    """Bits of an unlimited optimal Huffman code (a reference by heapq)."""
    heap = [int(c) for c in counts if c > 0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 10**6), min_size=256, max_size=256).filter(
    lambda c: sum(x > 0 for x in c) >= 2))
def test_code_lengths_are_a_limited_prefix_code_and_optimal_when_the_limit_allows(counts):
    c = np.array(counts, np.int64)
    lengths = np.zeros(256, np.int64)
    H.code_lengths(c, lengths)
    assert ((lengths > 0) == (c > 0)).all()
    assert lengths.max() <= H.MAX_BITS
    assert sum(2.0 ** -int(x) for x in lengths if x) <= 1.0
    bits = int((c * lengths).sum())
    optimal = huffman_cost(c)
    assert bits >= optimal
    probe = c[c > 0]
    if probe.max() < 2 ** (H.MAX_BITS - 1) * probe.min():  # no optimal code beyond the limit
        assert bits == optimal


def test_deep_codes_are_limited_at_a_small_cost():
    c = np.zeros(256, np.int64)
    c[:30] = [int(1.6 ** (30 - i)) + 1 for i in range(30)]  # Fibonacci-like: depth ~29
    lengths = np.zeros(256, np.int64)
    H.code_lengths(c, lengths)
    assert lengths.max() == H.MAX_BITS
    assert sum(2.0 ** -int(x) for x in lengths if x) <= 1.0
    assert (c * lengths).sum() <= 1.01 * huffman_cost(c)


def reference_entry(single, i):
    syms = used = count = 0
    while count < H.PER_LOOKUP:
        e = int(single[(i >> used) & H.MASK])
        length = e >> 8
        if length == 0 or used + length > H.MAX_BITS:
            break
        syms |= (e & 255) << (8 * count)
        used += length
        count += 1
    return syms, used, count


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 10**5), min_size=256, max_size=256).filter(
    lambda c: sum(x > 0 for x in c) >= 2))
def test_multi_symbol_entries_decode_as_symbol_by_symbol(counts):
    lengths = np.zeros(256, np.int64)
    H.code_lengths(np.array(counts, np.int64), lengths)
    single, multi = np.zeros(H.TABLE, np.int64), np.zeros(H.TABLE, np.int64)
    assert H.decoder_tables(lengths, single, multi)
    for i in range(H.TABLE):
        m = int(multi[i])
        got = (m & 0xFFFFFFFF, (m >> H.BITS_AT) & 15, (m >> H.COUNT_AT) & 7)
        assert got == reference_entry(single, i), i


def test_tables_that_are_no_prefix_code_are_refused():
    single, multi = np.zeros(H.TABLE, np.int64), np.zeros(H.TABLE, np.int64)
    lengths = np.zeros(256, np.int64)
    lengths[:3] = 1  # Kraft sum 1.5
    assert not H.decoder_tables(lengths, single, multi)
    lengths[:3] = [1, 2, 12]  # longer than MAX_BITS
    assert not H.decoder_tables(lengths, single, multi)


def test_blocks_pick_the_table_of_their_distribution():
    """Alternating blocks of two distributions: two tables, each block coded by its
    own, smaller than one table for all."""
    rng = np.random.default_rng(1)
    p = 0.5 ** np.arange(8)
    narrow = [rng.choice(8, H.BLOCK, p=p / p.sum()).astype(np.uint8) + 20 for _ in range(4)]
    wide = [rng.integers(100, 164, H.BLOCK).astype(np.uint8) for _ in range(4)]
    plane = np.concatenate([b for pair in zip(narrow, wide, strict=True) for b in pair])
    data = encode(plane)
    assert data[3] == 2  # tables, after the 3-byte symbol count
    one_table = len(encode(np.concatenate(narrow + wide)[rng.permutation(plane.size)]))
    apart = sum(len(encode(b)) for b in narrow + wide)
    assert len(data) < apart < one_table
    assert np.array_equal(decode(data, plane.size)[1], plane)


def test_constant_blocks_cost_two_bytes():
    plane = np.full(5 * H.BLOCK, 7, np.uint8)
    data = encode(plane)
    assert len(data) == 3 + 1 + 2 * 5  # symbol count, no table, five constant blocks
    assert np.array_equal(decode(data, plane.size)[1], plane)


def damaged(data, rng):
    kind = rng.integers(0, 4)
    bad = bytearray(data)
    if kind == 0:
        i = rng.integers(0, len(bad))
        bad[i] ^= 1 << rng.integers(0, 8)
    elif kind == 1:
        del bad[rng.integers(0, len(bad)):]
    elif kind == 2:
        bad += bytes(rng.integers(0, 256, rng.integers(1, 9)).astype(np.uint8))
    else:
        i = rng.integers(0, len(bad))
        bad[i] = rng.integers(0, 256)
    return np.frombuffer(bytes(bad), np.uint8)


@pytest.mark.parametrize("seed", range(6))
def test_damaged_planes_are_refused_or_decode_within_bounds(seed):
    """Any damage: the decoder returns CORRUPT, or OK with symbols, never writing
    outside its output (a checksum around the plane catches what decodes)."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, 999).astype(np.uint8)
    plane = np.concatenate([skewed(rng, 2 * H.BLOCK + 333, 20, 0.6),
                            np.zeros(H.BLOCK, np.uint8), noise])
    data = encode(plane)
    refused = 0
    for _ in range(300):
        status, _ = decode(damaged(data, rng), plane.size)
        assert status in (H.OK, H.CORRUPT)
        refused += status == H.CORRUPT
    assert refused > 150  # truncation, extension and most flips are caught by the layout


def test_headers_out_of_range_are_refused():
    plane = skewed(np.random.default_rng(2), 3 * H.BLOCK, 20, 0.6)
    data = encode(plane)
    head = 3  # the symbol count's bytes
    for at, value in ((head, H.MAX_TABLES + 1), (head, 0), (0, data[0] ^ 1)):
        bad = data.copy()
        bad[at] = value
        assert decode(bad, plane.size)[0] == H.CORRUPT
    assert decode(data, plane.size + 1)[0] == H.CORRUPT
    assert decode(data, plane.size - 1)[0] == H.CORRUPT
    assert decode(np.zeros(0, np.uint8), plane.size)[0] == H.CORRUPT
    with pytest.raises(EntropyCodingError, match="damaged"):
        H.decompress(bytes(data[:-1]), plane.size)
