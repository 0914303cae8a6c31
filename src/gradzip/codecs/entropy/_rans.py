"""A static-model rANS coder in numba: the fast path of the ``ans`` stage.

Range ANS as in Duda (2013) with the byte-/word-oriented layout of Giesen's public
``rans_byte`` (2014): a 32-bit state kept in [2**16, 2**32), 16-bit renormalisation
words, frequencies quantized to a total of 2**15, and the division in the encoder
replaced by a multiplication with a precomputed reciprocal (a 33-bit one, exact for
every state the encoder divides: see ``encoder_table``). Eight states are
interleaved (symbol i in state i % 8) so their dependency chains overlap in the CPU
(eight decode 1.25x faster than four and encode 0.93x as fast: the decoder's chain,
a table lookup per symbol, is the longer one);
the decoder takes each symbol's frequency, offset and value from one table lookup,
renormalises without a branch, and indexes with unsigned integers (numba adds no
wrap-around checks for them). The encoder runs backwards and writes words from the end;
the decoder reads forward and must finish with every state back at its initial value
and every word used, which catches most corruption on its own (a checksum covers the
rest). ``decode_v1`` reads the first format (two states), so old payloads decode.
"""

from __future__ import annotations

import numpy as np
from numba import njit

SCALE_BITS = 15
M = 1 << SCALE_BITS
L = 1 << 16  # lower bound of the state
STATES = 8  # interleaved states of ``encode``/``decode``


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


#: columns of a row of the encoder's table (``encoder_table``), one row per symbol
XMAX, RCP, SHIFT, START, CMPL = range(5)
ROW = 8  # words a row: padded to one 64-byte cache line


def encoder_table(freq: np.ndarray) -> np.ndarray:
    """Per-symbol rows for ``encode``: ``x_max = freq << 17``, the low 32 bits of the
    reciprocal, its shift, the symbol's start and ``2**15 - freq``, one uint64 each
    (columns ``XMAX`` .. ``CMPL``). A step reads them as memory operands, so no register
    holds them: packing them into two words took 26% more instructions a symbol (the
    fields had to be shifted out, and the eight interleaved states then spilled to the
    stack) and made the encoder 1.1-1.25x slower.

    The encoder divides states ``x < x_max = 2**17 * freq <= 2**32`` by ``freq``. Giesen's
    32-bit reciprocal ``ceil(2**(31 + s) / freq)`` (``s = ceil(log2(freq))``) is exact only
    for ``x < 2**31``, which ``rans_byte`` guarantees with its 31-bit state but this coder
    does not: with 16-bit words the state reaches 2**32 once ``freq > 2**14``, and for
    ``freq`` above about 23,300 (a symbol with probability > ~71%) some quotients came out
    one too large and the stream was undecodable. So the reciprocal here is
    Granlund-Montgomery's ``m = ceil(2**(32 + s) / freq)``, exact for every ``x < 2**32``;
    it has 33 bits, and only its low 32 (``m - 2**32``) are stored:
    ``x // freq == (x + ((x * (m - 2**32)) >> 32)) >> s`` with no 64-bit overflow. It
    needs no special case for ``freq == 1`` (``m = 2**32``).
    """
    freq = np.asarray(freq, np.int64)
    shift = [int(f - 1).bit_length() for f in freq.tolist()]
    table = np.zeros((freq.size, ROW), np.uint64)
    table[:, XMAX] = freq.astype(np.uint64) << np.uint64(17)
    table[:, RCP] = [-(-(1 << (32 + s)) // f) - (1 << 32)
                     for f, s in zip(freq.tolist(), shift, strict=True)]
    table[:, SHIFT] = shift
    table[:, START] = np.concatenate([[0], np.cumsum(freq)[:-1]])
    table[:, CMPL] = M - freq
    return table


_LOW16 = np.uint64(0xFFFF)


@njit(cache=True, nogil=True, inline="always")
def _step(x, table, r, out, pos):
    """Encode the symbol of row ``r`` of the flattened ``table`` into state ``x``;
    branch-free renormalisation: at most one 16-bit word, written speculatively at
    ``out[pos - 1]`` and kept (``pos`` moves) only if needed. Returns (state, pos).

    The table is 1-D so a row's address is ``r * 8`` words, a shift: a 2-D array's row
    stride is a run-time value, multiplied for every symbol (an ``imul`` and one more
    register among the eight states; 1.11-1.13x slower)."""
    r = r * np.uint64(ROW)
    big = x >= table[r + np.uint64(XMAX)]
    out[pos - np.uint64(1)] = np.uint16(x & _LOW16)
    pos -= np.uint64(big)
    x = (x >> np.uint64(16)) if big else x
    q = (x + ((x * table[r + np.uint64(RCP)]) >> np.uint64(32))) >> table[r + np.uint64(SHIFT)]
    return x + table[r + np.uint64(START)] + q * table[r + np.uint64(CMPL)], pos


@njit(cache=True, nogil=True, inline="always")
def _put(x, v, i, base, table, out, pos):
    """Encode ``v[i]``: its row is ``v[i] - base``, or the byte itself when ``base`` is
    None (numba then compiles the subtraction away, 1.02-1.09x faster)."""
    if base is None:
        r = np.uint64(v[i])
    else:
        r = np.uint64(np.int64(v[i]) - base)  # unsigned indices: no wrap-around checks
    return _step(x, table, r, out, pos)


@njit(cache=True, nogil=True)
def encode(v, base, table, out, end):
    """rANS-code ``v`` into the 16-bit words ``out[begin:end]``, written backwards from
    ``end``; returns ``begin``. ``table`` is ``encoder_table(...).ravel()`` with rows
    indexed by ``v - base`` (``base`` an int), or by the bytes of ``v`` (a uint8 array,
    ``base`` None). ``out`` must have room for ``v.size + 2 * STATES`` words before
    ``end``, so successive calls on a stream's chunks, last chunk first, leave the
    chunks' codes contiguous and in order.

    Eight states interleaved, symbol ``i`` in state ``i % 8``. The encoder runs
    backwards so the decoder reads forwards; the final states lead the code."""
    n = v.size
    pos = np.uint64(end)
    xs = np.full(STATES, np.uint64(L))
    for j in range(n - 1, n - n % STATES - 1, -1):  # the tail: states 0..n%8-1
        xs[j % STATES], pos = _put(xs[j % STATES], v, np.uint64(j), base, table, out, pos)
    x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
    i = np.uint64(n - n % STATES)
    eight = np.uint64(STATES)
    while i >= eight:
        i -= eight
        x7, pos = _put(x7, v, i + np.uint64(7), base, table, out, pos)
        x6, pos = _put(x6, v, i + np.uint64(6), base, table, out, pos)
        x5, pos = _put(x5, v, i + np.uint64(5), base, table, out, pos)
        x4, pos = _put(x4, v, i + np.uint64(4), base, table, out, pos)
        x3, pos = _put(x3, v, i + np.uint64(3), base, table, out, pos)
        x2, pos = _put(x2, v, i + np.uint64(2), base, table, out, pos)
        x1, pos = _put(x1, v, i + np.uint64(1), base, table, out, pos)
        x0, pos = _put(x0, v, i, base, table, out, pos)
    for x in (x7, x6, x5, x4, x3, x2, x1, x0):
        out[pos - np.uint64(1)] = np.uint16(x & _LOW16)
        out[pos - np.uint64(2)] = np.uint16(x >> np.uint64(16))
        pos -= np.uint64(2)
    return np.int64(pos)


def encode_chunks(v: np.ndarray, base: int | None, table: np.ndarray, chunk: int,
                  out: np.ndarray) -> tuple[int, list[int]]:
    """``encode`` of ``v`` in chunks of ``chunk`` symbols, each with its own eight
    states, last chunk first, so their codes end ``out`` contiguous and in order.
    ``out`` needs ``v.size + 2 * STATES`` words for each chunk. Returns where the codes
    begin and each chunk's word count."""
    end, sizes = out.size, []
    for first in reversed(range(0, v.size, chunk)):
        begin = encode(v[first:first + chunk], base, table, out, end)
        sizes.append(end - begin)
        end = begin
    return end, sizes[::-1]


def decoder_table(freq: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-slot ``(freq << 16 | slot - start, value)`` of the symbol owning each of the
    2**15 slots: the decoder's one table lookup per symbol."""
    freq = np.asarray(freq, np.int64)
    start = np.concatenate([[0], np.cumsum(freq)[:-1]])
    sym = np.repeat(np.arange(freq.size), freq)
    slot = np.arange(M, dtype=np.int64)
    packed = ((freq[sym] << 16) | (slot - start[sym])).astype(np.uint32)
    return packed, values[sym]


@njit(cache=True, nogil=True, inline="always")
def pop_symbol(x, table, values, word, out, i):
    """Decode symbol ``i`` from state ``x`` (32-bit) and refill the state with ``word``
    if it fell below 2**16. Returns (state, 1 if the word was used else 0)."""
    s = x & np.uint32(M - 1)
    e = table[s]
    out[i] = values[s]
    x = (e >> np.uint32(16)) * (x >> np.uint32(SCALE_BITS)) + (e & np.uint32(0xFFFF))
    need = x < np.uint32(L)
    x = ((x << np.uint32(16)) | np.uint32(word)) if need else x
    return x, np.uint64(need)


@njit(cache=True, nogil=True, inline="always")
def load_state(words, j):
    return (np.uint32(words[2 * j]) << np.uint32(16)) | np.uint32(words[2 * j + 1])


@njit(cache=True, nogil=True)
def decode(words, table, values, out):
    """Inverse of ``encode`` into ``out``; 0 if the stream is consistent, -1 if it runs
    out of words or does not end with every state back at 2**16 and every word used."""
    nw = np.uint64(words.size)
    if nw < 2 * STATES:
        return -1
    x0, x1 = load_state(words, 0), load_state(words, 1)
    x2, x3 = load_state(words, 2), load_state(words, 3)
    x4, x5 = load_state(words, 4), load_state(words, 5)
    x6, x7 = load_state(words, 6), load_state(words, 7)
    p = np.uint64(2 * STATES)
    n = np.uint64(out.size)
    i = np.uint64(0)
    eight = np.uint64(STATES)
    while i + eight <= n and p + eight <= nw:  # a block reads at most 8 words: in bounds
        x0, k = pop_symbol(x0, table, values, words[p], out, i)
        p += k
        x1, k = pop_symbol(x1, table, values, words[p], out, i + np.uint64(1))
        p += k
        x2, k = pop_symbol(x2, table, values, words[p], out, i + np.uint64(2))
        p += k
        x3, k = pop_symbol(x3, table, values, words[p], out, i + np.uint64(3))
        p += k
        x4, k = pop_symbol(x4, table, values, words[p], out, i + np.uint64(4))
        p += k
        x5, k = pop_symbol(x5, table, values, words[p], out, i + np.uint64(5))
        p += k
        x6, k = pop_symbol(x6, table, values, words[p], out, i + np.uint64(6))
        p += k
        x7, k = pop_symbol(x7, table, values, words[p], out, i + np.uint64(7))
        p += k
        i += eight
    xs = np.array([x0, x1, x2, x3, x4, x5, x6, x7], np.uint32)
    while i < n:  # the last symbols, one at a time, every read checked
        word = words[p] if p < nw else np.uint16(0)
        xs[i % eight], k = pop_symbol(xs[i % eight], table, values, word, out, i)
        p += k
        if p > nw:
            return -1
        i += np.uint64(1)
    if p != nw or (xs != np.uint32(L)).any():
        return -1
    return 0


def decode_chunks(words: np.ndarray, sizes: tuple[int, ...], chunk: int, table: np.ndarray,
                  values: np.ndarray, out: np.ndarray) -> int:
    """``decode`` of each chunk's words (``sizes`` of them) into its ``chunk`` symbols
    of ``out``; 0, or -1 at the first inconsistent chunk."""
    offset = 0
    for i, size in enumerate(sizes):
        part = out[i * chunk:(i + 1) * chunk]
        if decode(words[offset:offset + size], table, values, part) < 0:
            return -1
        offset += size
    return 0


@njit(cache=True, nogil=True)
def decode_v1(words, freq, cum, slot_sym, values, out):
    """Decoder of the first format (mode ``rans``: two interleaved states, even and odd
    symbols), kept so that its payloads still decode."""
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
