"""The Hugging Face Trainer callback: a tiny random Qwen2 trained by ``Trainer`` on 2 gloo
ranks under torchrun, its DDP buckets captured and read back (no downloads)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from train_helpers import launch

from gradzip.capture import Archive, verify

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytestmark = pytest.mark.dist

SCRIPT = """
import sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments
from gradzip.capture.capture import Capture
from gradzip.integrations.hf import attach_trainer

torch.manual_seed(0)
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64)
model = Qwen2ForCausalLM(config)
g = torch.Generator().manual_seed(1)
rows = torch.randint(0, 64, (32, 16), generator=g)
data = [{"input_ids": r, "labels": r.clone()} for r in rows]
args = TrainingArguments(output_dir=sys.argv[2], max_steps=4, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, use_cpu=True, ddp_backend="gloo",
                         report_to=[], save_strategy="no", logging_steps=100,
                         dataloader_num_workers=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
callback = attach_trainer(trainer, "none", capture=Capture(sys.argv[1], aggregated=True))
trainer.train()
assert callback.handle is not None and callback.capture.stats.buckets > 0
"""


def test_trainer_on_two_ranks_is_captured_and_read_back(tmp_path: Path) -> None:
    script = tmp_path / "train_hf.py"
    script.write_text(SCRIPT)
    archive = tmp_path / "grads"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([*launch(2), str(script), str(archive),
                           str(tmp_path / "hf")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Archive(archive) as a:
        # 32 rows / 2 ranks / 4 per batch / 2 accumulated: 2 optimizer steps an epoch
        assert sorted(a.steps()) == [(r, (s - 1) // 2, s) for r in (0, 1) for s in range(1, 5)]
        names = {e.name for e in a.entries(rank=0, step=2)}
        assert "model.layers.0.self_attn.q_proj.weight" in names
        assert "lm_head.weight" in names or "model.embed_tokens.weight" in names
        for b in sorted({e.bucket for e in a.entries(rank=0, step=3)}):
            local = [a.bucket(r, 1, 3, b) for r in (0, 1)]
            mean = a.bucket(0, 1, 3, b, kind="aggregated")
            np.testing.assert_allclose(mean, (local[0] + local[1]) / 2, rtol=1e-5, atol=1e-8)
    checked, problems = verify(archive)
    assert checked > 0 and problems == []
