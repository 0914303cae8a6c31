"""Gradient codecs: pure tensor -> payload -> tensor; no torch.distributed here.

Importing this package registers every built-in stage but the entropy coders (``ans``,
``eg``, ``zstd``, ``lz4``, ``lossless``), which register when a spec first names one
(``registry.lookup``) or ``registered()`` lists them all: so a chain without them never
imports numba, constriction or zstandard.
"""

# importing a stage module registers its stages
from gradzip.codecs import (  # noqa: F401
    casts,
    centroid,
    demo,
    dgc,
    feedback,
    fp8,
    gradiveq,
    powersgd,
    quantize,
    sharedtopk,
    sign,
    sketch,
    sparse,
    stdbins,
)
from gradzip.codecs.base import CodecState, Compressor, LosslessCoder, Slot, Stage, Wrapper
from gradzip.codecs.chain import Codec, NonFiniteGradientError
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, SpecError, register, registered

__all__ = [
    "Codec", "CodecState", "Compressor", "LosslessCoder", "NonFiniteGradientError", "Param",
    "Payload", "PayloadError", "Slot", "SpecError", "Stage", "Wrapper", "register",
    "registered",
]
