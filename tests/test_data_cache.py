"""Token shards: build, map, cap, resume after an interruption, damage detection."""

import pickle

import numpy as np
import pytest

from gradzip.train.data.atomic import atomic_write_bytes, remove_stale_temps
from gradzip.train.data.cache import TokenShards, build_tokens, token_dtype
from gradzip.train.data.sources import Doc, Source, split_of


class Words(Source):
    """Documents "w<i> w<i+1> ..." of varied length; keys are record numbers."""

    name = "words"

    def __init__(self, n: int = 200) -> None:
        self.n = n
        self.reads = 0

    def docs(self):
        for i in range(self.n):
            self.reads += 1
            yield Doc(str(i), " ".join(f"w{i + j}" for j in range(1 + i % 7)))

    def fingerprint(self):
        return f"words-{self.n}"


class CharTok:
    """A toy tokenizer: one token per character (ord), EOT = 0."""

    eot_id = 0

    def __init__(self, vocab_size: int = 128) -> None:
        self.vocab_size = vocab_size

    def encode_batch(self, texts):
        return [[ord(c) for c in t] for t in texts]


def expected_tokens(src, split, vf):
    out = []
    for d in src.docs():
        if split_of(d.key, vf) == split:
            out += [ord(c) for c in d.text] + [0]
    return np.array(out, dtype=np.int64)


def test_build_and_map(tmp_path):
    src = Words()
    train = build_tokens(tmp_path / "train", src, CharTok(), "train", 0.2, shard_tokens=300)
    val = build_tokens(tmp_path / "val", src, CharTok(), "val", 0.2, shard_tokens=300)
    assert len({s.path for s in train.segments}) > 3  # several shards
    np.testing.assert_array_equal(train[:], expected_tokens(src, "train", 0.2))
    np.testing.assert_array_equal(val[:], expected_tokens(src, "val", 0.2))
    assert train.num_tokens == len(train) and train.dtype == np.dtype("<u2")
    assert (tmp_path / "train" / "meta.json").is_file()


def test_cached_build_is_not_redone(tmp_path):
    src = Words()
    build_tokens(tmp_path, src, CharTok(), "train", 0.2)
    reads = src.reads
    again = build_tokens(tmp_path, src, CharTok(), "train", 0.2)
    assert src.reads == reads
    np.testing.assert_array_equal(again[:], expected_tokens(src, "train", 0.2))


def test_max_tokens_cuts_exactly(tmp_path):
    t = build_tokens(tmp_path, Words(), CharTok(), "train", 0.2, max_tokens=1000,
                     shard_tokens=128)
    assert t.num_tokens == 1000
    np.testing.assert_array_equal(t[:], expected_tokens(Words(), "train", 0.2)[:1000])


def test_interrupted_build_resumes_to_the_same_tokens(tmp_path):
    src = Words(400)
    commits = []

    def interrupt(meta):
        commits.append(meta)
        if len(commits) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_tokens(tmp_path, src, CharTok(), "train", 0.1, shard_tokens=200,
                     on_commit=interrupt)
    assert not commits[-1]["complete"] and len(commits[-1]["shards"]) == 3
    with pytest.raises(ValueError, match="unfinished"):
        TokenShards.open(tmp_path)
    # a crash mid-write leaves a temp file and maybe an uncommitted shard: both are harmless
    (tmp_path / "shard_00003.bin.tmp-999").write_bytes(b"junk")
    (tmp_path / "shard_00003.bin").write_bytes(b"partial junk")
    src.reads = 0
    resumed = build_tokens(tmp_path, src, CharTok(), "train", 0.1, shard_tokens=200)
    assert src.reads == 400  # the source is re-read, but only new documents are tokenized
    np.testing.assert_array_equal(resumed[:], expected_tokens(src, "train", 0.1))
    assert not list(tmp_path.glob("*.tmp-*"))
    fresh = build_tokens(tmp_path / "fresh", src, CharTok(), "train", 0.1, shard_tokens=200)
    np.testing.assert_array_equal(resumed[:], fresh[:])


def test_resume_starts_at_the_commit_point(tmp_path):
    seen = []
    committed = []

    class Recording(CharTok):
        def encode_batch(self, texts):
            seen.extend(texts)
            return super().encode_batch(texts)

    def stop_after_first(meta):
        committed.append(meta)
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        build_tokens(tmp_path, Words(300), Recording(), "train", 0.0, shard_tokens=100,
                     on_commit=stop_after_first)
    done = committed[0]["docs_scanned"]
    assert 0 < done < 300
    seen.clear()
    build_tokens(tmp_path, Words(300), Recording(), "train", 0.0, shard_tokens=100)
    assert seen == [d.text for d in Words(300).docs()][done:]


def test_damaged_cache_is_reported(tmp_path):
    build_tokens(tmp_path, Words(), CharTok(), "train", 0.0, shard_tokens=300)
    (tmp_path / "shard_00001.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="damaged: shard_00001.bin"):
        TokenShards.open(tmp_path)
    with pytest.raises(FileNotFoundError, match="meta.json missing"):
        TokenShards.open(tmp_path / "elsewhere")


def test_uint32_for_large_vocab(tmp_path):
    assert token_dtype(65536) == np.dtype("<u2") and token_dtype(65537) == np.dtype("<u4")
    t = build_tokens(tmp_path, Words(20), CharTok(100_000), "train", 0.0)
    assert t.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(t[:], expected_tokens(Words(20), "train", 0.0))


def test_views_reads_and_pickle(tmp_path):
    a = build_tokens(tmp_path / "a", Words(50), CharTok(), "train", 0.0, shard_tokens=64)
    b = build_tokens(tmp_path / "b", Words(30), CharTok(), "train", 0.0, shard_tokens=64)
    both = TokenShards.concat([a, b.prefix(100), a])
    ref = np.concatenate([a[:], b[:100], a[:]])
    assert both.num_tokens == ref.size
    rng = np.random.default_rng(0)
    for _ in range(50):
        start = int(rng.integers(ref.size))
        n = int(rng.integers(ref.size - start + 1))
        np.testing.assert_array_equal(both.read(start, n), ref[start:start + n])
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(both))[:], ref)
    with pytest.raises(IndexError):
        both.read(ref.size - 1, 2)
    with pytest.raises(TypeError):
        both[::2]
    assert TokenShards([]).num_tokens == 0


def test_atomic_write(tmp_path):
    target = tmp_path / "d" / "f.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    (tmp_path / "d" / "g.bin.tmp-123").write_bytes(b"x")
    assert remove_stale_temps(tmp_path / "d") == 1
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["f.bin"]
