"""``gradzip analyze``: measures against plain references, the first study's column,
every column of a captured archive, resume, and a corrupt bucket skipped."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gradzip.analyze.measures import analyze_values, ggd_shape, quantize
from gradzip.analyze.runner import Options, run_analysis
from gradzip.cli import main


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _plain_entropy(symbols: np.ndarray) -> float:
    """Order-0 entropy, symbol by symbol (the reference)."""
    counts: dict[int, int] = {}
    for s in symbols.tolist():
        counts[s] = counts.get(s, 0) + 1
    n = len(symbols)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def _plain_eg_sign_bits(symbols: np.ndarray, k: int) -> int:
    """Exp-Golomb order k of |v| plus a sign bit for non-zero values, value by value."""
    total = 0
    for v in symbols.tolist():
        u = abs(v) + (1 << k)
        total += 2 * (u.bit_length() - 1) - k + 1 + (v != 0)
    return total


def test_known_distributions_give_known_entropies_and_eg_lengths() -> None:
    rng = np.random.default_rng(0)
    x = rng.laplace(0, 2e-6, 20000).astype(np.float32)
    row = analyze_values(x, "float32", slice_elems=4096)  # five slices, merged
    q = quantize(x, "fixed")
    assert row["fixed_entropy_bits"] == pytest.approx(_plain_entropy(q), abs=1e-9)
    k = row["fixed_eg_sign_k"]
    assert row["fixed_eg_sign_bits"] * x.size == _plain_eg_sign_bits(q, k)
    assert all(row["fixed_eg_sign_bits"] * x.size <= _plain_eg_sign_bits(q, j)
               for j in range(0, 12))  # k is the best order
    # ANS pays a table per slice: 5 slices of 4096 values cost it ~8%
    assert row["fixed_eg_eta"] <= 1.0 and 0.85 < row["fixed_ans_eta"] <= 1.0
    u = rng.integers(-127, 128, 65536)
    u[::256] = 127  # every block's abs-max is 127: int8 quantization returns u itself
    uniform = analyze_values((u / 127).astype(np.float32), "float32")
    assert uniform["int8_entropy_bits"] == pytest.approx(_plain_entropy(u), abs=1e-9)
    assert uniform["int8_entropy_bits"] == pytest.approx(math.log2(255), abs=0.02)
    assert ggd_shape(math.sqrt(2 / math.pi), 1.0) == pytest.approx(2.0, rel=1e-6)  # Gauss
    assert ggd_shape(1.0, 2.0) == pytest.approx(1.0, rel=1e-6)  # Laplace
    assert row["ggd_shape"] == pytest.approx(1.0, abs=0.1)
    assert row["kurtosis"] == pytest.approx(3.0, abs=0.6)  # Laplace's excess kurtosis


def _first_study(values: torch.Tensor) -> tuple[int, float]:
    """The published method, written independently: torch, value by value sums."""
    q = torch.round(values.float() * 1e6).to(torch.int64)
    bits = 0
    for v in q.tolist():
        bits += 2 * int(math.floor(math.log2(abs(v) + 1))) + 1 + 1
    nbytes = bits // 8
    return nbytes, 1 - nbytes / (2 * q.numel())


def test_first_study_column_equals_an_independent_computation(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    bucket = {"a.weight": (torch.randn(40, 30, generator=g) * 3e-5).half(),
              "a.bias": (torch.randn(30, generator=g) * 1e-4).half()}
    torch.save(bucket, tmp_path / "R_0_E_0_S_7_B_2.pt")
    assert main(["analyze", str(tmp_path), "--out", str(tmp_path / "out"), "--workers", "1",
                 "--codecs", "none", "--no-progress"]) == 0
    [row] = _rows(tmp_path / "out" / "buckets.csv")
    flat = torch.cat([t.reshape(-1) for t in bucket.values()])
    nbytes, saving = _first_study(flat)
    assert int(row["first_study_bytes"]) == nbytes
    assert float(row["first_study_saving_vs_fp16"]) == pytest.approx(saving, abs=1e-12)
    assert (row["step"], row["bucket"], row["dtype"]) == ("7", "2", "float16")


@pytest.mark.dist
def test_a_captured_two_rank_archive_gives_every_column_and_resumes(tmp_path: Path) -> None:
    from test_capture import _captured_and_plain

    from gradzip.comm.launch import run_ranks

    archive = tmp_path / "grads"
    run_ranks(_captured_and_plain, 2, str(archive), "none")
    out = tmp_path / "analysis"
    outcome = run_analysis(archive, out, workers=2,
                           options=Options(per_param=True, codecs=("int8", "topk(ratio=0.1)")))
    assert not outcome.failed and outcome.analyzed > 0
    rows = _rows(out / "buckets.csv")
    assert {r["rank"] for r in rows} == {"0", "1"}
    for column in ("mean", "std", "absmax", "kurtosis", "zero_fraction", "ggd_shape",
                   "raw_deflate_ratio", "raw_zstd_ratio", "raw_lz4_ratio", "h5_deflate_ratio",
                   "lossless_ratio", "exponent_entropy_bits", "mantissa0_entropy_bits",
                   "int8_entropy_bits", "int8_eg_zigzag_bits", "int8_eg_rank_bits",
                   "int8_ans_bits", "int8_zstd_bits", "fixed_eg_eta", "fixed_misordered",
                   "first_study_saving_vs_fp16", "int8: link_bytes", "int8: mean_rel_error",
                   "topk(ratio=0.1): cosine", "deflate_impl"):
        assert all(r[column] != "" for r in rows), column
    assert rows[0]["whatif_ranks"] == "2"  # the captured ranks of the step, together
    assert all(float(r["kurtosis"]) > -3 for r in rows)  # plain numbers in the CSV
    assert float(rows[0]["int8: ratio_fp32"]) > 3
    assert (out / "params.csv").is_file() and (out / "summary.md").exists() is False
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow.parquet as pq

        assert pq.read_table(out / "buckets.parquet").num_rows == len(rows)
    again = run_analysis(archive, out, workers=1, options=Options(per_param=True))
    assert again.analyzed == 0 and again.resumed == len(rows)
    assert main(["analyze", str(archive), "--out", str(out), "--no-progress"]) == 0
    summary = (out / "summary.md").read_text()
    assert "Per metric" in summary and "## What if each codec sent these gradients" in summary
    assert "| `int8` |" in summary and "| `topk(ratio=0.1)` |" in summary
    assert "**first study**" in summary and "**field-entropy bound**" in summary
    assert list(out.glob("*.png"))


def test_a_torn_row_is_redone_and_a_corrupt_bucket_is_skipped(tmp_path: Path) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    for step in (1, 2):
        torch.save({"w": torch.randn(64) * 1e-3}, src / f"R_0_E_0_S_{step}_B_0.pt")
    (src / "R_0_E_0_S_3_B_0.pt").write_bytes(b"garbage")
    out = tmp_path / "out"
    outcome = run_analysis(src, out, options=Options())
    assert outcome.analyzed == 2 and list(outcome.failed) == ["R0_E0_S3_B0"]
    assert "R0_E0_S3_B0" in (out / "errors.csv").read_text()
    lines = (out / "buckets.csv").read_text().splitlines()
    (out / "buckets.csv").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # torn
    again = run_analysis(src, out, options=Options())
    assert again.analyzed == 1 and again.resumed == 1  # the torn row is done again
    assert len(_rows(out / "buckets.csv")) == 2


def test_the_what_if_runs_on_steps_spread_over_the_source(tmp_path: Path) -> None:
    from gradzip.analyze.runner import _groups, whatif_groups
    from gradzip.analyze.sources import find_buckets

    src = tmp_path / "pt"
    src.mkdir()
    for step in range(1, 12):
        torch.save({"w": torch.randn(300) * 1e-3}, src / f"R_0_E_0_S_{step}_B_0.pt")
    groups = _groups(find_buckets(src))
    steps = lambda n: sorted(groups[i][0].step for i in whatif_groups(groups, n))  # noqa: E731
    assert steps(3) == [1, 6, 11] and steps(1) == [11] and steps(0) == []
    assert steps(None) == steps(40) == list(range(1, 12))
    out = tmp_path / "out"
    # the first rows written have no what-if columns: the file is widened, nothing dropped
    outcome = run_analysis(src, out, options=Options(codecs=("int8",), whatif_steps=2))
    assert outcome.analyzed == 11
    rows = {int(r["step"]): r for r in _rows(out / "buckets.csv")}
    assert {s for s, r in rows.items() if r.get("int8: link_bytes")} == {1, 11}
    assert all(r["raw_zstd_ratio"] for r in rows.values())


def test_whatif_steps_must_be_a_count_or_all(tmp_path: Path, capsys: pytest.CaptureFixture
                                             ) -> None:
    assert main(["analyze", str(tmp_path), "--whatif-steps", "some", "--no-progress"]) != 0
    assert "--whatif-steps must be a number >= 0 or 'all'" in capsys.readouterr().err


def test_histograms_are_titled_and_count_in_whole_buckets() -> None:
    import numpy as np

    from gradzip.analyze.summary import histogram

    fig = histogram(np.array([1.1, 1.2, 1.2, 1.3]), "lossless_ratio")
    [ax] = fig.axes
    assert "4 buckets" in ax.get_title() and "lossless" in ax.get_title()
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_yticks()), ax.get_yticks()


def test_pt_buckets_of_two_ranks_give_the_what_if_of_their_packed_archive(
        tmp_path: Path) -> None:
    """The seeds' capture format (``R_{r}_E_{e}_S_{s}_B_{b}.pt``) holds several ranks'
    buckets: the what-if takes the mean over them, exactly as from the HDF5 archive of
    the same gradients."""
    from test_archive_cli import _write_pt

    from gradzip.analyze.summary import write_summary
    from gradzip.capture.convert import pack_directory

    src = tmp_path / "pt"
    src.mkdir()
    for rank in (0, 1):
        for step in (1, 2):
            _write_pt(src, rank, step, 0, dtype=torch.float32)
    pack_directory(src, tmp_path / "archive", workers=1)
    options = Options(codecs=("int8", "topk(ratio=0.1)"))
    rows = {}
    for name, source in (("pt", src), ("h5", tmp_path / "archive")):
        assert not run_analysis(source, tmp_path / name, options=options).failed
        rows[name] = {r["key"]: {k: v for k, v in r.items() if k != "source"}
                      for r in _rows(tmp_path / name / "buckets.csv")}
    assert rows["pt"] == rows["h5"] and len(rows["pt"]) == 4
    assert {r["whatif_ranks"] for r in rows["pt"].values()} == {"2"}
    assert any(r["int8: mean_rel_error"] != r["int8: rel_error"] for r in rows["pt"].values())
    summary = write_summary(tmp_path / "pt").read_text()
    assert f"Source: {src} (4 files), ranks 0, 1, 2 step(s)." in summary


def test_a_directory_without_capture_names_is_refused(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "pt"
    src.mkdir()
    torch.save({"w": torch.randn(8)}, src / "grads_step1.pt")
    assert main(["analyze", str(src), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no .pt file is named R_{rank}_E_{epoch}_S_{step}_B_{bucket}.pt" in err
    assert "grads_step1.pt" in err and not (tmp_path / "out").exists()
