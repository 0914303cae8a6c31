"""zstd for one byte plane: Huffman-coded literals behind an accelerated match search.

On the exponent plane of gradients most of zstd's time goes to the match search (two
thirds of its instructions on a ResNet's bf16 exponent plane, by callgrind), while most
of the saving comes from the Huffman-coded literals; the matches add the runs an order-0
coder misses (zero rows of unused embeddings, neighbouring weights of one magnitude).
zstd's fast strategy can skip ahead between match attempts (``targetLength``, the
"acceleration" of its negative levels), but it then stops coding literals unless the
experimental parameter ``ZSTD_c_literalCompressionMode`` forces Huffman on.
python-zstandard exposes only the stable parameters, so this module sets them through
libzstd's own C API (ctypes; Debian and Ubuntu install ``libzstd.so.1`` on every system,
dpkg depends on it). The frames are ordinary zstd frames that any zstd decoder reads.

Without that library (or with one older than 1.4.0) planes are compressed by
python-zstandard with the same parameters but no acceleration and the default literal
mode: the same format, a little smaller and up to 1.7x slower on run-free planes.
Contexts are per thread (a zstd context is not thread-safe).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np
import zstandard

from gradzip.codecs.entropy._frame import EntropyCodingError

#: parameters shared by both paths: the fast strategy, 7-byte hashes into a table of
#: 2**8 entries (2**6 lost 0.6-1.4% of the ratio on a captured bucket), one probe
HASH_LOG, MIN_MATCH, SEARCH_LOG, WINDOW_LOG = 8, 7, 1, 17

_STABLE = zstandard.ZstdCompressionParameters.from_level(
    1, strategy=zstandard.STRATEGY_FAST, min_match=MIN_MATCH, search_log=SEARCH_LOG,
    hash_log=HASH_LOG, window_log=WINDOW_LOG, write_content_size=True, write_checksum=False)

# ZSTD_cParameter ids of zstd.h (stable, and the experimental literal mode)
_C_WINDOW_LOG, _C_HASH_LOG, _C_SEARCH_LOG, _C_MIN_MATCH = 101, 102, 104, 105
_C_TARGET_LENGTH, _C_STRATEGY, _C_CONTENT_SIZE, _C_CHECKSUM = 106, 107, 200, 201
_C_LITERAL_MODE = 1002  # ZSTD_c_experimentalParam5
_FAST, _HUFFMAN = 1, 1  # ZSTD_fast, ZSTD_ps_enable (ZSTD_lcm_huffman before 1.5)
_MIN_VERSION = 10400
_CONTENT_UNKNOWN, _CONTENT_ERROR = 2**64 - 1, 2**64 - 2


def _load() -> ctypes.CDLL | None:
    """libzstd with the prototypes used here, or None when absent or too old."""
    name = ctypes.util.find_library("zstd")
    try:
        lib = ctypes.CDLL(name or "libzstd.so.1")
    except OSError:
        return None
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    protos = {
        "ZSTD_versionNumber": (ctypes.c_uint, []),
        "ZSTD_createCCtx": (ptr, []), "ZSTD_createDCtx": (ptr, []),
        "ZSTD_CCtx_setParameter": (size, [ptr, ctypes.c_int, ctypes.c_int]),
        "ZSTD_compressBound": (size, [size]),
        "ZSTD_compress2": (size, [ptr, ptr, size, ptr, size]),
        "ZSTD_decompressDCtx": (size, [ptr, ptr, size, ptr, size]),
        "ZSTD_getFrameContentSize": (ctypes.c_ulonglong, [ptr, size]),
        "ZSTD_isError": (ctypes.c_uint, [size]),
        "ZSTD_getErrorName": (ctypes.c_char_p, [size]),
    }
    try:
        for fn, (res, args) in protos.items():
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    except AttributeError:
        return None
    return lib if lib.ZSTD_versionNumber() >= _MIN_VERSION else None


_LIB = _load()
_local = threading.local()


def accelerated() -> bool:
    """True when planes are compressed through libzstd with the accelerated search
    (else ``compress`` ignores its ``acceleration``)."""
    return _LIB is not None


def _cctx(acceleration: int) -> int:
    """This thread's compression context for one acceleration (created once)."""
    contexts = _local.__dict__.setdefault("cctx", {})
    if acceleration not in contexts:
        assert _LIB is not None
        ctx = _LIB.ZSTD_createCCtx()
        settings = ((_C_STRATEGY, _FAST), (_C_WINDOW_LOG, WINDOW_LOG), (_C_HASH_LOG, HASH_LOG),
                    (_C_SEARCH_LOG, SEARCH_LOG), (_C_MIN_MATCH, MIN_MATCH),
                    (_C_TARGET_LENGTH, acceleration), (_C_LITERAL_MODE, _HUFFMAN),
                    (_C_CONTENT_SIZE, 1), (_C_CHECKSUM, 0))
        for param, value in settings:
            _check(_LIB.ZSTD_CCtx_setParameter(ctx, param, value), "setting up zstd")
        contexts[acceleration] = ctx
    return contexts[acceleration]


def _check(code: int, doing: str) -> int:
    assert _LIB is not None
    if _LIB.ZSTD_isError(code):
        raise EntropyCodingError(f"lossless: {doing} failed "
                                 f"({_LIB.ZSTD_getErrorName(code).decode()})")
    return code


def compress(plane: np.ndarray, acceleration: int = 0) -> bytes:
    """One zstd frame of a contiguous uint8 plane (its content size written).

    ``acceleration`` (zstd's ``targetLength`` of the fast strategy, 0..255) makes the
    match search skip ahead faster between matches: fewer matches found, a few tenths of
    a percent larger on gradient exponents, and up to 2x faster where the plane has no
    runs. Without libzstd it is ignored.
    """
    if not 0 <= acceleration <= 255:
        raise ValueError(f"zstd acceleration must be in 0..255, got {acceleration}")
    if _LIB is None:
        return zstandard.ZstdCompressor(compression_params=_STABLE).compress(plane.data)
    bound = _LIB.ZSTD_compressBound(plane.size)
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.size < bound:  # reused: no page faults per call
        scratch = _local.scratch = np.empty(bound, np.uint8)
    n = _check(_LIB.ZSTD_compress2(_cctx(acceleration), scratch.ctypes.data, bound,
                                   plane.ctypes.data, plane.size), "zstd compression")
    return scratch[:n].tobytes()


def decompress(data: bytes | bytearray | memoryview, size: int) -> np.ndarray:
    """The ``size`` bytes of one zstd frame (with or without its content size) as a new
    uint8 array; a frame that is damaged or holds any other size raises
    ``EntropyCodingError``."""
    if _LIB is None:
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
        except zstandard.ZstdError as e:
            raise EntropyCodingError(f"lossless: corrupt plane ({e})") from e
        if len(raw) != size:
            raise EntropyCodingError("lossless: a byte plane has the wrong size")
        return np.frombuffer(raw, np.uint8)
    src = np.frombuffer(data, np.uint8)
    declared = _LIB.ZSTD_getFrameContentSize(src.ctypes.data, src.size)
    if declared == _CONTENT_ERROR:
        raise EntropyCodingError("lossless: a byte plane's zstd frame header is damaged")
    if declared not in (size, _CONTENT_UNKNOWN):  # frames of ``rest=zstd`` omit it
        raise EntropyCodingError("lossless: a byte plane has the wrong size")
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = _LIB.ZSTD_createDCtx()
    out = np.empty(size, np.uint8)
    n = _check(_LIB.ZSTD_decompressDCtx(dctx, out.ctypes.data, size, src.ctypes.data,
                                        src.size), "zstd decompression of a plane")
    if n != size:
        raise EntropyCodingError("lossless: a byte plane has the wrong size")
    return out
