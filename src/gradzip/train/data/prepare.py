"""``prepare_data``: tokenizer + token caches for a list of sources, once per cache key.

Layout under ``cache_dir``::

    data-<key>.json            manifest: tokenizer path, per-source builds, weights (ready flag)
    data-<key>.status.json     builder heartbeat and state ("building", "failed: ...")
    data-<key>.lock            held by the one process that builds
    tokenizer-<hash>/tokenizer.json                 trained BPE (when no tokenizer is given)
    tokens-<hash>/{train,val}/meta.json, shard_*    one build per source x tokenizer x split

``<key>`` hashes the config and the sources' fingerprints (path, size, mtime of every file),
so editing the data gives a fresh build. Token builds are keyed by source and tokenizer
and are shared between mixtures.

Distributed runs: the builder (rank 0, or local rank 0 when the cache is per node) trains
the tokenizer and builds the shards under a file lock while the other ranks poll the
manifest — no collective is pending, so a build of any length cannot hit a NCCL/gloo
timeout. The builder refreshes a heartbeat file; a waiting rank fails with a clear message
if the builder reports a failure or goes silent for ``wait_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradzip.train.data.atomic import atomic_write_json, read_json
from gradzip.train.data.cache import FORMAT_VERSION, SHARD_TOKENS, TokenShards, build_tokens
from gradzip.train.data.mixture import interleave, mix, normalize
from gradzip.train.data.sources import Source, open_source, parse_spec, split_of
from gradzip.train.tokenizer import Tokenizer


@dataclass
class DataConfig:
    """Where the training text comes from and how it is tokenized and cached."""

    sources: list[str] = field(default_factory=lambda: ["stdlib"])
    """Source specs: "stdlib", a text file or dir, *.jsonl, *.json (array of records), a
    Hugging Face datasets dir; append ":WEIGHT" to mix by token proportion ("a.jsonl:0.3")."""
    cache_dir: str = "runs/.cache/data"
    """Tokenizer and token shards live here, keyed by a hash of sources + tokenizer."""
    tokenizer: str | None = None
    """None: train a byte-level BPE on the train split and cache it; else a tokenizer.json
    file or a directory holding one."""
    vocab_size: int = 4096
    """Vocabulary of a trained tokenizer (256 bytes + merges + EOT); 4096 suits small models."""
    val_fraction: float = 0.05
    """Share of files/records held out for validation, chosen by a hash of their key."""
    max_tokens: int | None = None
    """Cap on training tokens built (validation gets the matching val_fraction share);
    tests and demos use a small value. None: the whole corpus."""
    tokenizer_train_chars: int = 200_000_000
    """Cap on text (characters) the BPE trainer sees; with max_tokens, 4 chars per token of
    it at most. BPE merges settle long before the whole of a large corpus."""
    shard_tokens: int = SHARD_TOKENS
    """Tokens per shard file; a shard is also the unit an interrupted build resumes from."""
    wait_timeout: float = 600.0
    """Seconds a non-building rank waits without any sign of life from the builder."""

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            self.sources = [self.sources]
        if not self.sources:
            raise ValueError("DataConfig.sources is empty; give at least one source (e.g. stdlib)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive or None, got {self.max_tokens}")
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {self.shard_tokens}")


@dataclass
class PreparedData:
    """What the trainer gets: the tokenizer and the mixed train / validation tokens."""

    tokenizer: Tokenizer
    train: TokenShards
    val: TokenShards
    #: per-source (train, val) builds by spec, for per-source evaluation
    parts: dict[str, tuple[TokenShards, TokenShards]]
    manifest: Path


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class Plan:
    """The resolved sources, their weights and every cache path, computable on any rank."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.cache = Path(cfg.cache_dir).expanduser()
        specs = [parse_spec(s) for s in cfg.sources]
        self.names = [name for name, _ in specs]
        self.weights = [w for _, w in specs]
        self.sources: list[Source] = [open_source(name) for name in self.names]
        self.fingerprints = [s.fingerprint() for s in self.sources]
        tok_id: Any = None
        if cfg.tokenizer is not None:
            tok_path = Path(cfg.tokenizer).expanduser()
            tok_file = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
            if not tok_file.is_file():
                raise FileNotFoundError(f"tokenizer not found: {tok_file}")
            st = tok_file.stat()
            tok_id = [str(tok_file.resolve()), st.st_size, st.st_mtime_ns]
        self.tok_key = _hash({"v": FORMAT_VERSION, "sources": self.fingerprints,
                              "weights": self.weights, "vocab": cfg.vocab_size,
                              "val": cfg.val_fraction, "chars": self.train_chars()})
        key = {"v": FORMAT_VERSION, "sources": self.fingerprints, "weights": self.weights,
               "tokenizer": tok_id or self.tok_key, "val": cfg.val_fraction,
               "max_tokens": cfg.max_tokens}
        self.key = _hash(key)
        self.manifest = self.cache / f"data-{self.key}.json"
        self.status = self.cache / f"data-{self.key}.status.json"
        self.lock = self.cache / f"data-{self.key}.lock"

    def train_chars(self) -> int:
        """Characters of text the tokenizer trainer reads."""
        if self.cfg.max_tokens is None:
            return self.cfg.tokenizer_train_chars
        return min(self.cfg.tokenizer_train_chars, 4 * self.cfg.max_tokens)

    def caps(self) -> list[tuple[int | None, int | None]]:
        """Per source (train, val) token caps: max_tokens split by weight (equal if none)."""
        if self.cfg.max_tokens is None:
            return [(None, None)] * len(self.sources)
        vf = self.cfg.val_fraction
        out: list[tuple[int | None, int | None]] = []
        for p in normalize(self.weights):
            train = math.ceil(p * self.cfg.max_tokens)
            out.append((train, math.ceil(train * vf / (1 - vf))))
        return out


def train_tokenizer(plan: Plan) -> Tokenizer:
    vf = plan.cfg.val_fraction

    def texts(src: Source) -> Iterator[str]:
        return (d.text for d in src.docs() if split_of(d.key, vf) == "train")

    stream = interleave([texts(s) for s in plan.sources], plan.weights, plan.train_chars())
    return Tokenizer.train(stream, plan.cfg.vocab_size)


def _progress(status: Callable[[str], None], what: str) -> Callable[[dict[str, Any]], None]:
    """An ``on_commit`` callback reporting the tokens built so far for ``what``."""

    def report(meta: dict[str, Any]) -> None:
        status(f"tokenizing {what}: {meta['tokens']:,} tokens")

    return report


def _build(plan: Plan, status: Callable[[str], None]) -> dict[str, Any]:
    cfg = plan.cfg
    if cfg.tokenizer is not None:
        tok = Tokenizer.load(cfg.tokenizer)
        tok_path = str(Path(cfg.tokenizer).expanduser().resolve())
    else:
        tok_dir = plan.cache / f"tokenizer-{plan.tok_key}"
        tok_file = tok_dir / "tokenizer.json"
        if tok_file.is_file():
            tok = Tokenizer.load(tok_file)
        else:
            status(f"training a {cfg.vocab_size}-token BPE on {plan.train_chars():,} chars")
            tok = train_tokenizer(plan)
            tok.save(tok_file)
        tok_path = str(tok_file)
    parts = []
    for name, src, fp, (cap_train, cap_val) in zip(plan.names, plan.sources, plan.fingerprints,
                                                   plan.caps(), strict=True):
        build_key = _hash({"v": FORMAT_VERSION, "source": fp, "tokenizer": tok.fingerprint(),
                           "val": cfg.val_fraction, "caps": [cap_train, cap_val]})
        base = plan.cache / f"tokens-{build_key}"
        dirs: dict[str, str | None] = {}
        for split, cap in (("train", cap_train), ("val", cap_val)):
            dirs[split] = str(base / split)
            if split == "val" and cfg.val_fraction == 0:
                dirs[split] = None
                continue
            status(f"tokenizing {name} ({split})")
            build_tokens(base / split, src, tok, split, cfg.val_fraction, cap,
                         cfg.shard_tokens, on_commit=_progress(status, f"{name} ({split})"))
        parts.append({"spec": name, "fingerprint": fp, "train": dirs["train"],
                      "val": dirs["val"]})
    return {"format": FORMAT_VERSION, "config": asdict(cfg), "tokenizer": tok_path,
            "weights": plan.weights, "parts": parts, "complete": True}


class _Heartbeat:
    """Keeps ``data-<key>.status.json`` fresh while the builder works, from a thread."""

    def __init__(self, path: Path, period: float = 5.0) -> None:
        self.path = path
        self.period = period
        self.state: dict[str, Any] = {"state": "building", "stage": "starting", "pid": os.getpid(),
                      "host": socket.gethostname(), "updated": time.time(), "beat": 0}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="gradzip-data-heartbeat",
                                        daemon=True)

    def write(self, **changes: Any) -> None:
        with self._lock:
            self.state.update(changes, updated=time.time(), beat=self.state["beat"] + 1)
            atomic_write_json(self.path, self.state)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(OSError):
                self.write()

    def __enter__(self) -> _Heartbeat:
        self.write()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _build_locked(plan: Plan) -> dict[str, Any]:
    plan.cache.mkdir(parents=True, exist_ok=True)
    with open(plan.lock, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another job building the same key: wait for it
        try:
            manifest = read_json(plan.manifest)
            if manifest is not None:
                return manifest
            with _Heartbeat(plan.status) as beat:
                try:
                    manifest = _build(plan, lambda stage: beat.write(stage=stage))
                except BaseException as e:
                    reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    beat.write(state="failed", stage=reason)
                    raise
                atomic_write_json(plan.manifest, manifest)
                beat.write(state="done", stage="done")
            return manifest
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait(plan: Plan, rank: int, poll: float = 0.2) -> dict[str, Any]:
    started = time.time()
    last_seen: Any = None
    last_change = time.monotonic()
    while True:
        manifest = read_json(plan.manifest)
        if manifest is not None:
            return manifest
        status = read_json(plan.status)
        if status != last_seen:
            last_seen, last_change = status, time.monotonic()
        # a failure written before we started waiting belongs to an earlier attempt
        if status and status.get("state") == "failed" and status.get("updated", 0) >= started - 1:
            raise RuntimeError(f"rank {rank}: the data builder (pid {status.get('pid')} on "
                               f"{status.get('host')}) failed: {status.get('stage')}")
        silent = time.monotonic() - last_change
        if silent > plan.cfg.wait_timeout:
            what = (f"its last status was {status.get('state')!r} / {status.get('stage')!r}"
                    if status else f"it never started ({plan.status.name} absent)")
            raise TimeoutError(
                f"rank {rank}: no sign of life from the data builder for {silent:.0f} s while "
                f"waiting for {plan.manifest}; {what}. Is rank 0 running and does it see the "
                "same cache_dir? (raise DataConfig.wait_timeout for very slow file systems)")
        time.sleep(poll)


def _load(manifest: dict[str, Any], path: Path) -> PreparedData:
    tok = Tokenizer.load(manifest["tokenizer"])
    parts: dict[str, tuple[TokenShards, TokenShards]] = {}
    trains, vals = [], []
    for part in manifest["parts"]:
        train = TokenShards.open(part["train"])
        val = TokenShards.open(part["val"]) if part["val"] else TokenShards([])
        parts[part["spec"]] = (train, val)
        trains.append(train)
        vals.append(val)
    weights = manifest["weights"]
    train, val = mix(trains, weights), mix(vals, weights, strict=False)
    specs = ", ".join(parts)
    if not train.num_tokens:
        raise ValueError(f"no training tokens in {specs}: the sources hold no text")
    if not val.num_tokens and manifest["config"]["val_fraction"] > 0:
        raise ValueError(f"the validation split of {specs} is empty: too few files/records for "
                         f"val_fraction={manifest['config']['val_fraction']}; raise it, or set "
                         "it to 0 to train without validation")
    return PreparedData(tok, train, val, parts, path)


def prepare_data(cfg: DataConfig, rank: int = 0, world_size: int = 1,
                 local_rank: int | None = None) -> PreparedData:
    """Build (the builder rank) or wait for (the others) the data of ``cfg``, then map it.

    The builder is rank 0; pass ``local_rank`` when each node has its own ``cache_dir`` so
    local rank 0 of every node builds (a shared ``cache_dir`` is safe too: the lock lets one
    build and the others find the result). Cached results return at once on every rank.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    plan = Plan(cfg)
    manifest = read_json(plan.manifest)
    if manifest is None:
        builder = (local_rank if local_rank is not None else rank) == 0
        manifest = _build_locked(plan) if builder else _wait(plan, rank)
    return _load(manifest, plan.manifest)
