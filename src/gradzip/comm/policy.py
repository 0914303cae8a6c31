"""``Policy``: which codec each parameter's gradient goes through, and from which step.

Users of every compression tool ask for the same two knobs: leave some parameters
uncompressed (norms, biases, embeddings: small, or sensitive), and communicate
uncompressed for the first steps (PowerSGD's ``start_powerSGD_iter``, DGC's warm-up).
A policy says both::

    {"codec": "ef | topk(ratio=0.01)",
     "groups": [{"params": ["*.bias", "*norm*", "*embed*"], "codec": "none"}],
     "start_step": 100}

``params`` are shell-style patterns (``fnmatch``) over parameter names as the
wrapped module names them (``module.`` prefixes of DDP are stripped); the first
group that matches wins, and everything else takes ``codec``. ``start_step`` counts
synchronized steps: before it, every gradient travels as PyTorch's own uncompressed
all-reduce / reduce-scatter. A plain spec string is a policy with one codec.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field, replace
from typing import Any

from gradzip.codecs.chain import Codec
from gradzip.codecs.registry import SpecError

_KEYS = ("codec", "groups", "start_step")


@dataclass(frozen=True)
class Group:
    """Parameters whose names match any of ``patterns`` use codec ``spec``."""

    patterns: tuple[str, ...]
    spec: str
    #: ``spec`` built once when the policy was parsed: the prototype of every rank's codec
    codec: Codec = field(compare=False, repr=False)

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


@dataclass(frozen=True)
class Policy:
    """A default codec, per-parameter exceptions, and a start step.

    Every spec in it is parsed once, when the policy is (``parse``); its ``codecs`` are
    the prototypes the hooks copy (``Codec.fresh``), never parsed again.
    """

    spec: str
    codec: Codec = field(compare=False, repr=False)
    groups: tuple[Group, ...] = field(default=())
    start_step: int = 0

    @classmethod
    def parse(cls, spec: str | dict[str, Any] | list[Any] | Codec | Policy) -> Policy:
        """A policy from a spec string, a Codec, or the JSON policy form (text or dict)."""
        if isinstance(spec, Policy):
            return spec
        if isinstance(spec, Codec):
            return cls(str(spec), spec.fresh())
        obj: Any = spec
        if isinstance(spec, str) and spec.strip().startswith("{"):
            try:
                obj = json.loads(spec)
            except json.JSONDecodeError as e:
                raise SpecError(f"codec spec looks like JSON but is not valid: {e}") from None
        if not (isinstance(obj, dict) and ("groups" in obj or "start_step" in obj
                                           or "codec" in obj)):
            return cls(*_built(spec, "codec"))
        return cls._from_json(obj)

    @classmethod
    def _from_json(cls, obj: dict[str, Any]) -> Policy:
        unknown = sorted(set(obj) - set(_KEYS))
        if unknown:
            raise SpecError(f"unknown policy keys {unknown}; a policy has {', '.join(_KEYS)}")
        spec, codec = _built(obj.get("codec", "none"), "codec")
        raw_groups = obj.get("groups", [])
        if not isinstance(raw_groups, list):
            raise SpecError("policy 'groups' is a list of {\"params\": [...], \"codec\": SPEC}")
        groups = tuple(_group(g, n) for n, g in enumerate(raw_groups))
        return cls(spec, codec, groups, _start_step(obj.get("start_step", 0)))

    def with_overrides(self, groups: dict[str, str] | None,
                       start_step: int | None) -> Policy:
        """This policy with ``groups`` (name patterns -> spec, comma-separated patterns
        in a key) put first and ``start_step`` replaced (``attach``'s keywords)."""
        extra = tuple(_group({"params": [p.strip() for p in str(k).split(",")], "codec": v}, n)
                      for n, (k, v) in enumerate((groups or {}).items()))
        if not extra and start_step is None:
            return self
        start = self.start_step if start_step is None else _start_step(start_step)
        return replace(self, groups=extra + self.groups, start_step=start)

    @property
    def specs(self) -> list[str]:
        """Codec specs by group index: 0 is the default, 1.. the groups in order."""
        return [self.spec, *(g.spec for g in self.groups)]

    @property
    def codecs(self) -> list[Codec]:
        """The codecs by group index, built when the policy was parsed (prototypes)."""
        return [self.codec, *(g.codec for g in self.groups)]

    def group_of(self, name: str) -> int:
        """The group index for parameter ``name`` (0: the default codec)."""
        for n, g in enumerate(self.groups):
            if g.matches(name):
                return n + 1
        return 0

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.spec,
                "groups": [{"params": list(g.patterns), "codec": g.spec} for g in self.groups],
                "start_step": self.start_step}

    def __str__(self) -> str:
        if not self.groups and not self.start_step:
            return self.spec
        return json.dumps(self.to_json())


def _built(value: Any, where: str) -> tuple[str, Codec]:
    """A spec's text and its codec, parsed once (SpecError names the bad stage)."""
    if isinstance(value, str):
        spec = value
    elif isinstance(value, list | dict):
        spec = json.dumps(value)
    else:
        raise SpecError(f"policy {where} must be a codec spec string or JSON, got {value!r}")
    return spec, Codec.from_spec(value)


def _start_step(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SpecError(f"policy start_step must be an integer >= 0, got {value!r}")
    return value


def _group(obj: Any, n: int) -> Group:
    if not isinstance(obj, dict) or set(obj) != {"params", "codec"}:
        raise SpecError(f"policy group {n} must be {{\"params\": [PATTERN, ...], "
                        f"\"codec\": SPEC}}, got {obj!r}")
    patterns = obj["params"]
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise SpecError(f"policy group {n}: 'params' must be non-empty name patterns")
    return Group(tuple(patterns), *_built(obj["codec"], f"group {n} codec"))
