"""Source readers: order, split, streaming of JSON arrays, and clear errors."""

import io
import json
import tracemalloc

import pytest

from gradzip.train.data import sources
from gradzip.train.data.sources import (
    DirectorySource,
    JsonArraySource,
    JsonlSource,
    StdlibSource,
    TextSource,
    open_source,
    parse_spec,
    split_of,
)


def test_parse_spec(tmp_path):
    assert parse_spec("stdlib") == ("stdlib", None)
    assert parse_spec("data/a.jsonl:0.3") == ("data/a.jsonl", 0.3)
    assert parse_spec("C:dir") == ("C:dir", None)
    odd = tmp_path / "x:2"
    odd.write_text("hi")
    assert parse_spec(str(odd)) == (str(odd), None)  # an existing path wins over a weight
    for bad in ("a.txt:0", "a.txt:-1", "a.txt:inf"):
        with pytest.raises(ValueError, match="weight must be a positive number"):
            parse_spec(bad)


def test_split_is_deterministic_and_close_to_fraction():
    keys = [f"file{i}.py" for i in range(4000)]
    val = [k for k in keys if split_of(k, 0.1) == "val"]
    assert val == [k for k in keys if split_of(k, 0.1) == "val"]
    assert 300 < len(val) < 500
    assert all(split_of(k, 0.0) == "train" for k in keys)
    assert set(val) <= {k for k in keys if split_of(k, 0.2) == "val"}  # nested fractions


def test_stdlib_source_is_ordered_and_fingerprinted():
    src = StdlibSource()
    files = src.files()
    assert len(files) > 500 and all(p.suffix == ".py" for p in files)
    assert not any("site-packages" in p.parts for p in files)
    first = [d.key for _, d in zip(range(20), src.docs(), strict=False)]
    assert first == [d.key for _, d in zip(range(20), StdlibSource().docs(), strict=False)]
    assert first != sorted(first)  # hash order, not alphabetical
    assert src.fingerprint() == StdlibSource().fingerprint()


def test_text_file_and_large_file_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BLOCK_CHARS", 100)
    path = tmp_path / "book.txt"
    lines = [f"line {i} of the book\n" for i in range(30)]
    path.write_text("".join(lines))
    docs = list(TextSource(path).docs())
    assert len(docs) > 3
    assert "".join(d.text for d in docs) == "".join(lines)
    assert all(d.text.endswith("\n") for d in docs)
    assert [d.eot for d in docs] == [False] * (len(docs) - 1) + [True]
    assert len({d.key for d in docs}) == len(docs)


@pytest.mark.parametrize("read_bytes", [7, 64, 1 << 20])
def test_text_file_streams_the_same_units_as_whole_text(tmp_path, monkeypatch, read_bytes):
    monkeypatch.setattr(sources, "BLOCK_CHARS", 50)
    # multi-byte characters split by small reads, a line longer than a block, a block
    # starting with a newline, and a file that is exactly one block or just over
    texts = ["", "short", "x" * 50, "x" * 51, "é€😀 line\n" * 40, "\n" + "y" * 120 + "\nend",
             "".join(f"l{i} ☃\n" for i in range(300))]
    for i, text in enumerate(texts):
        path = tmp_path / f"t{i}.txt"
        path.write_text(text, encoding="utf-8")
        streamed = list(sources._stream_units(path, "k", read_bytes=read_bytes))
        assert streamed == list(sources._text_units("k", text)) if text else streamed == []


def test_text_file_streams_a_file_larger_than_it_keeps_in_memory(tmp_path):
    path = tmp_path / "big.txt"
    with open(path, "w") as f:
        for i in range(16):
            f.write(f"block {i}\n" + ("word " * 20 + "\n") * 10_000)  # 1 MiB each
    size = path.stat().st_size
    tracemalloc.start()
    try:
        chars = sum(len(d.text) for d in TextSource(path).docs())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert chars == size  # ASCII: one byte per character, nothing lost
    # a few blocks in flight (buffer, read, decode, slice), whatever the file's size
    assert peak < 6 * sources.BLOCK_CHARS < size / 2, f"peak {peak} B reading {size} B"


def test_text_file_not_utf8_names_the_byte_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok \xc3\xa9 " * 10 + b"\xc3\xff")  # "\xc3" starts a character
    for read_bytes in (1, 3, 1 << 20):
        with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8 text \(bad byte at offset "
                                             r"60\)"):
            list(sources._stream_units(path, "k", read_bytes=read_bytes))


def test_jsonl_records_titles_and_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1, "title": "T", "text": "body"}\n\n"just a string"\n'
                    '{"text": "no title"}\n{"text": ""}\n')
    docs = list(JsonlSource(path).docs())
    assert [d.text for d in docs] == ["T\nbody", "just a string", "no title"]
    assert [d.key for d in docs] == ["1", "3", "4"]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "broken"\n', r"d\.jsonl:2: malformed JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"d\.jsonl:2: record has no string field 'text'"),
    ('{"text": 5}\n', r"d\.jsonl:1: record has no string field 'text'"),
    ('[1, 2]\n', r"d\.jsonl:1: expected an object"),
    ('{"text": "a", "title": 3}\n', r"d\.jsonl:1: field 'title' must be a string"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        list(JsonlSource(path).docs())


def test_jsonl_not_utf8(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not UTF-8"):
        list(JsonlSource(path).docs())


def _write_array(path, n, text_len=1000):
    with open(path, "w") as f:
        f.write("[\n")
        for i in range(n):
            rec = {"id": i, "title": f"Title {i}", "text": f"{i:08d} " + "x" * text_len}
            f.write(("," if i else "") + json.dumps(rec) + "\n")
        f.write("]\n")


def test_json_array_records(tmp_path):
    path = tmp_path / "a.json"
    _write_array(path, 5, text_len=3)
    docs = list(JsonArraySource(path).docs())
    assert [d.text for d in docs] == [f"Title {i}\n{i:08d} xxx" for i in range(5)]
    assert [d.key for d in docs] == [str(i) for i in range(5)]


def test_json_array_streams_a_file_larger_than_it_keeps_in_memory(tmp_path):
    path = tmp_path / "big.json"
    _write_array(path, 8000, text_len=1000)  # ~8 MB
    size = path.stat().st_size
    assert size > 8_000_000
    count = 0
    tracemalloc.start()
    try:
        for i, doc in enumerate(JsonArraySource(path).docs()):
            assert doc.text.startswith(f"Title {i}\n{i:08d} ")
            count += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 8000
    assert peak < size / 8, f"peak {peak} bytes while reading a {size}-byte file"


def test_json_array_yields_before_reading_the_whole_file(tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    _write_array(path, 4000, text_len=1000)
    reads = []

    class Counting(io.FileIO):
        def read(self, n=-1):
            data = super().read(n)
            reads.append(len(data))
            return data

    monkeypatch.setattr(sources, "open", lambda p, mode: io.BufferedReader(Counting(p, "r")),
                        raising=False)
    first = next(iter(JsonArraySource(path).docs()))
    assert first.key == "0"
    assert sum(reads) < path.stat().st_size / 10


@pytest.mark.parametrize("content, message", [
    ('[{"text": "a"}, {"text": "b"', r"malformed JSON in record 1 \(after 1 good records\)"),
    ('[{"text": "a"}, {"text": "b",, }]', r"malformed JSON in record 1"),
    ('[{"text": "a"}, {"title": "b"}]', r"record 1: record has no string field 'text'"),
    ('{"text": "a"}', r"expected a JSON array of records"),
    ('   ', r"empty file"),
])
def test_json_array_errors(tmp_path, content, message):
    path = tmp_path / "a.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        list(JsonArraySource(path).docs())
    assert "a.json" in str(err.value)


def test_directory_source_mixes_file_kinds(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "sub" / "b.md").write_text("# markdown")
    (tmp_path / "c.jsonl").write_text('{"text": "line one"}\n{"text": "line two"}\n')
    (tmp_path / "d.json").write_text('[{"title": "t", "text": "arr"}]')
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden.txt").write_text("secret")
    src = open_source(str(tmp_path))
    assert isinstance(src, DirectorySource)
    docs = list(src.docs())
    assert sorted(d.text for d in docs) == sorted(
        ["plain text", "# markdown", "line one", "line two", "t\narr"])
    assert {d.key for d in docs} == {"a.txt", "sub/b.md", "c.jsonl:1", "c.jsonl:2", "d.json:0"}
    assert docs == list(open_source(str(tmp_path)).docs())


def test_fingerprint_changes_with_content(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    before = open_source(str(path)).fingerprint()
    path.write_text("two, longer")
    assert open_source(str(path)).fingerprint() != before


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="data source not found: .*nope.jsonl"):
        open_source(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no data files"):
        open_source(str(empty)).fingerprint()
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8"):
        list(open_source(str(bad)).docs())


def test_hf_datasets_dir(tmp_path):
    """Read a saved dataset when ``datasets`` is installed, else refuse with a clear message."""
    try:
        import datasets
    except ImportError:
        (tmp_path / "dataset_dict.json").write_text('{"splits": ["train"]}')
        with pytest.raises(ValueError, match="install the 'datasets' package"):
            open_source(str(tmp_path))
        return
    ds = datasets.Dataset.from_dict({"title": ["a", ""], "text": ["one", "two"]})
    ds.save_to_disk(str(tmp_path / "ds"))
    docs = list(open_source(str(tmp_path / "ds")).docs())
    assert [d.text for d in docs] == ["a\none", "two"]
