"""Entropy measures: order-0 entropy, float fields, exact Exp-Golomb lengths, eta."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradzip.codecs.entropy import measures


def reference_eg_code(u: int, k: int) -> str:
    """Exp-Golomb order k written out as a bit string, the textbook way."""
    n = u + (1 << k)
    body = bin(n)[2:]
    return "0" * (len(body) - 1 - k) + body


def reference_length(v: int, k: int, mapping: str, lo: int = 0, rank: dict | None = None) -> int:
    if mapping == "sign":
        return len(reference_eg_code(abs(v), k)) + (v != 0)
    if mapping == "sign_always":
        return len(reference_eg_code(abs(v), k)) + 1
    if mapping == "zigzag":
        return len(reference_eg_code(2 * v if v >= 0 else -2 * v - 1, k))
    if mapping == "offset":
        return len(reference_eg_code(v - lo, k))
    assert rank is not None
    return len(reference_eg_code(rank[v], k))


def test_entropy_of_simple_streams():
    assert measures.entropy(np.array([], np.int8)) == 0.0
    assert measures.entropy(np.zeros(100, np.int32)) == 0.0
    assert measures.entropy(np.arange(4).repeat(25)) == pytest.approx(2.0)
    x = torch.tensor([0, 0, 0, 1], dtype=torch.int8)
    h = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))
    assert measures.entropy(x) == pytest.approx(h)
    assert measures.entropy_bits(x) == pytest.approx(4 * h)


def test_histogram_int8_uint8_and_wide():
    for dtype in (np.int8, np.uint8, np.int16, np.int64):
        a = np.array([3, 1, 3, 0, 3], dtype=dtype)
        values, counts = measures.histogram(a)
        assert values.tolist() == [0, 1, 3] and counts.tolist() == [1, 1, 3]
    a = np.array([-128, 127, -128], np.int8)
    assert measures.histogram(a)[0].tolist() == [-128, 127]
    wide = np.array([-(2**40), 2**40, 0, 0])
    assert measures.histogram(wide)[1].tolist() == [1, 2, 1]


def test_float_field_entropy():
    x = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.bfloat16)
    fields = measures.float_fields(x)
    assert fields["sign"].tolist() == [0, 1, 0, 1]
    assert fields["exponent"].tolist() == [127, 127, 128, 128]
    assert fields["mantissa"].tolist() == [0, 0, 0, 0]
    h = measures.float_field_entropy(x)
    assert h["sign"] == pytest.approx(1.0) and h["exponent"] == pytest.approx(1.0)
    assert h["mantissa"] == 0.0 and h["total"] == pytest.approx(2.0) and h["bits"] == 16
    g = torch.randn(10000)
    for dtype, bits in ((torch.float32, 32), (torch.float16, 16)):
        h = measures.float_field_entropy(g.to(dtype))
        assert h["exponent"] < 5 and 0.99 < h["sign"] <= 1.0 and h["total"] <= bits
    with pytest.raises(TypeError):
        measures.float_fields(torch.zeros(3, dtype=torch.int8))


@given(st.lists(st.integers(-300, 300), min_size=1, max_size=200), st.integers(0, 6),
       st.sampled_from(measures.MAPPINGS))
def test_eg_lengths_match_reference(values, k, mapping):
    a = np.array(values, np.int64)
    got = measures.eg_code_lengths(a, k, mapping)
    lo = int(a.min())
    distinct, counts = np.unique(a, return_counts=True)
    ranked = measures.rank_order(distinct, counts)
    rank = {int(v): i for i, v in enumerate(ranked)}
    want = [reference_length(int(v), k, mapping, lo, rank) for v in a]
    assert got.tolist() == want
    assert measures.eg_bits(distinct, counts, k, mapping) == sum(want)


def test_eg_lengths_of_large_values_and_domain():
    u = np.array([0, 1, 2**31, 2**51 - 1, 2**52 - 1], np.int64)
    for k in (0, 5, 40):
        want = [len(reference_eg_code(int(x), k)) for x in u]
        assert measures.eg_lengths(u, k).tolist() == want
    with pytest.raises(ValueError):
        measures.eg_lengths(np.array([2**52]), 0)
    with pytest.raises(ValueError):
        measures.eg_lengths(np.array([-1]), 0)
    assert measures.bit_length(np.array([0, 1, 255, 256, 2**63 - 1])).tolist() == [0, 1, 8, 9, 63]


def test_rank_mapping_puts_the_most_frequent_symbol_first():
    a = np.array([5, 5, 5, -2, -2, 9])
    u, extra = measures.map_values(a, "rank")
    assert u.tolist() == [0, 0, 0, 1, 1, 2] and not extra.any()
    assert measures.rank_table_bits(*np.unique(a, return_counts=True)) == 3 * 8


@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=300),
       st.sampled_from(measures.MAPPINGS))
def test_best_k_is_the_minimum_over_all_k(values, mapping):
    distinct, counts = np.unique(np.array(values), return_counts=True)
    choice = measures.best_k(distinct, counts, mapping)
    brute = [measures.eg_bits(distinct, counts, k, mapping) for k in range(measures.MAX_K + 1)]
    assert choice.payload_bits == min(brute)
    assert choice.k == brute.index(min(brute))
    assert (choice.table_bits > 0) == (mapping == "rank")


def test_efficiency():
    assert measures.efficiency(90, 80, 10, 10) == pytest.approx(0.9)
    assert measures.efficiency(0, 0) == 1.0
    assert measures.efficiency(5, 0) == 0.0


@given(st.binary(min_size=0, max_size=300), st.sampled_from([np.int8, np.uint8, np.bool_]))
def test_byte_histogram_matches_the_general_kernel(data, dtype):
    """The 8-bytes-a-load histogram of the ans/eg stages: every tail length, every bin."""
    from gradzip.codecs.entropy import _kernels

    v = np.frombuffer(data, np.uint8)
    if dtype is np.bool_:
        v = v & 1
    v = v.view(dtype)
    base = -128 if dtype is np.int8 else 0
    assert _kernels.byte_hist(v).tolist() == _kernels.hist(v, base, 256).tolist()
