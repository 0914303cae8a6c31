"""A Huffman coder for one byte plane with tables fitted to its blocks: ``lossless``'s
exponent coder for bf16 and fp32.

Gradient exponents are an order-0 source whose distribution moves from tensor to tensor
(each layer has its own scale), so one table for a whole bucket wastes 1-4% of the
plane (``bench_exponent_tables``). This coder cuts the plane into blocks of ``BLOCK``
symbols and fits up to ``MAX_TABLES`` tables to them by k-means (``cluster``): close to
per-tensor tables without knowing the boundaries, at a few table builds per plane.

Layout of a coded plane (little-endian):

* the number of symbols (LEB128), then the number of tables (a byte);
* each table: the lowest and highest symbol coded, then 4 bits per symbol between
  them, its code length (0 = absent, else 1..``MAX_BITS``); codes are canonical;
* each block: its table's index, or ``CONST`` and the one symbol the block holds; then
  the byte sizes (uint16) of its four bit streams, and the streams. Stream k holds
  symbols ``[k*q, (k+1)*q)`` of the block (q = ceil(block/4)), bits LSB-first.

Codes are at most ``MAX_BITS`` (11) bits, as in huff0, so a decoder table of 2**11
entries indexes the next 11 bits. Each entry holds every symbol whose code ends within
those bits (up to four; ~3.5 on bf16 exponents, whose codes average ~2.8 bits), so one
lookup writes four bytes, and the four streams run interleaved: their dependency chains
(a table load, a shift) overlap in the CPU. A stream's last symbols are decoded one at
a time with every read checked. The decoder refuses tables that are no prefix code,
codes it cannot find, a symbol count other than the caller's, and streams that do not
end where their size says; a checksum around the plane catches the rest.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

from gradzip.codecs.entropy._bytes import leading_zeros, load64, popcount, store32, store64
from gradzip.codecs.entropy._frame import EntropyCodingError

MAX_BITS = 11
TABLE = 1 << MAX_BITS
MASK = TABLE - 1
BLOCK = 1 << 14
STREAMS = 4
PER_LOOKUP = 4  # most symbols one decoder lookup writes
MAX_TABLES = 8
BLOCKS_PER_TABLE = 4  # a table build costs about a quarter of decoding four blocks
#: rounds of building the tables and moving blocks between them (four made the LM's
#: plane 0.6% smaller, the ResNet's 0.06% larger, and took 2.8x the time)
CLUSTER_ROUNDS = 2
CONST = 255  # a block's table index when the block is one symbol (which follows)
#: the most bytes a plane header (symbol count, table count, tables) and a block can take
HEADER_BOUND = 10 + 1 + MAX_TABLES * (2 + 128)
BLOCK_BOUND = 1 + 2 * STREAMS + (BLOCK * MAX_BITS + 7) // 8 + STREAMS

OK, CORRUPT = 0, -1
#: planes up to this size encode into a per-thread scratch buffer kept between calls
SCRATCH_MAX = 16 << 20


def bound(n: int) -> int:
    """Bytes ``encode`` may write for ``n`` symbols (plus 8 of slack for its stores)."""
    return HEADER_BOUND + (n // BLOCK + 1) * BLOCK_BOUND + 8


# ---------------------------------------------------------------------------- tables

@njit(cache=True, nogil=True)
def code_lengths(counts: np.ndarray, lengths: np.ndarray) -> None:
    """Huffman code lengths of the symbols with nonzero ``counts`` (at least two), limited
    to ``MAX_BITS``: the lengths of an optimal code, then the longest clamped and the
    Kraft sum restored by lengthening the rarest short codes, then any slack given back
    to the most frequent ones."""
    lengths[:] = 0
    used = np.nonzero(counts)[0]
    n = used.size
    order = used[np.argsort(counts[used], kind="mergesort")]  # ascending, stable
    weight = np.empty(2 * n - 1, np.int64)
    parent = np.zeros(2 * n - 1, np.int64)
    for i in range(n):
        weight[i] = counts[order[i]]
    leaf, node = 0, n  # the two queues: leaves in order, then internal nodes as made
    for k in range(n, 2 * n - 1):
        pair = 0
        for _ in range(2):
            if leaf < n and (node >= k or weight[leaf] <= weight[node]):
                child = leaf
                leaf += 1
            else:
                child = node
                node += 1
            parent[child] = k
            pair += weight[child]
        weight[k] = pair
    depth = np.zeros(2 * n - 1, np.int64)
    for k in range(2 * n - 3, -1, -1):
        depth[k] = depth[parent[k]] + 1
    kraft = 0  # in units of 2**-MAX_BITS
    for i in range(n):
        d = min(depth[i], MAX_BITS)
        lengths[order[i]] = d
        kraft += 1 << (MAX_BITS - d)
    while kraft > TABLE:  # lengthen the rarest of the longest codes below the limit
        pick = -1
        best = -1
        for i in range(n):
            s = order[i]
            if best < lengths[s] < MAX_BITS:
                best = lengths[s]
                pick = s
        lengths[pick] += 1
        kraft -= 1 << (MAX_BITS - lengths[pick])
    for i in range(n - 1, -1, -1):  # most frequent first: shorten while the sum allows
        s = order[i]
        while lengths[s] > 1 and kraft + (1 << (MAX_BITS - lengths[s])) <= TABLE:
            kraft += 1 << (MAX_BITS - lengths[s])
            lengths[s] -= 1


@njit(cache=True, nogil=True)
def canonical_codes(lengths: np.ndarray, codes: np.ndarray) -> None:
    """Canonical codes (by length, then symbol) of ``lengths``, bit-reversed for LSB-first
    streams; absent symbols get 0."""
    per_length = np.zeros(MAX_BITS + 2, np.int64)
    for s in range(256):
        per_length[lengths[s]] += 1
    per_length[0] = 0
    next_code = np.zeros(MAX_BITS + 2, np.int64)
    for length in range(1, MAX_BITS + 1):
        next_code[length] = (next_code[length - 1] + per_length[length - 1]) << 1
    for s in range(256):
        length = lengths[s]
        code = 0
        if length:
            forward = next_code[length]
            next_code[length] += 1
            for b in range(length):
                code |= ((forward >> b) & 1) << (length - 1 - b)
        codes[s] = code


#: fields of a ``multi`` entry above its symbols (bytes 0-3): bits used (4 bits), symbols
#: (3 bits), and a mask with bit c set where a symbol's code ends c bits in (12 bits)
BITS_AT, COUNT_AT, ENDS_AT = 32, 40, 44


@njit(cache=True, nogil=True)
def decoder_tables(lengths: np.ndarray, single: np.ndarray, multi: np.ndarray) -> bool:
    """The decoder's tables of a code, indexed by the next ``MAX_BITS`` bits:
    ``single`` = symbol | length << 8 (0 where no code starts) and ``multi`` = every
    symbol whose code ends within those bits, up to four (bytes 0-3), | bits used << 32 |
    symbols << 40 | ends mask << 44. False when the lengths are no prefix code.

    ``multi[i]`` is ``i``'s first symbol (length l) followed by what is left of
    ``multi[i >> l]`` (an earlier entry: the rest of the bits, zero-filled) once the
    symbols that end past ``MAX_BITS - l`` bits, and any fourth, are dropped."""
    kraft = 0
    for s in range(256):
        if lengths[s] > MAX_BITS:
            return False
        if lengths[s]:
            kraft += 1 << (MAX_BITS - lengths[s])
    if kraft > TABLE:
        return False
    codes = np.empty(256, np.int64)
    canonical_codes(lengths, codes)
    single[:] = 0
    for s in range(256):
        length = lengths[s]
        if length:
            for j in range(codes[s], TABLE, 1 << length):
                single[j] = s | (length << 8)
    multi[0] = _first_entry(single)
    for i in range(1, TABLE):
        e = single[i]
        first = e >> 8
        rest = multi[i >> first]
        ends = (rest >> ENDS_AT) & ((2 << (MAX_BITS - first)) - 1)  # those that fit
        last = 1 << (63 - leading_zeros(ends | 1))
        ends &= ~(last * (popcount(ends) // PER_LOOKUP))  # room for three more: drop a 4th
        keep = popcount(ends)
        syms = (e & 255) | ((rest & ((1 << (8 * keep)) - 1)) << 8)
        mask = (ends << first) | (1 << first)
        used = 63 - leading_zeros(mask)
        entry = syms | (used << BITS_AT) | ((keep + 1) << COUNT_AT) | (mask << ENDS_AT)
        multi[i] = entry if first else 0
    return True


@njit(cache=True, nogil=True)
def _first_entry(single: np.ndarray) -> int:
    """``multi[0]``, the one entry whose rest is itself, symbol by symbol: its bits are
    all zero, so every symbol is ``single[0]``'s, while it fits."""
    syms = used = count = mask = 0
    e = single[0]
    while count < PER_LOOKUP:
        length = e >> 8
        if length == 0 or used + length > MAX_BITS:
            break
        syms |= (e & 255) << (8 * count)
        used += length
        mask |= 1 << used
        count += 1
    return syms | (used << BITS_AT) | (count << COUNT_AT) | (mask << ENDS_AT)


# ---------------------------------------------------------------------------- encode

@njit(cache=True, nogil=True)
def _encode_stream(symbols: np.ndarray, table: np.ndarray, out: np.ndarray, at: int) -> int:
    """``symbols`` as LSB-first bits from ``out[at]``; returns the end. ``table[s]`` =
    code | length << 16. Flushes whole bytes every four symbols (at most 7 + 44 bits in
    hand). Indices run from 0 so numba's negative-index checks fold away."""
    acc = 0
    held = 0
    n = symbols.size
    whole = n - n % 4
    for i in range(0, whole, 4):
        e0, e1 = table[symbols[i]], table[symbols[i + 1]]
        e2, e3 = table[symbols[i + 2]], table[symbols[i + 3]]
        acc |= (e0 & 0xFFFF) << held
        held += e0 >> 16
        acc |= (e1 & 0xFFFF) << held
        held += e1 >> 16
        acc |= (e2 & 0xFFFF) << held
        held += e2 >> 16
        acc |= (e3 & 0xFFFF) << held
        held += e3 >> 16
        store64(out, at, acc)
        at += held >> 3
        acc >>= held & ~7
        held &= 7
    for i in range(whole, n):
        e = table[symbols[i]]
        acc |= (e & 0xFFFF) << held
        held += e >> 16
    store64(out, at, acc)
    return at + ((held + 7) >> 3)


@njit(cache=True, nogil=True)
def _histogram(symbols, counts):
    """Counts of ``symbols`` into ``counts``; returns how many symbols occur. Eight bytes
    a load, each byte into its own 32-bit copy of the histogram, so repeats of a symbol
    do not wait on each other's stores (as ``_kernels._byte_hist``, at any alignment)."""
    sub = np.zeros((8, 256), np.uint32)
    n = symbols.size
    whole = n - n % 8
    for i in range(0, whole, 8):
        x = load64(symbols, i)
        sub[0, x & 255] += 1
        sub[1, (x >> 8) & 255] += 1
        sub[2, (x >> 16) & 255] += 1
        sub[3, (x >> 24) & 255] += 1
        sub[4, (x >> 32) & 255] += 1
        sub[5, (x >> 40) & 255] += 1
        sub[6, (x >> 48) & 255] += 1
        sub[7, (x >> 56) & 255] += 1
    for i in range(whole, n):
        sub[0, symbols[i]] += 1
    distinct = 0
    for s in range(256):
        total = 0
        for j in range(8):
            total += sub[j, s]
        counts[s] = total
        distinct += total > 0
    return distinct


@njit(cache=True, nogil=True)
def _table_bytes(lengths: np.ndarray, out: np.ndarray, at: int) -> int:
    """Writes the table (lowest, highest, 4-bit lengths) at ``out[at]`` if ``out`` has
    room (pass an empty array to size it); returns its size in bytes."""
    lo, hi = 255, 0
    for s in range(256):
        if lengths[s]:
            lo, hi = min(lo, s), max(hi, s)
    size = 2 + (hi - lo + 2) // 2
    if out.size:
        out[at], out[at + 1] = lo, hi
        for k in range((hi - lo + 2) // 2):
            low = lengths[lo + 2 * k]
            high = lengths[lo + 2 * k + 1] if lo + 2 * k + 1 <= hi else 0
            out[at + 2 + k] = low | (high << 4)
    return size


@njit(cache=True, nogil=True)
def _bits(counts, b, tables, t, lo, hi):
    """Bits of block ``b`` (``counts[b]``, its symbols within ``lo..hi``) coded with
    table ``t``; -1 if a symbol that occurs has no code. Branch-free, and indexed rather
    than sliced (it runs for every block and table)."""
    total = 0
    missing = 0
    for s in range(lo, hi + 1):
        total += counts[b, s] * tables[t, s]
        missing += (counts[b, s] > 0) & (tables[t, s] == 0)
    return -1 if missing else total


@njit(cache=True, nogil=True)
def _put_varint(out: np.ndarray, at: int, value: int) -> int:
    """``value`` in LEB128 (7 bits a byte, low first) at ``out[at]``; returns the end."""
    while value >= 128:
        out[at] = (value & 127) | 128
        value >>= 7
        at += 1
    out[at] = value
    return at + 1


@njit(cache=True, nogil=True)
def _get_varint(data, at, expected):
    """The position after a LEB128 value at ``data[at]`` equal to ``expected``; -1 if it
    is another value or runs past the data."""
    value = 0
    shift = 0
    while at < data.size and shift < 63:
        byte = np.int64(data[at])
        value |= (byte & 127) << shift
        at += 1
        if byte < 128:
            return at if value == expected else -1
        shift += 7
    return -1


@njit(cache=True, nogil=True)
def cluster(counts: np.ndarray, varying: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """Up to ``MAX_TABLES`` code lengths (rows of ``tables``) for the blocks whose
    histograms are the rows of ``counts`` flagged ``varying`` (two or more symbols), and
    the table of each block: k-means with a block's coded size as the distance. There
    is a table for every ``BLOCKS_PER_TABLE`` blocks at most (each costs the decoder a
    table build). Blocks start in groups by their mean symbol (a tensor's scale moves
    its exponents), then each round builds a group's table from its summed histogram
    and moves every block to the table that codes it smallest. Returns the table index
    of each block (-1 where not varying); ``tables`` keeps only the tables used, in
    order, and zeros after."""
    blocks = np.nonzero(varying)[0]
    m = blocks.size
    assign = np.full(counts.shape[0], -1, np.int64)
    k = min(MAX_TABLES, max(1, m // BLOCKS_PER_TABLE))
    means = np.zeros(m)
    for j in range(m):
        weighted = total = 0
        for s in range(256):
            weighted += s * counts[blocks[j], s]
            total += counts[blocks[j], s]
        means[j] = weighted / total
    order = np.argsort(means, kind="mergesort")
    present = np.nonzero(counts.sum(axis=0))[0]  # the symbols of the plane
    lo, hi = (present[0], present[-1]) if present.size else (0, -1)
    for j in range(m):
        assign[blocks[order[j]]] = j * k // m
    pooled = np.zeros(256, np.int64)
    live = np.zeros(MAX_TABLES, np.bool_)
    for _ in range(CLUSTER_ROUNDS):
        live[:] = False
        for t in range(k):
            pooled[:] = 0
            for b in blocks:
                if assign[b] == t:
                    for s in range(lo, hi + 1):
                        pooled[s] += counts[b, s]
                    live[t] = True
            if live[t]:
                code_lengths(pooled, tables[t])
        for b in blocks:
            best, best_bits = -1, -1
            for t in range(k):
                bits = _bits(counts, b, tables, t, lo, hi) if live[t] else -1
                if bits >= 0 and (best < 0 or bits < best_bits):
                    best, best_bits = t, bits
            assign[b] = best
    renumber = np.full(MAX_TABLES, -1, np.int64)
    used = 0
    for t in range(k):
        if live[t] and (assign == t).any():
            renumber[t] = used
            tables[used] = tables[t]
            used += 1
    tables[used:] = 0
    for b in blocks:
        assign[b] = renumber[assign[b]]
    return assign


@njit(cache=True, nogil=True)
def encode(src: np.ndarray, out: np.ndarray) -> int:
    """Codes the uint8 plane ``src`` into ``out`` (``bound(src.size)`` bytes); returns
    the bytes written."""
    n = src.size
    nb = (n + BLOCK - 1) // BLOCK
    counts = np.zeros((nb, 256), np.int64)
    varying = np.zeros(nb, np.bool_)
    for b in range(nb):
        varying[b] = _histogram(src[b * BLOCK:min((b + 1) * BLOCK, n)], counts[b]) > 1
    tables = np.zeros((MAX_TABLES, 256), np.int64)
    assign = cluster(counts, varying, tables)
    used = 0
    while used < MAX_TABLES and tables[used].any():
        used += 1
    at = _put_varint(out, 0, n)
    out[at] = used
    at += 1
    coders = np.zeros((MAX_TABLES, 256), np.int64)
    codes = np.zeros(256, np.int64)
    for t in range(used):
        at += _table_bytes(tables[t], out, at)
        canonical_codes(tables[t], codes)
        coders[t] = codes | (tables[t] << 16)
    for b in range(nb):
        begin, end = b * BLOCK, min((b + 1) * BLOCK, n)
        if not varying[b]:
            out[at], out[at + 1] = CONST, src[begin]
            at += 2
            continue
        out[at] = assign[b]
        sizes = at + 1
        at = sizes + 2 * STREAMS
        q = (end - begin + STREAMS - 1) // STREAMS
        for k in range(STREAMS):
            first = min(begin + k * q, end)
            stop = _encode_stream(src[first:min(first + q, end)], coders[assign[b]], out, at)
            out[sizes + 2 * k], out[sizes + 2 * k + 1] = (stop - at) & 255, (stop - at) >> 8
            at = stop
    return at


# ---------------------------------------------------------------------------- decode

@njit(cache=True, nogil=True)
def _get64_checked(data, at, end):
    """Up to eight bytes from ``data[at]``, zeros from ``end`` on."""
    value = 0
    for b in range(min(8, max(0, end - at))):
        value |= np.int64(data[at + b]) << (8 * b)
    return value


@njit(cache=True, nogil=True)
def _run_stream(data, bit, multi, out, o, stop):
    """One stream on its own, a lookup at a time while it has four symbols to write and
    eight bytes to read (a block's streams end unevenly); returns the bit and output
    position reached."""
    last_read = 8 * (data.size - 8)
    while o + PER_LOOKUP <= stop and bit <= last_read:
        x = multi[(load64(data, bit >> 3) >> (bit & 7)) & MASK]
        if x == 0:
            break
        store32(out, o, x)
        o += (x >> COUNT_AT) & 7
        bit += (x >> BITS_AT) & 15
    return bit, o


@njit(cache=True, nogil=True)
def _finish_stream(data, bit, end, single, out, o, stop):
    """Decodes ``out[o:stop]`` one symbol at a time from bit ``bit`` of ``data``, reading
    nothing at or past byte ``end``; returns the bit reached, or -1 on a bad code."""
    while o < stop:
        if bit >= 8 * end:
            return -1
        e = single[(_get64_checked(data, bit >> 3, end) >> (bit & 7)) & MASK]
        if e == 0:
            return -1
        out[o] = e & 255
        o += 1
        bit += e >> 8
    return bit


@njit(cache=True, nogil=True)
def _decode_streams(data, starts, ends, multi, single, out, outs, stops):
    """The four streams of a block, interleaved in rounds as long as every stream has
    four symbols to write and eight bytes to read for each lookup of the round, then one
    by one; False on a bad code or a stream that does not end in its last byte. A bad
    code's ``multi`` entry moves nothing, which ends the rounds."""
    last_read = 8 * (data.size - 8)  # the last bit a whole 8-byte read may start at
    b0, b1, b2, b3 = 8 * starts[0], 8 * starts[1], 8 * starts[2], 8 * starts[3]
    o0, o1, o2, o3 = outs[0], outs[1], outs[2], outs[3]
    while True:  # a round: each stream refills 64 bits (57 usable), then 4 lookups
        rounds = min(min(stops[0] - o0, stops[1] - o1), min(stops[2] - o2, stops[3] - o3))
        rounds = min(rounds // (4 * PER_LOOKUP),
                     (last_read - max(max(b0, b1), max(b2, b3))) // (4 * MAX_BITS))
        if rounds <= 0:
            break
        p0, p1, p2, p3 = o0, o1, o2, o3
        for _ in range(rounds):
            c0 = load64(data, b0 >> 3) >> (b0 & 7)
            c1 = load64(data, b1 >> 3) >> (b1 & 7)
            c2 = load64(data, b2 >> 3) >> (b2 & 7)
            c3 = load64(data, b3 >> 3) >> (b3 & 7)
            for _ in range(4):
                x0 = multi[c0 & MASK]
                x1 = multi[c1 & MASK]
                x2 = multi[c2 & MASK]
                x3 = multi[c3 & MASK]
                store32(out, o0, x0)
                store32(out, o1, x1)
                store32(out, o2, x2)
                store32(out, o3, x3)
                o0 += (x0 >> COUNT_AT) & 7
                o1 += (x1 >> COUNT_AT) & 7
                o2 += (x2 >> COUNT_AT) & 7
                o3 += (x3 >> COUNT_AT) & 7
                n0, n1 = (x0 >> BITS_AT) & 15, (x1 >> BITS_AT) & 15
                n2, n3 = (x2 >> BITS_AT) & 15, (x3 >> BITS_AT) & 15
                c0 >>= n0
                c1 >>= n1
                c2 >>= n2
                c3 >>= n3
                b0 += n0
                b1 += n1
                b2 += n2
                b3 += n3
        if min(min(o0 - p0, o1 - p1), min(o2 - p2, o3 - p3)) < rounds:
            break  # a stream met a bad code: the one-by-one step reports it
    bits = (b0, b1, b2, b3)
    done = (o0, o1, o2, o3)
    for k in range(STREAMS):
        bit, o = _run_stream(data, bits[k], multi, out, done[k], stops[k])
        bit = _finish_stream(data, bit, ends[k], single, out, o, stops[k])
        if bit < 0 or (bit + 7) >> 3 != ends[k]:
            return False
    return True


@njit(cache=True, nogil=True)
def _read_table(data, at, lengths):
    """Reads a table at ``data[at]`` into ``lengths``; returns the position after it, or
    -1 if it does not fit or codes fewer than two symbols."""
    if at + 2 > data.size:
        return -1
    lo, hi = np.int64(data[at]), np.int64(data[at + 1])
    size = (hi - lo + 2) // 2
    if hi < lo or at + 2 + size > data.size:
        return -1
    lengths[:] = 0
    present = 0
    for k in range(hi - lo + 1):
        byte = data[at + 2 + k // 2]
        lengths[lo + k] = (byte >> (4 * (k & 1))) & 15
        present += lengths[lo + k] > 0
    return at + 2 + size if present >= 2 else -1


@njit(cache=True, nogil=True)
def decode(data, out):
    """Decodes a plane written by ``encode`` into all of ``out``; returns ``OK``, or
    ``CORRUPT`` when the data is not such a plane of ``out.size`` symbols."""
    n = out.size
    m = data.size
    at = _get_varint(data, 0, n)
    if at < 0 or at >= m or data[at] > MAX_TABLES:
        return CORRUPT
    used = np.int64(data[at])
    lengths = np.zeros(256, np.int64)
    single = np.zeros((max(used, 1), TABLE), np.int64)
    multi = np.zeros((max(used, 1), TABLE), np.int64)
    at += 1
    for t in range(used):
        at = _read_table(data, at, lengths)
        if at < 0 or not decoder_tables(lengths, single[t], multi[t]):
            return CORRUPT
    starts = np.empty(STREAMS, np.int64)
    ends = np.empty(STREAMS, np.int64)
    outs = np.empty(STREAMS, np.int64)
    stops = np.empty(STREAMS, np.int64)
    for begin in range(0, n, BLOCK):
        end = min(begin + BLOCK, n)
        if at + 2 > m:
            return CORRUPT
        t = np.int64(data[at])
        if t == CONST:
            out[begin:end] = data[at + 1]
            at += 2
            continue
        if t >= used or at + 1 + 2 * STREAMS > m:
            return CORRUPT
        position = at + 1 + 2 * STREAMS
        q = (end - begin + STREAMS - 1) // STREAMS
        for k in range(STREAMS):
            size = np.int64(data[at + 1 + 2 * k]) | (np.int64(data[at + 2 + 2 * k]) << 8)
            starts[k] = position
            position += size
            ends[k] = position
            outs[k] = min(begin + k * q, end)
            stops[k] = min(outs[k] + q, end)
        if position > m:
            return CORRUPT
        if not _decode_streams(data, starts, ends, multi[t], single[t], out, outs, stops):
            return CORRUPT
        at = position
    return OK if at == m else CORRUPT


# ---------------------------------------------------------------------------- python API

_local = threading.local()


def compress(plane: np.ndarray) -> bytes:
    """The coded form of a contiguous uint8 plane. Encodes into a per-thread scratch
    buffer kept between calls (up to ``SCRATCH_MAX``), so a call faults in no pages."""
    plane = np.ascontiguousarray(plane, np.uint8)
    size = bound(plane.size)
    scratch = getattr(_local, "scratch", None)
    if size > SCRATCH_MAX:
        scratch = np.empty(size, np.uint8)
    elif scratch is None or scratch.size < size:
        scratch = _local.scratch = np.empty(size, np.uint8)
    return scratch[:encode(plane, scratch)].tobytes()


def decompress(data: bytes | bytearray | memoryview, size: int) -> np.ndarray:
    """The ``size`` symbols of a coded plane as a new uint8 array; data that is not such
    a plane raises ``EntropyCodingError``."""
    out = np.empty(size, np.uint8)
    if decode(np.frombuffer(data, np.uint8), out) != OK:
        raise EntropyCodingError("lossless: a Huffman-coded byte plane is damaged")
    return out


@njit(cache=True, nogil=True)
def _estimate(symbols):
    counts = np.zeros(256, np.int64)
    if _histogram(symbols, counts) < 2:
        return 0
    lengths = np.zeros(256, np.int64)
    code_lengths(counts, lengths)
    return (_bits(counts.reshape(1, 256), 0, lengths.reshape(1, 256), 0, 0, 255) + 7) // 8


def estimate(plane: np.ndarray) -> int:
    """Bytes of ``plane``'s streams under its own optimal table (no headers): what this
    coder's order-0 model makes of it, for comparing with a coder that finds repeats."""
    return int(_estimate(np.ascontiguousarray(plane, np.uint8)))
