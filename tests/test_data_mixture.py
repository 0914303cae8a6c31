"""Weighted mixtures: proportions, repeats, and the tokenizer-text interleave."""

import numpy as np
import pytest

from gradzip.train.data.cache import build_tokens
from gradzip.train.data.mixture import interleave, mix, normalize
from gradzip.train.data.sources import Doc, Source


class Const(Source):
    """``n`` documents of one repeated character (so tokens identify the source)."""

    def __init__(self, char: str, n: int) -> None:
        self.char, self.n, self.name = char, n, char

    def docs(self):
        for i in range(self.n):
            yield Doc(str(i), self.char * 9)

    def fingerprint(self):
        return f"{self.char}{self.n}"


class CharTok:
    eot_id, vocab_size = 0, 128

    def encode_batch(self, texts):
        return [[ord(c) for c in t] for t in texts]


@pytest.fixture
def parts(tmp_path):
    a = build_tokens(tmp_path / "a", Const("a", 100), CharTok(), "train", 0.0)  # 1000 tokens
    b = build_tokens(tmp_path / "b", Const("b", 300), CharTok(), "train", 0.0)  # 3000 tokens
    return a, b


def share(tokens, char):
    arr = tokens[:]
    return float((arr == ord(char)).sum()) / float((arr != 0).sum())


def test_no_weights_concatenates(parts):
    a, b = parts
    m = mix([a, b], [None, None])
    assert m.num_tokens == 4000 and share(m, "a") == pytest.approx(0.25)


def test_weights_set_token_proportions_and_keep_total(parts):
    a, b = parts
    m = mix([a, b], [3.0, 1.0])  # upsample a (repeated 3x), downsample b
    assert m.num_tokens == 4000
    assert share(m, "a") == pytest.approx(0.75, abs=0.01)
    np.testing.assert_array_equal(m[:1000], a[:])
    m2 = mix([a, b], [1.0, None])  # a missing weight counts as 1
    assert share(m2, "a") == pytest.approx(0.5, abs=0.01)


def test_weighted_empty_part(parts, tmp_path):
    a, _ = parts
    empty = build_tokens(tmp_path / "e", Const("e", 10), CharTok(), "val", 0.0)
    with pytest.raises(ValueError, match="no tokens in this split"):
        mix([a, empty], [1.0, 1.0])
    assert mix([a, empty], [1.0, 1.0], strict=False).num_tokens == 1000


def test_normalize_errors():
    assert normalize([1, 3]) == [0.25, 0.75]
    with pytest.raises(ValueError):
        normalize([])


def test_interleave_follows_weights_and_cap():
    a = ("a" * 10 for _ in range(1000))
    b = ("b" * 10 for _ in range(1000))
    text = "".join(interleave([a, b], [1.0, 3.0], max_chars=4000))
    assert len(text) == 4000
    assert text.count("a") == pytest.approx(1000, abs=10)
    short = list(interleave([["x"], ["y"] * 5], [None, None]))
    assert short.count("x") == 1 and short.count("y") == 5  # a finished stream drops out
