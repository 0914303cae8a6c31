"""``demo`` (DeMo): against an independent optimizer-form implementation on 2 simulated
ranks, in the DDP hook on 2 gloo ranks, and refused on FSDP2."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradzip
from gradzip.aggregation import reduce
from gradzip.collectives.simulated import run_simulated
from gradzip.comm.launch import run_ranks

SHAPES = [torch.Size([16, 24]), torch.Size([24]), torch.Size([8, 3, 4])]
SPEC = "demo(chunk=8, topk=5, decay=0.9)"


def _dct(n: int) -> torch.Tensor:
    """DCT-II, orthonormal, entry by entry from its definition."""
    d = torch.empty(n, n, dtype=torch.float32)
    for k in range(n):
        for i in range(n):
            scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
            d[k, i] = scale * math.cos(math.pi * (i + 0.5) * k / n)
    return d


def _divisor(dim: int, chunk: int) -> int:
    return max(t for t in range(1, min(chunk, dim) + 1) if dim % t == 0)


def _geometry(shape: torch.Size, chunk: int) -> tuple[int, int, int, int]:
    rows = 1 if len(shape) == 1 else shape[0]
    cols = math.prod(shape) // rows
    return rows, cols, 1 if rows == 1 else _divisor(rows, chunk), _divisor(cols, chunk)


def _sent(delta: torch.Tensor, chunk: int, topk: int) -> dict[tuple[int, int], torch.Tensor]:
    """DeMo's extraction for one tensor, tile by tile: the coefficients it sends (zero
    where it sends none), keyed by the tile's corner."""
    rows, cols, r, c = _geometry(delta.shape, chunk)
    mat = delta.reshape(rows, cols)
    dr, dc = _dct(r), _dct(c)
    out = {}
    for i in range(0, rows, r):
        for j in range(0, cols, c):
            coeffs = (dr @ mat[i:i + r, j:j + c] @ dc.T).reshape(-1)
            keep = coeffs.abs().topk(min(topk, r * c)).indices
            sent = torch.zeros(r * c)
            sent[keep] = coeffs[keep]
            out[(i, j)] = sent
    return out


def _dense(tiles: dict[tuple[int, int], torch.Tensor], shape: torch.Size,
           chunk: int) -> torch.Tensor:
    """The inverse DCT of every tile's coefficients, back in the tensor's shape."""
    rows, cols, r, c = _geometry(shape, chunk)
    dr, dc = _dct(r), _dct(c)
    out = torch.zeros(rows, cols)
    for (i, j), coeffs in tiles.items():
        out[i:i + r, j:j + c] = dr.T @ coeffs.reshape(r, c) @ dc
    return out.reshape(shape)


def _mean_of_senders(sent: list[dict[tuple[int, int], torch.Tensor]]
                     ) -> dict[tuple[int, int], torch.Tensor]:
    """Each coefficient averaged over the ranks that sent it (the reference's
    ``scatter_reduce(..., "mean", include_self=False)``): zero where none did."""
    out = {}
    for corner in sent[0]:
        total = sum(s[corner] for s in sent)
        count = sum((s[corner] != 0).float() for s in sent)
        out[corner] = total / count.clamp(min=1)
    return out


def _reference(grads: list[list[list[torch.Tensor]]], lr: float) -> list[torch.Tensor]:
    """Optimizer form: grads[step][rank][tensor]; returns the parameter change."""
    world = len(grads[0])
    deltas = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    params = [torch.zeros(s) for s in SHAPES]
    for step_grads in grads:
        sent = []
        for r in range(world):
            sent_r = []
            for t, g in enumerate(step_grads[r]):
                deltas[r][t] = 0.9 * deltas[r][t] + g
                tiles = _sent(deltas[r][t], 8, 5)
                deltas[r][t] = deltas[r][t] - _dense(tiles, SHAPES[t], 8)
                sent_r.append(tiles)
            sent.append(sent_r)
        for t in range(len(SHAPES)):
            mean = _mean_of_senders([sent[r][t] for r in range(world)])
            params[t] = params[t] - lr * torch.sign(_dense(mean, SHAPES[t], 8))
    return params


def test_updates_equal_an_independent_optimizer_form_on_two_ranks() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [[[torch.randn(s, generator=g) for s in SHAPES] for _ in range(2)]
             for _ in range(4)]
    want = _reference(steps, lr=0.01)

    def rank(r: int, comm: object) -> torch.Tensor:
        codec = gradzip.codec(SPEC, rank=r)
        param = torch.zeros(sum(s.numel() for s in SHAPES))
        for step in steps:
            flat = torch.cat([t.reshape(-1) for t in step[r]])
            update, _ = reduce(codec, flat, "bucket0", comm, shapes=SHAPES)  # type: ignore[arg-type]
            param -= 0.01 * update
        return param

    got = run_simulated(2, rank)
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)  # the same on every rank
    flat_want = torch.cat([p.reshape(-1) for p in want])
    torch.testing.assert_close(got[0], flat_want, rtol=0, atol=1e-7)


def test_wire_is_values_and_small_positions() -> None:
    codec = gradzip.codec("demo")  # 64 x 64 tiles, 32 coefficients each
    p = codec.encode(torch.randn(128, 192), key="w", shapes=[torch.Size([128, 192])])
    n_tiles = 2 * 3
    assert p.tensor("values").numel() == 32 * n_tiles
    assert p.tensor("pos16").dtype == torch.int16 and p.tensor("pos8").numel() == 0
    assert p.wire_bytes < 128 * 192 * 4 / 60  # 6 B per kept coefficient + header
    small = gradzip.codec("demo(chunk=16, topk=8)").encode(torch.randn(32), key="b")
    assert small.tensor("pos8").dtype == torch.uint8 and small.tensor("pos8").numel() == 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def _train_demo(rank: int) -> tuple[float, float, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(copy.deepcopy(_model()))
    handle = gradzip.attach(model, "demo(chunk=8, topk=4)")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # no momentum: DeMo keeps its own
    g = torch.Generator().manual_seed(rank)
    w = torch.linspace(-1, 1, 16)
    losses = []
    for _ in range(60):
        x = torch.randn(32, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), (x @ w).unsqueeze(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        handle.stats.end_step()
        losses.append(float(loss.detach()))
    totals = handle.stats.totals()
    handle.close()
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5, totals["bytes_raw"] / totals["bytes_wire"]


@pytest.mark.dist
def test_trains_in_the_ddp_hook_with_honest_bytes() -> None:
    for first, last, ratio in run_ranks(_train_demo, 2):
        assert last < 0.5 * first
        assert ratio > 2.0  # the uncompressed first step included


def _fsdp_refused(rank: int) -> str:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_model())
    try:
        gradzip.attach(model, "demo")
    except gradzip.SpecError as e:
        return str(e)
    return "attached"


@pytest.mark.dist
def test_fsdp2_is_refused_when_attached() -> None:
    for message in run_ranks(_fsdp_refused, 2):
        assert "'demo'" in message and "FSDP2" in message


def test_one_64x64_tile_with_overlapping_top_k_matches_the_reference_sign_for_sign() -> None:
    """The audit's case: 2 ranks, one 64 x 64 tile, top-32 sets that partly overlap.
    Summing and dividing by W (what gradzip did) changed 410 of 4,096 update signs."""
    shape = torch.Size([64, 64])
    g = torch.Generator().manual_seed(3)
    base = torch.randn(shape, generator=g)
    grads = [base + 0.7 * torch.randn(shape, generator=g) for _ in range(2)]
    sent = [_sent(x, 64, 32) for x in grads]
    overlap = int(((sent[0][(0, 0)] != 0) & (sent[1][(0, 0)] != 0)).sum())
    assert 0 < overlap < 32  # the sets overlap, partly
    want = torch.sign(_dense(_mean_of_senders(sent), shape, 64))

    def rank(r: int, comm: object) -> torch.Tensor:
        codec = gradzip.codec("demo(chunk=64, topk=32, decay=0.9)", rank=r)
        update, _ = reduce(codec, grads[r].reshape(-1), "w", comm,  # type: ignore[arg-type]
                                 shapes=[shape])
        return update.reshape(shape)

    got = run_simulated(2, rank)
    assert int((got[0] != want).sum()) == 0


def test_chunk_is_bounded_by_its_16_bit_positions() -> None:
    with pytest.raises(gradzip.SpecError, match="chunk"):
        gradzip.codec("demo(chunk=182)")
    gradzip.codec("demo(chunk=181)")
