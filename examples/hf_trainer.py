"""A Hugging Face ``Trainer`` script that ``gradzip compare --script`` can race.

    gradzip compare --script examples/hf_trainer.py --script-args "--steps 200" \\
        --methods "torch:fp16;int8" --rate 100mbit --out runs/hf-race

One line is gradzip's: ``attach_trainer(trainer)`` adds a callback that, at train
begin, attaches the method compare chose (``GRADZIP_METHOD``) to the DDP model the
Trainer built, hands every evaluation's ``eval_loss`` to the race and writes the run's
record when training ends. The model is a small Qwen2 built from a config with random
weights, the data a synthetic Markov chain (``markov_data.py``): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from markov_data import markov_tokens, windows  # noqa: E402

from gradzip.integrations.hf import attach_trainer  # noqa: E402


def rows_as_examples(rows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=25,
                   help="evaluate every N steps (make it divide --steps: the record is "
                        "written when training ends)")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    seed = int(os.environ.get("GRADZIP_SEED", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    vocab = 64
    torch.manual_seed(seed)  # the same initial model on every rank
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len)
    model = Qwen2ForCausalLM(config)
    tokens = args.steps * args.batch_size * world * args.seq_len
    train = windows(markov_tokens(vocab, tokens, seed=seed), args.seq_len)
    val = windows(markov_tokens(vocab, 16 * args.seq_len, seed=999_999), args.seq_len)
    out = os.environ.get("GRADZIP_RUN_DIR") or tempfile.mkdtemp(prefix="hf-trainer-")
    training = TrainingArguments(
        output_dir=str(Path(out) / "trainer"), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=16,
        learning_rate=args.lr, lr_scheduler_type="constant", seed=seed, data_seed=seed,
        eval_strategy="steps", eval_steps=args.eval_every, use_cpu=True,
        ddp_backend="gloo", report_to=[], save_strategy="no", logging_steps=args.eval_every,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=rows_as_examples(train),
                      eval_dataset=rows_as_examples(val))
    attach_trainer(trainer)  # gradzip: the method compare chose, evaluations, the record
    trainer.train()


if __name__ == "__main__":
    main()
