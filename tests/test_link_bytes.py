"""``bytes_wire`` against the kernel: 4 gloo ranks in a fresh network namespace.

Inside the namespace ``lo``'s tx counter sees every byte every rank sends, so over
the training steps (setup traffic and the closing barrier measured and subtracted,
see ``gradzip.bench.linkcount``) it must agree with the sum over ranks of the
reported ``bytes_wire``, one case per aggregation path. The naive figure
(``bytes_handed``) must not: that is what shows the counter can tell them apart.
"""

from __future__ import annotations

import json
import sys

import pytest

from gradzip.comm.netns import netns_available, run_in_netns

pytestmark = pytest.mark.dist

OK, WHY = netns_available()
RANKS = 4
STEPS = 6
TOLERANCE = 0.10  # the bar; gloo's per-call transport is in the model

ALL_REDUCE = "none"
ALL_GATHER = "ef | topk(ratio=0.01)"
MULTI_ROUND = "ef | powersgd(rank=2)"
REDUCE_SCATTER = "fsdp2: none"
DILOCO = "diloco(sync_every=2) | int8"  # pseudo-gradients through a codec every 2 steps

@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """One namespace, one group of ranks, every case in turn: {case: row}."""
    if not OK:
        pytest.skip(f"no network namespace here: {WHY}")
    cases = [ALL_REDUCE, ALL_GATHER, MULTI_ROUND, REDUCE_SCATTER, DILOCO]
    argv = [sys.executable, "-m", "gradzip.bench.linkcount", "--ranks", str(RANKS),
            "--steps", str(STEPS)]
    for case in cases:
        argv += ["--case", case]
    proc = run_in_netns(argv, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"linkcount exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[row["case"]] = row
    assert sorted(rows) == sorted(cases), proc.stdout
    return rows


@pytest.mark.parametrize("case", [
    ALL_REDUCE,
    ALL_GATHER,
    MULTI_ROUND,
    REDUCE_SCATTER,
    DILOCO,
])
def test_kernel_bytes_match_bytes_wire(measured: dict[str, dict], case: str) -> None:
    row = measured[case]
    assert row["world"] == RANKS and row["steps"] == STEPS
    assert row["wire"] > 0 and row["kernel"] > 0
    # FSDP2's parameter all-gathers are not gradient traffic; linkcount models them
    expected = row["wire"] + row["other_model"]
    ratio = row["kernel"] / expected
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{case}: kernel {row['kernel']:.0f} B vs model {expected} B "
        f"(bytes_wire {row['wire']} + other {row['other_model']}), ratio {ratio:.3f}; "
        f"by op {row['by_op']}, calls {row['calls_by_op']}"
    )


def test_handed_bytes_are_not_wire_bytes(measured: dict[str, dict]) -> None:
    """The counter tells the link model from the naive figure: an all-gather's input
    crosses W-1 links, an all-reduce's 2(W-1)/W x its size."""
    for case in (ALL_REDUCE, ALL_GATHER):
        row = measured[case]
        assert abs(row["kernel"] / row["handed"] - 1) > 3 * TOLERANCE, row
