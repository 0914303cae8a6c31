"""zstd for one byte plane: Huffman-coded literals behind an accelerated match search.

On the exponent plane of gradients most of zstd's time goes to the match search (two
thirds of its instructions on a ResNet's bf16 exponent plane, by callgrind), while most
of the saving comes from the Huffman-coded literals; the matches add the runs an order-0
coder misses (zero rows of unused embeddings, neighbouring weights of one magnitude).
zstd's fast strategy can skip ahead between match attempts (``targetLength``, the
"acceleration" of its negative levels), but it then stops coding literals unless the
experimental parameter ``ZSTD_c_literalCompressionMode`` forces Huffman on.
python-zstandard's C backend takes only the stable parameters; its cffi backend exposes
the bundled libzstd's whole API, experimental parameters included, so this module drives
that (it needs the ``cffi`` package). The frames are ordinary zstd frames that any zstd
decoder reads.

Without cffi, planes are compressed by python-zstandard's C backend with the same
parameters but no acceleration and the default literal mode: the same format, a little
smaller and up to 1.7x slower on run-free planes. Contexts are per thread (a zstd
context is not thread-safe).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zstandard

from gradzip.codecs.entropy._frame import EntropyCodingError

#: parameters shared by both paths: the fast strategy, 7-byte hashes into a table of
#: 2**8 entries (2**6 lost 0.6-1.4% of the ratio on a captured bucket), one probe
HASH_LOG, MIN_MATCH, SEARCH_LOG, WINDOW_LOG = 8, 7, 1, 17

#: planes up to this size compress into a per-thread scratch buffer kept between calls
#: (no page faults per call); larger ones get a buffer of their own, so a thread never
#: holds more than this much
SCRATCH_MAX = 16 << 20

_STABLE = zstandard.ZstdCompressionParameters.from_level(
    1, strategy=zstandard.STRATEGY_FAST, min_match=MIN_MATCH, search_log=SEARCH_LOG,
    hash_log=HASH_LOG, window_log=WINDOW_LOG, write_content_size=True, write_checksum=False)


def _load() -> tuple[Any, Any]:
    """(lib, ffi) of python-zstandard's cffi backend, or (None, None) without cffi."""
    try:
        from zstandard import backend_cffi
    except ImportError:
        return None, None
    if not hasattr(backend_cffi.lib, "ZSTD_c_literalCompressionMode"):
        return None, None
    return backend_cffi.lib, backend_cffi.ffi


_LIB, _FFI = _load()
_local = threading.local()


def accelerated() -> bool:
    """True when planes are compressed through the cffi backend with the accelerated search
    (else ``compress`` ignores its ``acceleration``)."""
    return _LIB is not None


def _cctx(acceleration: int) -> Any:
    """This thread's compression context for one acceleration (created once)."""
    contexts = _local.__dict__.setdefault("cctx", {})
    if acceleration not in contexts:
        lib = _LIB
        ctx = _FFI.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        settings = ((lib.ZSTD_c_strategy, lib.ZSTD_fast), (lib.ZSTD_c_windowLog, WINDOW_LOG),
                    (lib.ZSTD_c_hashLog, HASH_LOG), (lib.ZSTD_c_searchLog, SEARCH_LOG),
                    (lib.ZSTD_c_minMatch, MIN_MATCH), (lib.ZSTD_c_targetLength, acceleration),
                    (lib.ZSTD_c_literalCompressionMode, lib.ZSTD_ps_enable),
                    (lib.ZSTD_c_contentSizeFlag, 1), (lib.ZSTD_c_checksumFlag, 0))
        for param, value in settings:
            _check(_LIB.ZSTD_CCtx_setParameter(ctx, param, value), "setting up zstd")
        contexts[acceleration] = ctx
    return contexts[acceleration]


def _check(code: int, doing: str) -> int:
    if _LIB.ZSTD_isError(code):
        name = _FFI.string(_LIB.ZSTD_getErrorName(code)).decode()
        raise EntropyCodingError(f"lossless: {doing} failed ({name})")
    return int(code)


def compress(plane: np.ndarray, acceleration: int = 0) -> bytes:
    """One zstd frame of a contiguous uint8 plane (its content size written).

    ``acceleration`` (zstd's ``targetLength`` of the fast strategy, 0..255) makes the
    match search skip ahead faster between matches: fewer matches found, a few tenths of
    a percent larger on gradient exponents, and up to 2x faster where the plane has no
    runs. Without cffi it is ignored.
    """
    if not 0 <= acceleration <= 255:
        raise ValueError(f"zstd acceleration must be in 0..255, got {acceleration}")
    plane = np.ascontiguousarray(plane, np.uint8)  # a view when it already is
    if _LIB is None:
        return zstandard.ZstdCompressor(compression_params=_STABLE).compress(plane.data)
    bound = _LIB.ZSTD_compressBound(plane.size)
    scratch = getattr(_local, "scratch", None)
    if bound > SCRATCH_MAX:
        scratch = np.empty(bound, np.uint8)
    elif scratch is None or scratch.size < bound:
        scratch = _local.scratch = np.empty(bound, np.uint8)
    n = _check(_LIB.ZSTD_compress2(_cctx(acceleration), _FFI.from_buffer(scratch), bound,
                                   _FFI.from_buffer(plane), plane.size), "zstd compression")
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
    src = _FFI.from_buffer(data)
    declared = _LIB.ZSTD_getFrameContentSize(src, len(src))
    if declared == _LIB.ZSTD_CONTENTSIZE_ERROR:
        raise EntropyCodingError("lossless: a byte plane's zstd frame header is damaged")
    if declared not in (size, _LIB.ZSTD_CONTENTSIZE_UNKNOWN):  # frames of ``rest=zstd`` omit it
        raise EntropyCodingError("lossless: a byte plane has the wrong size")
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = _FFI.gc(_LIB.ZSTD_createDCtx(), _LIB.ZSTD_freeDCtx)
    out = np.empty(size, np.uint8)
    n = _check(_LIB.ZSTD_decompressDCtx(dctx, _FFI.from_buffer(out), size, src, len(src)),
               "zstd decompression of a plane")
    if n != size:
        raise EntropyCodingError("lossless: a byte plane has the wrong size")
    return out
