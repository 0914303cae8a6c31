"""Parsing codec specs: ``"ef | topk(ratio=0.01) | qsgd(levels=16) | ans"`` or JSON.

Both forms become a list of ``(stage name, {param: value})``. The JSON form is a list
of stage objects ``[{"name": "topk", "ratio": 0.01}, ...]``, an object with a
``"chain"`` list, or a single stage object; a string starting with ``[`` or ``{``
is read as JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gradzip.codecs.registry import SpecError

StageSpec = tuple[str, dict[str, Any]]

#: chain options (``| name=value`` at the end of a spec string): how the chain runs
OPTIONS = ("aggregate",)

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<str>"[^"]*"|'[^']*')
      | (?P<word>[A-Za-z_][A-Za-z0-9_.\-]*)
      | (?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
      | (?P<punct>[|(),=])
    )""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise SpecError(f"cannot read codec spec at column {pos + 1}: {text[pos:]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return out


def _value(kind: str, text: str) -> Any:
    if kind == "str":
        return text[1:-1]
    if kind == "num":
        return float(text) if any(c in text for c in ".eE") else int(text)
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    return text


def parse_string(text: str) -> list[StageSpec]:
    """Parse the ``a(k=v) | b | ...`` form."""
    toks = _tokens(text)
    if not toks:
        raise SpecError("empty codec spec; try 'none', 'fp16' or 'ef | topk(ratio=0.01)'")
    stages: list[StageSpec] = []
    i = 0

    def expect(what: str) -> tuple[str, str, int]:
        nonlocal i
        if i >= len(toks):
            raise SpecError(f"codec spec {text!r} ends early; expected {what}")
        tok = toks[i]
        i += 1
        return tok

    while True:
        kind, name, col = expect("a stage name")
        if kind != "word":
            raise SpecError(f"expected a stage name at column {col + 1} of {text!r}, got {name!r}")
        params: dict[str, Any] = {}
        if i < len(toks) and toks[i][1] == "=":  # a chain option: name=value
            i += 1
            vkind, val, vcol = expect(f"a value for option {name}")
            if vkind not in ("str", "word", "num"):
                raise SpecError(f"bad value for option {name!r} at column {vcol + 1}: {val!r}")
            stages.append((f"={name.lower()}={val}", {}))
            if i == len(toks):
                return stages
            kind, tok, col = expect("'|'")
            if tok != "|":
                raise SpecError(f"expected '|' at column {col + 1} of {text!r}, got {tok!r}")
            continue
        if stages and stages[-1][0].startswith("="):
            raise SpecError(f"chain options such as {stages[-1][0][1:]!r} go at the end "
                            f"of the spec, after every stage: {text!r}")
        if i < len(toks) and toks[i][1] == "(":
            i += 1
            while not (i < len(toks) and toks[i][1] == ")"):
                kkind, key, kcol = expect(f"a parameter of {name}")
                if kkind != "word":
                    raise SpecError(
                        f"{name}: expected 'name=value' at column {kcol + 1}, got {key!r}"
                    )
                if expect("'='")[1] != "=":
                    raise SpecError(f"{name}: parameter {key!r} needs '=value'")
                vkind, val, vcol = expect(f"a value for {name}.{key}")
                if vkind not in ("str", "num", "word"):
                    raise SpecError(f"{name}: bad value for {key!r} at column {vcol + 1}: {val!r}")
                if key in params:
                    raise SpecError(f"{name}: parameter {key!r} given twice")
                params[key] = _value(vkind, val)
                if i < len(toks) and toks[i][1] == ",":
                    i += 1
            i += 1  # the ')'
        stages.append((name.lower(), params))
        if i == len(toks):
            return stages
        kind, tok, col = expect("'|'")
        if tok != "|":
            raise SpecError(
                f"expected '|' between stages at column {col + 1} of {text!r}, got {tok!r}"
            )


def parse_json(obj: Any) -> list[StageSpec]:
    """Parse the JSON form (already loaded)."""
    if isinstance(obj, dict) and "chain" in obj:
        obj = obj["chain"]
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list) or not obj:
        raise SpecError("a JSON codec spec is a non-empty list of stage objects")
    stages: list[StageSpec] = []
    for n, stage in enumerate(obj):
        if isinstance(stage, str):
            stages.append((stage.lower(), {}))
            continue
        if not isinstance(stage, dict) or not isinstance(stage.get("name"), str):
            raise SpecError(f"JSON stage {n} must be an object with a string 'name': {stage!r}")
        params = {k: v for k, v in stage.items() if k != "name"}
        stages.append((stage["name"].lower(), params))
    return stages


def parse(spec: str | list[Any] | dict[str, Any]) -> list[StageSpec]:
    """Parse a spec string, a JSON string, or loaded JSON into its stages."""
    return parse_options(spec)[0]


def parse_options(spec: str | list[Any] | dict[str, Any]
                  ) -> tuple[list[StageSpec], dict[str, Any]]:
    """The stages and the chain options of a spec.

    Chain options (``OPTIONS``) say how the whole chain runs rather than what a
    stage does: ``"qsgd | aggregate=two_phase"`` in the string form,
    ``{"chain": [...], "aggregate": "two_phase"}`` in JSON.
    """
    if isinstance(spec, str):
        stripped = spec.strip()
        if stripped[:1] in ("[", "{"):
            try:
                spec = json.loads(stripped)
            except json.JSONDecodeError as e:
                raise SpecError(f"codec spec looks like JSON but is not valid: {e}") from None
        else:
            stages = parse_string(stripped)
            options = {}
            while stages and stages[-1][0].startswith("="):
                name, value = stages.pop()[0][1:].split("=", 1)
                options[_option(name)] = _value("word", value)
            return stages, options
    options = {}
    if isinstance(spec, dict) and "chain" in spec:
        for name in spec:
            if name != "chain":
                options[_option(name)] = spec[name]
    return parse_json(spec), options


def _option(name: str) -> str:
    if name not in OPTIONS:
        raise SpecError(f"unknown chain option {name!r}; known: {', '.join(OPTIONS)}")
    return name
