"""Issue 10 end to end on tiny runs: a resume keeps its lr schedule unless told otherwise,
and a run directory's config.json works from any directory (resume, eval)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from train_helpers import flags

from gradzip.cli import main
from gradzip.train.config import JobConfig


def logged_lr(run_dir: Path) -> dict[int, float]:
    """optim/lr by step, from rank 0's JSON log lines."""
    rows = [json.loads(line) for line in (run_dir / "logs" / "rank0.log").read_text().splitlines()
            if line.startswith("{")]
    return {r["step"]: r["optim/lr"] for r in rows if "optim/lr" in r}


def test_resume_keeps_the_schedule_unless_told(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out, cache = tmp_path / "run", tmp_path / "cache"
    tiny = ["--warmup-steps", "2", "--eval-every", "0"]
    assert main(["train", *flags(cache, out, "--max-steps", "4", *tiny)]) == 0
    saved = (out / "config.json").read_text()
    capsys.readouterr()
    # more steps would restart the cosine from the floor: refused, nothing touched
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "6"]) == 2
    err = capsys.readouterr().err
    assert "from step 4 to step 6" in err and "--decay-steps 4" in err
    assert (out / "config.json").read_text() == saved
    # the advice: keep the horizon, and the added steps train at the floor
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "6",
                 "--decay-steps", "4"]) == 0
    cfg = JobConfig.from_dict(json.loads(saved))
    floor = cfg.optim.lr * cfg.optim.min_lr_ratio
    lr = logged_lr(out)
    assert lr[4] == pytest.approx(floor) and lr[6] == pytest.approx(floor)


def corpus(path: Path) -> None:
    """JSON Lines of 20-line chunks of argparse.py: many records for the hash split."""
    lines = Path(argparse.__file__).read_text().splitlines()
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"text": "\n".join(lines[i:i + 20])}) + "\n"
                            for i in range(0, len(lines), 20)))


def test_run_dir_works_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    corpus(here / "data" / "corpus.jsonl")
    elsewhere.mkdir()
    monkeypatch.chdir(here)
    assert main(["train", *flags(Path("cache"), Path("run"), "--dataset", "data/corpus.jsonl",
                                 "--max-steps", "2", "--decay-steps", "4",
                                 "--eval-every", "0")]) == 0
    saved = json.loads((here / "run" / "config.json").read_text())
    assert saved["data"]["sources"] == [str(here / "data" / "corpus.jsonl")]
    assert saved["data"]["cache_dir"] == str(here / "cache")
    assert saved["run"]["out"] == str(here / "run")
    cached = sorted((here / "cache").iterdir())

    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", "--out", str(here / "run"), "--max-steps", "4"]) == 0
    assert sorted((here / "cache").iterdir()) == cached  # the same cache, no rebuild
    assert main(["eval", "--ckpt", str(here / "run"), "--steps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["val_loss"] > 0
    # eval keys its data by the run's tokenizer.json (a manifest of its own), same tokens
    assert sorted((here / "cache").glob("tokens-*")) == [p for p in cached
                                                         if p.name.startswith("tokens-")]
    assert list(elsewhere.iterdir()) == []  # nothing built or written here
