"""docs/results.md documents every field of the results record, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from train_helpers import flags, last_result

from gradzip.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "results.md"


def documented_fields() -> set[str]:
    """Field names in the first column of the tables (``a_p50`` / ``_p90`` shorthands)."""
    names: set[str] = set()
    for line in DOC.read_text().split(COMPARE_HEADING)[0].splitlines():
        if not line.startswith("| `"):
            continue
        tokens = re.findall(r"`([^`]+)`", line.split("|")[1])
        for tok in tokens:
            names.add(tokens[0].rsplit("_", 1)[0] + tok if tok.startswith("_") else tok)
    return names


#: the heading of the ``compare`` object's section (documented apart from the record)
COMPARE_HEADING = "## The `compare` object"


def documented_compare_fields() -> set[str]:
    """The fields of the ``compare`` object that docs/results.md lists."""
    section = DOC.read_text().split(COMPARE_HEADING)[1]
    return {re.findall(r"`([^`]+)`", line)[0] for line in section.splitlines()
            if line.startswith("| `")}


def test_the_documented_fields_parse() -> None:
    fields = documented_fields()
    assert {"step_time_ms_p50", "step_time_ms_p95", "encode_ms", "decode_ms"} <= fields


@pytest.mark.parametrize("extra", [[], ["--parallel", "ddp", "--codec", "ef | topk(ratio=0.1)"]])
def test_every_record_field_is_documented(tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", *flags(tmp_path / "cache", out, "--max-steps", "3", *extra)]) == 0
    record = last_result(out)
    assert set(record) - documented_fields() == set(), "fields missing from docs/results.md"
    assert documented_fields() - set(record) == set(), "docs/results.md lists unknown fields"
