"""``gradzip archive``: pack .pt bucket directories (also while they grow), ls, export,
verify, repair."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from archive_helpers import damage_root_heap

from gradzip.capture import Archive
from gradzip.capture.convert import pack_directory
from gradzip.cli import main


def _bucket(rank: int, step: int, bucket: int, dtype: torch.dtype = torch.float16) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + bucket)
    return {"model.layers.0.mlp.w": torch.randn(16, 8, generator=g).to(dtype),
            "model.layers.0.mlp.b": torch.randn(8, generator=g).to(dtype)}


def _write_pt(directory: Path, rank: int, step: int, bucket: int, **kw: object) -> Path:
    path = directory / f"R_{rank}_E_0_S_{step}_B_{bucket}.pt"
    torch.save(_bucket(rank, step, bucket, **kw), path)  # type: ignore[arg-type]
    return path


def _same(archive: Archive, rank: int, step: int, bucket: int,
          dtype: torch.dtype = torch.float16) -> bool:
    want = torch.cat([t.reshape(-1) for t in _bucket(rank, step, bucket, dtype).values()])
    got = torch.from_numpy(archive.bucket(rank, 0, step, bucket))
    got = got.view(torch.bfloat16) if dtype == torch.bfloat16 else got
    return torch.equal(got, want)


@pytest.mark.parametrize("delete", [False, True])
def test_pack_a_directory_keeps_or_deletes_sources(tmp_path: Path, delete: bool) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    files = [_write_pt(src, r, s, b) for r in (0, 1) for s in (1, 2) for b in (0, 1)]
    (src / "notes.txt").write_text("not a bucket")
    args = ["archive", "pack", str(src), "--out", str(tmp_path / "a"), "--workers", "2"]
    assert main(args + (["--delete-source"] if delete else [])) == 0
    assert all(f.exists() != delete for f in files) and (src / "notes.txt").exists()
    with Archive(tmp_path / "a") as a:
        assert len(a.steps()) == 4 and all(_same(a, r, s, b) for r in (0, 1) for s in (1, 2)
                                           for b in (0, 1))
        [w] = a.entries(rank=1, step=2, bucket=1, name="model.layers.0.mlp.w")
        assert w.shape == (16, 8) and w.dtype == "float16"
    if not delete:  # a second run packs nothing twice
        report = pack_directory(src, tmp_path / "a", workers=1)
        assert (report.packed, report.present) == (0, 8)
    assert main(["archive", "verify", str(tmp_path / "a")]) == 0


def test_watch_packs_files_as_they_appear(tmp_path: Path) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    _write_pt(src, 0, 0, 0, dtype=torch.bfloat16)

    def produce() -> None:
        for step in range(1, 4):
            time.sleep(0.4)
            _write_pt(src, 0, step, 0, dtype=torch.bfloat16)

    producer = threading.Thread(target=produce)
    producer.start()
    report = pack_directory(src, tmp_path / "a", workers=2, watch=True, poll_s=0.2,
                            idle_exit_s=1.5, delete_source=True)
    producer.join()
    assert report.packed == 4 and report.failed == {} and not list(src.glob("*.pt"))
    with Archive(tmp_path / "a") as a:
        assert all(_same(a, 0, s, 0, torch.bfloat16) for s in range(4))


def test_a_bad_file_is_reported_and_the_rest_packed(tmp_path: Path) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    _write_pt(src, 0, 0, 0)
    (src / "R_0_E_0_S_1_B_0.pt").write_bytes(b"not a torch file")
    report = pack_directory(src, tmp_path / "a", workers=1)
    assert report.packed == 1 and list(report.failed) == [str(src / "R_0_E_0_S_1_B_0.pt")]


def test_ls_export_and_verify_a_corrupt_pack(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    _write_pt(src, 0, 5, 2, dtype=torch.float32)
    archive = tmp_path / "a"
    assert main(["archive", "pack", str(src), "--out", str(archive), "--workers", "1"]) == 0
    assert main(["archive", "ls", str(archive), "--tensors", "--name", "*mlp.b"]) == 0
    assert "model.layers.0.mlp.b" in capsys.readouterr().out
    out = tmp_path / "b.npy"
    assert main(["archive", "export", str(archive), "--step", "5", "--bucket", "2",
                 "--out", str(out)]) == 0
    want = torch.cat([t.reshape(-1) for t in _bucket(0, 5, 2, torch.float32).values()])
    np.testing.assert_array_equal(np.load(out), want.numpy())
    with Archive(archive) as a:
        [b] = a.entries(name="model.layers.0.mlp.b")
    with open(archive / b.pack, "r+b") as f:
        f.seek(b.file_offset)
        f.write(b"\x00\x00\x80\x7f")  # an inf where a value was
    capsys.readouterr()
    assert main(["archive", "verify", str(archive)]) == 1
    err = capsys.readouterr()
    assert f"{b.pack}:/R_0_E_0_S_5/B_2/model.layers.0.mlp.b: checksum mismatch" in err.err
    assert "1 problem(s)" in err.out
    assert main(["archive", "ls", str(tmp_path / "nothing")]) == 2


def test_a_fresh_pack_left_by_a_crash_is_a_note(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A rank killed while writing the first step of a new pack leaves a file HDF5 cannot
    read and that no committed step uses: verify notes it and passes (exit 0)."""
    src = tmp_path / "pt"
    src.mkdir()
    _write_pt(src, 0, 5, 2)
    archive = tmp_path / "a"
    assert main(["archive", "pack", str(src), "--out", str(archive), "--workers", "1"]) == 0
    with Archive(archive) as a:
        [entry, *_] = list(a)
    torn = archive / Path(entry.pack).parent / "pack_99.h5"
    torn.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(200))  # a superblock, then nothing
    capsys.readouterr()
    assert main(["archive", "verify", str(archive)]) == 0
    out = capsys.readouterr()
    assert "pack_99.h5" in out.out + out.err and "never completed" in out.out + out.err


def test_repair_rewrites_a_pack_a_kill_damaged_and_refuses_wrong_bytes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    _write_pt(src, 0, 5, 2)
    archive = tmp_path / "a"
    assert main(["archive", "pack", str(src), "--out", str(archive), "--workers", "1"]) == 0
    [pack] = archive.glob("*/pack_*.h5")
    damage_root_heap(pack)
    capsys.readouterr()
    assert main(["archive", "verify", str(archive)]) == 0
    assert "gradzip archive repair" in capsys.readouterr().out
    assert main(["archive", "repair", str(archive)]) == 0
    assert "rewrote 1 pack(s)" in capsys.readouterr().out
    assert main(["archive", "repair", str(archive)]) == 0
    assert "nothing to rewrite" in capsys.readouterr().out
    with Archive(archive) as a:
        assert _same(a, 0, 5, 2)
        [entry, *_] = list(a)
    [pack] = archive.glob("*/pack_*.h5")
    damage_root_heap(pack)
    with open(pack, "r+b") as f:
        f.seek(entry.file_offset)
        f.write(b"\x00\x7c")  # an fp16 inf where a value was
    assert main(["archive", "repair", str(archive)]) == 1
    assert "cannot mend" in capsys.readouterr().err and pack.exists()
    somewhere = tmp_path / "not-an-archive"
    somewhere.mkdir()
    assert main(["archive", "repair", str(somewhere)]) == 2
    assert "no capture archive here" in capsys.readouterr().err
    assert list(somewhere.iterdir()) == []  # refused before anything was written


def test_analyze_skips_and_reports_a_bucket_whose_bytes_changed(tmp_path: Path) -> None:
    from gradzip.analyze.runner import run_analysis

    src = tmp_path / "pt"
    src.mkdir()
    for step in (1, 2):
        _write_pt(src, 0, step, 0, dtype=torch.float32)
    archive = tmp_path / "a"
    assert main(["archive", "pack", str(src), "--out", str(archive), "--workers", "1"]) == 0
    with Archive(archive) as a:
        [bad] = a.entries(step=2, name="model.layers.0.mlp.w")
    with open(archive / bad.pack, "r+b") as f:
        f.seek(bad.file_offset)
        f.write(bytes(range(16)))  # 16 bytes flipped
    outcome = run_analysis(archive, tmp_path / "out", workers=1)
    assert outcome.analyzed == 1 and list(outcome.failed) == ["R0_E0_S2_B0"]
    assert "checksum mismatch" in outcome.failed["R0_E0_S2_B0"]


def test_a_closed_pipe_ends_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gradzip archive ls DIR | head`: the reader closing the pipe is exit 141 (as
    SIGPIPE), with no BrokenPipeError traceback."""
    import argparse

    import gradzip.cli as cli

    def closed(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    parser = cli.build_parser()
    real = parser.parse_known_args

    def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
        args, extras = real(argv)
        args.func = closed
        return args, extras

    monkeypatch.setattr(parser, "parse_known_args", parse)
    monkeypatch.setattr(cli, "build_parser", lambda **_: parser)
    dup2 = []
    monkeypatch.setattr(cli.os, "dup2", lambda fd, fd2: dup2.append(fd2))
    assert cli.main(["archive", "ls", "anything"]) == 141
    assert dup2 == [sys.stdout.fileno()]


def test_an_unknown_option_points_at_the_commands_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["archive", "verify", "somewhere", "--nope"])
    assert done.value.code == 2
    assert "unrecognized arguments: --nope (see gradzip archive verify --help)" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("argv", [["archive", "verify"], ["archive", "repair"],
                                  ["archive", "ls"], ["analyze"],
                                  ["codecs", "list"]])
def test_every_command_takes_debug_and_documents_its_options(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help wraps lines
    assert "--debug" in text
    if argv == ["archive", "verify"]:
        assert "Exit status: 0" in text
    if argv == ["archive", "ls"]:
        assert "the training step" in text


def test_pack_refuses_a_directory_of_other_names(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Files not named as capture buckets are named as skipped; with nothing to pack the
    command fails and leaves no empty archive behind."""
    src = tmp_path / "pt"
    src.mkdir()
    torch.save(_bucket(0, 1, 0), src / "step1.pt")
    out = tmp_path / "a"
    assert main(["archive", "pack", str(src), "--out", str(out), "--workers", "1"]) == 2
    assert "step1.pt" in capsys.readouterr().err and not out.exists()
    _write_pt(src, 0, 1, 0)  # one good file beside it: packed, the other named
    assert main(["archive", "pack", str(src), "--out", str(out), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert f"skipped {src / 'step1.pt'}: not named R_{{rank}}_E_{{epoch}}_S_{{step}}" \
        in captured.err and "1 skipped" in captured.out


def test_export_by_name_needs_no_bucket_and_verify_of_nothing_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    _write_pt(src, 0, 1, 0, dtype=torch.float32)
    pack_directory(src, tmp_path / "a", workers=1)
    out = tmp_path / "w.npy"
    assert main(["archive", "export", str(tmp_path / "a"), "--name", "model.layers.0.mlp.w",
                 "--out", str(out)]) == 0
    assert np.load(out).shape == (16, 8)
    assert main(["archive", "export", str(tmp_path / "a"), "--out", str(out)]) == 2
    assert "give --step and --bucket (one bucket), or --name" in capsys.readouterr().err
    missing = tmp_path / "nosuch"
    assert main(["archive", "verify", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count(str(missing)) == 1, err
