"""The cheapest Exp-Golomb (mapping, k) of a histogram, in one compiled call.

``eg`` picks its mapping and order by exact size. Done with ``measures.best_k`` for
each of the five mappings, that is some forty small numpy operations a stream, ~250-550
us here: 12-20% of coding an 875K-symbol stream. This kernel computes the same sizes in
one pass per mapping over the alphabet and returns the same choice, tie for tie (the
smallest k among equal sizes, the earliest mapping in ``measures.MAPPINGS`` among equal
totals; tested against ``measures.best_k``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gradzip.codecs.entropy import _kernels, measures

_SIGN, _SIGN_ALWAYS, _ZIGZAG, _OFFSET, _RANK = range(5)
assert measures.MAPPINGS == ("sign", "sign_always", "zigzag", "offset", "rank")


@njit(cache=True, nogil=True)
def _bit_length(n):
    bits = 0
    while n > 0:
        n >>= 1
        bits += 1
    return bits


@njit(cache=True, nogil=True)
def _mapped(values, counts, mapping, rank):
    """(u, extra sign bits of the whole stream) of ``values`` under ``mapping``."""
    u = np.empty(values.size, np.int64)
    extra = 0
    for i in range(values.size):
        v = values[i]
        if mapping in (_SIGN, _SIGN_ALWAYS):
            u[i] = abs(v)
            if mapping == _SIGN_ALWAYS or v != 0:
                extra += counts[i]
        elif mapping == _ZIGZAG:
            u[i] = 2 * v if v >= 0 else -2 * v - 1
        elif mapping == _OFFSET:
            u[i] = v - values[0]
        else:
            u[i] = rank[i]
    return u, extra


@njit(cache=True, nogil=True)
def _rank_and_table_bits(values, counts):
    """Each value's rank (by descending count, ties by value) and the rank table's
    bits on the wire (LEB128 varints of the ranked values minus the minimum)."""
    order = np.argsort(-counts, kind="mergesort")  # stable: ties keep ascending values
    rank = np.empty(values.size, np.int64)
    table_bytes = 0
    for j in range(order.size):
        rank[order[j]] = j
        table_bytes += max(1, (_bit_length(values[order[j]] - values[0]) + 6) // 7)
    return rank, 8 * table_bytes


@njit(cache=True, nogil=True)
def _choose(values, counts, allowed, k):
    """(mapping index, k, payload bits, table bits) of the fewest total bits over the
    allowed mappings, at order ``k`` or (``k`` < 0) the best order; mapping -1 if none."""
    rank, rank_table = np.zeros(0, np.int64), 0  # the span may not fit int64 unless allowed
    if allowed[_RANK]:
        rank, rank_table = _rank_and_table_bits(values, counts)
    best = (-1, 0, 0, 0)
    for m in range(allowed.size):
        if not allowed[m]:
            continue
        u, extra = _mapped(values, counts, m, rank)
        top = u.max()
        kmax = k if k >= 0 else min(measures.MAX_K, max(1, _bit_length(top)))
        by_k = _kernels.eg_bits_by_k(u, counts, kmax)
        kbest = kmax if k >= 0 else 0
        for kk in range(kbest, kmax + 1):
            if by_k[kk] < by_k[kbest]:
                kbest = kk
        table = rank_table if m == _RANK else 0
        payload = by_k[kbest] + extra
        if best[0] < 0 or payload + table < best[2] + best[3]:
            best = (m, kbest, payload, table)
    return best


def choose(values: np.ndarray, counts: np.ndarray, allowed: list[bool], k: int | None
           ) -> measures.EgChoice | None:
    """The cheapest choice over the mappings ``allowed`` (flags in ``measures.MAPPINGS``
    order) at order ``k`` (None: the best), as ``measures.best_k`` would pick it."""
    m, kbest, payload, table = _choose(np.ascontiguousarray(values, np.int64),
                                       np.ascontiguousarray(counts, np.int64),
                                       np.array(allowed, np.bool_), -1 if k is None else k)
    if m < 0:
        return None
    return measures.EgChoice(measures.MAPPINGS[m], int(kbest), int(payload), int(table))
