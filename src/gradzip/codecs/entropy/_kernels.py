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

MODE_SIGN, MODE_SIGN_ALWAYS, MODE_ZIGZAG, MODE_OFFSET, MODE_RANK = range(5)

# leading zero bits of a byte, and bit length of a byte
_LZ8 = np.array([8 - int(i).bit_length() for i in range(256)], dtype=np.int64)
_BL8 = np.array([int(i).bit_length() for i in range(256)], dtype=np.int64)


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
    out = np.zeros(nbytes + 8, np.uint8)
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
def eg_encode_lut(v, lo, codes, lens, nbytes):
    """Exp-Golomb bitstream from per-symbol (code, length) tables; lengths <= 32.

    For narrow alphabets (int8, int16 quantizers) every code is precomputed, so a
    symbol costs one table lookup, a shift and an or; 32 bits are flushed at a time.
    """
    out = np.zeros(nbytes + 8, np.uint8)
    acc = np.uint64(0)
    cnt = np.uint64(0)
    pos = 0
    total = 0
    for i in range(v.size):
        s = np.int64(v[i]) - lo
        length = lens[s]
        acc = (acc << length) | codes[s]
        cnt += length
        total += length
        if cnt >= 32:
            cnt -= np.uint64(32)
            w = acc >> cnt
            out[pos] = np.uint8((w >> np.uint64(24)) & np.uint64(0xFF))
            out[pos + 1] = np.uint8((w >> np.uint64(16)) & np.uint64(0xFF))
            out[pos + 2] = np.uint8((w >> np.uint64(8)) & np.uint64(0xFF))
            out[pos + 3] = np.uint8(w & np.uint64(0xFF))
            pos += 4
    while cnt >= 8:
        cnt -= np.uint64(8)
        out[pos] = np.uint8((acc >> cnt) & np.uint64(0xFF))
        pos += 1
    if cnt > 0:
        out[pos] = np.uint8((acc << (np.uint64(8) - cnt)) & np.uint64(0xFF))
        pos += 1
    return out[:pos], total


@njit(cache=True, nogil=True)
def peek_table(codes, lens, values):
    """Decoder lookup: for every PEEK-bit prefix, the value and length of a code that
    fits in it (length 0 when the code is longer: the slow path decodes it)."""
    size = 1 << PEEK
    dval = np.zeros(size, np.int64)
    dlen = np.zeros(size, np.int64)
    for s in range(codes.size):
        length = lens[s]
        if length == 0 or length > PEEK:
            continue
        start = np.int64(codes[s]) << (PEEK - length)
        for j in range(start, start + (1 << (PEEK - length))):
            dval[j] = values[s]
            dlen[j] = length
    return dval, dlen


@njit(cache=True, nogil=True)
def _be64(buf, b):
    word = np.uint64(0)
    for j in range(8):
        word = (word << np.uint64(8)) | np.uint64(buf[b + j])
    return word


@njit(cache=True, nogil=True)
def eg_decode_lut(buf, nbytes, out, mode, k, lo, table, lz8, dval, dlen):
    """Inverse of ``eg_encode``/``eg_encode_lut`` into ``out``.

    Codes of at most PEEK bits are decoded by one table lookup; longer ones from the
    absolute bit position. ``buf`` carries 16 bytes of zero padding. Returns the bits
    read, or -1 if the stream ends early or holds a code the encoder never writes.
    """
    limit = nbytes * 8
    one = np.uint64(1)
    base = one << np.uint64(k)
    ntable = table.size
    bitbuf = _be64(buf, 0)  # next bits, left-aligned
    bitcnt = 64
    bytepos = 8
    shift = np.uint64(64 - PEEK)
    for i in range(out.size):
        if bitcnt < 32:
            if bytepos + 4 > buf.size:
                return -1
            w = ((np.uint64(buf[bytepos]) << np.uint64(24))
                 | (np.uint64(buf[bytepos + 1]) << np.uint64(16))
                 | (np.uint64(buf[bytepos + 2]) << np.uint64(8))
                 | np.uint64(buf[bytepos + 3]))
            bitbuf |= w << np.uint64(32 - bitcnt)
            bytepos += 4
            bitcnt += 32
        peek = np.int64(bitbuf >> shift)
        length = dlen[peek]
        if length > 0:
            out[i] = dval[peek]
            bitbuf <<= np.uint64(length)
            bitcnt -= length
            continue
        # slow path: a long code, decoded from the absolute bit position
        bitpos = bytepos * 8 - bitcnt
        zeros = 0
        while True:
            b = bitpos >> 3
            off = bitpos & 7
            if b >= nbytes:
                return -1
            w8 = ((np.int64(buf[b]) << 8) | np.int64(buf[b + 1])) >> (8 - off)
            w8 &= 0xFF
            if w8 == 0:
                zeros += 8
                bitpos += 8
                if zeros > 64:
                    return -1
            else:
                lz = lz8[w8]
                zeros += lz
                bitpos += lz
                break
        length = zeros + 1 + k
        if length > 56 or bitpos + length > limit:
            return -1
        n = (_be64(buf, bitpos >> 3) << np.uint64(bitpos & 7)) >> np.uint64(64 - length)
        bitpos += length
        u = n - base
        if mode in (MODE_SIGN, MODE_SIGN_ALWAYS):
            neg = False
            if mode == MODE_SIGN_ALWAYS or u != 0:
                if bitpos >= limit:
                    return -1
                neg = ((buf[bitpos >> 3] >> (7 - (bitpos & 7))) & 1) == 1
                bitpos += 1
            x = -np.int64(u) if neg else np.int64(u)
        elif mode == MODE_ZIGZAG:
            x = np.int64(u >> one) ^ -np.int64(u & one)
        elif mode == MODE_OFFSET:
            x = lo + np.int64(u)
        else:
            if u >= np.uint64(ntable):
                return -1
            x = table[np.int64(u)]
        out[i] = x
        # re-synchronize the bit buffer at the new position
        bytepos = bitpos >> 3
        if bytepos + 8 > buf.size:
            return -1
        bitbuf = _be64(buf, bytepos) << np.uint64(bitpos & 7)
        bitcnt = 64 - (bitpos & 7)
        bytepos += 8
    return bytepos * 8 - bitcnt


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
