"""``gradzip codecs list``: every stage, its kind, properties and parameters."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "list codec stages and their parameters"  # shown by `gradzip --help`


def register(sub: Any) -> None:
    p = sub.add_parser("codecs", help=HELP)
    csub = p.add_subparsers(dest="codecs_command", metavar="ACTION", required=True)
    lst = csub.add_parser("list", help="print every codec stage with its parameters and defaults")
    lst.add_argument("--json", action="store_true", help="machine-readable output")
    lst.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    lst.set_defaults(func=run_list)
    show = csub.add_parser("check", help="parse a spec and print its canonical form and properties")
    show.add_argument("spec", help='e.g. "ef | topk(ratio=0.01) | qsgd(levels=16)"')
    show.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    show.set_defaults(func=run_check)
    warm = csub.add_parser(
        "warm", help="compile every numba kernel into its on-disk cache (make venv runs it)",
        description="Compile the kernels of every codec chain (each compressor alone and "
                    "before each lossless stage, for fp32, bf16 and fp16 gradients) and of "
                    "gradzip analyze, so that no run pays for compilation. numba caches "
                    "them next to their source; a cache goes stale when the source changes, "
                    "and is then rebuilt on first use. Runs once at install (make venv): "
                    "about a minute on 2 cores; seconds once cached.")
    warm.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    warm.set_defaults(func=run_warm)


def _kind(cls: type) -> str:
    from gradzip.codecs import Compressor, LosslessCoder

    if issubclass(cls, LosslessCoder):
        return "lossless"
    if issubclass(cls, Compressor):
        return "compressor"
    return "wrapper"


def describe() -> list[dict[str, Any]]:
    from gradzip.codecs import registered

    rows = []
    for name, cls in registered().items():
        rows.append({
            "name": name,
            "kind": _kind(cls),
            "summary": cls.summary or (cls.__doc__ or "").strip().splitlines()[0],
            "summable": bool(getattr(cls, "summable", False)),
            "unbiased": bool(getattr(cls, "unbiased", False)),
            "multi_round": bool(getattr(cls, "multi_round", False)),
            "params": [
                {"name": p.name, "type": p.type.__name__, "default": p.default, "help": p.help}
                for p in cls.PARAMS
            ],
        })
    return rows


def run_list(args: argparse.Namespace) -> int:
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gradzip codec stages", show_lines=True)
    for col in ("stage", "kind", "properties", "parameters (default)", "what it does"):
        table.add_column(col)
    for r in rows:
        props = ", ".join(k for k in ("summable", "unbiased", "multi_round") if r[k]) or "-"
        params = "\n".join(f"{p['name']}={p['default']}: {p['help']}" for p in r["params"]) or "-"
        table.add_row(r["name"], r["kind"], props, params, r["summary"])
    # piped output (a file, `less`) would otherwise wrap at rich's default 80 columns
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    return 0


def run_check(args: argparse.Namespace) -> int:
    import gradzip

    c = gradzip.codec(args.spec)
    print(str(c))
    print(json.dumps({"json": c.to_json(), "summable": c.summable, "unbiased": c.unbiased,
                      "multi_round": c.multi_round}, default=str))
    return 0


def run_warm(args: argparse.Namespace) -> int:
    from gradzip.aggregation.warm import warm_all
    from gradzip.analyze.runner import Options, warm_up

    chains, seconds = warm_all()
    from gradzip.analyze import DEFAULT_CODECS

    analysis = warm_up(Options(codecs=DEFAULT_CODECS))
    print(f"compiled the kernels of {chains} codec chains in {seconds:.1f} s and of "
          f"gradzip analyze in {analysis:.1f} s (cached on disk)")
    return 0
