"""A static-model rANS coder in numba: the fast path of the ``ans`` stage.

Range ANS as in Duda (2013) with the byte-/word-oriented layout of Giesen's public
``rans_byte`` (2014): a 32-bit state kept in [2**16, 2**32), 16-bit renormalisation
words, frequencies quantized to a total of 2**15, and the division in the encoder
replaced by a multiplication with a precomputed reciprocal (a 33-bit one, exact for
every state the encoder divides: see ``encoder_tables``). Two states are
interleaved (even and odd symbols) so their dependency chains overlap in the CPU.
The encoder runs backwards and writes words from the end; the decoder reads forward
and must finish with both states back at their initial value and every word used,
which catches most corruption on its own (a checksum covers the rest).
"""

from __future__ import annotations

import numpy as np
from numba import njit

SCALE_BITS = 15
M = 1 << SCALE_BITS
L = 1 << 16  # lower bound of the state


def quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies proportional to ``counts`` summing to 2**15, every present one >= 1.

    Needs at most 2**15 symbols; the largest frequencies absorb the rounding.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size == 0 or counts.size > M or (counts <= 0).any():
        raise ValueError(f"rANS needs 1..{M} positive counts, got {counts.size}")
    f = np.maximum(1, np.round(counts * (M / counts.sum()))).astype(np.int64)
    diff = M - int(f.sum())
    order = np.argsort(-f, kind="stable")
    while diff != 0:
        if diff > 0:
            f[order[0]] += diff
            diff = 0
        else:
            room = order[f[order] > 1][: -diff]
            f[room] -= 1
            diff += room.size
    return f


def encoder_tables(freq: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-symbol (x_max, reciprocal, shift, start, M - freq) for ``encode``.

    The encoder divides states ``x < x_max = 2**17 * freq <= 2**32`` by ``freq``. Giesen's
    32-bit reciprocal ``ceil(2**(31 + s) / freq)`` (``s = ceil(log2(freq))``) is exact only
    for ``x < 2**31``, which ``rans_byte`` guarantees with its 31-bit state but this coder
    does not: with 16-bit words the state reaches 2**32 once ``freq > 2**14``, and for
    ``freq`` above about 23,300 (a symbol with probability > ~71%) some quotients came out
    one too large and the stream was undecodable. So the reciprocal here is
    Granlund-Montgomery's ``m = ceil(2**(32 + s) / freq)``, exact for every ``x < 2**32``;
    it has 33 bits, and only its low 32 (``m - 2**32``) are stored:
    ``x // freq == (x + ((x * (m - 2**32)) >> 32)) >> s`` with no 64-bit overflow. It
    needs no special case for ``freq == 1`` (``m = 2**32``). Where the old reciprocal was
    right the words are the same, so the format is unchanged.
    """
    freq = freq.astype(np.int64)
    start = np.concatenate([[0], np.cumsum(freq)[:-1]])
    x_max = ((L >> SCALE_BITS) << 16) * freq
    shift = [int(f - 1).bit_length() for f in freq.tolist()]
    rcp = np.array([-(-(1 << (32 + s)) // f) - (1 << 32)
                    for f, s in zip(freq.tolist(), shift, strict=True)], np.uint64)
    return (x_max.astype(np.uint64), rcp, np.array(shift, np.uint64), start.astype(np.uint64),
            (M - freq).astype(np.uint64))


@njit(cache=True, nogil=True, inline="always")
def _step(x, s, x_max, rcp, shift, start, cmpl, out, pos):
    """Encode symbol ``s`` into state ``x``; branch-free renormalisation (at most one
    16-bit word, written speculatively and kept only if needed)."""
    big = x >= x_max[s]
    out[pos - 1] = np.uint16(x & np.uint64(0xFFFF))
    pos -= np.int64(big)
    x >>= np.uint64(16 * big)
    q = (x + ((x * rcp[s]) >> np.uint64(32))) >> shift[s]  # x // freq without a division
    return x + start[s] + q * cmpl[s], pos  # q * M + start + x % freq


@njit(cache=True, nogil=True)
def encode(v, base, lut, x_max, rcp, shift, start, cmpl):
    """16-bit words of the rANS code of ``v`` (symbol ``lut[v - base]``); two states are
    interleaved: even indices use state 0, odd ones state 1."""
    n = v.size
    out = np.empty(n + 8, np.uint16)
    pos = out.size
    x0 = np.uint64(L)
    x1 = np.uint64(L)
    i = n - 1
    if n % 2 == 1:  # the last symbol has an even index: state 0
        s = np.int64(lut[np.int64(v[i]) - base])
        x0, pos = _step(x0, s, x_max, rcp, shift, start, cmpl, out, pos)
        i -= 1
    while i > 0:
        s = np.int64(lut[np.int64(v[i]) - base])
        x1, pos = _step(x1, s, x_max, rcp, shift, start, cmpl, out, pos)
        s = np.int64(lut[np.int64(v[i - 1]) - base])
        x0, pos = _step(x0, s, x_max, rcp, shift, start, cmpl, out, pos)
        i -= 2
    for x in (x1, x0):
        pos -= 1
        out[pos] = np.uint16(x & np.uint64(0xFFFF))
        pos -= 1
        out[pos] = np.uint16(x >> np.uint64(16))
    return out[pos:]


@njit(cache=True, nogil=True)
def decode(words, freq, cum, slot_sym, values, out):
    """Inverse of ``encode`` into ``out`` (values[s] per symbol); 0 if the stream is
    consistent, -1 if it runs out of words or does not end in the initial states."""
    nw = words.size
    if nw < 4:
        return -1
    x0 = (np.uint64(words[0]) << np.uint64(16)) | np.uint64(words[1])
    x1 = (np.uint64(words[2]) << np.uint64(16)) | np.uint64(words[3])
    p = 4
    mask = np.uint64(M - 1)
    lower = np.uint64(L)
    shift = np.uint64(SCALE_BITS)
    sh16 = np.uint64(16)
    for i in range(out.size):
        odd = (i & 1) == 1
        x = x1 if odd else x0
        slot = x & mask
        s = np.int64(slot_sym[np.int64(slot)])
        x = freq[s] * (x >> shift) + slot - cum[s]
        while x < lower:
            if p >= nw:
                return -1
            x = (x << sh16) | np.uint64(words[p])
            p += 1
        if odd:
            x1 = x
        else:
            x0 = x
        out[i] = values[s]
    if p != nw or x0 != lower or x1 != lower:
        return -1
    return 0
