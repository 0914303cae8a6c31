"""Byte-level BPE: exact round trips, the EOT id, save/load, clear errors."""

import json

import pytest

from gradzip.train.tokenizer import EOT, Tokenizer

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "for i in range(10):\n\tprint(i, 'héllo wörld')\n",
] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(CORPUS, vocab_size=300)


def test_trained_vocab_and_eot(tok):
    assert tok.vocab_size == 300
    assert tok.decode([tok.eot_id]) == EOT
    assert tok.eot_id not in tok.encode("def f(): pass")


@pytest.mark.parametrize("text", [
    "def add(a, b):\n    return a + b\n",
    "  leading spaces and trailing  \n\n",
    "unicode: 日本語 🙂 ñ \u200b \x00 \r\n",
    "",
])
def test_round_trip_is_exact(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_bpe_merges_compress(tok):
    text = CORPUS[0]
    assert len(tok.encode(text)) < len(text.encode())


def test_encode_batch_matches_encode(tok):
    assert tok.encode_batch(CORPUS[:3]) == [tok.encode(t) for t in CORPUS[:3]]


def test_save_and_load_file_and_dir(tok, tmp_path):
    path = tok.save(tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json"
    for where in (path, tmp_path / "tok"):
        again = Tokenizer.load(where)
        assert again.vocab_size == tok.vocab_size and again.eot_id == tok.eot_id
        assert again.encode(CORPUS[1]) == tok.encode(CORPUS[1])
        assert again.fingerprint() == tok.fingerprint()
    assert tok.save(tmp_path / "named.json") == tmp_path / "named.json"
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        Tokenizer.load(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_tokenizer_without_eot_is_refused(tok, tmp_path):
    spec = json.loads(tok.to_json())
    spec["added_tokens"] = []
    del spec["model"]["vocab"][EOT]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="no end-of-text token"):
        Tokenizer.load(tmp_path)


def test_vocab_too_small():
    with pytest.raises(ValueError, match="at least 257"):
        Tokenizer.train(CORPUS, vocab_size=100)
