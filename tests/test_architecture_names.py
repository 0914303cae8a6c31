"""docs/architecture.md names real things: every function, class, method, parameter or
field it writes in code font exists in gradzip's source (or, for PyTorch's names, in
PyTorch). A rename that leaves the architecture behind fails here."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
#: PyTorch namespaces the document quotes names from
TORCH_MODULES = ("torch", "torch.distributed", "torch.futures", "torch.nn", "torch.amp",
                 "torch.cuda", "torch.distributed.fsdp",
                 "torch.distributed.algorithms.ddp_comm_hooks.default_hooks")


def gradzip_names() -> set[str]:
    """Every name gradzip's source defines or spells: modules, functions, classes,
    assigned names and attributes, parameters, and string constants (record fields,
    option values)."""
    names: set[str] = set()
    for path in (ROOT / "src" / "gradzip").rglob("*.py"):
        names.add(path.stem)  # a module
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name | ast.Attribute):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"[A-Za-z_]\w*", node.value))
    return names


def torch_has(name: str) -> bool:
    return any(hasattr(importlib.import_module(m), name) for m in TORCH_MODULES)


def code_names(text: str) -> list[tuple[str, str]]:
    """(code span, name) for each code span that is a Python name: `f(...)`, `a.b.c`,
    `CamelCase`, `snake_case`; spec strings, paths and commands are left to other tests."""
    found = []
    for span in re.findall(r"`([^`\n]+)`", text):
        m = re.fullmatch(r"([A-Za-z_][\w.]*)(\(.*\))?", span)
        if not m:
            continue
        parts = m.group(1).split(".")
        name = parts[-1]
        camel = re.fullmatch(r"[A-Z][a-z][A-Za-z0-9]*", name) is not None  # a class
        if m.group(2) is not None or camel or ("_" in name.strip("_") and name.islower()):
            found.append((span, name))
    return found


def test_every_name_the_architecture_writes_in_code_font_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    known = gradzip_names() | set(dir(builtins))
    spans = code_names(text)
    assert len(spans) > 100  # the document does name the code
    missing = sorted({span for span, name in spans if name not in known and not torch_has(name)})
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"
