"""Numba kernels of ``gradzip analyze``: each reads a slice of values once.

The numpy expressions they replace made a temporary array per operation (float64
copies for the moments, a uint64 copy and a shift per float field, a padded copy and a
division per quantizer), which cost more than every compressor together. Each kernel
here is one loop over the slice; histograms are filled where the values are read.
Exponent and quantized-symbol counts go to four interleaved copies of the histogram
(summed at the end): gradients concentrate on a few bins, and one copy would make
every increment wait for the previous one.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, fastmath=True)
def _sums(x):
    """Sums of |x|, x, x^2, x^3, x^4 in float64 (reassociated: vectorized)."""
    s0 = s1 = s2 = s3 = s4 = 0.0
    for i in range(x.size):
        d = np.float64(x[i])
        d2 = d * d
        s0 += abs(d)
        s1 += d
        s2 += d2
        s3 += d2 * d
        s4 += d2 * d2
    return np.array([s0, s1, s2, s3, s4])


@njit(cache=True, nogil=True)
def moments(x):
    """(sums of |x|, x, x^2, x^3, x^4 in float64; zero count; max |x|) of float32 x."""
    zeros = 0
    absmax = np.float32(0.0)
    for i in range(x.size):
        a = abs(x[i])
        absmax = max(absmax, a)
        zeros += a == 0
    return _sums(x), zeros, absmax


@njit(cache=True, nogil=True)
def float_fields(u, ebits, mbits, sign, exponent, mantissa, planes):
    """Histograms of the sign, exponent and mantissa fields of the words ``u``.

    ``mantissa`` (2**mbits bins) is filled when mbits <= 16; otherwise ``planes`` (one
    row of 256 bins per mantissa byte, least significant first)."""
    emask = np.uint64((1 << ebits) - 1)
    mmask = np.uint64((1 << mbits) - 1)
    sshift = np.uint64(ebits + mbits)
    mshift = np.uint64(mbits)
    direct = mbits <= 16
    nplanes = (mbits + 7) // 8
    ecopies = np.zeros((4, exponent.size), np.int64)
    negative = 0
    for i in range(u.size):
        w = np.uint64(u[i])
        negative += np.int64(w >> sshift) & 1
        ecopies[i & 3, np.int64((w >> mshift) & emask)] += 1
        m = w & mmask
        if direct:
            mantissa[np.int64(m)] += 1
        else:
            for p in range(nplanes):
                planes[p, np.int64((m >> np.uint64(8 * p)) & np.uint64(0xFF))] += 1
    for c in range(4):
        exponent += ecopies[c]
    sign[0] += u.size - negative
    sign[1] += negative


@njit(cache=True, nogil=True)
def float32_fields(u, sign, exponent, planes):
    """``float_fields`` for fp32 words, specialised: 32-bit arithmetic, three planes."""
    ecopies = np.zeros((4, 256), np.int64)
    negative = 0
    for i in range(u.size):
        w = u[i]
        negative += w >> 31
        ecopies[i & 3, (w >> 23) & 0xFF] += 1
        planes[0, w & 0xFF] += 1
        planes[1, (w >> 8) & 0xFF] += 1
        planes[2, (w >> 16) & 0x7F] += 1
    for c in range(4):
        exponent += ecopies[c]
    sign[0] += u.size - negative
    sign[1] += negative


@njit(cache=True, nogil=True)
def quantize_int8(x, block, out, counts):
    """Abs-max int8 per block: ``out = rint(x / (max|block| / 127))`` (float32, ties to
    even, scale 1 for an all-zero block); ``counts[q + 128]`` counts the symbols."""
    copies = np.zeros((4, 256), np.int64)
    n = x.size
    for start in range(0, n, block):
        stop = min(start + block, n)
        m = np.float32(0.0)
        for i in range(start, stop):
            a = abs(x[i])
            if a > m:
                m = a
        scale = m / np.float32(127.0)
        if scale == 0:
            scale = np.float32(1.0)
        for i in range(start, stop):
            q = max(-127, min(127, np.int64(np.rint(x[i] / scale))))  # NaN/inf: clamped
            out[i] = q
            copies[i & 3, q + 128] += 1
    for c in range(4):
        counts += copies[c]


@njit(cache=True, nogil=True)
def quantize_fixed(x, scale, out):
    """``out = rint(float32(x) * scale)`` in float32 (ties to even); returns (min, max)
    of the integers, or (1, 0) when one does not fit ``out``'s int32."""
    lo = np.int64(0)
    hi = np.int64(0)
    for i in range(x.size):
        f = np.rint(x[i] * scale)
        if not (-2147483648.0 <= f <= 2147483647.0):
            return np.int64(1), np.int64(0)
        q = np.int64(f)
        out[i] = q
        if i == 0 or q < lo:
            lo = q
        if i == 0 or q > hi:
            hi = q
    return lo, hi
