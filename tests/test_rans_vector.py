"""The vector rANS encoder (``_rans_vector``) writes exactly the words of the scalar one."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit
from test_expgolomb import int_tensors, skewed_int_tensors

from gradzip.codecs.entropy import _frame, _rans, _rans_vector, _rans_vector_decode, ans

pytestmark = pytest.mark.skipif(not _rans_vector.AVAILABLE,
                                reason="the vector rANS encoder needs x86-64 with AVX2")

SENTINEL = np.uint16(0xA5A5)


def _both_encoders(v: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Code ``v`` in chunks with each encoder into a sentinel-filled buffer; return
    both whole buffers (so writes outside the code show up too)."""
    base = int(v.min())
    counts = np.bincount(v.astype(np.int64) - base)
    present = np.nonzero(counts)[0]
    freq = _rans.quantize(counts[present])
    buffers = []
    for encoder in (_rans, _rans_vector):
        u, row_base, table = ans._rans_rows(v, base, present, freq, counts.size, encoder)
        starts = range(0, v.size, chunk)
        out = np.full(v.size + 2 * _rans.STATES * len(starts) + 24, SENTINEL, np.uint16)
        end = out.size - 8
        for first in reversed(starts):
            end = encoder.encode(u[first:first + chunk], row_base, table, out, end)
        buffers.append(out)
    return buffers[0], buffers[1]


@settings(max_examples=150)
@given(t=st.one_of(int_tensors(), skewed_int_tensors()),
       chunk=st.sampled_from([1, 7, 8, 9, 64, 1 << 20]))
def test_vector_encoder_writes_the_scalar_words(t, chunk):
    v = _frame.to_numpy(t).ravel()
    if v.size == 0 or int(v.max()) - int(v.min()) >= ans.ALPHABET_SPAN:
        return
    scalar, vector = _both_encoders(v, chunk)
    assert np.array_equal(scalar, vector)


@pytest.mark.parametrize("n", [*range(0, 20), 4096, 4099, 100_003])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32])
def test_every_tail_and_dtype(n, dtype):
    rng = np.random.default_rng(n)
    v = np.clip(np.round(rng.laplace(size=max(n, 1)) * 7), -100, 100).astype(dtype)
    scalar, vector = _both_encoders(v, 1 << 20)
    assert np.array_equal(scalar, vector)


@njit(cache=False)
def _vector_steps(xs, syms, table, controls):
    """Each group of eight (state, symbol) pairs through one vector block; the states
    after it and each lane's word (the state's low 16 bits if it renormalised, else 0)."""
    res = np.empty(xs.size, np.uint32)
    lanes = np.empty(8, np.uint32)
    out = np.zeros(8, np.uint16)
    for g in range(0, xs.size, 8):
        lanes[:] = xs[g:g + 8]
        _rans_vector._encode_blocks(syms[g:g + 8], 0, np.uint64(1), table, controls, out,
                                    np.uint64(8), lanes)
        res[g:g + 8] = lanes
    return res


def test_vector_step_is_exact_for_every_frequency():
    """x -> (x // f) * M + start + x % f for every frequency 1..2**15, in every lane, at
    the states where a reciprocal errs (multiples of f and one below, up to x_max =
    2**17 * f, i.e. 2**32), and a renormalising state first drops its low 16 bits.
    Each symbol starts at its highest valid slot, M - f, so states reach 2**32 - 1."""
    freq = np.arange(1, _rans.M + 1, dtype=np.int64)  # one "symbol" per frequency
    table = _rans_vector.encoder_table(freq)
    start = _rans.M - freq
    table[:, 3] = start | (start << 16)
    x_max = freq << 17
    k = np.concatenate([np.arange(1, 5), -np.arange(0, 24)])
    mult = np.where(k > 0, k[None, :], (x_max // freq)[:, None] + k[None, :])
    xs = np.concatenate([mult * freq[:, None] - 1, mult * freq[:, None],
                         x_max[:, None] + np.array([0, 1, 1 << 16])], axis=1)  # renormalise
    syms = np.broadcast_to(np.arange(freq.size)[:, None], xs.shape)
    ok = (xs >= _rans.L) & (xs < (1 << 32))
    xs, syms = xs[ok], syms[ok]
    pad = -xs.size % 8
    xs, syms = np.concatenate([xs, xs[:pad]]), np.concatenate([syms, syms[:pad]])
    got = _vector_steps(xs.astype(np.uint32), syms.astype(np.int32), table.ravel(),
                        _rans_vector._CONTROLS)
    f = freq[syms]
    y = np.where(xs >= x_max[syms], xs >> 16, xs)
    want = y // f * _rans.M + start[syms] + y % f
    bad = np.nonzero(got.astype(np.int64) != want)[0]
    assert bad.size == 0, f"{bad.size} wrong steps, e.g. f={f[bad[0]]} x={xs[bad[0]]}"


def test_ans_payloads_do_not_depend_on_the_encoder(monkeypatch):
    t = torch.from_numpy(np.random.default_rng(5).laplace(size=300_001).round().clip(-127, 127)
                         .astype(np.int8))
    assert ans.RANS_ENCODER is _rans_vector
    vector = ans.encode(t, chunk=100_000).serialize()
    monkeypatch.setattr(ans, "RANS_ENCODER", _rans)
    assert ans.encode(t, chunk=100_000).serialize() == vector


def _decoder_inputs(v: np.ndarray, chunk: int):
    """(words, sizes, table, values) of ``v`` coded in chunks of ``chunk``."""
    base = int(v.min())
    counts = np.bincount(v.astype(np.int64) - base)
    present = np.nonzero(counts)[0]
    freq = _rans.quantize(counts[present])
    u, row_base, table = ans._rans_rows(v, base, present, freq, counts.size, _rans)
    out = np.empty(v.size + 2 * _rans.STATES * -(-v.size // chunk), np.uint16)
    begin, sizes = _rans.encode_chunks(u, row_base, table, chunk, out)
    dtable, values = _rans.decoder_table(freq, (present + base).astype(v.dtype))
    return out[begin:].copy(), tuple(sizes), dtable, values


def _both_decoders(words, sizes, chunk, table, values, n, dtype):
    results = []
    for decoder in (_rans, _rans_vector_decode):
        out = np.zeros(n, dtype)
        results.append((decoder.decode_chunks(words, sizes, chunk, table, values, out), out))
    return results


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 7, 8, 9, 13])
@pytest.mark.parametrize("last", [0, 1, 7, 8, 9, 500])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32])
def test_chunk_groups_decode_like_the_scalar_decoder(chunks, last, dtype):
    """Four, two or one chunk at a time, a short last chunk or none, every dtype."""
    chunk = 1024
    n = (chunks - 1) * chunk + (last or chunk)
    rng = np.random.default_rng(chunks * 1000 + last)
    v = np.clip(np.round(rng.laplace(size=n) * 9), -100, 100).astype(dtype)
    words, sizes, table, values = _decoder_inputs(v, chunk)
    (s_scalar, scalar), (s_vector, vector) = _both_decoders(words, sizes, chunk, table, values,
                                                            n, dtype)
    assert s_scalar == s_vector == 0
    assert np.array_equal(scalar, v) and np.array_equal(vector, v)


@settings(max_examples=100)
@given(seed=st.integers(0, 2**32 - 1), chunks=st.integers(1, 9), data=st.data())
def test_damaged_words_get_the_scalar_decoders_verdict(seed, chunks, data):
    """Flipped, dropped or added words: the vector decoder says what the scalar one
    says (0 or -1) and, when it accepts, writes the same symbols."""
    chunk = 1024
    rng = np.random.default_rng(seed)
    n = chunks * chunk - int(rng.integers(0, chunk))
    v = np.clip(np.round(rng.laplace(size=n) * 5), -127, 127).astype(np.int8)
    words, sizes, table, values = _decoder_inputs(v, chunk)
    kind = data.draw(st.sampled_from(["flip", "drop", "add"]))
    at = data.draw(st.integers(0, words.size - 1))
    if kind == "flip":
        words[at] ^= np.uint16(data.draw(st.integers(1, 0xFFFF)))
    elif kind == "drop":
        words = np.delete(words, at)
        sizes = tuple(s - 1 if i == np.searchsorted(np.cumsum(sizes), at, "right") else s
                      for i, s in enumerate(sizes))
    else:
        words = np.insert(words, at, np.uint16(data.draw(st.integers(0, 0xFFFF))))
        sizes = (sizes[0] + 1, *sizes[1:])
    (s_scalar, scalar), (s_vector, vector) = _both_decoders(words, sizes, chunk, table, values,
                                                            n, np.int8)
    assert s_scalar == s_vector
    if s_scalar == 0:
        assert np.array_equal(scalar, vector)


def test_ans_decodes_with_the_vector_decoder():
    assert ans.RANS_DECODER is _rans_vector_decode
    t = torch.from_numpy(np.random.default_rng(6).laplace(size=300_001).round().clip(-127, 127)
                         .astype(np.int8))
    p = ans.encode(t)
    assert len(p.meta["cw"]) == 5 and torch.equal(ans.decode(p), t)
