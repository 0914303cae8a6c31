"""``gradzip train``: train a GPT, in one process or under torchrun.

Every field of ``gradzip.train.config`` is a flag (its docstring is the help text);
``--config FILE`` supplies them from TOML/JSON; ``--resume`` continues the run in --out
(keeping its lr schedule: see --allow-schedule-change). Every option, file and device is
checked before any work, --print-config included; config.json stores absolute paths.

    gradzip train --model tiny --max-steps 50 --out runs/tiny
    torchrun --nproc_per_node 2 -m gradzip train --model tiny --parallel ddp \\
        --codec "ef | topk(ratio=0.01)" --max-steps 20 --out runs/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HELP = "train a GPT language model (one process or torchrun)"  # shown by `gradzip --help`


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
                kwargs.update(type=typ, metavar=f.metadata.get("metavar",
                                                               typ.__name__.upper()))
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
    from gradzip.train.configure import presets

    p = sub.add_parser(
        "train", help=HELP,
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
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="check every option here, then start N ranks on this machine "
                        "(torchrun --standalone --nproc_per_node N -m gradzip train ...): a "
                        "bad flag or spec fails once, before any rank starts")
    ft = p.add_argument_group(
        "fault tolerance (torchft)",
        "Replica groups that may die and rejoin, for --outer diloco, average or sparseloco: "
        "needs torchft (pip install torchft; the ft extra).")
    ft.add_argument("--ft", type=int, default=None, metavar="N",
                    help="run N replica groups on this machine under torchft: a Lighthouse "
                         "on localhost, one process per group (run directories "
                         "OUT/replica_K), a group that dies started again and healed from a "
                         "live peer while the others go on; OUT/ft.json says what failed "
                         "and what it cost")
    ft.add_argument("--ft-lighthouse", default="", metavar="URL",
                    help="with --ft: use this Lighthouse (http://host:port, from `gradzip "
                         "lighthouse`) instead of starting one; with --ft-replica: the job "
                         "to join")
    ft.add_argument("--ft-replica", type=int, default=None, metavar="K",
                    help="run only replica group K of the --ft N groups, joining "
                         "--ft-lighthouse (several machines: one group each)")
    ft.add_argument("--ft-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a round's collective or commit vote may take before the "
                         "round fails and rolls back (default 60)")
    ft.add_argument("--ft-max-restarts", type=int, default=10, metavar="N",
                    help="with --ft: restarts per replica group before the job stops "
                         "(default 10)")
    add_config_args(p)
    p.set_defaults(func=run)


def resolve_args(args: argparse.Namespace) -> Any:
    """The run's JobConfig from defaults/preset or the saved config, file and flags.

    On --resume the saved config is the base, and a change of the lr schedule's end is
    refused here (``check_schedule``), before anything else happens.
    """
    from gradzip.train.config import JobConfig
    from gradzip.train.configure import resolve

    cli = cli_overrides(args)
    base = saved_config(cli, args.config) if cli.get("run", {}).get("resume") else None
    cfg = resolve(cli, args.config, base=base)
    if base is not None:
        check_schedule(JobConfig.from_dict(base), cfg)
    return cfg


def saved_config(cli: dict[str, dict[str, Any]], config_file: str | None) -> dict[str, Any]:
    """The config.json of the run --resume continues, as ``{section: {field: value}}``.

    Its ``allow_schedule_change`` is dropped: that permission is for one resume, the one
    whose flags give it, not for every later resume of the run.
    """
    from gradzip.train.configure import read_config_file

    out = cli.get("run", {}).get("out")
    if out is None and config_file:
        out = read_config_file(config_file).get("run", {}).get("out")
    if out is None:
        raise ValueError("--resume needs --out: the run directory to continue")
    saved = Path(out) / "config.json"
    if not saved.is_file():
        raise FileNotFoundError(f"cannot resume: {saved} does not exist (was {out} a "
                                f"gradzip train run directory?)")
    base = json.loads(saved.read_text())
    base.get("run", {}).pop("allow_schedule_change", None)
    return base


def check_schedule(old: Any, new: Any) -> None:
    """Refuse a resume that moves the step where the cosine lr reaches its floor.

    The lr of a step is a function of that horizon (``loop.lr_at``): moving it mid-run
    makes the lr jump, e.g. from the floor back up near the peak when --max-steps grows,
    which no uninterrupted run does. Keeping the old horizon (--decay-steps) or accepting
    the jump (--allow-schedule-change) are both reasonable; the user has to pick.
    """
    before, after = old.schedule_horizon(), new.schedule_horizon()
    if before == after or new.run.allow_schedule_change:
        return
    raise ValueError(
        f"--resume would move the end of the lr schedule (decay_steps, else max_steps) from "
        f"step {before} to step {after}{_lr_jump(old, new)}: the cosine would jump instead "
        f"of continuing. To keep the run's schedule (the lr stays at its floor after step "
        f"{before}), add --decay-steps {before}; to accept the jump, add "
        f"--allow-schedule-change.")


def _lr_jump(old: Any, new: Any) -> str:
    """", so the lr of step N would be A instead of B" for the run's next step, if known."""
    from gradzip.train.checkpoint import read_meta, step_dirs
    from gradzip.train.loop import lr_at

    found = step_dirs(Path(new.run.out))
    if not found:
        return ""
    step = read_meta(found[-1]).get("step", 0) + 1
    was = lr_at(step, old.optim, old.train.max_steps)
    would = lr_at(step, new.optim, new.train.max_steps)
    return f", so the lr of step {step} would be {would:.2e} instead of {was:.2e}"


def check_environment(cfg: Any) -> None:
    """Refuse, before any work, what this machine or the run directory cannot do.

    ``JobConfig.validate`` checks the values; this checks what they refer to: the
    device, optional packages, input files and the run directory's checkpoints. The
    loop would find each of these only after preparing the data, or later.
    """
    _check_devices(cfg.train)
    if cfg.run.wandb:
        from gradzip.train.metrics import require_wandb

        require_wandb()
    _check_inputs(cfg.data)
    _check_run_dir(cfg)


def checked_config(args: argparse.Namespace) -> Any:
    """The run's config, checked against this machine; what fails here is a usage error
    (``cli.UsageError``: every rank of a launch finds the same)."""
    from gradzip.cli import UsageError

    try:
        cfg = resolve_args(args)
        check_environment(cfg)
    except (ValueError, FileNotFoundError) as e:
        if getattr(args, "debug", False):
            raise
        raise UsageError(str(e)) from e
    return cfg


def without_nproc(argv: list[str]) -> list[str]:
    """The command line less ``--nproc N`` (or ``--nproc=N``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch_ranks(nproc: int, argv: list[str]) -> int:
    """Run ``gradzip train`` (``argv``, less --nproc) on ``nproc`` ranks under torchrun,
    once every option was checked here; torchrun's exit status."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "-m", "gradzip", *without_nproc(argv)]
    return subprocess.call(cmd)


def _say_if_one_rank(parallel: str) -> None:
    """``--parallel ddp|fsdp`` without torchrun runs as a 1-rank group: useful for
    checking a codec end to end, but never what someone expecting several ranks wants."""
    if parallel != "none" and "WORLD_SIZE" not in os.environ:
        print(f"gradzip train: --parallel {parallel} without torchrun runs ONE rank (a "
              f"1-rank group); for N ranks start it as: torchrun --nproc_per_node N -m "
              f"gradzip train ...", file=sys.stderr)


def _check_devices(t: Any) -> None:
    """The device and precision exist here; more than one process needs --parallel."""
    import torch

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and t.parallel == "none":
        raise ValueError(f"{world_size} processes were started but --parallel is none; "
                         f"use --parallel ddp or fsdp under torchrun")
    cuda = torch.cuda.is_available()
    if t.device == "cuda" and not cuda:
        raise RuntimeError("--device cuda but CUDA is not available")
    if t.dtype == "fp16" and not cuda:
        raise ValueError("--dtype fp16 needs CUDA (its grad scaler), which this machine "
                         "does not have; use bf16 on CPU")


def _check_inputs(d: Any) -> None:
    """Every data source and the tokenizer file exist (and can be read as given)."""
    from gradzip.train.data.sources import open_source, parse_spec

    for spec in d.sources:
        open_source(parse_spec(spec)[0])  # not found; a datasets dir without `datasets`
    if d.tokenizer:
        tok = Path(d.tokenizer)
        if not (tok / "tokenizer.json" if tok.is_dir() else tok).is_file():
            raise FileNotFoundError(f"tokenizer not found: {d.tokenizer} (a tokenizer.json "
                                    f"file or a directory holding one)")


def _check_run_dir(cfg: Any) -> None:
    """A fresh run must not mix with an old one; a resume (``--resume``, or torchrun's
    restart of a run that saved a checkpoint: ``gradzip.train.restart``) needs a
    checkpoint it can use."""
    from gradzip.train.checkpoint import read_meta, step_dirs
    from gradzip.train.restart import resumes

    run_dir, r = Path(cfg.run.out), cfg.run
    _check_writable(run_dir)
    found = step_dirs(run_dir)
    if not resumes(r.resume, bool(found)):
        if found:
            raise ValueError(f"{run_dir} already holds checkpoints: pass --resume to continue "
                             f"that run, or choose another --out")
        return
    if not found:
        raise FileNotFoundError(f"cannot resume: {run_dir} has no checkpoint (the run "
                                f"stopped before its first save); start it again without "
                                f"--resume")
    _check_resumable(cfg, found[-1], read_meta(found[-1]))


def _check_writable(run_dir: Path) -> None:
    """``--out`` can be made and written (checked before any data is prepared): its
    nearest existing ancestor is a writable directory."""
    here = run_dir.absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise ValueError(f"--out {run_dir}: {here} is a file, not a directory; choose "
                         "another --out")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ValueError(f"--out {run_dir}: cannot write under {here} (read-only or not "
                         "yours); choose another --out")


def _check_resumable(cfg: Any, ckpt: Path, meta: dict[str, Any]) -> None:
    """The latest checkpoint fits this run: an earlier step, codec, ranks and format."""
    t, step = cfg.train, meta.get("step", 0)
    world_size = t.replicas or int(os.environ.get("WORLD_SIZE", "1"))
    if step >= t.max_steps:
        raise ValueError(f"checkpoint is at step {step}, not before --max-steps "
                         f"{t.max_steps}: raise --max-steps to train further")
    if meta.get("codec", t.codec) != t.codec:
        raise ValueError(f"checkpoint {ckpt} was written with codec {meta.get('codec')!r} "
                         f"but this run uses {t.codec!r}")
    if meta.get("world_size", world_size) != world_size:
        raise ValueError(f"checkpoint {ckpt} was written by {meta.get('world_size')} ranks; "
                         f"this run has {world_size} (data position and codec state are "
                         f"per rank, so an exact resume needs the same number)")
    if t.parallel in ("fsdp", "hsdp") and meta.get("format") != "dcp":
        raise ValueError(f"{ckpt} is a single-file checkpoint; an FSDP run resumes only "
                         f"from an FSDP (DCP) checkpoint")


def check_ft(args: argparse.Namespace, cfg: Any) -> None:
    """--ft fits this run: torchft installed, a local-update method, one process per
    replica group, no overlap."""
    if args.ft is None:
        if args.ft_replica is not None or args.ft_lighthouse:
            raise ValueError("--ft-replica and --ft-lighthouse go with --ft N (how many "
                             "replica groups the job has)")
        return
    if cfg.optim.optimizer == "adamw_global":
        raise ValueError("--optimizer adamw_global sizes its step for a fixed number of "
                         "replicas; under --ft the replica groups change as they fail: "
                         "use --optimizer adamw")
    from gradzip.comm.ft import require_torchft

    require_torchft()
    t = cfg.train
    if args.ft < 1:
        raise ValueError(f"--ft must be >= 1 replica group, got {args.ft}")
    if t.outer not in ("diloco", "average", "sparseloco"):
        raise ValueError(f"--ft runs local-update methods (their rounds commit or roll back "
                         f"as a whole): add --outer diloco, average or sparseloco (got "
                         f"--outer {t.outer})")
    from gradzip.comm.outer import check_replica_options

    check_replica_options(t.overlap_steps)
    if t.parallel != "ddp":
        raise ValueError("--ft needs --parallel ddp (each replica group is one process)")
    if args.nproc is not None or "WORLD_SIZE" in os.environ:
        raise ValueError("--ft starts one process per replica group itself: drop --nproc "
                         "and torchrun")
    if args.ft_replica is not None and not (0 <= args.ft_replica < args.ft):
        raise ValueError(f"--ft-replica must be in [0, {args.ft}), got {args.ft_replica}")
    if args.ft_replica is not None and not args.ft_lighthouse:
        raise ValueError("--ft-replica joins a job: give its --ft-lighthouse URL (start one "
                         "with `gradzip lighthouse`)")


def without_ft(argv: list[str]) -> list[str]:
    """The command line less the launcher's own flags (a group finds the Lighthouse in
    its environment)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--ft-max-restarts", "--ft-lighthouse"):
            skip = True
        elif not a.startswith(("--ft-max-restarts=", "--ft-lighthouse=")):
            out.append(a)
    return out


def run_ft(args: argparse.Namespace, cfg: Any) -> int | None:
    """Under --ft: launch the job's groups (None when this process is a group itself,
    which then trains as usual)."""
    from gradzip.comm.ft import ENV_LIGHTHOUSE, FtJob

    if ENV_LIGHTHOUSE in os.environ:
        return None  # started by the launcher below: a replica group
    if args.ft_replica is not None:  # one group of a job on several machines
        job = FtJob.from_env({ENV_LIGHTHOUSE: args.ft_lighthouse,
                              "GRADZIP_FT_REPLICA": str(args.ft_replica),
                              "GRADZIP_FT_REPLICAS": str(args.ft),
                              "GRADZIP_FT_TIMEOUT": str(args.ft_timeout),
                              **({"GRADZIP_FT_HOST": os.environ["GRADZIP_FT_HOST"]}
                                 if "GRADZIP_FT_HOST" in os.environ else {})})
        assert job is not None
        os.environ.update(job.environ())
        return None
    from gradzip.train.ft_launch import FtLaunch

    argv = without_ft(getattr(args, "argv", None) or sys.argv[1:])
    return FtLaunch(args.ft, argv, Path(cfg.run.out), lighthouse=args.ft_lighthouse,
                    timeout_s=args.ft_timeout, max_restarts=args.ft_max_restarts).run()


def run(args: argparse.Namespace) -> int:
    """Resolve and check everything, then print the config or train."""
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc is not None and "WORLD_SIZE" in os.environ:
        raise ValueError("--nproc starts torchrun itself: drop it when launching with "
                         "torchrun")
    cfg = checked_config(args)
    try:
        check_ft(args, cfg)
    except (ValueError, RuntimeError) as e:
        from gradzip.cli import UsageError

        raise UsageError(str(e)) from e
    if args.nproc is not None and args.nproc > 1 and cfg.train.parallel == "none":
        raise ValueError(f"--nproc {args.nproc} starts {args.nproc} ranks: choose --parallel "
                         "ddp, fsdp or hsdp")
    if args.nproc is not None and not args.print_config:
        return launch_ranks(args.nproc, getattr(args, "argv", None) or sys.argv[1:])
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if cfg.train.replicas:
        record = run_replicas(args, cfg)
    else:
        if args.ft is not None:
            launched = run_ft(args, cfg)
            if launched is not None:
                return launched
        else:
            _say_if_one_rank(cfg.train.parallel)
        from gradzip.train.loop import train

        record = train(cfg)
    from gradzip.train.interrupt import EXIT_INTERRUPTED

    if record.get("failed"):
        return EXIT_COLLECTIVE_FAILED
    return EXIT_INTERRUPTED if record.get("interrupted") else 0


def run_replicas(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """--replicas W: W threads of this process train as W ranks (``comm/replicas.py``);
    rank 0's results record."""
    import copy

    from gradzip.cli import UsageError
    from gradzip.comm import replicas
    from gradzip.comm.netns import rate_bits_per_second
    from gradzip.train.interrupt import forward_signals
    from gradzip.train.loop import train

    t = cfg.train
    if "WORLD_SIZE" in os.environ or args.ft is not None:
        raise UsageError("--replicas runs every rank in this process: start it without "
                         "torchrun, --nproc or --ft")
    t.threads = 1
    link = replicas.LinkModel(rate_bits_per_second(t.replica_link),
                              t.replica_latency_us * 1e-6, t.replica_link)
    with forward_signals():  # Ctrl-C reaches every replica's loop, which agree on it
        records = replicas.run_replicas(t.replicas, lambda r: train(copy.deepcopy(cfg)),
                                        link=link)
    return records[0]


#: the exit status of a run a failed collective ended (a checkpoint and a record written)
EXIT_COLLECTIVE_FAILED = 3
