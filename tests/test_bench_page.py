"""Benchmark pages: an index that names every page, and each page's commands rerunnable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradzip.bench.page import page_commands, pages_dir
from gradzip.cli import main

DOCS = Path(__file__).parents[1] / "docs"


def test_commands_are_read_from_fenced_blocks_with_continuations_and_comments() -> None:
    text = """prose gradzip not a command
```sh
# a comment line
gradzip compare --preset full \\
    --out runs/full        # 132 runs
make demo
echo not listed
```
```
torchrun --nproc_per_node 2 -m gradzip train --max-steps 5
GRADZIP_KILL_AT=1@7 OMP_NUM_THREADS=1 torchrun -m gradzip train
lower=case echo not listed
```
"""
    assert page_commands(text) == ["gradzip compare --preset full --out runs/full",
                                   "make demo",
                                   "torchrun --nproc_per_node 2 -m gradzip train --max-steps 5",
                                   "GRADZIP_KILL_AT=1@7 OMP_NUM_THREADS=1 torchrun -m gradzip "
                                   "train"]


def test_the_index_links_every_page_and_every_page_has_commands() -> None:
    index = (DOCS / "benchmarks.md").read_text()
    pages = sorted(pages_dir().glob("*.md"))
    assert len(pages) >= 10
    for page in pages:
        assert f"(benchmarks/{page.name})" in index, page.name
        assert page_commands(page.read_text()), f"{page.name} gives no command to rerun"
        assert "[All benchmarks](../benchmarks.md)" in page.read_text()
    assert "| page | what it measures | first command | machine | dated |" in index


def test_bench_page_prints_a_pages_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "page", "race"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert any(re.match(r"gradzip compare --preset \w+", line) for line in shown), shown


def test_an_unknown_page_lists_the_pages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "page", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark page 'nope'" in err and "race" in err and "codecs" in err


def test_every_pages_commands_parse_and_hold_no_placeholder() -> None:
    """``bench page NAME --run`` runs the commands as written: an elided ``...`` or a
    ``<placeholder>`` would stop the rerun half-way."""
    import shlex

    for page in sorted(pages_dir().glob("*.md")):
        for command in page_commands(page.read_text()):
            words = shlex.split(command)  # quotes balance
            assert not any("..." in w or re.fullmatch(r"<[A-Za-z_-]+>", w) for w in words), \
                f"{page.name}: {command}"
