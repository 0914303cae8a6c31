import json

import pytest

import gradzip
from gradzip.codecs.spec import parse


def test_parse_string_forms():
    assert parse("none") == [("none", {})]
    assert parse(" ef(beta=0.5) | fp16 ") == [("ef", {"beta": 0.5}), ("fp16", {})]
    assert parse("x(a=1, b=true, c='s', d=auto, e=1e-3)") == [
        ("x", {"a": 1, "b": True, "c": "s", "d": "auto", "e": 1e-3})
    ]


def test_json_forms_match_string():
    s = parse("ef(beta=0.9) | bf16")
    assert parse([{"name": "ef", "beta": 0.9}, {"name": "bf16"}]) == s
    assert parse({"chain": [{"name": "ef", "beta": 0.9}, "bf16"]}) == s
    assert parse(json.dumps([{"name": "ef", "beta": 0.9}, {"name": "bf16"}])) == s


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "empty"),
        ("fp16 |", "ends early"),
        ("fp16 bf16", "expected '\\|'"),
        ("ef(beta)", "needs '=value'"),
        ("ef(beta=1, beta=2)", "given twice"),
        ("fp16 $", "cannot read"),
        ("[1, 2", "not valid"),
        ("wavelet", "unknown codec stage 'wavelet'.*known stages"),
        ("ef(beta=2) | fp16", "ef: parameter 'beta' must be in \\[0.0, 1.0\\]"),
        ("ef(beta=x) | fp16", "ef: parameter 'beta' must be float"),
        ("ef(alpha=1) | fp16", "unknown parameter 'alpha'; allowed: beta, gamma"),
        ("fp16 | ef", "must come first"),
    ],
)
def test_errors_are_clear(bad, message):
    with pytest.raises(gradzip.SpecError, match=message):
        gradzip.codec(bad)


def test_str_round_trips_to_equivalent_spec():
    for spec in ["none", "fp16", "ef | bf16", "ef(beta=0.5, gamma=0.9) | fp16"]:
        c = gradzip.codec(spec)
        assert str(gradzip.codec(str(c))) == str(c)
        assert str(gradzip.codec(c.to_json())) == str(c)
    assert str(gradzip.codec("ef(beta=1.0) | fp16")) == "ef | fp16"


# ---------------------------------------------------------------- every stage, every parameter
STAGES = gradzip.registered()


def _chain(stage: str) -> str:
    """A valid chain around one stage spec: coders need a quantizer, ef a compressor."""
    name = stage.split("(")[0]
    if issubclass(STAGES[name], gradzip.codecs.LosslessCoder):
        return f"int8 | {stage}"
    if issubclass(STAGES[name], gradzip.codecs.Wrapper):
        return f"{stage} | topk"
    return stage


def _other_value(p):
    """A valid value of ``p`` other than its default, or None if none is found."""
    if p.choices:
        return next(c for c in p.choices if c != p.default)
    if p.type is bool:
        return not p.default
    base = p.default if isinstance(p.default, int | float) and p.default else 1
    for v in (base * 2, base / 2, base + 1, base - 1, 3, 2, 0.5, 0.25):
        v = p.type(v)
        if v != p.default and (p.check is None or p.check(v) is None):
            return v
    return None


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_parameter_round_trips_through_str_and_json(name):
    for p in STAGES[name].PARAMS:
        value = _other_value(p)
        assert value is not None, f"{name}.{p.name}: no valid non-default value found"
        try:
            c = gradzip.codec(_chain(f"{name}({p.name}={value!r})"))
        except gradzip.SpecError as e:  # a cross-parameter rule (validate) may refuse it
            assert name in str(e)
            continue
        stage = next(s for s in c.stages if s.name == name)
        assert stage.params[p.name] == value
        for again in (gradzip.codec(str(c)), gradzip.codec(c.to_json()),
                      gradzip.codec(json.dumps(c.to_json()))):
            assert str(again) == str(c)
            assert [s.params for s in again.stages] == [s.params for s in c.stages]


@pytest.mark.parametrize("name", sorted(STAGES))
def test_bad_values_name_the_stage_the_parameter_and_what_is_allowed(name):
    with pytest.raises(gradzip.SpecError, match=rf"^{name}: unknown parameter 'bogus'; allowed"):
        gradzip.codec(_chain(f"{name}(bogus=1)"))
    for p in STAGES[name].PARAMS:
        prefix = rf"^{name}: parameter '{p.name}' must be"
        if p.type is str:
            assert p.choices, f"{name}.{p.name}: a free-form string; list its allowed values"
            with pytest.raises(gradzip.SpecError, match=prefix + " one of " + ", ".join(p.choices)):
                gradzip.codec(_chain(f"{name}({p.name}=zz_not_allowed)"))
            continue
        with pytest.raises(gradzip.SpecError, match=rf"{prefix} {p.type.__name__}"):
            gradzip.codec(_chain(f"{name}({p.name}=zz_not_allowed)"))
        if p.check is None:
            continue
        rejected = [v for v in (-1e30, -1, 0, 1e30, 2**40, float("nan"))
                    if p.check(p.type(v) if p.type is int and v == v else v) is not None]
        assert rejected, f"{name}.{p.name}: no out-of-range value found"
        with pytest.raises(gradzip.SpecError, match=rf"{prefix} (in [\[(]|>=? |> )"):
            gradzip.codec(_chain(f"{name}({p.name}={rejected[0]!r})"))


def test_codecs_list_shows_every_stage_with_parameters_and_defaults(capsys):
    import argparse

    from gradzip.commands.codecs import describe, run_list

    rows = {r["name"]: r for r in describe()}
    assert set(rows) == set(STAGES)
    for name, cls in STAGES.items():
        assert [(p["name"], p["default"]) for p in rows[name]["params"]] == [
            (p.name, p.default) for p in cls.PARAMS
        ]
        default = cls() if issubclass(cls, gradzip.codecs.Compressor) else None
        for flag in ("summable", "unbiased", "multi_round"):  # as the default instance has it
            if default is not None:
                assert rows[name][flag] == bool(getattr(default, flag)), (name, flag)
    assert run_list(argparse.Namespace(json=True)) == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == set(STAGES)
    assert run_list(argparse.Namespace(json=False)) == 0
    text = capsys.readouterr().out
    for name, cls in STAGES.items():
        assert name in text
        for p in cls.PARAMS:
            assert f"{p.name}=" in text, (name, p.name)
