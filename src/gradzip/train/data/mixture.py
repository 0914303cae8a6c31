"""Weighted mixing of several datasets.

Weights are token proportions. Each source is tokenized into its own cache (so changing the
weights never re-tokenizes anything) and the mixture is a *view*: with total size
``T = sum(N_i)`` tokens, source ``i`` contributes ``p_i * T`` tokens (``p_i = w_i / sum(w)``),
taken as whole repeats of the source plus a prefix of it. A small source with a large
weight is thus upsampled (repeated), a large source with a small weight downsampled, and
the mixture keeps the total size of the data. Without any weight the sources are simply
concatenated (natural proportions). The loader shuffles sequences across the whole mixture.

The same proportions drive :func:`interleave`, which feeds the tokenizer trainer text from
every source in proportion to its weight (by characters), so the vocabulary fits the mixture.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from gradzip.train.data.cache import TokenShards


def normalize(weights: Sequence[float | None]) -> list[float]:
    """Proportions summing to 1; a missing weight counts as 1 (all missing: equal shares)."""
    w = [1.0 if x is None else float(x) for x in weights]
    total = sum(w)
    if not w or total <= 0:
        raise ValueError("a data mixture needs at least one source with a positive weight")
    return [x / total for x in w]


def mix(parts: Sequence[TokenShards], weights: Sequence[float | None],
        strict: bool = True) -> TokenShards:
    """One ``TokenShards`` holding ``parts`` in the proportions ``weights`` (see module doc).

    An empty part with a weight is an error when ``strict`` (its share cannot be honoured);
    otherwise (validation splits of small sources) it is left out.
    """
    if len(parts) != len(weights):
        raise ValueError(f"{len(parts)} datasets but {len(weights)} weights")
    if not strict:
        keep = [i for i, part in enumerate(parts) if part.num_tokens]
        parts, weights = [parts[i] for i in keep], [weights[i] for i in keep]
        if not parts:
            return TokenShards([])
    if all(w is None for w in weights):
        return TokenShards.concat(list(parts))
    probs = normalize(weights)
    total = sum(p.num_tokens for p in parts)
    out = []
    for part, p in zip(parts, probs, strict=True):
        want = round(p * total)
        if strict and want and not part.num_tokens:
            raise ValueError("a weighted source has no tokens in this split; give it more "
                             "data or drop its weight")
        if not part.num_tokens:
            continue
        repeats, rest = divmod(want, part.num_tokens)
        out.extend([part] * repeats)
        out.append(part.prefix(rest))
    return TokenShards.concat(out)


def interleave(streams: Sequence[Iterable[str]], weights: Sequence[float | None],
               max_chars: int | None = None) -> Iterator[str]:
    """Texts from ``streams`` so that each stream's share of characters follows its weight.

    Deterministic (always draws from the stream furthest below its share); a finished stream
    drops out; stops after ``max_chars`` characters in total.
    """
    probs = normalize(weights)
    its: list[Iterator[str] | None] = [iter(s) for s in streams]
    taken = [0] * len(its)
    total = 0
    while any(it is not None for it in its):
        if max_chars is not None and total >= max_chars:
            return
        i = min((k for k, it in enumerate(its) if it is not None),
                key=lambda k: (taken[k] / probs[k], k))
        text = next(its[i], None)  # type: ignore[arg-type]
        if text is None:
            its[i] = None
            continue
        if max_chars is not None and total + len(text) > max_chars:
            text = text[:max_chars - total]
        taken[i] += len(text)
        total += len(text)
        yield text
