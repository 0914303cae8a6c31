"""Synthetic token streams both examples train on: a random order-1 Markov chain with
peaked transitions, so a model can learn it and validation loss falls (no download)."""

from __future__ import annotations

import numpy as np
import torch


def markov_tokens(vocab: int, length: int, seed: int, chain_seed: int = 1234) -> torch.Tensor:
    """``length`` tokens of the chain (the same chain for every seed; ``seed`` picks
    which stretch of it)."""
    logits = np.random.default_rng(chain_seed).standard_normal((vocab, vocab)) * 3.0
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs / probs.sum(axis=1, keepdims=True), axis=1)
    rng = np.random.default_rng(seed)
    draws = rng.random(length)
    out = np.empty(length, dtype=np.int64)
    token = int(rng.integers(vocab))
    for i in range(length):
        token = min(int(np.searchsorted(cdf[token], draws[i])), vocab - 1)
        out[i] = token
    return torch.from_numpy(out)


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping rows of ``seq_len`` tokens."""
    rows = tokens.numel() // seq_len
    return tokens[: rows * seq_len].view(rows, seq_len)
