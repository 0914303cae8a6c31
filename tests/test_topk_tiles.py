"""``topk(tile=T)``: the top k of every T x T block of each matrix, as templar's
SparseLoCo selects (issue 43 item 3), against ``chunk``'s consecutive entries."""

from __future__ import annotations

import pytest
import torch

import gradzip


def _kept(spec: str, x: torch.Tensor, shapes: list[torch.Size] | None = None) -> torch.Tensor:
    codec = gradzip.codec(spec)
    out = codec.decode(codec.encode(x, "k", shapes=shapes), x.shape, shapes=shapes)
    return out != 0


def test_each_tile_keeps_its_own_top_k() -> None:
    torch.manual_seed(0)
    m = torch.randn(8, 12)
    kept = _kept("topk(k=3, tile=4)", m)
    tiles = kept.view(2, 4, 3, 4).permute(0, 2, 1, 3).reshape(6, 16)
    assert tiles.sum(1).tolist() == [3] * 6
    mags = m.abs().view(2, 4, 3, 4).permute(0, 2, 1, 3).reshape(6, 16)
    for t in range(6):  # the kept ones are the tile's largest
        assert mags[t][tiles[t]].min() >= mags[t][~tiles[t]].max()


def test_a_square_tile_as_wide_as_the_matrix_is_a_chunk() -> None:
    """64-wide rows: a 64 x 64 tile is 4,096 consecutive entries, as chunk=4096."""
    torch.manual_seed(1)
    m = torch.randn(128, 64)
    assert torch.equal(_kept("topk(k=64, tile=64)", m), _kept("topk(k=64, chunk=4096)", m))
    wide = torch.randn(64, 128)  # wider rows: tiles and strips pick differently
    assert not torch.equal(_kept("topk(k=64, tile=64)", wide),
                           _kept("topk(k=64, chunk=4096)", wide))


def test_a_bucket_is_tiled_tensor_by_tensor() -> None:
    torch.manual_seed(2)
    a, v, b = torch.randn(8, 8), torch.randn(20), torch.randn(6, 9)
    flat = torch.cat([a.reshape(-1), v, b.reshape(-1)])
    shapes = [a.shape, v.shape, b.shape]
    kept = _kept("topk(k=2, tile=4)", flat, shapes)
    assert kept[:64].sum() == 4 * 2  # 4 tiles of 4 x 4
    assert kept[64:84].sum() == 2 * 2  # strips of 16: one full, one of 4
    assert kept[84:].sum() == 2 * 3 * 2  # 6 x 9: tiles of 3 x 3 (divisors below 4)
    assert torch.equal(kept[:64], _kept("topk(k=2, tile=4)", a).reshape(-1))


def test_chunk_and_tile_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        gradzip.codec("topk(k=2, chunk=16, tile=4)")


def test_sparseloco_takes_tiles() -> None:
    from gradzip.comm.method import parse_method

    method = parse_method("sparseloco(tile=64)")
    assert "topk(k=64, tile=64)" in method.codec_text
    assert "chunk=4096" in parse_method("sparseloco").codec_text
