"""A plain PyTorch DDP training script that ``gradzip compare --script`` can race.

    gradzip compare --script examples/ddp_train.py --script-args "--steps 300" \\
        --methods "torch:fp16;int8;ef | topk(ratio=0.01)" --rate 100mbit --out runs/mine

Three lines are gradzip's (marked below): ``gradzip.attach(model)`` takes the method
compare chose from the environment (``GRADZIP_METHOD``), ``handle.log_eval`` records
each evaluation and ``handle.close`` writes the run's record. The seed comes from
``GRADZIP_SEED`` so that seed k of every method starts alike. Outside compare, set the
method yourself: ``GRADZIP_METHOD=int8 torchrun --nproc_per_node 2 examples/ddp_train.py``.

The model is a small causal transformer; the data a synthetic Markov chain
(``markov_data.py``), each rank reading its own stretch; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from markov_data import markov_tokens, windows  # noqa: E402

import gradzip  # noqa: E402


class TinyLM(nn.Module):
    """Token and position embeddings, causal transformer layers, a tied output head."""

    def __init__(self, vocab: int, dim: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(x) @ self.embed.weight.T


def loss_of(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       rows[:, 1:].reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=33)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--close-steps", action="store_true",
                   help="call handle.stats.end_step() after every optimizer step, as "
                        "README's attach example does (per-step figures in "
                        "handle.stats.summary()); the race's clock is the same either way")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    seed = int(os.environ.get("GRADZIP_SEED", "0"))
    torch.manual_seed(seed)  # the same initial model on every rank
    vocab = 64
    train = windows(markov_tokens(vocab, args.steps * args.batch_size * args.seq_len,
                                  seed=1000 * seed + rank), args.seq_len)
    val = windows(markov_tokens(vocab, 16 * args.seq_len, seed=999_999), args.seq_len)

    model = DistributedDataParallel(TinyLM(vocab, args.dim, 2, args.seq_len - 1))
    handle = gradzip.attach(model)  # gradzip: the method gradzip compare chose
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for step in range(1, args.steps + 1):
        rows = train[(step - 1) * args.batch_size: step * args.batch_size]
        loss_of(model, rows).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.close_steps:
            handle.stats.end_step()
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                val_loss = loss_of(model, val)
            dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
            model.train()
            handle.log_eval(step, val_loss.item())  # gradzip: one evaluation
            if rank == 0:
                print(f"step {step}: val_loss {val_loss.item():.4f}", flush=True)
    handle.close()  # gradzip: the run's record (rank 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
