"""Gradient codecs: pure tensor -> payload -> tensor; no torch.distributed here.

Importing this package registers every built-in stage.
"""

# importing a stage module registers its stages
from gradzip.codecs import (  # noqa: F401
    casts,
    demo,
    dgc,
    entropy,
    feedback,
    gradiveq,
    powersgd,
    quantize,
    sign,
    sketch,
    sparse,
)
from gradzip.codecs.base import CodecState, Compressor, LosslessCoder, Slot, Stage, Wrapper
from gradzip.codecs.chain import Codec, NonFiniteGradientError
from gradzip.codecs.communicator import CommCounter, Communicator
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, SpecError, register, registered
from gradzip.codecs.simulated import SimulatedCommunicator, run_simulated, simulated_group

__all__ = [
    "Codec", "CodecState", "CommCounter", "Communicator", "Compressor", "LosslessCoder",
    "NonFiniteGradientError", "Param", "Payload", "PayloadError", "SimulatedCommunicator",
    "Slot", "SpecError", "Stage", "Wrapper", "register", "registered", "run_simulated",
    "simulated_group",
]
