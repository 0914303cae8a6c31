"""Numba kernels for the entropy stages: histogram, Exp-Golomb bit I/O, symbol maps.

These loops are the honest fast path: one pass over the symbols with a 64-bit bit
accumulator, compiled once (``cache=True`` keeps the machine code on disk). They never
raise; the decoder returns a negative status on malformed input and the caller turns
it into a clear error.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros  # LLVM ctlz

from gradzip.codecs.entropy._bytes import load_be64, store_be32

MODE_SIGN, MODE_SIGN_ALWAYS, MODE_ZIGZAG, MODE_OFFSET, MODE_RANK = range(5)

# leading zero bits of a byte, and bit length of a byte
LZ8 = np.array([8 - int(i).bit_length() for i in range(256)], dtype=np.int64)
BL8 = np.array([int(i).bit_length() for i in range(256)], dtype=np.int64)


@njit(cache=True, nogil=True)
def minmax(v):
    lo = np.int64(v[0])
    hi = lo
    for i in range(1, v.size):
        x = np.int64(v[i])
        if x < lo:
            lo = x
        elif x > hi:
            hi = x
    return lo, hi


@njit(cache=True, nogil=True)
def hist(v, lo, size):
    """Counts of v - lo for an alphabet of ``size`` symbols.

    Four interleaved copies: skewed streams pile onto a few bins, and one copy would
    make every increment wait for the one before (a store-to-load chain)."""
    c = np.zeros((4, size), np.int64)
    n4 = v.size - v.size % 4
    b = np.int64(lo)
    for i in range(0, n4, 4):
        c[0, np.uint64(np.int64(v[i]) - b)] += 1
        c[1, np.uint64(np.int64(v[i + 1]) - b)] += 1
        c[2, np.uint64(np.int64(v[i + 2]) - b)] += 1
        c[3, np.uint64(np.int64(v[i + 3]) - b)] += 1
    for i in range(n4, v.size):
        c[0, np.uint64(np.int64(v[i]) - b)] += 1
    return c[0] + c[1] + c[2] + c[3]


def byte_hist(v: np.ndarray) -> np.ndarray:
    """Counts of a 1-byte stream over its whole range, indexed by ``v - min(dtype)``
    (int8: -128 is bin 0; uint8/bool: 0 is bin 0)."""
    if v.size >= 1 << 35:  # each of the eight 32-bit copies could overflow
        return hist(v, -128 if v.dtype == np.int8 else 0, 256)
    flip = 0x80 if v.dtype == np.int8 else 0  # int8 v - (-128) is its byte xor 0x80
    return _byte_hist(v.reshape(-1).view(np.uint8), flip)


@njit(cache=True, nogil=True)
def _byte_hist(u, flip):
    """``hist`` for bytes, 1.2-1.3x faster: eight bytes per 64-bit load, split by shifts
    into eight 32-bit count copies (no int64 widening per symbol)."""
    c = np.zeros((8, 256), np.uint32)
    n8 = u.size - u.size % 8
    w = u[:n8].view(np.uint64)
    f = np.uint64(flip) * np.uint64(0x0101010101010101)
    m = np.uint64(0xFF)
    for i in range(w.size):
        x = w[i] ^ f
        c[0, x & m] += 1
        c[1, (x >> np.uint64(8)) & m] += 1
        c[2, (x >> np.uint64(16)) & m] += 1
        c[3, (x >> np.uint64(24)) & m] += 1
        c[4, (x >> np.uint64(32)) & m] += 1
        c[5, (x >> np.uint64(40)) & m] += 1
        c[6, (x >> np.uint64(48)) & m] += 1
        c[7, x >> np.uint64(56)] += 1
    out = np.zeros(256, np.int64)
    for j in range(8):
        for k in range(256):
            out[k] += c[j, k]
    for i in range(n8, u.size):
        out[u[i] ^ np.uint8(flip)] += 1
    return out


@njit(cache=True, nogil=True)
def entropy_bits(counts):
    """Order-0 entropy in bits a symbol of a histogram (0 for an empty one): what
    ``measures.entropy_of_counts`` computes, without its numpy temporaries (~40 us of
    small-array overhead there, ~1 us here)."""
    n = 0.0
    for c in counts:
        n += c
    h = 0.0
    for c in counts:
        if c > 0:
            p = c / n
            h -= p * np.log2(p)
    return h


@njit(cache=True, nogil=True)
def apply_lut(v, lo, lut, out):
    """out[i] = lut[v[i] - lo] (dense symbol numbers for the entropy coder)."""
    for i in range(v.size):
        out[i] = lut[np.int64(v[i]) - lo]


@njit(cache=True, nogil=True)
def take(table, s, out):
    """out[i] = table[s[i]]; returns -1 if a symbol is out of range."""
    n = table.size
    for i in range(s.size):
        j = s[i]
        if j < 0 or j >= n:
            return -1
        out[i] = table[j]
    return 0


@njit(cache=True, nogil=True, inline="always")
def _bitlen(n, bl8):
    length = 0
    while n >= 256:
        n >>= np.uint64(8)
        length += 8
    return length + bl8[n]


@njit(cache=True, nogil=True)
def eg_encode(v, mode, k, lo, lut, nbytes, bl8):
    """Exp-Golomb order-k bitstream (MSB first) of ``v`` under a mapping ``mode``.

    ``nbytes`` is the exact size from the length formula; returns the byte array and
    the number of bits written (the caller checks it against the formula).
    """
    out = np.empty(nbytes + 8, np.uint8)  # every byte up to the end is written
    acc = np.uint64(0)
    cnt = 0  # bits pending in acc (< 8 between symbols)
    pos = 0
    one = np.uint64(1)
    base = one << np.uint64(k)
    total = 0
    for i in range(v.size):
        x = np.int64(v[i])
        neg = x < 0
        if mode in (MODE_SIGN, MODE_SIGN_ALWAYS):
            u = np.uint64(-x) if neg else np.uint64(x)
        elif mode == MODE_ZIGZAG:
            u = np.uint64((x << 1) ^ (x >> 63))
        elif mode == MODE_OFFSET:
            u = np.uint64(x - lo)
        else:
            u = np.uint64(lut[x - lo])
        n = u + base
        length = _bitlen(n, bl8)
        zeros = length - 1 - k
        # the zero prefix
        while zeros > 0:
            t = zeros if zeros < 32 else 32
            acc <<= np.uint64(t)
            cnt += t
            zeros -= t
            while cnt >= 8:
                cnt -= 8
                out[pos] = np.uint8((acc >> np.uint64(cnt)) & np.uint64(0xFF))
                pos += 1
        # the value n in `length` bits, at most 32 at a time
        rem = length
        while rem > 0:
            t = rem if rem < 32 else 32
            rem -= t
            chunk = (n >> np.uint64(rem)) & ((one << np.uint64(t)) - one)
            acc = (acc << np.uint64(t)) | chunk
            cnt += t
            while cnt >= 8:
                cnt -= 8
                out[pos] = np.uint8((acc >> np.uint64(cnt)) & np.uint64(0xFF))
                pos += 1
        total += 2 * length - 1 - k
        if (mode == MODE_SIGN and x != 0) or mode == MODE_SIGN_ALWAYS:
            acc = (acc << one) | np.uint64(1 if neg else 0)
            cnt += 1
            total += 1
            if cnt >= 8:
                cnt -= 8
                out[pos] = np.uint8((acc >> np.uint64(cnt)) & np.uint64(0xFF))
                pos += 1
        acc &= (one << np.uint64(cnt)) - one
    if cnt > 0:
        out[pos] = np.uint8((acc << np.uint64(8 - cnt)) & np.uint64(0xFF))
        pos += 1
    return out[:pos], total


@njit(cache=True, nogil=True)
def varint_pack(n):
    """LEB128 bytes of non-negative int64 values."""
    out = np.empty(n.size * 10, np.uint8)
    pos = 0
    for i in range(n.size):
        x = np.uint64(n[i])
        while x >= np.uint64(0x80):
            out[pos] = np.uint8((x & np.uint64(0x7F)) | np.uint64(0x80))
            x >>= np.uint64(7)
            pos += 1
        out[pos] = np.uint8(x)
        pos += 1
    return out[:pos]


@njit(cache=True, nogil=True)
def varint_unpack(buf, count):
    """``count`` LEB128 values from ``buf``; (values, bytes used), used = -1 if malformed."""
    out = np.zeros(count, np.int64)
    pos = 0
    for i in range(count):
        x = np.uint64(0)
        shift = 0
        while True:
            if pos >= buf.size or shift > 56:
                return out, -1
            b = np.uint64(buf[pos])
            pos += 1
            x |= (b & np.uint64(0x7F)) << np.uint64(shift)
            shift += 7
            if b < np.uint64(0x80):
                break
        out[i] = np.int64(x)
    return out, pos


# ---------------------------------------------------------------- table-driven fast path
#: prefix bits the decoder looks up at once
PEEK = 12


@njit(cache=True, nogil=True)
def eg_encode_lut(v, lo, codes, lens, out, start, short):
    """Exp-Golomb bitstream from per-symbol (code, length) tables, written into the
    bytes ``out[start:]``; lengths <= 32, or <= 16 if ``short``. Returns (end byte,
    bits written). ``out`` must have room for the stream's bytes plus 4.

    For narrow alphabets (int8, int16 quantizers) every code is precomputed, so a
    symbol costs one table lookup, a shift and an or. Codes of at most 16 bits go two
    at a time into the 64-bit accumulator, which then flushes 32 bits without a branch
    (the word is always stored, as one unaligned big-endian store; the position moves
    only when it is full): a flush every
    ~4.5 symbols at irregular intervals had been a mispredicted branch, and this is
    1.5-1.65x faster. Longer codes go one at a time with a branch (a branch-free flush
    a symbol was 0.6-0.8x as fast). Writing in place lets the two halves of a stream
    share one buffer with no copy: a buffer per half, then their concatenation, had
    cost 1,800 page faults (5 of 22 ms) on 4M symbols. Indices are unsigned, so numba
    adds no wrap-around checks.
    """
    acc = np.uint64(0)
    cnt = np.uint64(0)
    pos = np.uint64(start)
    b = np.int64(lo)
    c32 = np.uint64(32)
    n = v.size
    i = 0
    if short:
        while i + 1 < n:
            s0 = np.uint64(np.int64(v[i]) - b)
            s1 = np.uint64(np.int64(v[i + 1]) - b)
            acc = (acc << lens[s0]) | codes[s0]
            acc = (acc << lens[s1]) | codes[s1]
            cnt += lens[s0] + lens[s1]
            full = cnt >> np.uint64(5)
            cnt -= full << np.uint64(5)
            store_be32(out, pos, acc >> cnt)
            pos += full << np.uint64(2)
            i += 2
    while i < n:
        s = np.uint64(np.int64(v[i]) - b)
        acc = (acc << lens[s]) | codes[s]
        cnt += lens[s]
        if cnt >= c32:
            cnt -= c32
            store_be32(out, pos, acc >> cnt)
            pos += np.uint64(4)
        i += 1
    p = np.int64(pos)
    total = (p - np.int64(start)) * 8 + np.int64(cnt)
    while cnt >= 8:
        cnt -= np.uint64(8)
        out[p] = np.uint8((acc >> cnt) & np.uint64(0xFF))
        p += 1
    if cnt > 0:
        out[p] = np.uint8((acc << (np.uint64(8) - cnt)) & np.uint64(0xFF))
        p += 1
    return p, total


@njit(cache=True, nogil=True)
def peek_table(codes, lens, values):
    """Decoder lookup: for every PEEK-bit prefix, ``value << 8 | length`` of the code
    that fits in it, one int32 (16 KB in all, so it stays in the L1 cache). 0 when the
    code is longer, or its value needs more than 24 bits: ``_eg_long`` decodes those."""
    entries = np.zeros(1 << PEEK, np.int32)
    for s in range(codes.size):
        length = lens[s]
        if length == 0 or length > PEEK or not -(1 << 23) <= values[s] < (1 << 23):
            continue
        start = np.int64(codes[s]) << (PEEK - length)
        entry = np.int32((values[s] << 8) | length)
        for j in range(start, start + (1 << (PEEK - length))):
            entries[j] = entry
    return entries


@njit(cache=True, nogil=True, inline="always")
def _unmap(u, neg, mode, lo, table):
    """The value of Exp-Golomb number ``u`` (sign bit ``neg`` already read) under the
    mapping ``mode``; (value, False) if a rank is outside the table."""
    if mode in (MODE_SIGN, MODE_SIGN_ALWAYS):
        return (-np.int64(u) if neg else np.int64(u)), True
    if mode == MODE_ZIGZAG:
        return np.int64(u >> np.uint64(1)) ^ -np.int64(u & np.uint64(1)), True
    if mode == MODE_OFFSET:
        return lo + np.int64(u), True
    if u >= np.uint64(table.size):
        return np.int64(0), False
    return table[u], True


@njit(cache=True, nogil=True, inline="always")
def _has_sign(mode, u):
    return mode == MODE_SIGN_ALWAYS or (mode == MODE_SIGN and u != 0)


@njit(cache=True, nogil=True, inline="always")
def _window(buf, pos):
    """The 64 stream bits from absolute bit ``pos`` on, left-aligned (the top 57 at
    least are the stream's): one unaligned big-endian load."""
    return load_be64(buf, pos >> 3) << np.uint64(pos & 7)


@njit(cache=True, nogil=True)
def _eg_long(buf, end, pos, mode, k, lo, table, lz8):
    """The code at absolute bit ``pos`` that the PEEK table lacks, of a stream ending at
    byte ``end``: (value, position after it), the position -1 if the stream is
    malformed. A code (and its sign bit) within the 57 sure bits of the window is read
    from the window's leading zeros, in registers; a longer one by ``_eg_slow``."""
    w = _window(buf, pos)
    zeros = np.int64(leading_zeros(w)) if w != 0 else np.int64(64)
    length = 2 * zeros + 1 + k
    if length + 1 > 57:
        return _eg_slow(buf, end, pos, mode, k, lo, table, lz8)
    u = (w >> np.uint64(64 - length)) - (np.uint64(1) << np.uint64(k))
    neg = False
    if _has_sign(mode, u):
        neg = ((w >> np.uint64(63 - length)) & np.uint64(1)) == np.uint64(1)
        length += 1
    x, ok = _unmap(u, neg, mode, lo, table)
    if not ok or pos + length > end * 8:
        return np.int64(0), np.int64(-1)
    return x, pos + length


@njit(cache=True, nogil=True)
def _eg_one(buf, end, pos, mode, k, lo, table, lz8, peek):
    """One value at absolute bit ``pos`` of a stream ending at byte ``end``: (value,
    position after it), the position -1 if the stream is malformed."""
    entry = peek[np.int64(_window(buf, pos) >> np.uint64(64 - PEEK))]
    if entry & 0xFF:
        return np.int64(entry >> 8), pos + (entry & 0xFF)
    return _eg_long(buf, end, pos, mode, k, lo, table, lz8)


#: symbols a stream decodes from one 64-bit window: 4 codes of <= PEEK bits fit in 57
GROUP = 4


@njit(cache=True, nogil=True)
def eg_decode_lut(buf, nbytes, out, mode, k, lo, table, lz8, peek):
    """Inverse of ``eg_encode``/``eg_encode_lut`` (one stream, ``buf[:nbytes]``) into
    ``out``, one 64-bit window per ``GROUP`` symbols as ``eg_decode_pair`` reads each of
    its streams. ``buf`` carries 16 bytes of zero padding. Returns the bits read, or -1
    if the stream ends early or holds a code the encoder never writes."""
    n = out.size
    pos = np.int64(0)
    limit = (buf.size - 8) * 8  # a window at a position below this stays in ``buf``
    shift = np.uint64(64 - PEEK)
    groups = n // GROUP
    for g in range(groups):
        if pos >= limit:
            return -1
        w = _window(buf, pos)
        for r in range(g * GROUP, (g + 1) * GROUP):
            e = peek[np.int64(w >> shift)]
            length = e & 0xFF
            if length > 0:
                out[r] = e >> 8
                w <<= np.uint64(length)
                pos += length
            else:
                out[r], pos = _eg_long(buf, nbytes, pos, mode, k, lo, table, lz8)
                if pos < 0 or pos >= limit:
                    return -1
                w = _window(buf, pos)
    for r in range(groups * GROUP, n):  # the last symbols, one window each
        if pos >= limit:
            return -1
        out[r], pos = _eg_one(buf, nbytes, pos, mode, k, lo, table, lz8, peek)
        if pos < 0:
            return -1
    return pos


@njit(cache=True, nogil=True)
def eg_decode_pair(buf, split, nbytes, out, mode, k, lo, table, lz8, peek):
    """Two streams at once: ``buf[:split]`` codes ``out[:h]`` and ``buf[split:nbytes]``
    codes ``out[h:]`` (``h = ceil(n / 2)``). Their readers alternate in one loop, so the
    CPU overlaps two dependency chains (each symbol's length decides where the next one
    starts). Each reader loads a 64-bit window once per ``GROUP`` symbols, with no
    branch: refilling whenever fewer than 32 bits were left had been a branch taken at
    irregular intervals. Codes the PEEK table lacks (longer than PEEK bits) are read
    by ``_eg_long``, and the window reloaded after them. ``buf`` carries 16 bytes of
    zero padding. Returns the bits read from each stream, -1 for a malformed one."""
    n = out.size
    h = (n + 1) // 2
    pa, pb = np.int64(0), np.int64(split) * 8
    limit = (buf.size - 8) * 8  # a window at a position below this stays in ``buf``
    shift = np.uint64(64 - PEEK)
    groups = (n - h) // GROUP
    for g in range(groups):
        if max(pa, pb) >= limit:
            return -1, -1
        wa, wb = _window(buf, pa), _window(buf, pb)
        for r in range(g * GROUP, (g + 1) * GROUP):
            ea = peek[np.int64(wa >> shift)]
            eb = peek[np.int64(wb >> shift)]
            la = ea & 0xFF
            lb = eb & 0xFF
            if la > 0:
                out[r] = ea >> 8
                wa <<= np.uint64(la)
                pa += la
            else:
                out[r], pa = _eg_long(buf, split, pa, mode, k, lo, table, lz8)
                if pa < 0 or pa >= limit:
                    return -1, -1
                wa = _window(buf, pa)
            if lb > 0:
                out[h + r] = eb >> 8
                wb <<= np.uint64(lb)
                pb += lb
            else:
                out[h + r], pb = _eg_long(buf, nbytes, pb, mode, k, lo, table, lz8)
                if pb < 0 or pb >= limit:
                    return -1, -1
                wb = _window(buf, pb)
    for r in range(groups * GROUP, h):  # the last symbols, one window each
        if pa >= limit:
            return -1, -1
        out[r], pa = _eg_one(buf, split, pa, mode, k, lo, table, lz8, peek)
        if pa < 0:
            return -1, -1
    for r in range(groups * GROUP, n - h):
        if pb >= limit:
            return -1, -1
        out[h + r], pb = _eg_one(buf, nbytes, pb, mode, k, lo, table, lz8, peek)
        if pb < 0:
            return -1, -1
    return pa, pb - np.int64(split) * 8


@njit(cache=True, nogil=True)
def _eg_slow(buf, end, bitpos, mode, k, lo, table, lz8):
    """The long code at absolute ``bitpos`` of a stream ending at byte ``end``:
    (value, bit position after it), the position -1 if the stream ends early or the
    code is malformed."""
    limit = end * 8
    zeros = 0
    while True:
        b = bitpos >> 3
        if b >= end:
            return np.int64(0), -1
        w8 = (((np.int64(buf[b]) << 8) | np.int64(buf[b + 1])) >> (8 - (bitpos & 7))) & 0xFF
        if w8 != 0:
            zeros += lz8[w8]
            bitpos += lz8[w8]
            break
        zeros += 8
        bitpos += 8
        if zeros > 64:
            return np.int64(0), -1
    length = zeros + 1 + k
    if length > 56 or bitpos + length > limit:
        return np.int64(0), -1
    n = (load_be64(buf, bitpos >> 3) << np.uint64(bitpos & 7)) >> np.uint64(64 - length)
    bitpos += length
    u = n - (np.uint64(1) << np.uint64(k))
    neg = False
    if _has_sign(mode, u):
        if bitpos >= limit:
            return np.int64(0), -1
        neg = ((buf[bitpos >> 3] >> (7 - (bitpos & 7))) & 1) == 1
        bitpos += 1
    x, ok = _unmap(u, neg, mode, lo, table)
    return x, (bitpos if ok else -1)


@njit(cache=True, nogil=True)
def eg_bits_by_k(u, counts, kmax):
    """``bits[k] = sum(counts * (2 floor(log2(u + 2**k)) - k + 1))`` for k = 0..kmax: the
    exact Exp-Golomb payload of a histogram at every order in one pass over it
    (``u + 2**k < 2**53``, so float64's exponent is the exact bit length)."""
    bits = np.zeros(kmax + 1, np.int64)
    for i in range(u.size):
        c = counts[i]
        for k in range(kmax + 1):
            n = math.frexp(np.float64(u[i] + (np.int64(1) << k)))[1]  # bit length
            bits[k] += c * (2 * n - k - 1)
    return bits
