"""The codec registry: stage names, their parameters, and validation.

Every stage class declares its parameters as ``Param`` objects; the registry checks
user values against them before a stage is built, so a bad spec fails with a message
that names the stage, the parameter and what is allowed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradzip.codecs.base import Stage


class SpecError(ValueError):
    """A codec spec (string or JSON) is malformed or names bad values."""


Check = Callable[[Any], str | None]


@dataclass(frozen=True)
class Param:
    """One parameter of a stage: its type, default, meaning and allowed values."""

    name: str
    type: type
    default: Any
    help: str
    check: Check | None = None
    choices: tuple[Any, ...] | None = None
    #: an ``auto`` default is chosen by the stage (e.g. Exp-Golomb order k)
    allow_auto: bool = False

    def coerce(self, stage: str, value: Any) -> Any:
        """Validate ``value`` for this parameter; return it in canonical type."""
        if value is None and self.default is None:
            return None
        if self.allow_auto and value == "auto":
            return "auto"
        try:
            if self.type is bool:
                if isinstance(value, str):
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError
                    value = value.lower() in ("true", "1")
                elif not isinstance(value, bool | int):
                    raise ValueError
                value = bool(value)
            elif self.type is int:
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, int):
                    value = int(str(value), 0)
            elif self.type is float:
                if isinstance(value, bool):
                    raise ValueError
                value = float(value)
            else:
                value = self.type(value)
        except (TypeError, ValueError):
            raise SpecError(
                f"{stage}: parameter {self.name!r} must be {self.type.__name__}"
                f"{' or auto' if self.allow_auto else ''}, got {value!r}"
            ) from None
        if self.choices is not None and value not in self.choices:
            raise SpecError(
                f"{stage}: parameter {self.name!r} must be one of "
                f"{', '.join(map(str, self.choices))}; got {value!r}"
            )
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise SpecError(f"{stage}: parameter {self.name!r} {problem}; got {value!r}")
        return value


# ---------------------------------------------------------------- checks
def in_range(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A check for lo <= x <= hi with optional open ends; the message shows the interval."""
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(x: Any) -> str | None:
        ok_lo = x > lo if lo_open else x >= lo
        ok_hi = x < hi if hi_open else x <= hi
        return None if ok_lo and ok_hi else f"must be in {interval}"

    return check


def at_least(lo: float) -> Check:
    return lambda x: None if x >= lo else f"must be >= {lo}"


def positive(x: Any) -> str | None:
    return None if x > 0 else "must be > 0"


# ---------------------------------------------------------------- registry
_REGISTRY: dict[str, type[Stage]] = {}

#: built-in stages registered when first looked up: the entropy coders import numba,
#: constriction and zstandard, which a chain without them never needs
_LAZY = {"ans": "gradzip.codecs.entropy", "eg": "gradzip.codecs.entropy",
         "zstd": "gradzip.codecs.entropy", "lz4": "gradzip.codecs.entropy",
         "lossless": "gradzip.codecs.entropy"}


def register(name: str) -> Callable[[type[Stage]], type[Stage]]:
    """Class decorator: make a stage available to specs under ``name``."""

    def wrap(cls: type[Stage]) -> type[Stage]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise RuntimeError(f"codec stage {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def lookup(name: str) -> type[Stage]:
    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])  # registers it
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(set(_REGISTRY) | set(_LAZY)))
        raise SpecError(f"unknown codec stage {name!r}; known stages: {known}") from None


def registered() -> dict[str, type[Stage]]:
    """All stages by name, sorted (the lazily registered ones imported now)."""
    for module in sorted(set(_LAZY.values())):
        importlib.import_module(module)
    return dict(sorted(_REGISTRY.items()))
