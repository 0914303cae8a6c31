"""The lossless stage: entropy measures and coders that follow any integer codec.

Importing this package registers the stages ``eg`` (Exp-Golomb), ``ans`` (rANS via
constriction), ``zstd`` and ``lz4`` (byte-oriented baselines) and the ``lossless``
float codec (byte planes of fp32/bf16/fp16 values, ZipNN-style). ``measures`` holds the
pure functions (entropy, exact Exp-Golomb lengths, efficiency) the benchmarks use.
"""

from gradzip.codecs.entropy import ans, bytecoders, expgolomb, floatcodec, measures  # noqa: F401
from gradzip.codecs.entropy._frame import EntropyCodingError

__all__ = ["EntropyCodingError", "ans", "bytecoders", "expgolomb", "floatcodec", "measures"]
