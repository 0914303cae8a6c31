"""Checks on received payloads that need not stop the GPU: flags read later, once.

A decoder validates what it received (positions ascending and in range, a bitmap
marking as many positions as values came) because the bytes came from the network.
On the host path each check is a read of one value. On a GPU that read stalls the
stream, once per check and per received payload, in the middle of a reduction.

Inside ``deferred_checks()`` a decoder instead records each check as a 0-d bool
tensor on the device (``DeferredChecks.require``) and makes its output safe to use
whatever the bytes said (positions clamped into range, counts fixed), so no memory
outside the tensor is ever touched; the caller reads the flags once, with the
reduction's other flags (``Communicator.watch``), and raises ``PayloadError`` before
the result is used. Outside it, decoders check on the host as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_ACTIVE = threading.local()


class DeferredChecks:
    """The failed-check flags a decode recorded, and what each one said."""

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._messages: list[str] = []

    def require(self, ok: torch.Tensor, message: str) -> None:
        """Record a check (``ok``: a 0-d bool on the data's device) without reading it."""
        self._flags.append(~ok.reshape(()))
        self._messages.append(message)

    def failed(self, device: torch.device) -> torch.Tensor:
        """A 0-d bool on ``device``: whether any recorded check failed."""
        if not self._flags:
            return torch.zeros((), dtype=torch.bool, device=device)
        return torch.stack(self._flags).any()

    def describe(self) -> str:
        """What the checks were (the error's words: which one failed is on the device)."""
        return "; ".join(sorted(set(self._messages))) or "no checks"


def deferring() -> DeferredChecks | None:
    """The checks collecting on this thread, or None (decoders then read at once)."""
    return getattr(_ACTIVE, "checks", None)


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Decoders on this thread record their checks instead of reading them (module doc)."""
    before = deferring()
    _ACTIVE.checks = checks = DeferredChecks()
    try:
        yield checks
    finally:
        _ACTIVE.checks = before


@contextmanager
def own_payload() -> Iterator[None]:
    """Decoding a payload this rank encoded itself (error feedback's residual, its own
    share of a mean): nothing crossed a network, so its checks are not read at all."""
    with deferred_checks():
        yield


def require(ok: torch.Tensor, what: str, error: type[Exception] = ValueError) -> None:
    """A check on a received payload (``ok``: a 0-d bool on the data's device): read at
    once (one host read; ``error(what)`` if it failed), or recorded under
    ``deferred_checks`` and read later with the others."""
    checks = deferring()
    if checks is not None:
        checks.require(ok, what)
    elif not bool(ok):
        raise error(what)


def codes_below(codes: torch.Tensor, limit: int, what: str,
                error: type[Exception] = ValueError) -> torch.Tensor:
    """``codes`` (received, untrusted), each below ``limit``: checked at once (one host
    read, ``error(what ...)`` if one is not), or under ``deferred_checks`` recorded as a
    flag on the device and clamped into range, so the decode reads only valid codes."""
    if not codes.numel():
        return codes
    checks = deferring()
    if checks is None:
        if int(codes.max()) >= limit:
            raise error(f"{what}: a code of {int(codes.max())} exceeds {limit - 1}")
        return codes
    checks.require(codes.max() < limit, f"{what} below {limit}")
    return codes.clamp(max=limit - 1)
