"""BatchLoader: packing, determinism, disjoint rank shares, epochs, exact resume, shutdown."""

import threading

import numpy as np
import pytest
import torch

from gradzip.train.data.cache import Segment, TokenShards
from gradzip.train.data.loader import BatchLoader


def shards(tmp_path, n=5000, dtype="<u2"):
    """Tokens 0..n-1 (mod 60000) in two shard files, so windows cross a file boundary."""
    arr = (np.arange(n) % 60000).astype(dtype)
    half = n // 2
    (tmp_path / "a.bin").write_bytes(arr[:half].tobytes())
    (tmp_path / "b.bin").write_bytes(arr[half:].tobytes())
    return TokenShards([Segment(str(tmp_path / "a.bin"), dtype, 0, half),
                        Segment(str(tmp_path / "b.bin"), dtype, 0, n - half)])


def take(loader, n):
    return [next(loader) for _ in range(n)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_shapes_and_shift(tmp_path, prefetch):
    with BatchLoader(shards(tmp_path), batch_size=4, seq_len=16, prefetch=prefetch) as loader:
        for x, y in take(loader, 5):
            assert x.shape == y.shape == (4, 16)
            assert x.dtype == y.dtype == torch.long
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert torch.equal(y - x, torch.ones_like(x))  # consecutive tokens: packed windows


def test_deterministic_and_prefetch_independent(tmp_path):
    t = shards(tmp_path)
    with BatchLoader(t, 4, 16, seed=3, prefetch=0) as a, BatchLoader(t, 4, 16, seed=3) as b:
        for (xa, ya), (xb, yb) in zip(take(a, 30), take(b, 30), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    with BatchLoader(t, 4, 16, seed=4) as c, BatchLoader(t, 4, 16, seed=3) as d:
        assert not torch.equal(next(c)[0], next(d)[0])


def test_ranks_get_disjoint_shares(tmp_path):
    t = shards(tmp_path, n=8000)
    world = 3
    loaders = [BatchLoader(t, 2, 10, rank=r, world_size=world, seed=1) for r in range(world)]
    try:
        steps = loaders[0].steps_per_epoch
        assert all(lo.steps_per_epoch == steps for lo in loaders)
        starts = [set() for _ in range(world)]
        for r, lo in enumerate(loaders):
            for x, _ in take(lo, steps):
                starts[r].update(x[:, 0].tolist())
        for r in range(world):
            assert len(starts[r]) == steps * 2
            for q in range(r):
                assert not starts[r] & starts[q]
    finally:
        for lo in loaders:
            lo.close()


def test_epochs_reshuffle_and_cover(tmp_path):
    t = shards(tmp_path, n=2000)
    with BatchLoader(t, batch_size=5, seq_len=10, seed=0) as loader:
        steps = loader.steps_per_epoch
        windows = (2000 - 10) // 10
        assert steps == windows // 5
        e0 = [x[:, 0].tolist() for x, _ in take(loader, steps)]
        assert loader.epoch == 1 and loader.step == 0
        e1 = [x[:, 0].tolist() for x, _ in take(loader, steps)]
    flat0, flat1 = sum(e0, []), sum(e1, [])
    assert len(set(flat0)) == len(flat0) == steps * 5  # no window twice in an epoch
    assert flat0 != flat1
    assert all(s % 10 == flat0[0] % 10 for s in flat0)  # one packing offset per epoch


@pytest.mark.parametrize("prefetch", [0, 3])
def test_state_dict_resumes_exactly(tmp_path, prefetch):
    t = shards(tmp_path, n=3000)
    with BatchLoader(t, 4, 16, seed=7, prefetch=prefetch) as ref:
        expected = take(ref, 60)  # crosses epochs (steps_per_epoch is 2)
    with BatchLoader(t, 4, 16, seed=7, prefetch=prefetch) as first:
        take(first, 23)
        state = first.state_dict()
        take(first, 5)  # advance past the saved point; must not matter
    with BatchLoader(t, 4, 16, seed=7, prefetch=prefetch) as second:
        second.load_state_dict(state)
        got = take(second, 37)
    for (xe, ye), (xg, yg) in zip(expected[23:], got, strict=True):
        assert torch.equal(xe, xg) and torch.equal(ye, yg)


def test_state_dict_mismatch_is_refused(tmp_path):
    t = shards(tmp_path)
    with BatchLoader(t, 4, 16) as a, BatchLoader(t, 4, 32) as b:
        with pytest.raises(ValueError, match="seq_len was 16 when saved, is 32 now"):
            b.load_state_dict(a.state_dict())
        bad = dict(a.state_dict(), step=10**6)
        with pytest.raises(ValueError, match="out of range"):
            a.load_state_dict(bad)


def test_too_small_dataset(tmp_path):
    with pytest.raises(ValueError, match="dataset too small"):
        BatchLoader(shards(tmp_path, n=100), batch_size=4, seq_len=32)


def test_close_joins_thread_and_is_idempotent(tmp_path):
    before = threading.active_count()
    loader = BatchLoader(shards(tmp_path), 4, 16, prefetch=2)
    next(loader)
    thread = loader._thread
    assert thread is not None and thread.is_alive()
    loader.close()
    loader.close()
    assert not thread.is_alive()
    assert threading.active_count() == before
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_dropped_loader_stops_its_thread(tmp_path):
    loader = BatchLoader(shards(tmp_path), 4, 16, prefetch=2)
    thread = loader._thread
    del loader
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_worker_error_reaches_the_caller(tmp_path):
    t = shards(tmp_path)
    loader = BatchLoader(t, 4, 16, prefetch=2)
    loader.close()
    (tmp_path / "b.bin").write_bytes(b"")  # shard vanishes under the loader
    broken = BatchLoader(TokenShards(t.segments), 4, 16, seed=1, prefetch=2)
    with pytest.raises(RuntimeError, match="batch prefetch failed"):
        take(broken, 20)
    assert broken._thread is None
