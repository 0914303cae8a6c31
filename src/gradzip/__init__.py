"""gradzip: cheap gradient communication for data-parallel PyTorch, measured honestly.

>>> import gradzip, torch
>>> c = gradzip.codec("ef | topk(ratio=0.01) | qsgd(levels=16)")
>>> p = c.encode(torch.randn(4096), key="w")
>>> g = c.decode(gradzip.Payload.deserialize(p.serialize()))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names are real; they are imported on first use (see __getattr__)
    from gradzip.codecs import (
        Codec,
        CodecState,
        NonFiniteGradientError,
        Payload,
        PayloadError,
        SpecError,
        registered,
    )
    from gradzip.collectives import Communicator
    from gradzip.comm import ddp_hook
    from gradzip.integrations.script import attach

__version__ = "0.1.0"


def codec(spec: str | list[Any] | dict[str, Any] | Codec, **kwargs: Any) -> Codec:
    """Build a codec from a spec string (``"ef | topk(ratio=0.01)"``) or its JSON form.

    Keyword arguments: ``seed`` (shared randomness), ``rank`` (private randomness),
    ``nonfinite`` (``"error"`` or ``"propagate"``).
    """
    from gradzip.codecs import Codec

    if isinstance(spec, Codec):
        spec = str(spec)
    return Codec.from_spec(spec, **kwargs)


_LAZY = {
    **dict.fromkeys(("Codec", "CodecState", "NonFiniteGradientError",
                     "Payload", "PayloadError", "SpecError", "registered"), "gradzip.codecs"),
    "Communicator": "gradzip.collectives",
    "ddp_hook": "gradzip.comm",
    # with a spec, gradzip.comm's attach; without one, the method of gradzip compare
    "attach": "gradzip.integrations.script",
}


def __getattr__(name: str) -> Any:
    """Import on first use, so ``import gradzip`` (and ``gradzip --help``) does not load
    torch, numba or torch.distributed until a name that needs them is touched."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Codec", "CodecState", "Communicator", "NonFiniteGradientError", "Payload",
    "PayloadError", "SpecError", "attach", "codec", "ddp_hook", "registered",
]
