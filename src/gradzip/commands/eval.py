"""``gradzip eval --ckpt DIR``: validation loss and perplexity of a checkpoint.

DIR is a run directory (its latest checkpoint) or one checkpoint directory. By default
the run's own validation split; ``--dataset`` evaluates on other text with the run's
tokenizer, all of it unless ``--split`` picks its train or validation part.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--steps", type=int, default=0,
                   help="batches to evaluate; 0 = one pass over the split (default: 0)")
    p.add_argument("--batch-size", type=int, default=0, help="0 = the run's (default: 0)")
    p.add_argument("--seq-len", type=int, default=0, help="0 = the run's (default: 0)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="cap on tokens prepared from --dataset; 0 = the run's setting")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="autocast precision (default: fp32)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from gradzip.train.data import BatchLoader, DataConfig, prepare_data
    from gradzip.train.evaluate import evaluate, load_run

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
    steps = args.steps
    if steps <= 0:
        with BatchLoader(shards, batch_size=batch, seq_len=seq, prefetch=0) as probe:
            steps = probe.steps_per_epoch
    result = evaluate(model, shards, make_loader=BatchLoader, batch_size=batch, seq_len=seq,
                      steps=steps, rank=0, world_size=1, device=device, dtype=args.dtype)
    out = {"checkpoint": str(path), "dataset": "+".join(args.dataset or d.sources),
           "split": split, "batches": steps, "tokens": steps * batch * seq, **result}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{path}: {split} loss {result['val_loss']:.4f}, perplexity "
              f"{result['val_ppl']:.2f} ({out['tokens']:,} tokens of {out['dataset']})")
    return 0
