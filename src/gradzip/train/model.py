"""A GPT language model, readable top to bottom (after nanoGPT).

Two families from one class, chosen by config:

* modern / Llama-style: RMSNorm, rotary position embeddings (RoPE), SwiGLU MLP,
  optional grouped-query attention, no biases;
* GPT-2 style: LayerNorm, learned absolute positions, GELU MLP, biases.

Both are pre-norm transformers with causal attention through
``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where available).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gradzip.train.config import ModelConfig


def ffn_hidden(cfg: ModelConfig) -> int:
    """MLP width: explicit, else 4*dim for GELU and 2/3 of that for SwiGLU.

    SwiGLU has three matrices instead of two, so 8/3*dim keeps the parameter count of
    a 4*dim GELU MLP (rounded up to a multiple of 64 for friendlier matmul shapes).
    """
    if cfg.ffn_dim:
        return cfg.ffn_dim
    if cfg.mlp == "gelu":
        return 4 * cfg.dim
    return 64 * math.ceil(8 * cfg.dim / 3 / 64)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)


def rope_table(head_dim: int, max_len: int, theta: float) -> torch.Tensor:
    """cos and sin of position * frequency, shape [max_len, head_dim // 2, 2]."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of channels of x [B, H, T, D] by their position's angle."""
    T = x.shape[2]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, H, T, D/2, 2]
    cos, sin = table[:T, :, 0], table[:T, :, 1]  # [T, D/2] broadcast over B, H
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query key/value heads and RoPE."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.dim // cfg.n_head
        kv_dim = self.n_kv_head * self.head_dim
        self.qkv = nn.Linear(cfg.dim, cfg.dim + 2 * kv_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([C, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.n_kv_head != self.n_head:  # each kv head serves n_head/n_kv_head query heads
            rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GELU: down(gelu(up(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden(cfg)
        self.swiglu = cfg.mlp == "swiglu"
        self.up = nn.Linear(cfg.dim, hidden, bias=cfg.bias)
        self.gate = nn.Linear(cfg.dim, hidden, bias=cfg.bias) if self.swiglu else None
        self.down = nn.Linear(hidden, cfg.dim, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.up(x), approximate="tanh")  # GPT-2 used the tanh approximation
        return self.drop(self.down(h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab] (and the mean cross-entropy with targets)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ModelConfig.vocab_size must be set (the tokenizer's vocabulary)")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        if cfg.pos == "rope":
            # A buffer, not a parameter: it moves with .to(device) but is never trained
            # and (persistent=False) never checkpointed, since it is a pure function of cfg.
            table = rope_table(cfg.dim // cfg.n_head, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("rope", table, persistent=False)
        else:
            self.rope = None
        self.apply(self._init_weights)
        # GPT-2: the projections that add into the residual stream (attention output,
        # MLP down) get std / sqrt(2 * n_layer), so the stream's variance does not grow
        # with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; tied weights count once. non_embedding drops the input tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq = idx.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds max_seq_len "
                             f"{self.cfg.max_seq_len}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(seq, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, self.rope)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        # Loss in fp32 even under autocast: a bf16 log-softmax over 50k classes is lossy.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss
