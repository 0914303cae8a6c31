"""prepare_data end to end: stdlib, caching, mixtures, resume, rank 0 builds / others wait."""

import json
import threading
import time

import numpy as np
import pytest

from gradzip.train.data import BatchLoader, DataConfig, prepare_data
from gradzip.train.data import prepare as prepare_mod
from gradzip.train.tokenizer import Tokenizer


def write_jsonl(path, word, n=300):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "title": f"{word} {i}",
                                "text": f"{word} " * (5 + i % 11)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory):
    cfg = DataConfig(sources=["stdlib"], cache_dir=str(tmp_path_factory.mktemp("cache")),
                     vocab_size=320, max_tokens=40_000)
    return cfg, prepare_data(cfg)


def test_stdlib_end_to_end(stdlib_data):
    cfg, data = stdlib_data
    assert data.tokenizer.vocab_size == 320
    assert data.train.num_tokens == 40_000
    assert 0 < data.val.num_tokens <= 40_000 * 0.05 / 0.95 + 1
    text = data.tokenizer.decode(data.train[:2000].tolist())
    assert "def " in text or "import " in text
    with BatchLoader(data.train, batch_size=4, seq_len=64, seed=0) as loader:
        x, y = next(loader)
    assert x.shape == (4, 64) and int(x.max()) < data.tokenizer.vocab_size


def test_second_call_uses_the_cache(stdlib_data, monkeypatch):
    cfg, data = stdlib_data
    monkeypatch.setattr(prepare_mod, "_build", lambda *a: pytest.fail("rebuilt"))
    again = prepare_data(cfg)
    np.testing.assert_array_equal(again.train[:], data.train[:])
    assert again.tokenizer.fingerprint() == data.tokenizer.fingerprint()


def test_given_tokenizer_and_weighted_mixture(stdlib_data, tmp_path):
    _, data = stdlib_data
    tok_path = data.tokenizer.save(tmp_path / "tok")
    a = write_jsonl(tmp_path / "a.jsonl", "alpha")
    b = write_jsonl(tmp_path / "b.jsonl", "beta")
    cfg = DataConfig(sources=[f"{a}:3", f"{b}:1"], cache_dir=str(tmp_path / "c"),
                     tokenizer=str(tok_path.parent), val_fraction=0.1)
    mixed = prepare_data(cfg)
    assert mixed.tokenizer.fingerprint() == data.tokenizer.fingerprint()
    assert set(mixed.parts) == {a, b}
    (ta, _), (tb, _) = mixed.parts[a], mixed.parts[b]
    assert mixed.train.num_tokens == pytest.approx(ta.num_tokens + tb.num_tokens, abs=2)
    files_a = {s.path for s in ta.segments}
    from_a = sum(s.length for s in mixed.train.segments if s.path in files_a)
    assert from_a / mixed.train.num_tokens == pytest.approx(0.75, abs=0.001)
    # a different weighting reuses the token builds (no re-tokenizing)
    cfg2 = DataConfig(sources=[a, b], cache_dir=cfg.cache_dir, tokenizer=cfg.tokenizer,
                      val_fraction=0.1)
    before = {p.name for p in (tmp_path / "c").iterdir() if p.name.startswith("tokens-")}
    plain = prepare_data(cfg2)
    after = {p.name for p in (tmp_path / "c").iterdir() if p.name.startswith("tokens-")}
    assert before == after and plain.train.num_tokens == ta.num_tokens + tb.num_tokens


def test_interrupted_prepare_resumes(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "d.jsonl", "gamma", n=2000)
    cfg = DataConfig(sources=[src], cache_dir=str(tmp_path / "c"), vocab_size=300,
                     shard_tokens=5000)
    real = prepare_mod.build_tokens
    calls = []

    def interrupted(*args, on_commit=None, **kw):
        def hook(meta):
            calls.append(meta["tokens"])
            if len(calls) == 2:
                raise KeyboardInterrupt
        return real(*args, on_commit=hook, **kw)

    monkeypatch.setattr(prepare_mod, "build_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg)
    assert len(calls) == 2  # stopped after the second shard of the first split
    status = json.loads(next((tmp_path / "c").glob("data-*.status.json")).read_text())
    assert status["state"] == "failed" and "KeyboardInterrupt" in status["stage"]
    monkeypatch.setattr(prepare_mod, "build_tokens", real)
    resumed = prepare_data(cfg)
    fresh = prepare_data(DataConfig(sources=[src], cache_dir=str(tmp_path / "fresh"),
                                    tokenizer=str(next((tmp_path / "c").glob("tokenizer-*"))),
                                    shard_tokens=5000))
    np.testing.assert_array_equal(resumed.train[:], fresh.train[:])
    np.testing.assert_array_equal(resumed.val[:], fresh.val[:])


def test_other_ranks_wait_for_the_builder(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", "delta")
    cfg = DataConfig(sources=[src], cache_dir=str(tmp_path / "c"), vocab_size=300)
    results = {}

    def rank1():
        results[1] = prepare_data(cfg, rank=1, world_size=2)

    waiter = threading.Thread(target=rank1)
    waiter.start()
    time.sleep(0.3)  # let rank 1 start polling before anything exists (no timing asserted)
    assert 1 not in results
    results[0] = prepare_data(cfg, rank=0, world_size=2)
    waiter.join(timeout=60)
    np.testing.assert_array_equal(results[0].train[:], results[1].train[:])


def test_waiting_rank_times_out_with_a_clear_message(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", "eps")
    cfg = DataConfig(sources=[src], cache_dir=str(tmp_path / "c"), wait_timeout=0.5)
    with pytest.raises(TimeoutError, match="rank 1: no sign of life from the data builder"):
        prepare_data(cfg, rank=1, world_size=2)


def test_waiting_rank_sees_the_builder_fail(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    cfg = DataConfig(sources=[str(bad)], cache_dir=str(tmp_path / "c"), wait_timeout=60)
    errors = {}

    def rank1():
        try:
            prepare_data(cfg, rank=1, world_size=2)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion below
            errors[1] = e

    waiter = threading.Thread(target=rank1)
    waiter.start()
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON"):
        prepare_data(cfg, rank=0, world_size=2)
    waiter.join(timeout=60)
    assert isinstance(errors[1], RuntimeError)
    assert "bad.jsonl:2: malformed JSON" in str(errors[1])


def test_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data source not found: .*missing.txt"):
        prepare_data(DataConfig(sources=[str(tmp_path / "missing.txt")],
                                cache_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        prepare_data(DataConfig(sources=["stdlib"], tokenizer=str(tmp_path / "t.json"),
                                cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match="at least one source"):
        DataConfig(sources=[])
    with pytest.raises(ValueError, match="outside world_size"):
        prepare_data(DataConfig(), rank=2, world_size=2)


def test_empty_validation_split_is_explained(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single small document\n" * 50)
    tok = Tokenizer.train(["a single small document"], vocab_size=260)
    tok_file = tok.save(tmp_path / "tok")
    cfg = DataConfig(sources=[str(one)], cache_dir=str(tmp_path / "c"), tokenizer=str(tok_file))
    with pytest.raises(ValueError, match="validation split of .*one.txt is empty"):
        prepare_data(cfg)
    cfg0 = DataConfig(sources=[str(one)], cache_dir=str(tmp_path / "c"),
                      tokenizer=str(tok_file), val_fraction=0.0)
    data = prepare_data(cfg0)
    assert data.val.num_tokens == 0 and data.train.num_tokens > 0
