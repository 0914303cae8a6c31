"""Shared by the trainer tests: a tiny, fast run configuration on real (cached) data."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Options every trainer test uses: the tiny model on 40k tokens of the standard library
# (tokenizer training and tokenization take about a second, then come from the cache).
DATA_FLAGS = ["--model", "tiny", "--dataset", "stdlib", "--max-tokens", "40000",
              "--vocab-size", "384", "--batch-size", "4", "--seq-len", "32",
              "--eval-steps", "2", "--log-every", "5", "--no-progress", "--no-tensorboard",
              "--threads", "1"]


def launch(nproc: int = 2) -> list[str]:
    """``torchrun --standalone --nproc_per_node N`` as this interpreter runs it (add
    ``-m gradzip train ...`` or a script)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc)]


def flags(cache: Path, out: Path, *extra: str) -> list[str]:
    return [*DATA_FLAGS, "--cache-dir", str(cache), "--out", str(out), *extra]


def last_result(run_dir: Path) -> dict[str, Any]:
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def default_sigint() -> None:
    """``preexec_fn`` of a child that must see Ctrl-C as in a terminal: a test run started
    as a background job of a non-interactive shell has SIGINT ignored, which children
    would inherit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
