"""``gradzip archive``: list, verify, repair, export and pack gradient capture archives.

    gradzip archive ls runs/grads [--rank 0 --step 100 --bucket 3 --name '*attn*']
    gradzip archive verify runs/grads
    gradzip archive repair runs/grads
    gradzip archive export runs/grads --rank 0 --step 100 --bucket 3 --out b3.npy
    gradzip archive pack DIR_OF_PT --out runs/grads [--watch] [--delete-source]
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import Any

HELP = "list, verify, repair, export and pack gradient archives"  # shown by `gradzip --help`


def register(sub: Any) -> None:
    p = sub.add_parser("archive", help=HELP,
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    ls = actions.add_parser("ls", help="list the captured steps, buckets and tensors")
    ls.add_argument("archive", help="archive directory (gradzip train --capture DIR)")
    _filters(ls)
    ls.add_argument("--tensors", action="store_true", help="one line per tensor")
    ls.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    ls.set_defaults(func=_ls)

    _on_archive(actions, "verify", _verify, "check every tensor's checksum and its pack",
                "Check every indexed tensor's bytes against its CRC-32 and its dataset in the "
                "pack's HDF5 structure. Datasets no committed step lists are notes: steps "
                "captured again after a resume from an earlier checkpoint (the index holds "
                "the later capture) and leftovers of steps that never completed (also a "
                "fresh pack no committed step uses); so is a pack whose HDF5 structure a "
                "kill damaged while every indexed byte in it checks out (repair mends it). "
                "Exit status: 0 all good (notes allowed), 1 a problem found, 2 not an "
                "archive.")
    _on_archive(actions, "repair", _repair, "rewrite packs whose HDF5 structure a kill damaged",
                "A process killed during an HDF5 flush can leave a pack whose HDF5 structure "
                "no longer finds datasets it held while every committed tensor's bytes are "
                "intact (verify calls it repairable). Repair copies each such pack's "
                "committed tensors into a fresh pack, reads every copy back against its "
                "CRC-32, points the index at the copies in one transaction and then deletes "
                "the damaged pack; a repair a kill cut short is finished first. A pack a "
                "running capture holds is left alone. Exit status 1 when a problem repair "
                "cannot mend remains (wrong bytes).")

    export = actions.add_parser("export", help="write one bucket or tensor to .npy or .pt")
    export.add_argument("archive")
    _filters(export, required=True)
    export.add_argument("--aggregated", action="store_true",
                        help="the aggregated (post-communication) gradient")
    export.add_argument("--out", required=True, help="FILE.npy or FILE.pt")
    export.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    export.set_defaults(func=_export)

    pack = actions.add_parser("pack", help="convert R_r_E_e_S_s_B_b.pt bucket files to packs")
    pack.add_argument("source", help="directory of .pt bucket files (dicts name -> tensor)")
    pack.add_argument("--out", required=True, help="archive directory to write")
    pack.add_argument("--workers", type=int, default=2, help="packing processes (default 2)")
    pack.add_argument("--watch", action="store_true",
                      help="keep converting new files as they appear (Ctrl-C stops)")
    pack.add_argument("--idle-exit", type=float, default=None, metavar="S",
                      help="with --watch: stop after S seconds without a new file")
    pack.add_argument("--delete-source", action="store_true",
                      help="delete each file once its packed copy read back bit-identical")
    pack.add_argument("--pack-cap", default="1.8TB", help="size of a pack file (default 1.8TB)")
    pack.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    pack.set_defaults(func=_pack)


def _on_archive(actions: Any, name: str, func: Any, summary: str, description: str) -> None:
    """An action whose only argument is the archive directory."""
    p = actions.add_parser(name, help=summary, description=description)
    p.add_argument("archive", help="archive directory (gradzip train --capture DIR)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=func)


def _filters(p: argparse.ArgumentParser, required: bool = False) -> None:
    every = "" if required else " (default: every one)"
    p.add_argument("--rank", type=int, default=None if not required else 0,
                   help="the capturing rank" + (" (default 0)" if required else every))
    p.add_argument("--epoch", type=int, default=None if not required else 0,
                   help="the epoch" + (" (default 0)" if required else every))
    needed = " (needed without --name)" if required else every
    p.add_argument("--step", type=int, default=None, help="the training step" + needed)
    p.add_argument("--bucket", type=int, default=None,
                   help="the bucket index (DDP's, or the FSDP unit's)" + needed)
    p.add_argument("--name", default=None, help="a tensor name (glob patterns in ls)")


def _select(archive: Any, args: argparse.Namespace, kind: str | None = None) -> list[Any]:
    pattern = args.name if args.name and any(c in args.name for c in "*?[") else None
    entries = archive.entries(rank=args.rank, epoch=args.epoch, step=args.step,
                              bucket=args.bucket, name=None if pattern else args.name,
                              kind=kind)
    return [e for e in entries if pattern is None or fnmatch.fnmatchcase(e.name, pattern)]


def _ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from gradzip.capture import Archive

    with Archive(args.archive) as archive:
        entries = _select(archive, args)
    if args.tensors:
        table = Table("rank", "epoch", "step", "bucket", "kind", "name", "dtype", "shape",
                      "pack")
        for e in entries:
            table.add_row(*map(str, (e.rank, e.epoch, e.step, e.bucket, e.kind, e.name,
                                     e.dtype, list(e.shape), e.pack)))
    else:
        table = Table("rank", "epoch", "step", "bucket", "kind", "tensors", "dtype", "MB")
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for e in entries:
            groups.setdefault((e.rank, e.epoch, e.step, e.bucket, e.kind), []).append(e)
        for key, es in groups.items():
            table.add_row(*map(str, key), str(len(es)), es[0].dtype,
                          f"{sum(e.nbytes for e in es) / 1e6:.3f}")
    # piped output (scripts, grep) gets whole names rather than a terminal's width
    Console(width=None if sys.stdout.isatty() else 240).print(table)
    total = sum(e.nbytes for e in entries)
    print(f"{len(entries)} tensors, {total / 1e6:.1f} MB in {args.archive}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from gradzip.capture import verify

    checked, problems = verify(args.archive)
    for p in problems:
        print(p, file=sys.stderr if p.fatal else sys.stdout)
    fatal = [p for p in problems if p.fatal]
    if not checked and not fatal:
        print(f"0 tensors checked: {args.archive} is an empty archive (nothing was captured "
              "or packed into it)")
        return 1
    print(f"{checked} tensors checked: " + (f"{len(fatal)} problem(s)" if fatal else "all good"))
    return 1 if fatal else 0


def _repair(args: argparse.Namespace) -> int:
    from gradzip.capture import verify
    from gradzip.capture.repair import repair

    try:
        rewritten = repair(args.archive)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    fatal = [p for p in verify(args.archive)[1] if p.fatal]
    print(f"rewrote {len(rewritten)} pack(s)" if rewritten else
          f"nothing to rewrite: no pack in {args.archive} has a damaged HDF5 structure over "
          "intact bytes")
    if fatal:
        print(f"error: {len(fatal)} problem(s) repair cannot mend (e.g. {fatal[0]}); "
              "`gradzip archive verify` lists them", file=sys.stderr)
    return 1 if fatal else 0


def _export(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from gradzip.capture import Archive

    out = Path(args.out)
    if out.suffix not in (".npy", ".pt"):
        raise ValueError(f"--out must end in .npy or .pt, got {out.name}")
    if args.name is None and (args.step is None or args.bucket is None):
        raise ValueError("give --step and --bucket (one bucket), or --name (one tensor)")
    kind = "aggregated" if args.aggregated else "local"
    with Archive(args.archive) as archive:
        if args.name is None:
            values = archive.bucket(args.rank, args.epoch, args.step, args.bucket, kind)
            dtype = archive.entries(rank=args.rank, epoch=args.epoch, step=args.step,
                                    bucket=args.bucket, kind=kind)[0].dtype
            tensor = torch.from_numpy(values)
            tensor = tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
        else:
            found = _select(archive, args, kind)
            if len(found) != 1:
                raise ValueError(f"--name {args.name!r} matches {len(found)} tensors in the "
                                 "selected steps and buckets; give one exact name, or narrow "
                                 "it with --step/--bucket (see `gradzip archive ls --tensors`)")
            tensor = archive.tensor(found[0])
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".pt":
        torch.save(tensor, tmp)
    else:
        if tensor.dtype == torch.bfloat16:
            raise ValueError("numpy has no bfloat16: export bf16 tensors to .pt")
        with open(tmp, "wb") as f:
            np.save(f, tensor.numpy())
    tmp.replace(out)
    print(f"wrote {out} ({tensor.dtype}, shape {list(tensor.shape)})")
    return 0


def _pack(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from gradzip.capture.convert import pack_directory
    from gradzip.capture.layout import parse_size

    if args.idle_exit is not None and not args.watch:
        raise ValueError("--idle-exit needs --watch")
    bar = tqdm(unit="file", desc="packing", dynamic_ncols=True)

    def done(path: str, error: str | None) -> None:
        bar.update(1)
        if error is not None:
            tqdm.write(f"skipped {path}: {error}", file=sys.stderr)

    try:
        report = pack_directory(args.source, args.out, workers=args.workers,
                                delete_source=args.delete_source, watch=args.watch,
                                idle_exit_s=args.idle_exit, pack_cap=parse_size(args.pack_cap),
                                on_file=done)
    finally:
        bar.close()
    for path, why in report.skipped.items():
        print(f"skipped {path}: {why}", file=sys.stderr)
    print(f"packed {report.packed} file(s), {report.bytes / 1e6:.1f} MB into {args.out}; "
          f"{report.present} already there; {report.deleted} source file(s) deleted; "
          f"{len(report.failed)} failed; {len(report.skipped)} skipped")
    if not (report.packed or report.present):
        print(f"error: nothing was packed from {args.source}", file=sys.stderr)
        return 1
    return 1 if report.failed else 0
