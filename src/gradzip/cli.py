"""The ``gradzip`` command line.

Each command lives in its own module with ``HELP`` (its line in ``gradzip --help``) and
``register(subparsers)``, which adds the command's parser and sets ``func``; this file only
lists the modules, so commands import their heavy dependencies lazily and stay
independent of each other. ``main`` registers only the command it runs; the others are
listed by name and HELP, so ``gradzip --help`` imports neither torch nor numba.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMAND_MODULES = [
    "gradzip.commands.codecs",  # gradzip codecs list
    "gradzip.commands.bench",  # gradzip bench codecs|entropy|...
    "gradzip.commands.train",  # gradzip train (also under torchrun)
    "gradzip.commands.compare",  # gradzip compare --preset quick --out DIR
    "gradzip.commands.eval",  # gradzip eval --ckpt DIR
    "gradzip.commands.generate",  # gradzip generate --ckpt DIR
    "gradzip.commands.report",  # gradzip report RESULTS.jsonl --out DIR
    "gradzip.commands.archive",  # gradzip archive ls|verify|export|pack
    "gradzip.commands.analyze",  # gradzip analyze ARCHIVE|DIR|FILE
    "gradzip.commands.lighthouse",  # gradzip lighthouse (torchft, several machines)
]


#: modules only the ``lab`` extra installs (pyproject.toml): a command that needs one
#: says which extra to install instead of a traceback
LAB_MODULES = ("h5py", "tqdm", "rich", "tokenizers", "ijson", "matplotlib", "tensorboard")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (``only``) one command's in full and the rest by name."""
    from gradzip import __version__

    parser = argparse.ArgumentParser(
        prog="gradzip",
        description="Gradient compression for data-parallel PyTorch training, measured honestly.",
    )
    parser.add_argument("--version", action="version", version=f"gradzip {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(module_name)
        command = module_name.rsplit(".", 1)[1]
        if only is None or only == command:
            module.register(sub)
        else:
            sub.add_parser(command, help=module.HELP)
    return parser


def _command_in(argv: list[str]) -> str:
    """The command named on the command line ('' when none is: --help, --version)."""
    first = next((a for a in argv if not a.startswith("-")), "")  # top level takes no values
    return first if any(m.endswith("." + first) for m in COMMAND_MODULES) else ""


class UsageError(ValueError):
    """A bad flag, spec or file named on the command line, found before any work: every
    rank of a torchrun launch finds the same one."""


def say_error(command: str, e: Exception) -> None:
    """Print ``e`` for the user. Under torchrun a ``UsageError`` is said once per node
    (every rank has the same), with a line on the launcher's report that follows; any
    other error by every rank that has it, naming the rank."""
    rank = os.environ.get("RANK") if "TORCHELASTIC_RUN_ID" in os.environ else None
    if rank is None:
        print(f"gradzip {command}: error: {e}", file=sys.stderr)
    elif isinstance(e, UsageError):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"gradzip {command}: error: {e}", file=sys.stderr)
            print(f"gradzip {command}: every rank stopped on this error before training; "
                  "the launcher's report that follows says only that they exited (gradzip "
                  "train --nproc N checks a command before it starts torchrun)",
                  file=sys.stderr)
    else:
        print(f"gradzip {command} (rank {rank}): error: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(only=_command_in(sys.argv[1:] if argv is None else argv))
    args, extras = parser.parse_known_args(argv)
    if extras:  # say which command's --help lists what it takes
        sub = next((getattr(args, k) for k in ("action", "bench_command", "codecs_command")
                    if getattr(args, k, None)), None)
        command = f"{args.command} {sub}" if sub else args.command
        parser.exit(2, f"gradzip {command}: error: unrecognized arguments: "
                       f"{' '.join(extras)} (see gradzip {command} --help)\n")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (train --nproc)
    try:
        result = args.func(args)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in LAB_MODULES or getattr(args, "debug", False):
            raise
        print(f"gradzip {args.command}: error: this command needs the lab extra, which is "
              f"not installed (no module {e.name!r}): pip install 'gradzip[lab]' (in the "
              f"clone: pip install -e '.[lab]', or make venv)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gradzip archive ls DIR | head`: the reader has had enough
        # later writes (and the flush at exit) go nowhere instead of raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if getattr(args, "debug", False):
            raise
        say_error(args.command, e)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
