"""Untrusted payload bytes never crash, hang or exhaust memory, and fail as PayloadError.

``tests/fuzz_payloads.py`` runs in a subprocess with its address space capped (what it
uses once every decoder is warm, plus 512 MiB) and decodes ~1,500 mutated payloads of
every registered stage as a receiver would (with the shape it expects). The test fails
on a signal (a segfault), a hang (the timeout), an allocation beyond the cap
(``MemoryError``), or any exception other than ``PayloadError``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("fuzz_payloads.py")


def test_mutated_payloads_of_every_stage_fail_cleanly() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "0", "12", "30"],
                          capture_output=True, text=True, timeout=240)
    lines = proc.stdout.splitlines()
    last = lines[-1] if lines else "(nothing)"
    assert proc.returncode == 0, (
        f"the decoding process died (exit {proc.returncode}) after: {last}\n{proc.stderr}")
    assert lines and lines[-1] == "done", f"stopped after: {last}"
    bad = [line for line in lines if line.startswith("BAD")]
    assert not bad, "\n".join(bad[:20])
    cases = [line for line in lines if line.startswith("ok")]
    assert len(cases) >= 1000 and any(": decoded" in c for c in cases)
    assert sum("PayloadError" in c for c in cases) >= 500  # most mutations are caught
