"""gradzip: cheap gradient communication for data-parallel PyTorch, measured honestly.

>>> import gradzip, torch
>>> c = gradzip.codec("ef | topk(ratio=0.01) | qsgd(levels=16)")
>>> p = c.encode(torch.randn(4096), key="w")
>>> g = c.decode(gradzip.Payload.deserialize(p.serialize()))
"""

from __future__ import annotations

from typing import Any

from gradzip.codecs import (
    Codec,
    CodecState,
    Communicator,
    NonFiniteGradientError,
    Payload,
    PayloadError,
    SpecError,
    registered,
)

__version__ = "0.1.0"


def codec(spec: str | list[Any] | dict[str, Any] | Codec, **kwargs: Any) -> Codec:
    """Build a codec from a spec string (``"ef | topk(ratio=0.01)"``) or its JSON form.

    Keyword arguments: ``seed`` (shared randomness), ``rank`` (private randomness),
    ``nonfinite`` (``"error"`` or ``"propagate"``).
    """
    if isinstance(spec, Codec):
        spec = str(spec)
    return Codec.from_spec(spec, **kwargs)


def __getattr__(name: str) -> Any:
    """Lazy ``attach``/``ddp_hook``: importing gradzip stays free of torch.distributed."""
    if name in ("attach", "ddp_hook"):
        import gradzip.comm

        return getattr(gradzip.comm, name)
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")


__all__ = [
    "Codec", "CodecState", "Communicator", "NonFiniteGradientError", "Payload",
    "PayloadError", "SpecError", "attach", "codec", "ddp_hook", "registered",
]
