"""Numba kernels of the ``lossless`` codec: float words <-> byte planes in one pass.

``split*`` writes every byte plane of a float tensor (layouts in ``floatcodec``) while
reading the words once, and counts the other planes' bytes of every ``SAMPLE``-th value
(256-bin histograms that only decide between zstd and raw for those planes; the exponent
plane is always coded); ``join*`` is the inverse, reading each plane from its own array
(the decoded planes are separate buffers: stacking them first cost as much as the join).
The numpy expressions they replace read the words once per plane and allocate a
temporary per shift, which cost 10x more than the coder itself on fp32 gradients.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: one value in SAMPLE is counted for the planes' histograms
SAMPLE = 8


@njit(cache=True, nogil=True)
def split32(w, planes, counts):
    """fp32 words -> [exponent] [sign + 7 mantissa] [mantissa 8] [mantissa 8]."""
    for i in range(w.size):  # no branch: the compiler vectorizes it
        x = w[i]
        planes[0, i] = (x >> 23) & 0xFF
        planes[1, i] = ((x >> 24) & 0x80) | ((x >> 16) & 0x7F)
        planes[2, i] = (x >> 8) & 0xFF
        planes[3, i] = x & 0xFF
    _count_sample(planes, 1, counts)


@njit(cache=True, nogil=True)
def _count_sample(planes, first, counts):
    """Histograms of planes ``first..`` over every SAMPLE-th value."""
    for p in range(first, planes.shape[0]):
        for i in range(0, planes.shape[1], SAMPLE):
            counts[p, planes[p, i]] += 1


@njit(cache=True, nogil=True)
def join32(exponent, sign_top, mid, low, w):
    for i in range(w.size):
        e = np.uint32(exponent[i])
        sm = np.uint32(sign_top[i])
        w[i] = (((sm & 0x80) << 24) | (e << 23) | ((sm & 0x7F) << 16)
                | (np.uint32(mid[i]) << 8) | np.uint32(low[i]))


@njit(cache=True, nogil=True)
def split_bf16(h, planes, counts):
    """bf16 words -> [exponent] [sign + 7 mantissa]."""
    for i in range(h.size):
        x = h[i]
        planes[0, i] = (x >> 7) & 0xFF
        planes[1, i] = ((x >> 8) & 0x80) | (x & 0x7F)
    _count_sample(planes, 1, counts)


@njit(cache=True, nogil=True)
def join_bf16(exponent, sign_mantissa, h):
    for i in range(h.size):
        e = np.uint16(exponent[i])
        sm = np.uint16(sign_mantissa[i])
        h[i] = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


@njit(cache=True, nogil=True)
def split_fp16(h, planes, counts):
    """fp16 words -> [5-bit exponent, sign, 2 top mantissa bits] [mantissa 8]: the
    exponent shares its byte with the three bits beside it, so one coded plane carries
    everything compressible and the other travels raw."""
    for i in range(h.size):
        x = h[i]
        planes[0, i] = ((x >> 7) & 0xF8) | ((x >> 13) & 0x4) | ((x >> 8) & 0x3)
        planes[1, i] = x & 0xFF
    _count_sample(planes, 1, counts)


@njit(cache=True, nogil=True)
def join_fp16(top_plane, low, h):
    for i in range(h.size):
        top = np.uint16(top_plane[i])
        h[i] = (((top & 0x4) << 13) | ((top >> 3) << 10) | ((top & 0x3) << 8)
                | np.uint16(low[i]))


@njit(cache=True, nogil=True)
def join_fp16_v1(exponent, sign_top, low, h):
    """Inverse of the first fp16 layout, [5-bit exponent] [sign + 2 top mantissa bits]
    [mantissa 8], so its payloads still decode."""
    for i in range(h.size):
        e = np.uint16(exponent[i])
        s2 = np.uint16(sign_top[i])
        h[i] = (((s2 & 0x4) << 13) | (e << 10) | ((s2 & 0x3) << 8)
                | np.uint16(low[i]))
