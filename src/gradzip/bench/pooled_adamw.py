"""AdamW for W replicas whose denominator the replicas share cheaply: each keeps its own
first moment, and divides by Adafactor's factored second moment (a row and a column
mean of the squared gradient) pooled over the replicas.

Why: on a tied embedding each replica's own AdamW takes full-size steps along the dense
softmax part of rows whose tokens its small share of the batch did not hold, where
DDP's AdamW divides by a second moment that holds them (docs/benchmarks/frontier.md,
"What the floor is on `small`"). The pooled row and column means carry every
replica's occurrences for ``rows + columns`` numbers a refresh, not ``rows x columns``
(``stat``: ``row`` pools row means alone, ``full`` every coordinate, the bound).

Pooled, a second moment still holds each replica's gradient noise, W times what the mean
gradient holds, so the replicas' mean step is too short where noise dominates. With
``noise_corrected`` the replicas also pool the same statistics of their first moments'
squares, and the shared denominator is ``global_adamw.mean_second_moment`` of the two:
the second moment of the mean of W gradients, which DDP's AdamW divides by (on
`small` at W = 8, one inner step, that is what closes the embedding's gap).

``every`` is how often the pooled statistics are refreshed: between refreshes each
replica divides by the last pooled estimate (what a local-update method could afford:
exchanged at its syncs); they are also refreshed at each of the first ``warmup``
steps, while the second moments still grow fast. With ``floor_own`` the denominator is
at least the replica's own factored one, so a stale pooled estimate never lengthens a
step beyond what the replica's own AdamW would take on a coordinate that grew since.
With ``carry`` the pooled estimate is each replica's second moment at a refresh, and
between refreshes each replica carries it on with its own squared gradients as AdamW
does (the exchange anchors the state; a gradient that grows enters the denominator at
once, as in AdamW, instead of at the next refresh).

An experiment of ``gradzip bench floor`` (the rule ``pooled``), not a trainer option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradzip.train.global_adamw import kept_noise_fraction, mean_second_moment


def factored(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The rank-one second moment of mean row ``rows`` and mean column ``cols``
    (Adafactor: ``v[i, j] = rows[i] * cols[j] / mean(rows)``)."""
    return torch.outer(rows, cols).div_(rows.mean().clamp_(min=1e-30))


def row_col_means(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column means of ``g ** 2`` for a matrix (a vector: itself, and its mean,
    so that ``factored`` gives it back)."""
    sq = g.float().square()
    if sq.dim() < 2:
        return sq, sq.mean().reshape(1)
    sq = sq.reshape(sq.shape[0], -1)
    return sq.mean(1), sq.mean(0)


#: what the replicas pool: Adafactor's row and column means (rows + columns numbers), the
#: row means alone (rows), or every coordinate's second moment (the tensor's size: the
#: bound the cheap ones approach)
STATS = ("factored", "row", "full")


def estimate(rows: torch.Tensor, cols: torch.Tensor, stat: str) -> torch.Tensor:
    """The second moment ``stat`` makes of the statistics (``full``: ``rows`` is it)."""
    if stat == "full":
        return rows
    if stat == "row":
        return rows.unsqueeze(1).expand(-1, cols.numel())
    return factored(rows, cols)


@dataclass(frozen=True)
class PooledOptions:
    """How the pooled rule builds and keeps its shared denominator (the keyword
    arguments of ``PooledFactoredAdamW`` of the same names; see the module)."""

    every: int = 1
    warmup: int = 0
    stat: str = "factored"
    noise_corrected: bool = False
    floor_own: bool = False
    carry: bool = False


class PooledFactoredAdamW(torch.optim.Optimizer):
    """AdamW over ``copies[r][k]``, tensor ``k`` of replica ``r``, with the pooled
    factored denominator refreshed every ``every`` steps (see the module)."""

    def __init__(self, copies: list[list[torch.Tensor]], *, weight_decays: list[float],
                 lr: float, betas: tuple[float, float], eps: float, every: int = 1,
                 floor_own: bool = False, stat: str = "factored",
                 noise_corrected: bool = False, warmup: int = 0,
                 carry: bool = False) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if stat not in STATS:
            raise ValueError(f"stat must be one of {', '.join(STATS)}, got {stat!r}")
        self.stat, self.noise_corrected, self.warmup = stat, noise_corrected, warmup
        self.carry = carry
        super().__init__([p for copy in copies for p in copy], {"lr": lr})
        self.copies, self.weight_decays = copies, weight_decays
        self.betas, self.eps, self.every, self.floor_own = betas, eps, every, floor_own
        self.count = 0
        self.pooled: list[torch.Tensor | None] = [None] * len(copies[0])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        b1, b2 = self.betas
        lr = self.param_groups[0]["lr"]
        self.count += 1
        refresh = self.count <= max(1, self.warmup) or self.count % self.every == 0
        for k, decay in enumerate(self.weight_decays):
            owns = [self._moments(copy[k]) for copy in self.copies]
            correction = 1 - b2 ** self.count
            if refresh:
                self.pooled[k] = self._pooled(owns)
            shared = self.pooled[k]
            assert shared is not None
            for copy, s in zip(self.copies, owns, strict=True):
                p = copy[k]
                v = self._carried(p, shared, refresh, correction) if self.carry else shared
                if self.floor_own:
                    own = estimate(s["rows"] / correction, s["cols"] / correction, self.stat)
                    v = torch.maximum(v.reshape(p.shape), own.reshape(p.shape))
                m = s["m"] / (1 - b1 ** self.count)
                p.mul_(1 - lr * decay)
                p.sub_(lr * m / (v.reshape(p.shape).sqrt() + self.eps))

    def _carried(self, p: torch.Tensor, shared: torch.Tensor, refresh: bool,
                 correction: float) -> torch.Tensor:
        """``p``'s replica's second moment: the pooled estimate at a refresh, carried on
        with the replica's own squared gradient since (kept uncorrected for bias, as
        AdamW keeps it)."""
        assert p.grad is not None
        s = self.state[p]
        if refresh or "v" not in s:
            s["v"] = shared.reshape(p.shape) * correction
        else:
            s["v"].mul_(self.betas[1]).addcmul_(p.grad, p.grad, value=1 - self.betas[1])
        return s["v"] / correction

    def _pooled(self, owns: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The second moment the replicas share: their pooled statistics' estimate; with
        ``noise_corrected``, less the part of it that is the replicas' gradient noise,
        which averages out of their mean (``global_adamw.mean_second_moment`` on the
        pooled moments, where one replica's miss the rows others saw)."""
        b1, b2 = self.betas
        world = len(owns)

        def pool(stats: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
            return estimate(torch.stack([r for r, _ in stats]).mean(0),
                            torch.stack([c for _, c in stats]).mean(0), self.stat)

        correction = 1 - b2 ** self.count
        v = pool([(s["rows"] / correction, s["cols"] / correction) for s in owns])
        if not self.noise_corrected or self.count == 1:  # one step: no noise to tell apart
            return v
        firsts = [s["m"] / (1 - b1 ** self.count) for s in owns]
        m2 = pool([self._stats(m) for m in firsts])
        return mean_second_moment(m2.sqrt(), v, world, kept_noise_fraction(b1, self.count))

    def _stats(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics of ``g ** 2`` this optimizer pools."""
        rows, cols = row_col_means(g)
        if self.stat == "full":
            rows = g.float().square().reshape(rows.shape[0], -1)
        return rows, cols

    def _moments(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s first moment and its own row and column means of g^2, updated with
        its gradient."""
        b1, b2 = self.betas
        assert p.grad is not None
        s = self.state[p]
        rows, cols = self._stats(p.grad)
        if not s:
            s["m"] = torch.zeros_like(p)
            s["rows"], s["cols"] = torch.zeros_like(rows), torch.zeros_like(cols)
        s["m"].lerp_(p.grad, 1 - b1)
        s["rows"].lerp_(rows, 1 - b2)
        s["cols"].lerp_(cols, 1 - b2)
        return s
