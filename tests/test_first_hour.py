"""A newcomer's first commands: fast help, and a plain word where a run is not what it
looks like."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import flags, last_result

from gradzip.cli import main

IMPORTS_AFTER = """
import sys
from gradzip.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print("LOADED", *sorted(m for m in ("torch", "numba", "numpy") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"],
                                  ["analyze", "--help"], ["compare", "--help"],
                                  ["archive", "--help"], ["report", "--help"]])
def test_help_imports_neither_torch_nor_numba(argv: list[str]) -> None:
    """`gradzip --help` took 7-13 s on a cold machine because it imported torch."""
    out = subprocess.run([sys.executable, "-c", IMPORTS_AFTER.format(argv=argv)],
                         capture_output=True, text=True, check=True).stdout
    loaded = out.split("LOADED", 1)[1].split()
    assert "torch" not in loaded and "numba" not in loaded, (argv, loaded)
    assert "usage: gradzip" in out or "gradzip 0" in out


def test_import_gradzip_is_light_until_a_name_is_used() -> None:
    code = ("import sys, gradzip; a = 'torch' in sys.modules; "
            "c = gradzip.codec('int8'); print(a, 'torch' in sys.modules, c)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True", "int8"]


def test_the_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    for command in ("codecs", "bench", "train", "compare", "eval", "generate", "report",
                    "archive", "analyze"):
        assert f"    {command}" in shown


def test_ddp_without_torchrun_says_it_runs_one_rank(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    argv = flags(tmp_path / "cache", tmp_path / "run", "--max-steps", "1", "--parallel",
                 "ddp")
    assert main(["train", *argv]) == 0
    err = capsys.readouterr().err
    assert "without torchrun runs ONE rank" in err and "torchrun --nproc_per_node" in err


README_SNIPPETS = re.findall(r"```python\n(.*?)```",
                             (Path(__file__).parents[1] / "README.md").read_text(), re.S)


@pytest.mark.parametrize("snippet", README_SNIPPETS,
                         ids=[f"block{i}" for i in range(len(README_SNIPPETS))])
def test_every_readme_python_snippet_runs_as_pasted(snippet: str, tmp_path: Path) -> None:
    """Pasted into a fresh interpreter (the DDP ones start a one-process gloo group)."""
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_readme_has_python_snippets_to_run() -> None:
    assert len(README_SNIPPETS) >= 3


def test_no_doc_installs_gradzip_from_the_package_index() -> None:
    """gradzip is installed from the clone; `pip install gradzip[hf]` would look it up on
    PyPI."""
    root = Path(__file__).parents[1]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        assert not re.search(r"pip install [\"']?gradzip\b", doc.read_text()), doc


# ---- gradzip analyze on bad input ------------------------------------------------------

@pytest.mark.parametrize("name, content, says", [
    ("random.pt", b"\x80\x02" + bytes(range(256)) * 4, "not a tensor file gradzip can read"),
    ("random.bin", bytes(range(256)) * 4, "not a tensor file gradzip can read"),
    ("random.npy", bytes(range(256)) * 4, "not a .npy file (no NumPy header)"),
    ("objects.npy", None, "holds Python objects, which gradzip never loads"),
])
def test_analyze_says_what_a_bad_file_is_without_loader_advice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
        content: bytes | None, says: str) -> None:
    import numpy as np

    path = tmp_path / name
    if content is None:
        np.save(path, np.array([{"a": 1}], dtype=object))
    else:
        path.write_bytes(content)
    assert main(["analyze", str(path), "--workers", "1", "--no-progress"]) == 1
    errors = (tmp_path / f"{name}.analysis" / "errors.csv").read_text()
    assert says in errors, errors
    for advice in ("Please file an issue", "weights_only` set to `False",
                   "allow_pickle=", "pickle.load()"):
        assert advice not in errors, errors


@pytest.mark.parametrize("kind", ["missing", "empty directory"])
def test_analyze_of_nothing_is_one_error_and_leaves_no_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    source = tmp_path / "src"
    if kind == "empty directory":
        source.mkdir()
    assert main(["analyze", str(source), "--no-progress"]) == 2
    assert "gradzip analyze: error:" in capsys.readouterr().err
    assert not (tmp_path / "src.analysis").exists()


# ---- compilation is not training ---------------------------------------------------------

def test_compiling_the_codec_happens_before_the_clock_and_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold numba cache cost ~8 s inside the first steps of `qsgd | eg` (its first
    evaluation at 9.0 s of training instead of 0.9 s); it is now paid before step 1."""
    import time

    import gradzip.aggregation.warm as warm_module

    seen: list[list[str]] = []

    def slow_warm(codecs: list[object], *args: object) -> float:
        seen.append([str(c) for c in codecs])
        time.sleep(1.0)  # a cold compile, as far as the trainer can tell
        return 1.0

    monkeypatch.setattr(warm_module, "warm", slow_warm)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    argv = flags(tmp_path / "cache", out, "--max-steps", "3", "--parallel", "ddp",
                 "--codec", "qsgd | eg", "--codec-groups", "*norm*=int8")
    assert main(["train", *argv]) == 0
    record = last_result(out)
    assert "qsgd | eg" in seen[0] and "int8" in seen[0]
    assert record["compile_s"] == 1.0 and record["train_time_s"] < 1.0, record


def test_every_chain_covers_every_compressor_and_lossless_stage() -> None:
    from gradzip.aggregation.warm import every_chain, warm
    from gradzip.codecs import Compressor, LosslessCoder, registered

    chains = every_chain()
    stages = registered()
    assert "qsgd | eg" in chains and "int8 | ans" in chains
    for name, cls in stages.items():
        if issubclass(cls, Compressor | LosslessCoder):
            assert name in chains
    from gradzip.codecs import Codec

    assert warm(["int8 | eg", "none", Codec.from_spec("qsgd")]) >= 0.0


def test_analyze_draws_its_bar_once_the_total_is_known(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo log used to show `analyze: 0bucket [00:00, ?bucket/s]` before the bar."""
    import numpy as np

    np.save(tmp_path / "g.npy", np.random.default_rng(0).standard_normal(4096)
            .astype(np.float32))
    assert main(["analyze", str(tmp_path / "g.npy"), "--workers", "1", "--codecs", "none"]) == 0
    err = capsys.readouterr().err
    assert "0bucket [" not in err and "1/1" in err, err
