"""The documents point at things that exist.

Every relative markdown link in README.md and docs/*.md names an existing file, and
every source or test path the documents quote in backticks (``src/...``, ``tests/...``)
exists, so a renamed module cannot leave the docs pointing at nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_INLINE_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_REPO_PATH = re.compile(r"^(?:src|tests)/[\w./-]*$")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (no links live there)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    """Targets of inline and reference links that point into the repository."""
    prose = _prose(text)
    targets = _INLINE_LINK.findall(prose) + _REFERENCE_LINK.findall(prose)
    return [t for t in targets
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)  # http:, mailto:
            and not t.startswith("#")]


def quoted_paths(text: str) -> list[str]:
    """``src/...`` and ``tests/...`` paths quoted in backticks (code blocks excluded)."""
    return [m for m in _CODE_SPAN.findall(_FENCE.sub("", text)) if _REPO_PATH.match(m)]


def test_the_parsers_find_what_they_should() -> None:
    text = ("[a](architecture.md) [b](../README.md#layout) [c](https://x.org/y.md) [d](#top)\n"
            "`src/gradzip/cli.py` `tests/` `[x](in-code.md)` `src/gradzip/codecs/base.py:Slot`\n"
            "```\n[e](in-a-block.md) `src/in/a/block.py`\n```\n[ref]: docs/results.md\n")
    assert relative_links(text) == ["architecture.md", "../README.md#layout",
                                    "docs/results.md"]
    assert quoted_paths(text) == ["src/gradzip/cli.py", "tests/"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(doc: Path) -> None:
    missing = []
    for target in relative_links(doc.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (doc.parent / path).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quoted_source_paths_exist(doc: Path) -> None:
    missing = [p for p in quoted_paths(doc.read_text(encoding="utf-8"))
               if not (ROOT / p).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_architecture_doc_names_source_files() -> None:
    """The architecture page exists and its paths are checked (not silently skipped)."""
    paths = quoted_paths((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert sum(p.startswith("src/") and p.endswith(".py") for p in paths) >= 20


def test_readme_names_every_registered_stage() -> None:
    """The README's spec section lists every stage a spec can name (a new codec file
    registers itself; the list must not silently miss it)."""
    import gradzip

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Specs"):]
    section = section[:section.index("\n## ", 1)]
    missing = [name for name in gradzip.registered() if f"`{name}" not in section]
    assert not missing, f"README's Specs section does not name {missing}"
