"""The GPT model: both families, shapes, causality, weight tying, presets, sampling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradzip.train.config import ModelConfig
from gradzip.train.configure import resolve
from gradzip.train.generate import generate, sample_next
from gradzip.train.model import GPT, ffn_hidden

LLAMA = ModelConfig(n_layer=2, n_head=4, dim=32, max_seq_len=16, vocab_size=50)
GPT2 = dataclasses.replace(LLAMA, norm="layernorm", pos="learned", mlp="gelu", bias=True,
                           tie_embeddings=True)


@pytest.mark.parametrize("cfg", [LLAMA, GPT2, dataclasses.replace(LLAMA, n_kv_head=2),
                                 dataclasses.replace(LLAMA, tie_embeddings=False)],
                         ids=["llama", "gpt2", "gqa", "untied"])
def test_forward_shapes_loss_and_backward(cfg: ModelConfig) -> None:
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 10))
    logits, loss = model(idx, torch.randint(0, cfg.vocab_size, (3, 10)))
    assert logits.shape == (3, 10, cfg.vocab_size)
    # At init the prediction is near uniform: loss close to log(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_causal_future_tokens_do_not_change_the_past(cfg: ModelConfig) -> None:
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    a = torch.randint(0, cfg.vocab_size, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % cfg.vocab_size
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[:, :8], lb[:, :8])
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


def test_tied_embeddings_share_one_tensor() -> None:
    tied, untied = GPT(LLAMA), GPT(dataclasses.replace(LLAMA, tie_embeddings=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == LLAMA.vocab_size * LLAMA.dim


def test_swiglu_width_matches_gelu_parameter_count() -> None:
    cfg = ModelConfig(dim=384)
    assert ffn_hidden(cfg) == 1024  # 8/3 * 384
    assert ffn_hidden(dataclasses.replace(cfg, mlp="gelu")) == 1536
    assert ffn_hidden(dataclasses.replace(cfg, ffn_dim=100)) == 100


def test_too_long_sequence_and_missing_vocab_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        GPT(LLAMA)(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(dataclasses.replace(LLAMA, vocab_size=0))


@pytest.mark.parametrize("name,low,high", [("tiny", 0.05e6, 0.5e6), ("small", 3.5e6, 4.5e6),
                                           ("gpt2-124m", 123e6, 126e6),
                                           ("llama-120m", 115e6, 130e6)])
def test_preset_sizes(name: str, low: float, high: float) -> None:
    cfg = resolve({"model": {"name": name}})
    cfg.model.vocab_size = cfg.data.vocab_size
    with torch.device("meta"):  # no memory, no init time: only the shapes matter
        n = GPT(cfg.model).num_params()
    assert low <= n <= high


def test_sampling_filters() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, -10.0]])
    assert sample_next(logits, temperature=0, top_k=0, top_p=1).item() == 0
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, temperature=1.0, top_k=2, top_p=1.0, generator=g).item()
             for _ in range(200)}
    assert picks == {0, 1}
    # top_p=0.5: token 0 alone has p~0.67, so nothing else survives.
    picks = {sample_next(logits, temperature=1.0, top_k=0, top_p=0.5, generator=g).item()
             for _ in range(50)}
    assert picks == {0}


def test_generate_extends_and_crops_context() -> None:
    torch.manual_seed(0)
    model = GPT(LLAMA).eval()
    out = generate(model, torch.zeros(2, 3, dtype=torch.long), 20, temperature=1.0, top_k=5)
    assert out.shape == (2, 23)  # longer than max_seq_len 16: the context is cropped
    assert out.max() < LLAMA.vocab_size
