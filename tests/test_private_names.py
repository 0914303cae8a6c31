"""No module calls another's private names (docs/architecture.md, section 1).

A name with one leading underscore is its module's own: another gradzip module may not
import it nor reach it as an attribute (``codec._decode_body``, ``module._helper``).
An underscored *module* (``codecs/entropy/_kernels.py``) is private to its package:
modules of that package may import it, nothing outside may. Names of other libraries
(``torch._C``, FSDP's ``_get_fsdp_state``) are not gradzip's and are not checked here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "gradzip"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def on_self(node: ast.Attribute) -> bool:
    """``self._x`` or ``cls._x``: the object's own name."""
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignments, ``self._x``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if private(n)}


def modules() -> dict[str, ast.AST]:
    return {module_name(f): ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
            for f in sorted(PACKAGE.rglob("*.py"))}


def private_module_owner(module: str) -> str | None:
    """The package an underscored module belongs to (None for a public module)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if private(part):
            return ".".join(parts[:i])
    return None


def violations(trees: dict[str, ast.AST]) -> list[str]:
    own = {name: defined_private_names(tree) for name, tree in trees.items()}
    everyone = set().union(*own.values())
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.startswith("gradzip"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target in trees:  # a module: private ones stay in their package
                        owner = private_module_owner(target)
                        if owner is not None and not (name + ".").startswith(owner + "."):
                            found.append(f"{name}:{node.lineno} imports {target}")
                    elif private(alias.name) and alias.name not in own[name]:
                        found.append(f"{name}:{node.lineno} imports {target}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    owner = private_module_owner(alias.name)
                    if alias.name in trees and owner is not None \
                            and not (name + ".").startswith(owner + "."):
                        found.append(f"{name}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.Attribute) and private(node.attr) \
                    and not on_self(node) \
                    and node.attr in everyone and node.attr not in own[name]:
                found.append(f"{name}:{node.lineno} uses {ast.unparse(node)}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    found = violations(modules())
    assert not found, "\n".join(found)


def test_the_checker_sees_imports_and_attributes() -> None:
    a = ast.parse("def _helper():\n    pass\nclass C:\n    def _body(self):\n        pass\n")
    b = ast.parse("from gradzip.a import _helper\n"
                  "from gradzip.pkg import _kernels\n"
                  "def f(codec):\n    return codec._body()\n")
    inside = ast.parse("from gradzip.pkg import _kernels\n")
    trees = {"gradzip.a": a, "gradzip.b": b, "gradzip.pkg._kernels": ast.parse(""),
             "gradzip.pkg.user": inside}
    assert violations(trees) == [
        "gradzip.b:1 imports gradzip.a._helper",
        "gradzip.b:2 imports gradzip.pkg._kernels",
        "gradzip.b:4 uses codec._body",
    ]
