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
