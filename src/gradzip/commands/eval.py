"""``gradzip eval --ckpt DIR``: validation loss and perplexity of a checkpoint.

DIR is a run directory (its latest checkpoint) or one checkpoint directory. By default
it reproduces the run's own evaluation: the validation batches each of the run's ranks
read (``--eval-steps`` per rank, in the run's precision), averaged as the ranks did, so
the loss is the one the run recorded at that step. ``--whole-split`` reads the whole
validation split once instead; ``--dataset`` evaluates on other text with the run's
tokenizer, all of it unless ``--split`` picks its train or validation part.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HELP = "validation loss / perplexity of a checkpoint"  # shown by `gradzip --help`


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help=HELP,
                       description=__doc__)
    p.add_argument("--ckpt", required=True, metavar="DIR", help="run or checkpoint directory")
    p.add_argument("--dataset", nargs="+", metavar="SOURCE",
                   help="text sources to evaluate on (default: the run's)")
    p.add_argument("--split", choices=("val", "train", "all"),
                   help="part of the sources to evaluate (default: val for the run's own "
                        "data, all for --dataset)")
    p.add_argument("--whole-split", action="store_true",
                   help="one pass over the whole split instead of the run's own evaluation "
                        "batches")
    p.add_argument("--steps", type=int, default=0,
                   help="batches to evaluate; 0 = the run's own (--eval-steps per rank of "
                        "the run), or with --whole-split or --dataset one pass (default: 0)")
    p.add_argument("--batch-size", type=int, default=0, help="0 = the run's (default: 0)")
    p.add_argument("--seq-len", type=int, default=0, help="0 = the run's (default: 0)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="cap on tokens prepared from --dataset; 0 = the run's setting")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="autocast precision (default: the run's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from gradzip.train.data import BatchLoader, DataConfig, prepare_data
    from gradzip.train.evaluate import EVAL_SEED, evaluate, evaluate_as_ranks, load_run

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    model, cfg, path, _ = load_run(args.ckpt, device)
    d = cfg.data
    run_dir = path.parent.parent
    split = args.split or ("all" if args.dataset else "val")
    data = prepare_data(DataConfig(
        sources=args.dataset or list(d.sources), cache_dir=d.cache_dir,
        tokenizer=str(run_dir / "tokenizer.json"),
        val_fraction=0.0 if split == "all" else d.val_fraction,  # "all": nothing held out
        max_tokens=(args.max_tokens or d.max_tokens) or None), rank=0, world_size=1)
    shards = data.val if split == "val" else data.train
    batch, seq = args.batch_size or d.batch_size, args.seq_len or d.seq_len
    dtype = args.dtype or cfg.train.dtype
    own = not (args.whole_split or args.dataset or args.steps or args.batch_size
               or args.seq_len or split != "val")
    if own:  # the run's own evaluation: each rank's batches, averaged as the ranks did
        ranks, per_rank = run_world_size(path), cfg.train.eval_steps
        result = evaluate_as_ranks(model, shards, world_size=ranks, make_loader=BatchLoader,
                                   batch_size=batch, seq_len=seq, steps=per_rank,
                                   device=device, dtype=dtype)
        steps = ranks * per_rank
        how = (f"the run's evaluation: {ranks} rank(s) x {per_rank} batches of "
               f"{batch}x{seq}, seed {EVAL_SEED}")
    else:
        ranks, steps = 1, args.steps
        if steps <= 0:
            with BatchLoader(shards, batch_size=batch, seq_len=seq, prefetch=0) as probe:
                steps = probe.steps_per_epoch
        result = evaluate(model, shards, make_loader=BatchLoader, batch_size=batch,
                          seq_len=seq, steps=steps, rank=0, world_size=1, device=device,
                          dtype=dtype)
        how = f"{steps} batches of {batch}x{seq}" + (
            " (the whole split)" if not args.steps else "")
    recorded = recorded_val_loss(run_dir, path) if own else None
    out = {"checkpoint": str(path), "dataset": "+".join(args.dataset or d.sources),
           "split": split, "selection": "run" if own else "split", "ranks": ranks,
           "batches": steps, "tokens": steps * batch * seq, "dtype": dtype,
           "recorded_val_loss": recorded, **result}
    if args.json:
        print(json.dumps(out))
    else:
        note = f"; the run recorded {recorded:.4f}" if recorded is not None else ""
        print(f"{path}: {split} loss {result['val_loss']:.4f}, perplexity "
              f"{result['val_ppl']:.2f} ({out['tokens']:,} tokens of {out['dataset']}: "
              f"{how}{note})")
    return 0


def run_world_size(ckpt: Path) -> int:
    """The ranks that wrote the checkpoint (1 for a checkpoint that does not say)."""
    from gradzip.train.checkpoint import read_meta

    ranks = read_meta(ckpt).get("world_size")
    return ranks if isinstance(ranks, int) and ranks > 0 else 1


def recorded_val_loss(run_dir: Path, ckpt: Path) -> float | None:
    """The validation loss the run recorded at the checkpoint's step: its results
    record of that step, else the evaluation history entry of that step; None if the
    run recorded none there."""
    from gradzip.train.checkpoint import read_meta

    step = read_meta(ckpt)["step"]
    results = run_dir / "results.jsonl"
    if not results.is_file():
        return None
    for line in reversed(results.read_text().splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for h in reversed(record.get("eval_history") or []):
            if h.get("step") == step and isinstance(h.get("val_loss"), int | float):
                return float(h["val_loss"])
        if record.get("steps") == step and isinstance(record.get("val_loss"), int | float):
            return float(record["val_loss"])
    return None
