"""``gradzip compare``: run the matrix over a real rate-limited link, then the report.

Each run's ranks start inside a fresh network namespace whose loopback carries a
token-bucket qdisc (``gradzip.comm.netns``): one link shared by all ranks, so with W
ranks sending at once each gets about RATE/W — not a NIC per node, and every record
and the report say so. The rate the link delivers is measured once per rate
(``linkrate.py``) and recorded. Where namespaces or ``tc`` are unavailable the runs go
over the unshaped loopback and every record is marked ``shaped: false``.

Records: each run's ``results.jsonl`` line plus a ``compare`` object (method, seed,
ranks, rate, link, shaped, achieved rate, the link model in words) is appended to
``OUT/results.jsonl`` as soon as the run ends (nothing is lost if a later run fails);
at the end the file is rewritten (write, then rename) with each run's
``time_to_target_s`` and ``quality_at_time`` from the report's one evaluation schedule,
and ``OUT/report.md`` with its plots is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradzip.compare.matrix import Run

SHARED_LINK = ("one token bucket on the loopback of a network namespace, shared by all "
               "ranks: with W ranks sending at once each gets about RATE/W (not a NIC per "
               "node)")


class RunFailed(RuntimeError):
    """A training run of the matrix exited with an error."""


@dataclass
class Link:
    """How the runs of one rate reach each other."""

    rate: str | None
    shaped: bool
    achieved_bits_per_s: float | None
    why_unshaped: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"rate": self.rate, "shaped": self.shaped,
                "link": "shared" if self.shaped else "unshaped",
                "achieved_rate_bits_per_s": self.achieved_bits_per_s,
                "link_model": (SHARED_LINK if self.shaped else
                               f"unshaped loopback ({self.why_unshaped or 'no rate asked'}); "
                               "not representative of a slow link")}


def open_link(rate: str | None) -> Link:
    """The link for ``rate``: shaped in a namespace and measured, or why it cannot be."""
    from gradzip.comm.netns import NetnsError, netns_available, rate_bits_per_second, run_in_netns

    if rate is None:
        return Link(None, False, None, "unlimited loopback asked for")
    ok, why = netns_available(shaping=True)
    if not ok:
        return Link(rate, False, None, why)
    argv = [sys.executable, "-m", "gradzip.compare.linkrate", "--nominal",
            str(rate_bits_per_second(rate))]
    try:
        proc = run_in_netns(argv, rate=rate, timeout=120.0)
    except NetnsError as e:
        return Link(rate, False, None, str(e))
    if proc.returncode != 0:
        return Link(rate, False, None, f"link probe failed: {proc.stderr[-300:]}")
    return Link(rate, True, float(json.loads(proc.stdout.strip().splitlines()[-1])
                                  ["bits_per_s"]))


def execute(run: Run, link: Link, out: Path, cache: Path,
            on_line: Callable[[str], None] | None = None,
            timeout: float = 4 * 3600.0) -> dict[str, Any]:
    """Train one run (shaped when the link is) and return its annotated record."""
    from gradzip.comm.netns import run_in_netns

    run_dir = out / "runs" / run.slug
    argv = run.argv(run_dir, cache)
    if link.shaped:
        proc = run_in_netns(argv, rate=link.rate, timeout=timeout, on_line=on_line)
    else:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RunFailed(f"{run.method} (seed {run.seed}, {run.ranks} ranks, "
                        f"{run.rate or 'unlimited'}) failed with exit status "
                        f"{proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    record["compare"] = {"method": run.method, "seed": run.seed, "ranks": run.ranks,
                         **link.describe()}
    return record


def append_record(path: Path, record: dict[str, Any]) -> None:
    from gradzip.train.metrics import append_results

    append_results(record, [path])


def add_race_figures(records: list[dict[str, Any]], budget_s: float | None) -> None:
    """Each record's time_to_target_s and quality_at_time, from the report's summary
    (the target: the uncompressed baseline's mean final validation loss x 1.01)."""
    from gradzip.compare.summary import loss_at_time, summarize, time_to_target

    for setting in summarize(records, budget_s):
        for method in setting.methods:
            for run in method.runs:
                c = run.record["compare"]
                c["target_val_loss"] = setting.target
                c["time_to_target_s"] = (time_to_target(run, setting.target)
                                         if setting.target is not None else None)
                c["quality_budget_s"] = setting.budget_s
                c["quality_at_time"] = (loss_at_time(run, setting.budget_s)
                                        if setting.budget_s is not None else None)


def rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records`` (write a temporary file, then rename)."""
    from gradzip.train.metrics import append_results

    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    for record in records:
        append_results(record, [tmp])
    tmp.replace(path)
