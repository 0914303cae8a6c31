"""``gradzip train``: train a GPT, in one process or under torchrun.

Every field of ``gradzip.train.config`` is a flag (its docstring is the help text);
``--config FILE`` supplies them from TOML/JSON; ``--resume`` continues the run in --out.

    gradzip train --model tiny --max-steps 50 --out runs/tiny
    torchrun --nproc_per_node 2 -m gradzip train --model tiny --parallel ddp \\
        --codec "ef | topk(ratio=0.01)" --max-steps 20 --out runs/x
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_config_args(p: argparse.ArgumentParser, sections: list[str] | None = None) -> None:
    """One flag per config field, grouped by section, with the field docstrings as help."""
    import typing

    from gradzip.train.config import SECTIONS, field_docs, fields_of, flag_of

    for section, cls in SECTIONS.items():
        if sections is not None and section not in sections:
            continue
        group = p.add_argument_group(f"{section} options", (cls.__doc__ or "").strip())
        docs = field_docs(cls)
        defaults = cls()
        for f, typ in fields_of(cls):
            default = getattr(defaults, f.name)
            text = docs.get(f.name, "").replace("%", "%%")
            kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS,
                                      "help": f"{text} (default: {default!r})"}
            if typ is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(typ) is list:
                kwargs.update(nargs="+", metavar="SOURCE")
            else:
                kwargs.update(type=typ, metavar=typ.__name__.upper())
            group.add_argument(flag_of(f), **kwargs)


def cli_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags given on the command line as ``{section: {field: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        if "." in dest:
            section, name = dest.split(".", 1)
            out.setdefault(section, {})[name] = value
    return out


def register(sub: Any) -> None:
    from gradzip.train.config import presets

    p = sub.add_parser(
        "train", help="train a GPT language model (one process or torchrun)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --model must never be mistaken for --model-vocab-size
        epilog=f"model presets: {', '.join(presets())}. A preset may also set data and optim\n"
               "options (tiny: --vocab-size 512, --seq-len 32, ...); the defaults shown above\n"
               "are those before a preset. A config file (--config run.toml or .json) uses the\n"
               "sections and field names above, e.g.\n\n    [optim]\n    lr = 3e-4\n")
    p.add_argument("--config", metavar="FILE", help="TOML or JSON file with options by section")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration as JSON and exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    add_config_args(p)
    p.set_defaults(func=run)


def resolve_args(args: argparse.Namespace) -> Any:
    """The run's JobConfig from defaults/preset or the saved config, file and flags."""
    from gradzip.train.config import read_config_file, resolve

    cli = cli_overrides(args)
    base = None
    if cli.get("run", {}).get("resume"):
        out = cli.get("run", {}).get("out")
        if out is None and args.config:
            out = read_config_file(args.config).get("run", {}).get("out")
        if out is None:
            raise ValueError("--resume needs --out: the run directory to continue")
        saved = Path(out) / "config.json"
        if not saved.is_file():
            raise FileNotFoundError(f"cannot resume: {saved} does not exist (was {out} a "
                                    f"gradzip train run directory?)")
        base = json.loads(saved.read_text())
    return resolve(cli, args.config, base=base)


def run(args: argparse.Namespace) -> int:
    cfg = resolve_args(args)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from gradzip.train.loop import train

    train(cfg)
    return 0
