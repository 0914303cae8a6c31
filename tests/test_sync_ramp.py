"""A ramp of DiLoCo's H (issue 43 item 3): synchronize every step at first, then at
intervals that grow with the step they start at, up to ``sync_every``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradzip.comm.outer import ramped_sync


def _syncs(upto: int, sync_every: int, ramp: int) -> list[int]:
    return [n for n in range(1, upto + 1) if ramped_sync(n, sync_every, ramp)]


def test_h_ramps_from_one_to_sync_every() -> None:
    syncs = _syncs(700, 32, 500)
    intervals = [b - a for a, b in zip([0, *syncs], syncs, strict=False)]
    assert syncs[:3] == [1, 2, 3]  # every step at first, as DDP
    assert intervals == sorted(intervals)  # never shorter than the one before
    assert max(intervals) == 32 and intervals[-1] == 32
    settled = next(s for s in syncs if s >= 500)
    assert all(b - a == 32 for a, b in zip(syncs, syncs[1:], strict=False) if a >= settled)
    assert _syncs(60, 10, 30) == [1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 28, 37, 47, 57]


def test_a_ramp_is_a_method_option_and_a_train_flag() -> None:
    from gradzip.comm.method import parse_method

    method = parse_method("diloco(sync_every=32, ramp=500) | int8")
    assert "ramp=500" in str(method) and parse_method(str(method)) == method
    flags = method.train_flags()
    assert flags[flags.index("--sync-ramp") + 1] == "500"
    assert method.options()["sync_ramp"] == 500
    with pytest.raises(ValueError, match="one fragment and no overlap"):
        parse_method("diloco(sync_every=32, fragments=2, ramp=100) | int8")
    with pytest.raises(ValueError, match=">= 0"):
        parse_method("diloco(ramp=-1)")


def test_a_run_synchronizes_on_the_ramp(tmp_path: Path) -> None:
    from train_helpers import flags, last_result

    from gradzip.cli import main

    out = tmp_path / "run"
    assert main(["train", "--parallel", "ddp", "--outer", "diloco", "--outer-codec", "int8",
                 "--sync-every", "10", "--sync-ramp", "30",
                 *flags(tmp_path / "cache", out, "--max-steps", "60")]) == 0
    record = last_result(out)
    assert record["outer"]["syncs"] == len(_syncs(60, 10, 30)) == 14
    assert "ramp=30" in record["method"]


def test_a_ramp_without_a_local_update_method_is_refused(tmp_path: Path, capsys: Any) -> None:
    from train_helpers import flags

    from gradzip.cli import main

    code = main(["train", "--parallel", "ddp", "--sync-ramp", "10", "--print-config",
                 *flags(tmp_path / "cache", tmp_path / "out", "--max-steps", "2")])
    assert code != 0 and "--sync-ramp ramps the H" in capsys.readouterr().err
