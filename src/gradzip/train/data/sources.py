"""Text sources: where documents come from, in a fixed order, with a fixed split.

A source yields :class:`Doc` records — a stable ``key``, the ``text``, and whether an
end-of-text token follows — always in the same order, so a cache build can resume by
skipping the documents it already tokenized. Every source streams, so a file larger than
RAM is fine (only the standard library's small files are read whole).

Sources by spec string (see :func:`parse_spec`):

- ``stdlib``: the ``.py`` files of the running interpreter's standard library (found via
  ``sysconfig``; ``site-packages`` excluded, the 4 non-UTF-8 test files skipped). Needs no
  download, so demos and tests always have real text.
- a text file (``.txt``, ``.md``, anything not JSON) or a directory (searched recursively for
  text, ``.jsonl`` and ``.json`` files).
- ``*.jsonl``: one JSON object per line with a string ``text`` (and optional ``title``), or a
  bare JSON string per line; blank lines are skipped.
- ``*.json``: a JSON array of ``{id, title, text}`` records, streamed with ``ijson``.
- a Hugging Face ``datasets`` directory (from ``save_to_disk``), when ``datasets`` is installed.

Split: the unit is a file, a record, or a 1 MiB block of a larger text file. A unit goes to
validation when a hash of its key falls below ``val_fraction`` — deterministic, independent of
the machine, and stable when other files are added. Files of a directory (and the stdlib) are
visited in hash order of their path, so a build capped by ``max_tokens`` samples the whole
corpus instead of the alphabetically first modules.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import sys
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: files a directory source reads as plain text
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".py")
#: a text file larger than this is cut (at line ends) into several split units
BLOCK_CHARS = 1 << 20


@dataclass(frozen=True)
class Doc:
    """One split unit: ``key`` is stable across runs, ``eot`` says a document ends here."""

    key: str
    text: str
    eot: bool = True


def split_of(key: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` for a unit key: a hash threshold, same on every machine."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return "val" if h / 2.0**64 < val_fraction else "train"


def _hash_order(paths: list[Path], root: Path) -> list[Path]:
    """``paths`` sorted by a hash of their path relative to ``root``: fixed, well mixed."""
    def key(p: Path) -> bytes:
        return hashlib.blake2b(os.path.relpath(p, root).replace(os.sep, "/").encode(),
                               digest_size=8).digest()
    return sorted(paths, key=key)


def _stat_fingerprint(paths: list[Path]) -> str:
    """Hash of (path, size, mtime) of every file: changes when any file may have changed."""
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


class Source(ABC):
    """Base class: a named, fingerprinted, ordered stream of documents."""

    #: short description used in messages and the cache manifest
    name: str = "source"

    @abstractmethod
    def docs(self) -> Iterator[Doc]:
        """Every document of the source, in a fixed order."""

    @abstractmethod
    def fingerprint(self) -> str:
        """Identity of the content: the token cache is rebuilt when it changes."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


# -- plain text --------------------------------------------------------------------------


def _read_text(path: Path, strict: bool = True) -> str | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"data file not found: {path}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not strict:
            return None
        raise ValueError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None


def _text_units(key: str, text: str) -> Iterator[Doc]:
    """A file as split units: whole if small, else 1 MiB blocks cut after a newline.

    The standard library's files are small and read whole (so a non-UTF-8 one can be
    skipped); user text files go through :func:`_stream_units`, which cuts identically.
    """
    if len(text) <= BLOCK_CHARS:
        yield Doc(key, text)
        return
    start, block = 0, 0
    while start < len(text):
        end = min(start + BLOCK_CHARS, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        yield Doc(f"{key}#{block}", text[start:end], eot=end >= len(text))
        start, block = end, block + 1


class StdlibSource(Source):
    """The standard library ``.py`` files of the running interpreter (about 31 MB)."""

    name = "stdlib"

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root or sysconfig.get_paths()["stdlib"])
        if not self.root.is_dir():
            raise FileNotFoundError(f"standard library directory not found: {self.root}")
        self._files: list[Path] | None = None

    def files(self) -> list[Path]:
        """The files in visiting order (hash order of the relative path); listed once."""
        if self._files is None:
            skip = {"site-packages", "dist-packages", "__pycache__"}
            paths: list[Path] = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = [d for d in dirnames if d not in skip]
                paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
            self._files = _hash_order(paths, self.root)
        return self._files

    def docs(self) -> Iterator[Doc]:
        for p in self.files():
            text = _read_text(p, strict=False)  # a few test files are latin-1 on purpose
            if text:
                yield from _text_units(os.path.relpath(p, self.root).replace(os.sep, "/"), text)

    def fingerprint(self) -> str:
        return f"stdlib-{sys.version_info[0]}.{sys.version_info[1]}-" + _stat_fingerprint(
            sorted(self.files()))


def _stream_units(path: Path, key: str, read_bytes: int = 1 << 18) -> Iterator[Doc]:
    """The units of :func:`_text_units`, decoded incrementally: memory stays about two blocks.

    A block is cut only once more than ``BLOCK_CHARS`` characters are buffered (or the file
    ended), so the cuts, keys and ``eot`` flags equal those of the whole-text version.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a generator holds it
    except FileNotFoundError:
        raise FileNotFoundError(f"data file not found: {path}") from None
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, block, offset, eof = "", 0, 0, False
    with f:
        while True:
            while not eof and len(buf) <= BLOCK_CHARS:
                raw = f.read(read_bytes)
                eof = not raw
                pending = len(decoder.getstate()[0])  # bytes of a character split by the read
                try:
                    buf += decoder.decode(raw, final=eof)
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: not UTF-8 text (bad byte at offset "
                                     f"{offset - pending + e.start})") from None
                offset += len(raw)
            if len(buf) <= BLOCK_CHARS:  # the file ended: the rest is the last unit
                if buf:
                    yield Doc(f"{key}#{block}" if block else key, buf)
                return
            nl = buf.rfind("\n", 0, BLOCK_CHARS)
            end = nl + 1 if nl > 0 else BLOCK_CHARS
            yield Doc(f"{key}#{block}", buf[:end], eot=False)
            buf, block = buf[end:], block + 1


class TextSource(Source):
    """One text file (any suffix but .json/.jsonl), streamed as UTF-8 in blocks."""

    def __init__(self, path: Path, key: str | None = None) -> None:
        self.path = path
        self.name = str(path)
        self.key = key or path.name

    def docs(self) -> Iterator[Doc]:
        # Streamed, not read whole: a single multi-GB text file must not need its size in RAM.
        yield from _stream_units(self.path, self.key)

    def fingerprint(self) -> str:
        return _stat_fingerprint([self.path])


# -- JSON Lines and JSON arrays ------------------------------------------------------------


def record_text(rec: Any, where: str) -> str:
    """The training text of one record: ``title + "\\n" + text`` (title optional)."""
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected an object with a 'text' field, got "
                         f"{type(rec).__name__}")
    text = rec.get("text")
    if not isinstance(text, str):
        keys = ", ".join(sorted(map(str, rec))[:8]) or "none"
        raise ValueError(f"{where}: record has no string field 'text' (fields: {keys})")
    title = rec.get("title")
    if title is not None and not isinstance(title, str):
        raise ValueError(f"{where}: field 'title' must be a string, got {type(title).__name__}")
    return f"{title}\n{text}" if title else text


class JsonlSource(Source):
    """JSON Lines: one record per line; errors name the file and line."""

    def __init__(self, path: Path, key_prefix: str = "") -> None:
        self.path = path
        self.name = str(path)
        self.prefix = key_prefix

    def docs(self) -> Iterator[Doc]:
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below; a generator holds it
        except FileNotFoundError:
            raise FileNotFoundError(f"data file not found: {self.path}") from None
        with f:
            for lineno, raw in enumerate(f, 1):
                where = f"{self.path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{where}: not UTF-8 (bad byte at column {e.start + 1})"
                                     ) from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})"
                                     ) from None
                text = record_text(rec, where)
                if text:
                    yield Doc(f"{self.prefix}{lineno}", text)

    def fingerprint(self) -> str:
        return _stat_fingerprint([self.path])


class JsonArraySource(Source):
    """A JSON array of records, parsed incrementally with ``ijson`` (never loaded whole)."""

    def __init__(self, path: Path, key_prefix: str = "") -> None:
        self.path = path
        self.name = str(path)
        self.prefix = key_prefix

    def _check_array(self, f: Any) -> None:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        f.seek(0)
        if not head:
            raise ValueError(f"{self.path}: empty file, expected a JSON array of records")
        if head[:1] != b"[":
            raise ValueError(f"{self.path}: expected a JSON array of records ('[' first), "
                             f"found {head[:20]!r} (one record per line? name it .jsonl)")

    def docs(self) -> Iterator[Doc]:
        import ijson

        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below; a generator holds it
        except FileNotFoundError:
            raise FileNotFoundError(f"data file not found: {self.path}") from None
        with f:
            self._check_array(f)
            index = -1
            items = ijson.items(f, "item", use_float=True)
            while True:
                try:
                    rec = next(items)
                except StopIteration:
                    break
                except (ijson.JSONError, UnicodeDecodeError) as e:
                    where = f"record {index + 1}" if index >= 0 else "the first record"
                    raise ValueError(f"{self.path}: malformed JSON in {where} "
                                     f"(after {index + 1} good records): {e}") from None
                index += 1
                text = record_text(rec, f"{self.path}: record {index}")
                if text:
                    yield Doc(f"{self.prefix}{index}", text)

    def fingerprint(self) -> str:
        return _stat_fingerprint([self.path])


# -- directories and Hugging Face datasets -------------------------------------------------


def _file_source(path: Path, rel: str | None = None) -> Source:
    """The reader for one file, by suffix; ``rel`` (path inside a directory) prefixes keys."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JsonlSource(path, f"{rel}:" if rel else "")
    if suffix == ".json":
        return JsonArraySource(path, f"{rel}:" if rel else "")
    return TextSource(path, rel)


class DirectorySource(Source):
    """All text, ``.jsonl`` and ``.json`` files under a directory, in hash order of path."""

    SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".json")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)

    def files(self) -> list[Path]:
        paths = [p for p in self.path.rglob("*")
                 if p.is_file() and p.suffix.lower() in self.SUFFIXES
                 and not any(part.startswith(".") for part in p.relative_to(self.path).parts)]
        if not paths:
            raise ValueError(f"{self.path}: no data files (looked for {', '.join(self.SUFFIXES)})")
        return _hash_order(paths, self.path)

    def docs(self) -> Iterator[Doc]:
        for p in self.files():
            yield from _file_source(p, p.relative_to(self.path).as_posix()).docs()

    def fingerprint(self) -> str:
        return _stat_fingerprint(sorted(self.files()))


HF_MARKERS = ("dataset_dict.json", "state.json")


def is_hf_dataset_dir(path: Path) -> bool:
    """True for a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / m).is_file() for m in HF_MARKERS)


class HFDatasetSource(Source):
    """A ``datasets`` directory from ``save_to_disk`` (needs the ``datasets`` package).

    A ``DatasetDict`` contributes all its splits in name order; our own hash split decides
    train/validation so every source kind is split the same way.
    """

    def __init__(self, path: Path) -> None:
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise ValueError(f"{path} is a Hugging Face datasets directory; install the "
                             "'datasets' package to read it (pip install datasets)") from None
        self.path = path
        self.name = str(path)

    def docs(self) -> Iterator[Doc]:
        import datasets

        loaded = datasets.load_from_disk(str(self.path))
        parts = (sorted(loaded.items()) if isinstance(loaded, datasets.DatasetDict)
                 else [("", loaded)])
        for split, ds in parts:
            if "text" not in ds.column_names:
                raise ValueError(f"{self.path} [{split or 'dataset'}]: no 'text' column "
                                 f"(columns: {', '.join(ds.column_names)})")
            cols = ["text"] + (["title"] if "title" in ds.column_names else [])
            index = 0
            for batch in ds.select_columns(cols).iter(batch_size=1000):
                titles = batch.get("title") or [None] * len(batch["text"])
                for title, text in zip(titles, batch["text"], strict=True):
                    where = f"{self.path} [{split or 'dataset'}] row {index}"
                    t = record_text({"text": text, "title": title}, where)
                    if t:
                        yield Doc(f"{split}/{index}", t)
                    index += 1

    def fingerprint(self) -> str:
        return _stat_fingerprint(sorted(p for p in self.path.rglob("*") if p.is_file()))


# -- spec strings ----------------------------------------------------------------------------


def open_source(spec: str) -> Source:
    """The source named by ``spec`` ("stdlib" or a path), with a clear error if missing."""
    if spec == "stdlib":
        return StdlibSource()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data source not found: {spec} (give 'stdlib', a text file or "
                                "directory, a .jsonl file, a .json array or a datasets dir)")
    if path.is_dir():
        return HFDatasetSource(path) if is_hf_dataset_dir(path) else DirectorySource(path)
    return _file_source(path)


def parse_spec(spec: str) -> tuple[str, float | None]:
    """Split ``"path:0.3"`` into ``("path", 0.3)``; no suffix gives weight None."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and not Path(spec).exists():
        try:
            weight = float(tail)
        except ValueError:
            return spec, None  # a ':' that is part of the path
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"source {spec!r}: weight must be a positive number, got {tail}")
        return head, weight
    return spec, None
