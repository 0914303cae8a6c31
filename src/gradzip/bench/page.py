"""``gradzip bench page NAME``: the commands of one benchmark page, printed or rerun.

A page (``docs/benchmarks/NAME.md``) gives the commands its figures came from in fenced
code blocks. This lists them in order (lines that start with ``gradzip``, ``make``,
``torchrun``, ``python`` or ``find``, after any ``NAME=value`` environment settings; a
trailing backslash continues a line; ``#``
comments dropped) and, with ``--run``, runs each in a shell from the repository root,
stopping at the first that fails. Reruns are how a page's figures are refreshed when the
code they describe changes; paste the new tables into the page with the date, machine
and commit.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: how a command line of a page starts (after environment settings: ``NAME=value``)
_COMMAND = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*(gradzip|make|torchrun|python3?|find)\b")
_FENCE = re.compile(r"```[A-Za-z]*\n(.*?)```", re.S)


def pages_dir() -> Path:
    """docs/benchmarks of the checkout gradzip runs from."""
    return Path(__file__).resolve().parents[3] / "docs" / "benchmarks"


def page_commands(text: str) -> list[str]:
    """The commands in the fenced blocks of a page's Markdown, in order."""
    commands = []
    for block in _FENCE.findall(text):
        pending = ""
        for raw in block.splitlines():
            line = raw.split("  #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
            if pending:
                pending += " " + line.strip().rstrip("\\").strip()
                if not line.endswith("\\"):
                    commands.append(pending)
                    pending = ""
                continue
            if _COMMAND.match(line.strip()):
                if line.endswith("\\"):
                    pending = line.strip().rstrip("\\").strip()
                else:
                    commands.append(line.strip())
        if pending:
            commands.append(pending)
    return commands


def register(sub: Any) -> None:
    p = sub.add_parser("page", help="print (or --run) the commands of one benchmark page",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="page name: a file of docs/benchmarks without .md "
                                "(e.g. race, codecs, first-run)")
    p.add_argument("--run", action="store_true", help="run the commands (default: print)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    directory = pages_dir()
    path = directory / f"{args.name}.md"
    if not path.is_file():
        names = sorted(p.stem for p in directory.glob("*.md"))
        raise FileNotFoundError(f"no benchmark page {args.name!r}; the pages: "
                                f"{', '.join(names) or 'none (docs/benchmarks is missing)'}")
    commands = page_commands(path.read_text())
    if not args.run:
        print("\n".join(commands))
        return 0
    root = directory.parents[1]
    for i, command in enumerate(commands, 1):
        print(f"[{i}/{len(commands)}] {command}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        code = subprocess.run(command, shell=True, cwd=root).returncode
        if code != 0:
            print(f"gradzip bench page: command {i} failed with exit status {code}",
                  file=sys.stderr)
            return code
        print(f"[{i}/{len(commands)}] done in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
    return 0
