"""What each lossy codec would cost on a bucket: link bytes, ratio, error.

Each codec runs its own reduction protocol over the simulated communicator, exactly as
in an N-rank run: with every captured rank's bucket of one step when the source has them
(an archive, or ``R_{r}_E_{e}_S_{s}_B_{b}.pt`` files), else with 2 ranks holding this
bucket. Per codec: the link bytes one rank sends (the link byte model's count, as
``bytes_wire`` in training), the ratio against the fp32 all-reduce of the same ranks and
against the captured dtype, the relative L2 error and cosine similarity of this rank's
decoded contribution, and of the aggregated mean against the exact mean.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import gradzip
from gradzip.aggregation import reduce
from gradzip.collectives.simulated import run_simulated


def error(x: torch.Tensor, y: torch.Tensor | None) -> tuple[float, float]:
    """(relative L2 error, cosine similarity) of ``y`` as an estimate of ``x``.

    In the tensors' own float32 (BLAS dot products): the error norm comes from the
    difference itself, so it stays precise however small; copies to float64 cost more
    than every codec's encode on a 17 MB bucket."""
    if y is None:
        return math.nan, math.nan
    x, y = x.float().reshape(-1), y.float().reshape(-1)
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    rel = float(torch.linalg.vector_norm(x - y)) / nx if nx else math.nan
    cos = float(torch.dot(x, y)) / (nx * ny) if nx and ny else math.nan
    return rel, cos


def _reduce(spec: str, xs: list[torch.Tensor], shapes: list[torch.Size]
            ) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
    def work(rank: int, comm: Any) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        codec = gradzip.codec(spec, seed=0, rank=rank)
        mean, local = reduce(codec, xs[rank].clone(), "whatif", comm, want_local=True,
                                   shapes=shapes)
        return comm.counter.total_wire, mean, local

    return run_simulated(len(xs), work)


def codec_costs(xs: list[torch.Tensor], shapes: list[torch.Size], specs: list[str],
                captured_itemsize: int) -> list[dict[str, Any]]:
    """One dict of columns per rank in ``xs`` (float32 buckets of one step)."""
    world = max(len(xs), 2)
    ranks = xs if len(xs) > 1 else xs * 2
    exact = (torch.stack([x.double() for x in ranks]).mean(0)).float()
    plain = _reduce("none", ranks, shapes)  # the fp32 all-reduce of the same ranks
    rows: list[dict[str, Any]] = [{"whatif_ranks": world if len(xs) > 1 else 1}
                                  for _ in xs]
    for spec in specs:
        results = _reduce(spec, ranks, shapes)
        mean_rel, mean_cos = error(exact, results[0][1])
        for r, row in enumerate(rows):
            wire, _, local = results[r]
            rel, cos = error(ranks[r], local)
            row.update({
                f"{spec}: link_bytes": wire,
                f"{spec}: ratio_fp32": plain[r][0] / wire if wire else math.nan,
                f"{spec}: ratio_captured": plain[r][0] * captured_itemsize / 4 / wire
                if wire else math.nan,
                f"{spec}: rel_error": rel, f"{spec}: cosine": cos,
                f"{spec}: mean_rel_error": mean_rel, f"{spec}: mean_cosine": mean_cos})
    return rows
