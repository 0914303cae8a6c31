"""``gradzip compare``: run the matrix over a real rate-limited link, then the report.

Each run's ranks start inside fresh network namespaces. The shared link (default):
one namespace whose loopback carries a token-bucket qdisc (``gradzip.comm.netns``),
one link shared by all ranks, so with W ranks sending at once each gets about
RATE/W. Per-rank links (``--link per-rank``): one namespace per rank behind its own
veth link shaped both ways (``gradzip.comm.rank_links``), like one NIC per node.
Every record and the report say which. The rate the link delivers is measured once per rate
(``linkrate.py``) and recorded. Where namespaces or ``tc`` are unavailable the runs go
over the unshaped loopback and every record is marked ``shaped: false``.

Records: each run's ``results.jsonl`` line plus a ``compare`` object (method, seed,
ranks, rate, link, shaped, achieved rate, the link model in words, the train flags) is
appended to ``OUT/results.jsonl`` as soon as the run ends (nothing is lost if a later
run fails). Nothing there is ever deleted: a rerun into the same ``OUT`` keeps the runs
whose records exist (same method, seed, ranks, rate, link and train flags) and runs
the rest;
at the end the file is rewritten (write, then rename) with each run's
``time_to_target_s`` and ``quality_at_time`` from the report's one evaluation schedule,
and ``OUT/report.md`` with its plots is written.
"""

from __future__ import annotations

import bisect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gradzip.compare.matrix import Run, nodes_of

SHARED_LINK = ("one token bucket on the loopback of a network namespace, shared by all "
               "ranks: with W ranks sending at once each gets about RATE/W (not a NIC per "
               "node)")
PER_RANK_LINK = ("one network namespace per rank behind its own veth link, shaped to RATE "
                 "in each direction, all joined by a bridge: like one NIC per node on a "
                 "non-blocking switch (rate measured rank 0 -> rank 1, TCP payload)")
REPLICAS_LINK = ("the ranks as replicas in one process (gradzip train --replicas): each "
                 "step's time is one replica's CPU time plus the stated model's link time, "
                 "a latency per collective and one rank's bytes over RATE (a NIC per "
                 "rank); modelled, not emulated")
NODES_LINK = ("nodes of several ranks: the ranks of a node on an unshaped bridge of their "
              "own, each node behind one uplink shaped to RATE in each direction (rate "
              "measured node to node, TCP payload)")


#: what a shaped run's ranks see: no GPU, so the built-in trainer (``--device auto``) and
#: a script that picks CUDA when it has one train on the CPU over gloo, whose TCP goes
#: through the shaped link. NCCL between ranks of one host takes P2P and shared memory,
#: which bypass the namespace's qdisc: a "100 Mbit/s" race would be an NVLink race.
SHAPED_RUN_ENV = {"CUDA_VISIBLE_DEVICES": ""}
#: the record's word for it
SHAPED_DEVICE = ("cpu over gloo: a shaped link hides the GPUs (NCCL between ranks of one "
                 "host would bypass the shaping through P2P and shared memory)")


class RunFailed(RuntimeError):
    """A training run of the matrix exited with an error."""


@dataclass
class Link:
    """How the runs of one rate reach each other."""

    rate: str | None
    shaped: bool
    achieved_bits_per_s: float | None
    why_unshaped: str | None = None
    kind: str = "shared"  # matrix.LINK_KINDS

    def describe(self) -> dict[str, Any]:
        if self.kind == "replicas":
            return {"rate": self.rate, "shaped": True, "rate_changes": None,
                    "link": "replicas", "achieved_rate_bits_per_s": self.achieved_bits_per_s,
                    "link_model": REPLICAS_LINK}
        model = (PER_RANK_LINK if self.kind == "per-rank" else
                 NODES_LINK if nodes_of(self.kind) else SHARED_LINK)
        from gradzip.comm.netns import rate_changes

        return {"rate": self.rate, "shaped": self.shaped,
                "rate_changes": rate_changes(self.rate) if self.rate else None,
                "link": self.kind if self.shaped else "unshaped",
                "achieved_rate_bits_per_s": self.achieved_bits_per_s,
                "link_model": (model if self.shaped else
                               f"unshaped loopback ({self.why_unshaped or 'no rate asked'}); "
                               "not representative of a slow link")}


def namespace_command(argv: list[str], rate: str, kind: str,
                      ranks: int) -> tuple[list[str], dict[str, str]]:
    """The command that runs ``argv`` behind links of ``kind`` shaped to ``rate``, and
    its environment (argv is one process on a shared link, each rank's per rank; no
    GPU visible: ``SHAPED_RUN_ENV``)."""
    from gradzip.comm import rank_links
    from gradzip.comm.netns import netns_command

    env = {**os.environ, **SHAPED_RUN_ENV}
    if kind == "per-rank":
        return rank_links.command(argv, ranks=ranks, rate=rate), env
    nodes = nodes_of(kind)
    if nodes is not None:  # the probe (2 ranks) crosses between two one-rank nodes
        per_node = nodes[1] if ranks == nodes[0] * nodes[1] else 1
        return rank_links.command(argv, ranks=ranks, rate=rate, per_node=per_node), env
    cmd, extra = netns_command(argv, rate=rate)
    return cmd, {**env, "GLOO_SOCKET_IFNAME": "lo", **extra}


def _links_available(kind: str) -> tuple[bool, str]:
    from gradzip.comm import rank_links
    from gradzip.comm.netns import netns_available

    if kind == "per-rank" or nodes_of(kind):
        return rank_links.available()
    return netns_available(shaping=True)


def open_link(rate: str | None, kind: str = "shared") -> Link:
    """The link for ``rate``: shaped in namespaces and measured, or why it cannot be."""
    from gradzip.comm.netns import (
        NetnsError,
        base_rate,
        rate_bits_per_second,
        rate_schedule,
        run_streaming,
    )

    if kind == "replicas":  # modelled at the rate: nothing to shape or measure
        if rate is None:
            raise ValueError("--link replicas models the link at each --rate: give one")
        return Link(rate, True, rate_bits_per_second(rate), kind=kind)
    if rate is None:
        return Link(None, False, None, "unlimited loopback asked for", kind)
    ok, why = _links_available(kind)
    if not ok:
        return Link(rate, False, None, why, kind)
    first = base_rate(rate_schedule(rate)[0][1])  # probed at its start, unimpaired
    argv = [sys.executable, "-m", "gradzip.compare.linkrate", "--nominal",
            str(rate_bits_per_second(first))]
    if kind == "per-rank" or nodes_of(kind):
        argv.append("--between-ranks")
    cmd, env = namespace_command(argv, first, kind, ranks=2)
    try:
        proc = run_streaming(cmd, env=env, timeout=120.0)
    except NetnsError as e:
        return Link(rate, False, None, str(e), kind)
    if proc.returncode != 0:
        return Link(rate, False, None, f"link probe failed: {proc.stderr[-300:]}", kind)
    return Link(rate, True, float(json.loads(proc.stdout.strip().splitlines()[-1])
                                  ["bits_per_s"]), kind=kind)


def execute(run: Run, link: Link, out: Path, cache: Path,
            on_line: Callable[[str], None] | None = None,
            timeout: float = 4 * 3600.0) -> dict[str, Any]:
    """Train one run (shaped when the link is) and return its annotated record."""
    from gradzip.comm.netns import run_streaming

    run_dir = out / "runs" / run.slug
    change_log = (run_dir / "link_changes.txt").resolve()
    if link.kind == "replicas":  # one process; the link is the trainer's model
        proc = run_streaming(run.argv(run_dir, cache), env={**os.environ, **SHAPED_RUN_ENV},
                             timeout=timeout, on_line=on_line)
    elif link.shaped:
        assert link.rate is not None
        cmd, env = namespace_command(run.argv(run_dir, cache), link.rate, link.kind,
                                      run.ranks)
        run_dir.mkdir(parents=True, exist_ok=True)
        change_log.unlink(missing_ok=True)
        env["GRADZIP_NETNS_CHANGE_LOG"] = str(change_log)
        proc = run_streaming(cmd, env={**env, **run.env(run_dir)}, timeout=timeout,
                             on_line=on_line)
    else:  # torchrun on the unshaped loopback, whatever link kind was asked for
        flat = replace(run, link="shared")
        proc = subprocess.run(flat.argv(run_dir, cache), capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **flat.env(run_dir)})
    if proc.returncode != 0 and not _ended_by_a_fault(proc.returncode, run_dir):
        raise RunFailed(f"{run.method} (seed {run.seed}, {run.ranks} ranks, "
                        f"{run.rate or 'unlimited'}) failed with exit status "
                        f"{proc.returncode}:\n{proc.stderr[-3000:]}")
    results = run_dir / "results.jsonl"
    if not results.is_file():
        raise RunFailed(f"{run.method} (seed {run.seed}) exited cleanly but wrote no "
                        f"record to {results}: " + ("call gradzip.attach(model) without a "
                        "spec and handle.close() in the script (docs/guide.md, racing "
                        "your own script)" if run.script else "see its output"))
    record = json.loads(results.read_text().splitlines()[-1])
    record["compare"] = {"method": run.method, "seed": run.seed, "ranks": run.ranks,
                         **link.describe(), "link_kind": run.link, "train": list(run.what),
                         "parallel": run.parallel, "start_step": run.compressed_from(),
                         "trial": dict(run.trial) or None,
                         "faults": ({"kill": run.kill or None, "ft": run.uses_ft(),
                                     "survival": run.survival()}
                                    if run.kill or run.uses_ft() else None),
                         "device": ("cpu: replicas in one process" if link.kind == "replicas"
                                    else SHAPED_DEVICE if link.shaped else "default"),
                         "uplink_bytes": _uplinks(run, link, proc.stderr or "")}
    if record["compare"]["rate_changes"]:
        record["compare"]["rate_changes"] = place_rate_changes(
            record["compare"]["rate_changes"],
            change_log.read_text() if change_log.is_file() else "",
            record.get("step_clock"))
    return record


def _ended_by_a_fault(code: int, run_dir: Path) -> bool:
    """Whether a run's non-zero exit is a collective that failed on a link that went
    down (``gradzip train`` exits 3 after writing its checkpoint and its record, whose
    ``failed`` says where): the race keeps that record and its report says so."""
    results = run_dir / "results.jsonl"
    if code != 3 or not results.is_file():
        return False
    return bool(json.loads(results.read_text().splitlines()[-1]).get("failed"))


def place_rate_changes(changes: list[dict[str, Any]], log: str,
                       clock: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each scheduled change of the link's rate with when it happened: ``at_unix``
    (the namespace's log: ``UNIX_SECONDS RATE`` per change, in order) and ``at_step``,
    the step it fell in (the first that ended after it, from the record's
    ``step_clock``; None where the run ended first or nothing was logged). The schedule
    counts from the namespace's start, before the interpreter and the first step, so
    only the log says which step a change reached."""
    logged = [line.split() for line in log.splitlines() if line.strip()]
    ends = (clock or {}).get("end_unix") or []
    first = int((clock or {}).get("first_step") or 1)
    every = int((clock or {}).get("every") or 1)  # a long run keeps every n-th step's end
    placed = []
    for i, change in enumerate(changes):
        at = (float(logged[i][0]) if i < len(logged) and len(logged[i]) == 2
              and logged[i][0] != "failed" else None)  # a change tc refused: nowhere
        step = (first + every * bisect.bisect_left(ends, at) if at is not None
                and ends and at <= ends[-1] else None)
        placed.append({**change, "at_unix": at, "at_step": step})
    return placed


def _uplinks(run: Run, link: Link, stderr: str) -> dict[str, list[int]] | None:
    """On a shaped ``nodes=NxL`` link: what each node's uplink carried, counted by the
    kernel (the whole run: setup, evaluation and checkpoints included)."""
    from gradzip.comm.rank_links import read_uplink_bytes

    return read_uplink_bytes(stderr) if link.shaped and nodes_of(run.link) else None


def run_key(run: Run) -> tuple[Any, ...]:
    """What makes two runs the same run: method, seed, ranks, rate, link, train flags,
    parallel kind."""
    return (run.method, run.seed, run.ranks, run.rate, run.link, tuple(run.what),
            run.parallel)


def record_key(record: dict[str, Any]) -> tuple[Any, ...] | None:
    """``run_key`` of the run a record came from (None: a record without it, which an
    earlier gradzip wrote; such a run is run again)."""
    c = record.get("compare") or {}
    if "link_kind" not in c or "train" not in c:
        return None
    return (c["method"], c["seed"], c["ranks"], c["rate"], c["link_kind"], tuple(c["train"]),
            c.get("parallel", "ddp"))


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``path`` (none if it does not exist; a torn last line is dropped:
    its run did not finish writing and runs again)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    from gradzip.train.metrics import append_results

    append_results(record, [path])


def add_race_figures(records: list[dict[str, Any]], budget_s: float | None) -> None:
    """Each record's time_to_target_s and quality_at_time, from the report's summary
    (the target: the final validation loss of the uncompressed baseline run with the same
    seed x 1.01; a diverged run reaches none, ``Run.diverged``)."""
    from gradzip.compare.summary import loss_at_time, summarize, time_to_target

    for setting in summarize(records, budget_s):
        for method in setting.methods:
            for run in method.runs:
                c = run.record["compare"]
                target = setting.target_for(run)
                c["target_val_loss"] = target
                c["unmeasured"] = run.unmeasured()
                c["diverged"] = run.diverged()
                c["time_to_target_s"] = (time_to_target(run, target) if target is not None
                                         and not c["unmeasured"] and not c["diverged"]
                                         else None)
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
