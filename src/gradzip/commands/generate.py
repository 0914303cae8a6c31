"""``gradzip generate --ckpt DIR``: sample text from a checkpoint.

With ``--prompt`` it prints the continuations and exits; without, it reads prompts
interactively (an empty line or Ctrl-D ends).
"""

from __future__ import annotations

import argparse
from typing import Any

HELP = "sample text from a checkpoint"  # shown by `gradzip --help`


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help=HELP, description=__doc__)
    p.add_argument("--ckpt", required=True, metavar="DIR", help="run or checkpoint directory")
    p.add_argument("--prompt", help="text to continue (omit for an interactive prompt loop)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="(default: 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k likeliest tokens; 0 = all (default: 0)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling: smallest set with this probability (default: 0.95)")
    p.add_argument("--num-samples", type=int, default=1, help="continuations per prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from gradzip.train.evaluate import load_run
    from gradzip.train.generate import generate

    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise ValueError("--max-new-tokens and --num-samples must be >= 1")
    if not 0 < args.top_p <= 1 or args.temperature < 0 or args.top_k < 0:
        raise ValueError("need 0 < --top-p <= 1, --temperature >= 0, --top-k >= 0")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    model, _, path, tok = load_run(args.ckpt, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def complete(prompt: str) -> None:
        ids = tok.encode(prompt) or [tok.eot_id]  # an empty prompt starts a new document
        idx = torch.tensor([ids] * args.num_samples, device=device)
        out = generate(model, idx, args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, generator=gen)
        for i, row in enumerate(out.tolist()):
            if args.num_samples > 1:
                print(f"--- sample {i + 1}")
            print(tok.decode(row), flush=True)

    if args.prompt is not None:
        complete(args.prompt)
        return 0
    print(f"{path}: type a prompt (empty line or Ctrl-D to quit)")
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            print()
            return 0
        if not prompt:
            return 0
        complete(prompt)
