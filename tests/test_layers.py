"""The dependency rule of docs/architecture.md, checked on the source.

Imports point downwards only: ``collectives`` knows nothing of codecs, ``codecs``
nothing above collectives, ``aggregation`` (reductions) nothing of the hooks, and none
of the three ``torch.distributed``; ``comm`` nothing of training, benchmarks or the CLI,
``train`` nothing of benchmarks or the CLI. Function-local imports count too: a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "gradzip"

#: layer -> gradzip modules it must not import (prefix match)
FORBIDDEN = {
    # how ranks exchange tensors and what it costs on the link: nothing of codecs
    "collectives": ("gradzip.codecs", "gradzip.comm", "gradzip.train", "gradzip.bench",
                    "gradzip.commands", "gradzip.cli", "gradzip.capture", "gradzip.analyze",
                    "gradzip.compare", "torch.distributed"),
    # tensor -> payload -> tensor; multi-round stages talk through collectives
    "codecs": ("gradzip.aggregation", "gradzip.comm", "gradzip.train", "gradzip.bench",
               "gradzip.commands", "gradzip.cli", "gradzip.capture", "gradzip.analyze",
               "gradzip.compare", "torch.distributed"),
    # reductions over any Communicator: above codecs, below the hooks
    "aggregation": ("gradzip.comm", "gradzip.train", "gradzip.bench", "gradzip.commands",
                    "gradzip.cli", "gradzip.capture", "gradzip.analyze", "gradzip.compare",
                    "torch.distributed"),
    "comm": ("gradzip.train", "gradzip.bench", "gradzip.commands", "gradzip.cli"),
    "train": ("gradzip.bench", "gradzip.commands", "gradzip.cli"),
    "bench": ("gradzip.commands", "gradzip.cli"),
    "compare": ("gradzip.commands", "gradzip.cli"),
    # the archive knows tensors and files, not how they were communicated
    "capture": ("gradzip.comm", "gradzip.train", "gradzip.bench", "gradzip.commands",
                "gradzip.cli", "torch.distributed"),
    # analysis reads archives and runs codecs over the simulated communicator
    "analyze": ("gradzip.comm", "gradzip.train", "gradzip.bench", "gradzip.commands",
                "gradzip.cli", "torch.distributed"),
}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import; ``from a import b`` yields ``a`` and ``a.b``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def distributed_attributes(tree: ast.AST) -> list[int]:
    """Lines that reach ``torch.distributed`` as an attribute (``torch.distributed.x``)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch"]


def _breaks(module: str, banned: tuple[str, ...]) -> bool:
    return any(module == b or module.startswith(b + ".") for b in banned)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_point_downwards(layer: str) -> None:
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, layer
    problems = []
    for f in files:
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        rel = f.relative_to(PACKAGE.parent)
        problems += [f"{rel}:{line} imports {mod}" for line, mod in imported_modules(tree)
                     if _breaks(mod, FORBIDDEN[layer])]
        if layer in ("codecs", "collectives", "aggregation"):
            problems += [f"{rel}:{line} uses torch.distributed"
                         for line in distributed_attributes(tree)]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_lazy_and_attribute_uses() -> None:
    tree = ast.parse("def f():\n    from gradzip.train import loop\n"
                     "    import torch\n    return torch.distributed.get_rank()\n")
    assert (2, "gradzip.train.loop") in imported_modules(tree)
    assert distributed_attributes(tree) == [4]


def test_torchft_stays_behind_its_seam() -> None:
    """Only ``gradzip.comm.ft`` imports torchft (issue 42): without the ft extra,
    everything else works as before."""
    seam = PACKAGE / "comm" / "ft.py"
    problems = [f"{f.relative_to(PACKAGE.parent)}:{line} imports {mod}"
                for f in sorted(PACKAGE.rglob("*.py")) if f != seam
                for line, mod in imported_modules(ast.parse(f.read_text(encoding="utf-8")))
                if _breaks(mod, ("torchft",))]
    assert not problems, "\n".join(problems)
    assert any(_breaks(mod, ("torchft",))
               for _, mod in imported_modules(ast.parse(seam.read_text(encoding="utf-8"))))
