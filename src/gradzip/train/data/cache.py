"""Tokenized data on disk: memory-mapped shards, a meta file, resumable builds.

One build directory holds one split of one source under one tokenizer::

    meta.json          {"complete", "docs_scanned", "shards": [{"file", "tokens"}], ...}
    shard_00000.bin    raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    shard_00001.bin    ...

The builder tokenizes documents in order and appends ``ids + [eot]`` to a buffer; when
the buffer reaches ``shard_tokens`` it writes a shard and then the meta file, both atomically.
The meta file is the commit point: it lists the finished shards and how many documents of
the source they cover, so an interrupted build (crash, Ctrl-C, killed job) resumes by
skipping that many documents — no token is lost or written twice.

Readers never load a shard: :class:`TokenShards` maps the files (``numpy.memmap``) and reads
only the windows a batch needs, so a dataset larger than RAM costs nothing to open.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gradzip.train.data.atomic import (
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    remove_stale_temps,
)
from gradzip.train.data.sources import Doc, Source, split_of

FORMAT_VERSION = 1
META = "meta.json"
#: default tokens per shard: 32 MiB of uint16, small enough to write often (resume points)
SHARD_TOKENS = 1 << 24
#: documents / characters handed to the tokenizer at once
BATCH_DOCS, BATCH_CHARS = 256, 4 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class Segment:
    """A run of tokens inside one shard file: ``[start, start + length)``."""

    path: str
    dtype: str
    start: int
    length: int


class TokenShards:
    """A read-only sequence of tokens spread over memory-mapped shard files.

    It is a list of :class:`Segment` views, so a mixture (prefixes, repeats, concatenation of
    several builds) is another ``TokenShards`` without copying a token. Pickles as paths and
    offsets; the maps are reopened lazily in the receiving process.
    """

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = [s for s in segments if s.length > 0]
        self._ends = list(itertools.accumulate(s.length for s in self.segments))
        self._maps: dict[tuple[str, str], np.memmap] = {}

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> TokenShards:
        """Map a finished build directory; a missing or unfinished build is an error."""
        d = Path(directory)
        meta = read_json(d / META)
        if meta is None:
            raise FileNotFoundError(f"no token cache in {d} ({META} missing)")
        if not meta.get("complete"):
            raise ValueError(f"token cache in {d} is unfinished ({meta.get('tokens', 0)} tokens "
                             "so far); run the build again to resume it")
        segs = []
        for sh in meta["shards"]:
            path = d / sh["file"]
            expected = sh["tokens"] * np.dtype(meta["dtype"]).itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise ValueError(f"token cache in {d} is damaged: {sh['file']} missing or not "
                                 f"{expected} bytes; delete the directory to rebuild")
            segs.append(Segment(str(path), meta["dtype"], 0, sh["tokens"]))
        return cls(segs)

    @classmethod
    def concat(cls, parts: list[TokenShards]) -> TokenShards:
        """The tokens of ``parts`` one after another."""
        return cls([s for p in parts for s in p.segments])

    def prefix(self, n: int) -> TokenShards:
        """The first ``n`` tokens."""
        out, left = [], n
        for s in self.segments:
            if left <= 0:
                break
            take = min(s.length, left)
            out.append(Segment(s.path, s.dtype, s.start, take))
            left -= take
        return TokenShards(out)

    # -- reading ----------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Total number of tokens."""
        return self._ends[-1] if self._ends else 0

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype (uint16 or uint32); the widest one if parts differ."""
        sizes = {np.dtype(s.dtype) for s in self.segments}
        return max(sizes, key=lambda d: d.itemsize) if sizes else np.dtype("<u2")

    def _map(self, seg: Segment) -> np.memmap:
        key = (seg.path, seg.dtype)
        m = self._maps.get(key)
        if m is None:
            m = np.memmap(seg.path, dtype=np.dtype(seg.dtype), mode="r")
            self._maps[key] = m
        return m

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens ``[start, start + n)`` as a new int64 array (may cross shard boundaries)."""
        if start < 0 or n < 0 or start + n > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + n}) out of range 0..{self.num_tokens}")
        out = np.empty(n, dtype=np.int64)
        i = bisect.bisect_right(self._ends, start)
        pos, done = start, 0
        while done < n:
            seg = self.segments[i]
            seg_begin = self._ends[i] - seg.length
            off = pos - seg_begin
            take = min(seg.length - off, n - done)
            out[done:done + take] = self._map(seg)[seg.start + off:seg.start + off + take]
            done, pos, i = done + take, pos + take, i + 1
        return out

    def __getitem__(self, item: slice) -> np.ndarray:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError("TokenShards supports contiguous slices only, e.g. tokens[a:b]")
        start, stop, _ = item.indices(self.num_tokens)
        return self.read(start, max(0, stop - start))

    def __getstate__(self) -> dict[str, Any]:
        return {"segments": self.segments}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["segments"])  # type: ignore[misc]

    def __repr__(self) -> str:
        files = len({s.path for s in self.segments})
        return f"TokenShards({self.num_tokens:,} tokens in {files} shard files)"


# -- building -----------------------------------------------------------------------------


class Encoder(Protocol):
    """What the builder needs from a tokenizer (see gradzip.train.tokenizer.Tokenizer)."""

    @property
    def eot_id(self) -> int:
        """Id appended after every document."""

    @property
    def vocab_size(self) -> int:
        """Number of ids; picks uint16 or uint32 storage."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text."""


def _take(docs: Iterator[tuple[int, Doc]], max_docs: int, max_chars: int
          ) -> Iterator[tuple[int, Doc]]:
    """The next documents of ``docs`` up to ``max_docs`` of them or ``max_chars`` of text."""
    chars = 0
    for n, item in enumerate(docs, 1):
        yield item
        chars += len(item[1].text)
        if n >= max_docs or chars >= max_chars:
            return


def build_tokens(
    directory: str | os.PathLike[str],
    source: Source,
    tokenizer: Encoder,
    split: str,
    val_fraction: float,
    max_tokens: int | None = None,
    shard_tokens: int = SHARD_TOKENS,
    on_commit: Callable[[dict[str, Any]], None] | None = None,
) -> TokenShards:
    """Tokenize the ``split`` documents of ``source`` into ``directory``; resume if begun.

    ``max_tokens`` caps the build (the last document is cut). ``on_commit`` is called with the
    meta dict after each shard is committed (progress reports; tests interrupt builds there).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(d)
    meta_path = d / META
    identity = {"format": FORMAT_VERSION, "source": source.name, "split": split,
                "val_fraction": val_fraction, "max_tokens": max_tokens,
                "eot_id": tokenizer.eot_id, "vocab_size": tokenizer.vocab_size}
    dtype = token_dtype(tokenizer.vocab_size)
    meta = read_json(meta_path)
    if meta is None or meta.get("identity") != identity:
        meta = {"identity": identity, "dtype": dtype.str, "complete": False,
                "docs_scanned": 0, "tokens": 0, "shards": []}
    if meta["complete"]:
        return TokenShards.open(d)
    resumed_from = meta["docs_scanned"]
    buffer: list[np.ndarray] = []
    buffered = 0

    def commit(docs_scanned: int, complete: bool) -> None:
        nonlocal buffer, buffered
        if buffered:
            arr = np.concatenate(buffer).astype(dtype, copy=False)
            name = f"shard_{len(meta['shards']):05d}.bin"
            atomic_write_bytes(d / name, arr.tobytes())
            meta["shards"].append({"file": name, "tokens": int(arr.size)})
            meta["tokens"] += int(arr.size)
        meta["docs_scanned"] = docs_scanned
        meta["complete"] = complete
        atomic_write_json(meta_path, meta)  # the commit point: shards first, then the meta
        buffer, buffered = [], 0
        if on_commit is not None:
            on_commit(dict(meta))

    mine = ((i, doc) for i, doc in enumerate(source.docs())
            if i >= resumed_from and split_of(doc.key, val_fraction) == split)
    scanned = resumed_from
    while True:
        # encode in batches (parallel in Rust), but not far past a max_tokens cap:
        # ~2 characters per token is a safe lower bound for a BPE with >= 256 merges
        room = BATCH_CHARS if max_tokens is None else min(
            BATCH_CHARS, 2 * (max_tokens - meta["tokens"] - buffered))
        batch = list(_take(mine, BATCH_DOCS, max(room, 1)))
        if not batch:
            break
        ids = tokenizer.encode_batch([doc.text for _, doc in batch])
        for x, (index, doc) in zip(ids, batch, strict=True):
            arr = np.array(x + [tokenizer.eot_id] if doc.eot else x, dtype=np.int64)
            scanned = index + 1
            if max_tokens is not None and meta["tokens"] + buffered + arr.size >= max_tokens:
                buffer.append(arr[:max_tokens - meta["tokens"] - buffered])
                buffered += buffer[-1].size
                commit(scanned, complete=True)
                return TokenShards.open(d)
            buffer.append(arr)
            buffered += arr.size
            if buffered >= shard_tokens:  # a shard ends on a document boundary
                commit(scanned, complete=False)
    commit(scanned, complete=True)
    return TokenShards.open(d)
