"""``gradzip bench link``: reported ``bytes_wire`` against the kernel's count, per codec.

For each world size in ``--ranks`` it starts a fresh network namespace
(``gradzip.comm.netns``) with that many local gloo ranks, trains the small MLP of
``gradzip.bench.linkcount`` under DDP with every codec in turn, and compares the
sum over ranks of ``CommStats``' ``bytes_wire`` with what ``lo``'s tx counter saw
over the same steps (TCP/IP headers, ACKs and gloo's preambles included). A ratio
near 1 says the link model is right for that codec's aggregation path (the model
includes gloo's measured per-call transport cost and its all-reduce-based
reduce-scatter, see ``gradzip.collectives.linkmodel``).

Default codecs: the default spec of every registered stage (a lossless-only stage
runs as ``none | X``), plus ``ef | topk(ratio=0.01)``, two-phase ``qsgd`` and four
FSDP2 cases (``fsdp2: SPEC``: its reduce-scatter path). A case that fails is reported
as failed and the others still run. Also ``python -m gradzip.bench.linkbytes``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXTRA_SPECS = ["ef | topk(ratio=0.01)", "qsgd | aggregate=two_phase", "fsdp2: none",
               "fsdp2: fp16", "fsdp2: ef | topk(ratio=0.01)", "fsdp2: qsgd"]


def default_specs() -> list[str]:
    """Every registered stage's default spec (canonical form, deduplicated) + extras."""
    import gradzip
    from gradzip.codecs.registry import registered

    specs = [str(gradzip.codec(name)) for name in registered()]
    return list(dict.fromkeys([*specs, *EXTRA_SPECS]))


def _measure(world: int, cases: list[str], steps: int, timeout: float,
             on_row: Any) -> list[dict[str, Any]]:
    """Rows for ``cases`` at ``world`` ranks; a case that kills its group becomes an
    error row and the remaining cases run in a fresh namespace."""
    from gradzip.comm.netns import run_in_netns

    rows: list[dict[str, Any]] = []
    todo = list(cases)
    while todo:
        got: list[dict[str, Any]] = []

        def line(text: str, got: list[dict[str, Any]] = got) -> None:
            if text.startswith("{"):
                row = json.loads(text)
                got.append(row)
                on_row(row)

        argv = [sys.executable, "-m", "gradzip.bench.linkcount", "--ranks", str(world),
                "--steps", str(steps), "--timeout", str(timeout)]
        for case in todo:
            argv += ["--case", case]
        proc = run_in_netns(argv, timeout=timeout + 120, on_line=line)
        rows += got
        todo = todo[len(got):]
        if proc.returncode != 0 and todo:
            error = _last_error(proc.stderr)
            failed = {"kind": "case", "case": todo[0], "world": world, "error": error}
            rows.append(failed)
            on_row(failed)
            todo = todo[1:]
        elif proc.returncode != 0:
            raise RuntimeError(f"linkcount failed after its last case:\n{proc.stderr[-2000:]}")
    return rows


def _last_error(stderr: str) -> str:
    """The most telling line of a failed rank group's stderr."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("rank ") and ": " in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "failed without a message"


def _per_rank_step(row: dict[str, Any]) -> dict[str, Any]:
    if "error" in row:
        return {"spec": row["case"], "ranks": row["world"], "error": row["error"]}
    div = row["world"] * row["steps"]
    return {"spec": row["case"], "ranks": row["world"], "steps": row["steps"],
            "wire_per_rank_step": row["wire"] / div,
            "kernel_per_rank_step": row["kernel"] / div,
            "handed_per_rank_step": row["handed"] / div,
            # FSDP2's parameter all-gathers are not gradient traffic (link-modelled apart)
            "other_per_rank_step": row.get("other_model", 0) / div,
            "kernel_over_wire": (row["kernel"] / (row["wire"] + row.get("other_model", 0))
                                 if row["wire"] else None),
            "bytes_by_op": row["by_op"], "calls_by_op": row["calls_by_op"],
            "barrier_bytes": row["barrier"]}


def run(args: Any) -> int:
    from gradzip.bench.linkcount import parse_case
    from gradzip.comm.netns import netns_available

    try:
        ranks = sorted({int(r) for r in str(args.ranks).split(",") if r.strip()})
    except ValueError:
        print(f"--ranks must be comma-separated integers, got {args.ranks!r}", file=sys.stderr)
        return 2
    if not ranks or min(ranks) < 2:
        print("--ranks needs world sizes of at least 2 (nothing crosses a link at 1)",
              file=sys.stderr)
        return 2
    specs = list(args.codec or [])
    if args.codecs:
        specs += [s.strip() for s in args.codecs.split(";") if s.strip()]
    specs = specs or default_specs()
    for spec in specs:  # a bad spec fails before any namespace starts
        parse_case(spec)
    ok, why = netns_available()
    if not ok:
        print(f"gradzip bench link needs a network namespace: {why}", file=sys.stderr)
        return 1

    from tqdm import tqdm

    results: list[dict[str, Any]] = []
    with tqdm(total=len(specs) * len(ranks), desc="link bytes", unit="case",
              disable=args.quiet, file=sys.stderr) as bar:
        for world in ranks:
            def done(row: dict[str, Any], world: int = world) -> None:
                bar.set_postfix_str(f"W={world} {row['case']}")
                bar.update(1)

            rows = _measure(world, specs, args.steps, args.timeout, done)
            results += [_per_rank_step(r) for r in rows]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    _print_table(results, args.steps)
    return 0


def _print_table(results: list[dict[str, Any]], steps: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bytes per rank per step, {steps} steps; kernel: lo tx counter; "
                        "other: FSDP2's parameter all-gathers (link model); "
                        "kernel / model = kernel / (bytes_wire + other)")
    for col in ("codec", "W", "bytes_wire", "+ other", "kernel", "kernel / model", "handed",
                "collective calls per rank per step"):
        left = col == "codec" or col.startswith("coll")
        table.add_column(col, justify="left" if left else "right")
    for r in results:
        if "error" in r:
            table.add_row(r["spec"], str(r["ranks"]), "-", "-", "-", "failed", "-",
                          r["error"][:60])
            continue
        ratio = r["kernel_over_wire"]
        per = r["ranks"] * r["steps"]
        ops = ", ".join(f"{op} {n / per:.1f}" for op, n in r["calls_by_op"].items())
        table.add_row(r["spec"], str(r["ranks"]), f"{r['wire_per_rank_step']:,.0f}",
                      f"{r['other_per_rank_step']:,.0f}", f"{r['kernel_per_rank_step']:,.0f}",
                      "-" if ratio is None else f"{ratio:.3f}",
                      f"{r['handed_per_rank_step']:,.0f}", ops)
    Console(width=160).print(table)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="2,4",
                   help="world sizes to measure, comma-separated (default: 2,4)")
    p.add_argument("--codec", action="append",
                   help="codec spec for DDP, 'fsdp2: SPEC', or 'diloco(sync_every=H) | SPEC' "
                        "(DiLoCo syncing every H steps; repeatable); default: every "
                        "registered stage's "
                        f"default spec plus {'; '.join(EXTRA_SPECS)}")
    p.add_argument("--codecs", help="codec specs separated by ';' (added to --codec)")
    p.add_argument("--steps", type=int, default=6,
                   help="DDP steps per codec (the first is DDP's plain fp32 all-reduce)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds allowed for one group of ranks")
    p.add_argument("--json", action="store_true", help="print rows as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def register(sub: Any) -> None:
    p = sub.add_parser("link", help="reported bytes_wire vs the kernel's loopback count "
                                    "(real gloo ranks in a network namespace)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradzip.bench.linkbytes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
