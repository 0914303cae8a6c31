"""Sampling text from a trained model: temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gradzip.train.model import GPT


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``logits`` [B, V].

    temperature 0 is greedy; top_k keeps the k likeliest tokens; top_p keeps the smallest
    set whose probability reaches p. Filters apply in that order, then renormalize.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach p (the first always stays).
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
             stop_id: int | None = None, generator: torch.Generator | None = None
             ) -> torch.Tensor:
    """Extend ``idx`` [B, T] by up to ``max_new_tokens`` tokens.

    No KV cache: each step re-runs the (cropped) context. Simple and fast enough for
    the small models this trainer is for.
    """
    max_len = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -max_len:])
        nxt = sample_next(logits[:, -1, :], temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
        if stop_id is not None and bool((nxt == stop_id).all()):
            break
    return idx
