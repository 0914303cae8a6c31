"""``gradzip compare``: which method reaches the target quality soonest on this link.

Trains the same model on the same data, from the same initialization and in the same
data order, under each method of a matrix (gradzip specs and PyTorch's own hooks as
``torch:none``, ``torch:fp16``, ``torch:bf16``, ``torch:powersgd(rank=R)``), over a
real rate-limited link, and writes ``OUT/results.jsonl`` and ``OUT/report.md``.

    gradzip compare --preset quick --out runs/compare
    gradzip compare --methods "torch:none;ef | topk(ratio=0.01)" --rate 100mbit,1gbit \\
        --ranks 2 --seeds 3 --out runs/race
    gradzip compare --script train.py --script-args "--steps 500" \\
        --methods "torch:fp16;int8" --out runs/mine

Your own script (--script) runs under torchrun with the method, seed and run directory
in its environment; in it, gradzip.attach(ddp_model) takes the method, and
handle.log_eval(step, val_loss) and handle.close() give the race its figures
(docs/guide.md, "Racing your own training script").
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HELP = "race methods to a target loss over a rate-limited link; report"  # shown by `gradzip --help`


def register(sub: Any) -> None:
    from gradzip.compare.matrix import PRESETS

    p = sub.add_parser(
        "compare", help=HELP,
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n" + "\n".join(f"  {k:<10} {v.doc}" for k, v in PRESETS.items())
        + "\n\nThe link (no root needed): 'shared' is one tc token bucket on the loopback "
          "of a fresh\nnetwork namespace, shared by all ranks; 'per-rank' gives every rank "
          "its own namespace\nand a veth link shaped both ways, joined by a bridge; "
          "'nodes=NxL' puts N nodes of L ranks\non unshaped node bridges, each node behind "
          "one shaped uplink. Where namespaces are\nunavailable the runs go unshaped and "
          "every record says so. A shaped run sees no GPU: its ranks\ntrain on the CPU "
          "over gloo through the link (NCCL on one host would bypass the\nshaping).")
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="the matrix to start from (default: quick)")
    p.add_argument("--methods", default=None, metavar="SPEC;SPEC",
                   help="methods separated by ';' (gradzip specs or torch:...), instead "
                        "of the preset's")
    p.add_argument("--rate", default=None, metavar="RATE[,RATE]",
                   help="tc rates, e.g. 100mbit,1gbit; 'none' for unlimited loopback; a rate "
                        "that changes during each run: 1gbit@60>25mbit (1 Gbit/s for the "
                        "first 60 s of the run, then 25 Mbit/s), on the shared link. "
                        "Faults: 'down' drops every packet (100mbit@30>down@40>100mbit); "
                        "'+loss=P%%' loses packets at random and '+delay=D' delays each "
                        "(100mbit@30>100mbit+loss=2%%@40>100mbit; needs tc netem)")
    p.add_argument("--link", default=None, metavar="KIND[,KIND]",
                   help="how ranks reach each other: 'shared' (one token bucket on a "
                        "loopback shared by all ranks; default), 'per-rank' (a "
                        "shaped link per rank, like one NIC per node) and/or 'nodes=NxL' "
                        "(N nodes of L ranks, one shaped uplink per node)")
    p.add_argument("--parallel", choices=("ddp", "hsdp"), default="ddp",
                   help="how each run trains: ddp (default; on nodes=NxL links gradzip "
                        "codecs compress between nodes only) or hsdp (FSDP2 sharded within "
                        "a node, the replicate link compressed; 'none' is FSDP2's native "
                        "HSDP)")
    p.add_argument("--script", default=None, metavar="PATH",
                   help="race your own training script instead of the built-in trainer "
                        "(started by torchrun; see docs/guide.md for its three lines)")
    p.add_argument("--script-args", default="", metavar="ARGS",
                   help="arguments of --script, one string (e.g. \"--steps 500 --lr 3e-4\")")
    p.add_argument("--model", default=None,
                   help="built-in trainer: the model preset (tiny, small, ...) instead of "
                        "the preset's")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="built-in trainer: training tokens to prepare (all ranks)")
    p.add_argument("--lr", type=float, default=None, help="built-in trainer: learning rate")
    p.add_argument("--train-args", default="", metavar="FLAGS",
                   help="built-in trainer: further gradzip train flags, one string "
                        "(e.g. \"--warmup-steps 20 --eval-every 50\"); they override the "
                        "preset's")
    p.add_argument("--tune", default="", metavar="OPT=V,V;OPT=V,V",
                   help="an equal tuning budget per method: every method runs every "
                        "combination (e.g. \"lr=1e-3,3e-3\": --lr to the trainer or the "
                        "script); the report races each method's trial with the lowest "
                        "mean final validation loss and lists them all")
    p.add_argument("--start-step", type=int, default=0, metavar="N",
                   help="gradzip codecs send plain until step N, compressing after that "
                        "warm-up (as the PowerSGD and DGC papers do); stated in each record")
    add_fault_options(p)
    p.add_argument("--ranks", default=None, metavar="W[,W]", help="ranks per run, e.g. 2,4")
    p.add_argument("--replicas", default=None, metavar="W[,W]",
                   help="run each run's ranks as W replicas in one process (gradzip train "
                        "--replicas; --link replicas --ranks W): the link is modelled at "
                        "each --rate, not emulated, so a machine with 2 cores races W = 8")
    p.add_argument("--seeds", type=int, default=None, help="seeds per method")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--budget-s", type=float, default=None,
                   help="time budget for quality_at_time (default: the shortest run)")
    add_sweep_options(p)
    p.add_argument("--out", required=True, help="directory for runs, results and report")
    p.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=run)


def add_fault_options(p: argparse.ArgumentParser) -> None:
    """--ft and --kill: replica groups that heal, ranks killed at chosen steps."""
    from gradzip.compare.matrix import KILL_CKPT_EVERY

    p.add_argument("--ft", action="store_true",
                   help="run local-update methods (diloco, average, sparseloco) as torchft "
                        "replica groups, one process each, with a Lighthouse on localhost: "
                        "a group that dies is started again and heals from a live peer "
                        "while the others go on (the 'ft' extra); other methods run under "
                        "torchrun as usual")
    p.add_argument("--kill", default="", metavar="R@S[,R@S]",
                   help="faults: rank (under --ft: replica group) R dies after step S, "
                        "in order, e.g. 1@100,0@220. Runs under torchrun get --max-restarts "
                        "and --ckpt-every " + KILL_CKPT_EVERY + " (unless --train-args sets "
                        "it) and resume from the newest checkpoint; the report says where "
                        "each fault fell and what it cost")


def add_sweep_options(p: argparse.ArgumentParser) -> None:
    """The options of the report's section across bandwidths (also ``gradzip report``'s)."""
    p.add_argument("--latency-us", type=float, default=50.0, metavar="US",
                   help="latency of one collective in the bandwidth projection (default "
                        "50 us: a TCP round trip between hosts in a data centre)")
    p.add_argument("--sweep-from", default=None, metavar="RATE",
                   help="project across bandwidths from the runs at this rate (default: "
                        "the fastest shaped rate); the other rates validate the model")


def runs_of(args: argparse.Namespace) -> list[Any]:
    from gradzip.comm.netns import check_impairments, rate_schedule
    from gradzip.compare.matrix import LINK_KINDS, PRESETS, check_link, plan

    preset = PRESETS[args.preset]
    methods = ([m.strip() for m in args.methods.split(";") if m.strip()] if args.methods
               else list(preset.methods))
    rates: list[str | None] = (list(preset.rates) if args.rate is None else
                               [None if r.strip() == "none" else r.strip()
                                for r in args.rate.split(",")])
    changing = False
    for r in rates:
        if r is not None:
            try:
                changing |= len(rate_schedule(r)) > 1 or "+" in r  # or impaired
            except ValueError as e:
                raise ValueError(f"--rate {r!r}: {e}") from None
            check_impairments(r)  # loss and delay need the kernel's sch_netem
    if args.replicas is not None:
        if args.link is not None or args.ranks is not None:
            raise ValueError("--replicas W is --link replicas --ranks W: drop --link and "
                             "--ranks")
        if not all(w.strip().isdigit() for w in args.replicas.split(",")):
            raise ValueError(f"--replicas must be integers separated by ',', got "
                             f"{args.replicas!r}")
        args.link, args.ranks = "replicas", args.replicas
    links = tuple(k.strip() for k in (args.link or "shared").split(",") if k.strip())
    if "replicas" in links and (None in rates or changing or args.ft or args.kill.strip()
                                or args.script or args.parallel != "ddp"):
        raise ValueError("replicas model a link of fixed --rate (not none, not one that "
                         "changes) under --parallel ddp, without --ft, --kill or --script")
    if changing and links != ("shared",):
        raise ValueError("a rate that changes (RATE@SECONDS>RATE) or loses or delays "
                         "packets shapes the shared link for now: drop --link or use --link "
                         "shared")
    if not links:
        raise ValueError(f"--link must be one or more of {', '.join(LINK_KINDS)} separated "
                         f"by ',', got {args.link!r}")
    for k in links:
        check_link(k)
    try:
        ranks = ([int(w) for w in args.ranks.split(",")] if args.ranks
                 else list(preset.ranks))
    except ValueError:
        raise ValueError(f"--ranks must be integers separated by ',', got {args.ranks!r}") \
            from None
    if any(w < 1 for w in ranks) or (args.seeds is not None and args.seeds < 1):
        raise ValueError("--ranks and --seeds must be >= 1")
    if args.start_step < 0:
        raise ValueError(f"--start-step must be >= 0, got {args.start_step}")
    if args.sweep_from is not None and args.sweep_from not in rates:
        raise ValueError(f"--sweep-from {args.sweep_from!r} is not one of the rates raced "
                         f"({', '.join(r or 'none' for r in rates)})")
    from gradzip.compare.trials import check_trials, parse_tune

    script = _script(args)
    trials = parse_tune(args.tune)
    if not script:
        check_trials(trials, _train_flags(args, preset)[len(preset.train):])
    runs = plan(methods, rates, ranks, args.seeds or preset.seeds, _train_flags(args, preset),
                links, args.parallel, script, trials)
    runs = [replace(r, start_step=args.start_step, ft=args.ft, kill=args.kill.strip())
            for r in runs]
    check_faults(runs, args)
    if script:
        check_script_runs(runs)
    else:
        check_runs(runs, Path(args.out))  # a bad spec fails here, before any training
    return runs


def _train_flags(args: argparse.Namespace, preset: Any) -> tuple[str, ...]:
    """The built-in trainer's flags: the preset's, then the options passed through
    (argparse keeps the last of a repeated flag)."""
    extra: list[str] = []
    for flag, value in (("--max-steps", args.steps), ("--model", args.model),
                        ("--max-tokens", args.max_tokens), ("--lr", args.lr)):
        if value is not None:
            extra += [flag, str(value)]
    return (*preset.train, *extra, *shlex.split(args.train_args))


def _script(args: argparse.Namespace) -> tuple[str, ...]:
    """``(PATH, *ARGS)`` of ``--script``; ValueError for a missing file or options
    that belong to the built-in trainer."""
    if args.script is None:
        if args.script_args:
            raise ValueError("--script-args needs --script")
        return ()
    path = Path(args.script)
    if not path.is_file():
        raise ValueError(f"--script {args.script}: no such file")
    clash = [f for f, v in (("--model", args.model), ("--max-tokens", args.max_tokens),
                            ("--lr", args.lr), ("--train-args", args.train_args or None),
                            ("--steps", args.steps)) if v is not None]
    if clash:
        raise ValueError(f"{', '.join(clash)} configure the built-in trainer; pass your "
                         "script's own options with --script-args")
    if args.parallel != "ddp":
        raise ValueError("--script runs your script as it is: --parallel applies to the "
                         "built-in trainer only")
    return (str(path.resolve()), *shlex.split(args.script_args))


def check_faults(runs: list[Any], args: argparse.Namespace) -> None:
    """``--ft`` and ``--kill`` fit the matrix: a valid kill list whose ranks exist, on
    the shared link with torchrun or ``--ft`` to restart what dies, the built-in trainer
    (it is what dies on cue and resumes)."""
    if not (args.ft or args.kill.strip()):
        return
    what = "--ft" if args.ft else "--kill"
    if args.script:
        raise ValueError(f"{what} needs the built-in trainer (it dies on cue, resumes and "
                         "heals): race your script without it")
    if any(r.link != "shared" for r in runs):
        raise ValueError(f"{what} runs on the shared link for now: drop --link or use "
                         "--link shared")
    if args.kill.strip():
        if any(r.link_goes_down() for r in runs):
            raise ValueError("--kill with a link that goes down: race one fault at a time "
                             "(a run whose link goes down has no torchrun agent to restart "
                             "its ranks)")
        for r in runs:
            try:
                kills = r.kills()
            except ValueError as e:
                raise ValueError(f"--kill {args.kill!r}: {str(e).split(': ', 1)[-1]}") \
                    from None
            if not kills:
                raise ValueError(f"--kill {args.kill!r}: give RANK@STEP, e.g. 1@100")
            bad = [k for k, _ in kills if k >= r.ranks]
            if bad:
                raise ValueError(f"--kill {args.kill!r}: rank {bad[0]} does not exist in a "
                                 f"run of {r.ranks} ranks")
            steps = [s for _, s in kills]
            last = _max_steps(r)
            if steps != sorted(set(steps)) or steps[0] < 1 or \
                    (last is not None and steps[-1] >= last):
                raise ValueError(f"--kill {args.kill!r}: the steps must increase, from 1 to "
                                 f"below the run's {last or '--max-steps'} steps (each death "
                                 "comes after the one before it)")
    if args.ft and not any(r.uses_ft() for r in runs):
        raise ValueError("--ft runs local-update methods (diloco(...), average(...), "
                         "sparseloco) as torchft replica groups: none of the methods is one")


def _max_steps(run: Any) -> int | None:
    """The ``--max-steps`` a run's trainer gets (the last one given), if any."""
    flags = list(run.train)
    at = [i for i, f in enumerate(flags[:-1]) if f == "--max-steps"]
    return int(flags[at[-1] + 1]) if at else None


def check_script_runs(runs: list[Any]) -> None:
    """Every method of a ``--script`` race parses and can run in a script (a codec spec
    or ``torch:...``; local-update methods need the built-in trainer)."""
    from gradzip.comm.method import LocalUpdateMethod, parse_method

    for method in dict.fromkeys(r.method for r in runs):
        try:
            parsed = parse_method(method)
        except ValueError as e:
            raise ValueError(f"method {method!r}: {e}") from None
        if isinstance(parsed, LocalUpdateMethod):
            raise ValueError(f"method {method!r}: local-update methods run their outer "
                             "loop in gradzip's trainer; race them without --script")


def check_runs(runs: list[Any], out: Path) -> None:
    """Resolve and validate every run's training configuration exactly as its
    ``gradzip train`` will (a bad spec, a torch: method on the wrong path, a bad
    option): ValueError naming the method, before any training starts."""
    from gradzip.cli import build_parser
    from gradzip.commands.train import check_ft, resolve_args

    parser = build_parser()
    for run in {(r.method, r.trial): r for r in runs}.values():
        try:
            argv = run.argv(out / "check", out / "cache")  # parses the method
            args = parser.parse_args(argv[argv.index("train"):])
            cfg = resolve_args(args)
            cfg.validate()
            if run.uses_ft():
                check_ft(args, cfg)
        except (ValueError, SystemExit) as e:
            raise ValueError(f"method {run.method!r}: {e}") from None


def run(args: argparse.Namespace) -> int:
    try:
        runs = runs_of(args)
    except ValueError as e:
        print(f"gradzip compare: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from gradzip.compare.trials import trial_label

        for r in runs:
            trial = f"  [{trial_label(r.trial)}]" if r.trial else ""
            faults = f"  [kill {r.kill}; {r.survival()}]" if r.kill else (
                "  [torchft replica groups]" if r.uses_ft() else "")
            print(f"{r.rate or 'unlimited'}  {r.link} link  {r.ranks} ranks  seed {r.seed}  "
                  f"{r.method}{trial}{faults}")
        return 0
    if not args.latency_us >= 0:
        print("gradzip compare: error: --latency-us must be >= 0", file=sys.stderr)
        return 2
    return _race(runs, Path(args.out), args.budget_s,
                 {"fit_rate": args.sweep_from, "latency_s": args.latency_us * 1e-6})


def _race(runs: list[Any], out: Path, budget_s: float | None,
          sweep_options: dict[str, Any]) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gradzip.compare import harness
    from gradzip.compare.report import print_tables, write_report
    from gradzip.compare.summary import summarize
    from gradzip.compare.verdict import verdicts

    console = Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    earlier = harness.load_records(results)  # never deleted: a rerun keeps what it finds
    done = {harness.record_key(r): r for r in earlier}
    todo = [r for r in runs if harness.run_key(r) not in done]
    if len(todo) < len(runs):
        console.print(f"{len(runs) - len(todo)} of {len(runs)} runs already in {results}: "
                      "kept, not run again")
    links = {key: harness.open_link(*key) for key in dict.fromkeys((r.rate, r.link)
                                                                    for r in todo)}
    for link in links.values():
        console.print(_link_line(link))
    start = time.perf_counter()
    failures: list[str] = []  # one line per run that failed: the race goes on without it
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total} runs"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("compare", total=len(todo))
        for r in todo:
            progress.update(task, description=f"{r.method} (seed {r.seed}, {r.ranks} ranks, "
                                              f"{r.rate or 'unlimited'})")
            shutil.rmtree(out / "runs" / r.slug, ignore_errors=True)  # an unfinished try
            try:
                record = harness.execute(r, links[r.rate, r.link], out, out / "cache")
            except harness.RunFailed as e:
                console.print(f"[red]{e}[/red]")
                failures.append(_failure_line(r, e))
            else:
                done[harness.run_key(r)] = record
                harness.append_record(results, record)  # kept even if a later run fails
            progress.advance(task)
    records = [done[k] for k in map(harness.run_key, runs) if k in done]
    if not records:
        return 1
    others = [r for r in earlier if harness.record_key(r) not in
              {harness.run_key(run) for run in runs}]
    harness.add_race_figures(records, budget_s)
    harness.rewrite(results, others + records)
    report = write_report(records, out, budget_s, sources=[str(results)], **sweep_options)
    summaries = summarize(records, budget_s)
    print_tables(summaries)
    failed = _failed_note(failures)
    (out / "verdict.txt").write_text("\n".join(verdicts(summaries) + failed) + "\n")
    if failed:
        with report.open("a", encoding="utf-8") as f:
            f.write("\n".join(failed) + "\n")
        console.print("\n".join(failed), markup=False)
    console.print(f"{len(todo)} runs in {time.perf_counter() - start:.0f} s; report: "
                  f"{report}, records: {results}")
    return 1 if failures else 0


def _failure_line(run: Any, error: Exception) -> str:
    """One run's failure as the report lists it: what ran and its last error line (the
    trainer's one-line error, e.g. a non-finite pseudo-gradient), else its last line."""
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    last = [ln for ln in lines if "error:" in ln][-1:] or lines[-1:] or ["(no output)"]
    return (f"{run.method} (seed {run.seed}, {run.ranks} ranks, {run.rate or 'unlimited'}"
            f"{', trial ' + ', '.join(f'{k}={v}' for k, v in run.trial) if run.trial else ''}"
            f"): {last[0].strip()}")


def _failed_note(failures: list[str]) -> list[str]:
    """The report's and verdict's section on failed runs: none are in any table or
    verdict above it, and a rerun of the same command retries only them."""
    if not failures:
        return []
    return ["", f"**{len(failures)} run(s) failed** and are in no table or verdict above "
            "(a rerun of the same command retries only them):", "",
            *(f"- {line}" for line in failures)]


def _link_line(link: Any) -> str:
    if link.kind == "replicas":
        return (f"link {link.rate}, replicas: modelled (latency per collective + one "
                "rank's bytes / rate), not emulated; ranks are replicas in one process")
    if link.shaped and link.kind.startswith("nodes="):
        return (f"link {link.rate}, {link.kind}: shaped uplink per node, measured "
                f"{link.achieved_bits_per_s / 1e6:.1f} Mbit/s node to node; unshaped "
                "inside a node")
    if link.shaped and link.kind == "per-rank":
        return (f"link {link.rate}, per rank: shaped, measured "
                f"{link.achieved_bits_per_s / 1e6:.1f} Mbit/s rank 0 -> rank 1; one link "
                "per rank, each way")
    if link.shaped:
        return (f"link {link.rate}, shared: shaped, measured "
                f"{link.achieved_bits_per_s / 1e6:.1f} Mbit/s for one sender; one token "
                "bucket shared by all ranks")
    return f"link {link.rate or 'unlimited'} ({link.kind}): UNSHAPED ({link.why_unshaped})"
