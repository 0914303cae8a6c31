"""The unaligned big-endian load/store intrinsics of the bit-stream kernels."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from gradzip.codecs.entropy._bytes import load_be64, store_be32


@njit(cache=False)
def _load(buf, i):
    return load_be64(buf, i)


@njit(cache=False)
def _store(buf, i, value):
    store_be32(buf, i, value)


@settings(max_examples=200)
@given(data=st.binary(min_size=8, max_size=40), at=st.integers(0, 32))
def test_load_be64_reads_eight_bytes_big_endian_at_any_offset(data, at):
    at = min(at, len(data) - 8)
    buf = np.frombuffer(data, np.uint8).copy()
    assert int(_load(buf, at)) == int.from_bytes(data[at:at + 8], "big")


@settings(max_examples=200)
@given(size=st.integers(4, 40), at=st.integers(0, 36), value=st.integers(0, 2**64 - 1))
def test_store_be32_writes_the_low_word_big_endian_and_nothing_else(size, at, value):
    at = min(at, size - 4)
    buf = np.arange(size, dtype=np.uint8)
    want = bytearray(buf.tobytes())
    want[at:at + 4] = (value & 0xFFFFFFFF).to_bytes(4, "big")
    _store(buf, at, np.uint64(value))
    assert buf.tobytes() == bytes(want)
