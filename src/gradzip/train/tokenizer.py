"""Byte-level BPE tokenizer: train one on a corpus, or load a ``tokenizer.json``.

Byte-level means every string round-trips exactly (no unknown tokens, whitespace and
non-ASCII kept), which matters for code corpora such as the Python standard library.
The wrapper gives the trainer the few things it needs — ``encode``, ``decode``,
``vocab_size``, ``eot_id``, ``save`` — and hides the ``tokenizers`` API.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

#: the document separator appended after every document when tokenizing a corpus
EOT = "<|endoftext|>"
#: names other tokenizers use for their end-of-text token, tried in order when loading
_EOT_ALIASES = (EOT, "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "<|eot_id|>", "[SEP]")


class Tokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer`` with an end-of-text id."""

    def __init__(self, tok: _HFTokenizer, source: str = "<memory>") -> None:
        self._tok = tok
        self.source = source
        self.eot_id = self._find_eot(tok, source)

    @staticmethod
    def _find_eot(tok: _HFTokenizer, source: str) -> int:
        for name in _EOT_ALIASES:
            idx = tok.token_to_id(name)
            if idx is not None:
                return int(idx)
        raise ValueError(
            f"tokenizer {source} has no end-of-text token (looked for {', '.join(_EOT_ALIASES)});"
            " documents could not be separated"
        )

    # -- construction -------------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Train a byte-level BPE with ``vocab_size`` entries (256 bytes + merges + EOT)."""
        if vocab_size < 257:
            raise ValueError(f"vocab_size must be at least 257 (256 bytes + EOT), got {vocab_size}")
        if vocab_size > 2**32:
            raise ValueError(f"vocab_size {vocab_size} does not fit the uint32 token shards")
        tok = _HFTokenizer(models.BPE())
        # no prefix space: the text is code, and a leading space would change the first token
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok, source=f"<trained, vocab {vocab_size}>")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a ``tokenizer.json`` file, or a directory that contains one."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer not found: {p} (give a tokenizer.json or its dir)")
        try:
            tok = _HFTokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"{p}: not a valid tokenizer.json: {e}") from e
        return cls(tok, source=str(p))

    # -- use ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (the model's embedding rows)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOT added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once (parallel in Rust; much faster than a loop)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens such as EOT are kept so boundaries show."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        """The canonical ``tokenizer.json`` text."""
        return self._tok.to_str()

    def fingerprint(self) -> str:
        """A short hash of the tokenizer definition: token caches are keyed by it."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` atomically; ``path`` may be a file or a directory."""
        from gradzip.train.data.atomic import atomic_write_bytes

        p = Path(path)
        if p.is_dir() or p.suffix != ".json":
            p = p / "tokenizer.json"
        atomic_write_bytes(p, self.to_json().encode())
        return p

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eot_id={self.eot_id}, "
                f"source={self.source})")
