"""``gradzip train --ft N``: N replica groups on this machine that may die and rejoin.

The launcher starts a torchft Lighthouse (localhost only, unless ``--ft-lighthouse``
names one elsewhere), then N processes of ``gradzip train``, each one replica group of
one rank with its own run directory ``OUT/replica_K`` and its own shard of the data
(``gradzip.comm.ft`` is where they meet torchft). A replica group that dies is started
again (up to ``--ft-max-restarts`` times each): it resumes from its own checkpoint if it
has one, then heals from a live peer at the next round and goes on; the others never
stop. When every group has finished, ``OUT/ft.json`` says what failed, when, and what
each failure cost, and ``OUT/results.jsonl`` holds the record of a group that never
died (``record_source``) with that summary.

``GRADZIP_KILL_AT=R@S,...`` (tests, the faults page) kills replica R after step S: R's
i-th entry in its i-th start.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradzip.comm.ft import ENV_TIMEOUT, FtJob, Lighthouse
from gradzip.train.restart import kills, last_logged


@dataclass
class Failure:
    """One replica group that exited with an error."""

    replica: int
    attempt: int  # the start that failed (0: the first)
    exit_code: int
    died_s: float  # seconds since the launch
    last_step: int = 0  # the last step its log recorded before it died
    restarted: bool = False
    #: filled from the run files once the job is over (``cost``)
    back_s: float | None = None  # seconds from its death until it healed from a peer
    failed_rounds: int = 0  # the survivors' rounds that rolled back
    survivor_lost_s: float = 0.0  # their seconds in failed rounds and waiting beyond usual


@dataclass
class Replica:
    index: int
    proc: subprocess.Popen[bytes]
    attempt: int = 0
    done: bool = False


@dataclass
class FtLaunch:
    """One ``--ft`` job: ``replicas`` groups of ``argv`` (``gradzip train ...``)."""

    replicas: int
    argv: list[str]
    out: Path
    lighthouse: str = ""  # an existing Lighthouse's address; "" = start one here
    bind: str = "127.0.0.1:0"
    timeout_s: float = 60.0
    max_restarts: int = 10
    failures: list[Failure] = field(default_factory=list)
    #: the groups that finished the run, in the order they did
    finished: list[int] = field(default_factory=list)

    def run(self) -> int:
        """Start everything, restart what dies, summarize; the exit status."""
        self.out.mkdir(parents=True, exist_ok=True)
        own = None if self.lighthouse else Lighthouse(
            self.bind, min_replicas=min(2, self.replicas))
        address = self.lighthouse or (own.address if own else "")
        print(f"gradzip train --ft: {self.replicas} replica groups, Lighthouse at {address}; "
              f"logs in {self.out}/replica_*/", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        group = [Replica(i, self._start(i, 0, address)) for i in range(self.replicas)]
        try:
            status = self._supervise(group, address, t0)
        finally:
            for r in group:
                if r.proc.poll() is None:
                    r.proc.kill()
            if own is not None:
                own.close()
        self._summarize(time.perf_counter() - t0, t0)
        return status

    def _start(self, index: int, attempt: int, address: str) -> subprocess.Popen[bytes]:
        job = FtJob(address, index, self.replicas, "127.0.0.1" if not self.lighthouse
                    else os.environ.get("GRADZIP_FT_HOST", ""), self.timeout_s)
        env = {**os.environ, **job.environ(), ENV_TIMEOUT: str(self.timeout_s),
               "TORCHELASTIC_RESTART_COUNT": str(attempt),
               "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
               "GRADZIP_KILL_AT": ",".join(f"0@{s}" for r, s in kills() if r == index)}
        if not job.host:
            env.pop("GRADZIP_FT_HOST")
        log = open(self.out / f"replica_{index}.log", "ab")  # noqa: SIM115 (the child's)
        cmd = [sys.executable, "-m", "gradzip", *self.argv,
               "--out", str(self.out / f"replica_{index}")]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _supervise(self, group: list[Replica], address: str, t0: float) -> int:
        finished_at = None  # when the first group finished: the job's model is final
        while not all(r.done for r in group):
            time.sleep(0.2)
            if finished_at is not None and \
                    time.perf_counter() - finished_at > 2 * self.timeout_s + 30:
                self._stop_late(group)
            for r in group:
                code = None if r.done else r.proc.poll()
                if code is None:
                    continue
                if code == 0:
                    r.done = True
                    finished_at = finished_at or time.perf_counter()
                    self.finished.append(r.index)
                    continue
                failure = Failure(r.index, r.attempt, code, time.perf_counter() - t0,
                                  last_logged(self.out / f"replica_{r.index}")[0])
                self.failures.append(failure)
                if finished_at is not None:  # nothing left to rejoin
                    r.done = True
                    print(f"gradzip train --ft: replica {r.index} died (exit {code}) after "
                          f"another group finished the run: not restarted",
                          file=sys.stderr, flush=True)
                    continue
                if r.attempt >= self.max_restarts:
                    print(f"gradzip train --ft: replica {r.index} failed (exit {code}) and "
                          f"was restarted {r.attempt} times already (--ft-max-restarts "
                          f"{self.max_restarts}): stopping the job; see "
                          f"{self.out}/replica_{r.index}.log", file=sys.stderr)
                    return 1
                r.attempt += 1
                failure.restarted = True
                print(f"gradzip train --ft: replica {r.index} died (exit {code}) at "
                      f"{failure.died_s:.1f}s; starting it again (restart {r.attempt}); "
                      f"the others go on", file=sys.stderr, flush=True)
                r.proc = self._start(r.index, r.attempt, address)
        return 0

    def _stop_late(self, group: list[Replica]) -> None:
        """Groups still running long after another finished the run (a group that fell
        a round behind, or was started again just as the others ended, waits for a
        quorum that never comes): stopped. The run's model is the finished groups'."""
        for r in group:
            if not r.done and r.proc.poll() is None:
                print(f"gradzip train --ft: replica {r.index} is still waiting after the "
                      f"run finished on another group: stopping it", file=sys.stderr)
                r.proc.kill()
                r.proc.wait()
                r.done = True

    def _summarize(self, seconds: float, t0: float) -> None:
        """``ft.json`` and ``results.jsonl``: the failures and what they cost."""
        rounds = {i: read_rounds(self.out / f"replica_{i}" / "ft_rounds.jsonl")
                  for i in range(self.replicas)}
        launch_epoch = time.time() - (time.perf_counter() - t0)
        for f in self.failures:
            cost(f, rounds, launch_epoch)
        summary = {"replicas": self.replicas, "seconds": round(seconds, 2),
                   "failures": [asdict(f) for f in self.failures],
                   "restarts": sum(f.restarted for f in self.failures),
                   "finished": self.finished,
                   "rounds_agree": rounds_agree(rounds)}
        source = record_source(self.finished, {f.replica for f in self.failures})
        record = last_record(self.out / f"replica_{source}" / "results.jsonl")
        summary["record_of"] = source
        write_json(self.out / "ft.json", summary)
        if record is not None:
            record["ft_job"] = summary
            with open(self.out / "results.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")
        print(describe(summary), file=sys.stderr)


def record_source(finished: list[int], failed: set[int]) -> int:
    """Whose record stands for the job: the lowest-numbered group that finished and never
    died (its clock holds every failure's cost to the groups that went on: waits for
    quorums, failed rounds), else the first that finished, else replica 0."""
    clean = sorted(i for i in finished if i not in failed)
    return clean[0] if clean else finished[0] if finished else 0


def read_rounds(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cost(f: Failure, rounds: dict[int, list[dict[str, Any]]], launch_epoch: float) -> None:
    """Fill in what failure ``f`` cost: when its group healed, and the survivors' rounds
    in between that rolled back or took longer than their usual (median) round."""
    died = launch_epoch + f.died_s
    healed = [r["time"] for r in rounds.get(f.replica, []) if r.get("healed")
              and r["time"] > died]
    back = min(healed) if healed else None
    f.back_s = None if back is None else round(back - died, 2)
    end = back if back is not None else float("inf")
    lost, failed = [], 0
    for i, rs in rounds.items():
        if i == f.replica or not rs:
            continue
        usual = statistics.median(r["seconds"] for r in rs)
        # a round logs when it ends: one the death broke ends just after it
        window = [r for r in rs if died - 2.0 <= r["time"] <= end + 1.0]
        failed += sum(not r["committed"] for r in window)
        lost.append(sum(r["seconds"] if not r["committed"] else max(0.0, r["seconds"] - usual)
                        for r in window))
    f.failed_rounds = failed
    f.survivor_lost_s = round(statistics.mean(lost), 2) if lost else 0.0


def rounds_agree(rounds: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Whether every group that committed a round holds the same anchor and outer
    optimizer state after it (digests by round)."""
    by_round: dict[int, set[str]] = {}
    for rs in rounds.values():
        for r in rs:
            if r["committed"]:
                by_round.setdefault(r["round"], set()).add(r["anchor_digest"])
    differ = sorted(k for k, v in by_round.items() if len(v) > 1)
    return {"rounds": len(by_round), "identical": not differ, "differ": differ}


def describe(summary: dict[str, Any]) -> str:
    fails = summary["failures"]
    agree = summary["rounds_agree"]
    lines = [f"gradzip train --ft: {summary['replicas']} replica groups, {len(fails)} "
             f"failure(s), {summary['restarts']} restart(s) in {summary['seconds']:.0f}s; "
             f"after each of {agree['rounds']} committed rounds the groups' anchors and "
             f"outer optimizers were " + ("bit-identical" if agree["identical"] else
                                          f"DIFFERENT (rounds {agree['differ']})")]
    for f in fails:
        back = "never healed" if f["back_s"] is None else f"healed {f['back_s']:.1f}s later"
        lines.append(f"  replica {f['replica']} died at {f['died_s']:.1f}s: {back}; the "
                     f"others lost {f['survivor_lost_s']:.2f}s each "
                     f"({f['failed_rounds']} round(s) rolled back)")
    return "\n".join(lines)


def last_record(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def seeds_table(root: Path) -> str:
    """The faults page's table: for each seed, the fault-free job (``root/clean-S``)
    against the one with failures (``root/killed-S``): final validation loss, failures,
    whether every committed round left the groups bit-identical, and what each failure
    cost."""
    rows = ["| seed | val loss, no faults | val loss, with faults | difference | failures "
            "| rounds (all bit-identical) | healed after (s) | survivors lost (s each) "
            "| wall time (s): clean, faults |", "|---" * 9 + "|"]
    for clean_dir in sorted(root.glob("clean-*")):
        seed = clean_dir.name.split("-", 1)[1]
        clean, killed = (last_record(d / "results.jsonl")
                         for d in (clean_dir, root / f"killed-{seed}"))
        if clean is None or killed is None:
            continue
        job = killed["ft_job"]
        fails = job["failures"]
        agree = job["rounds_agree"]
        rows.append(
            f"| {seed} | {clean['val_loss']:.4f} | {killed['val_loss']:.4f} | "
            f"{killed['val_loss'] - clean['val_loss']:+.4f} | {len(fails)} | "
            f"{agree['rounds']} ({'yes' if agree['identical'] else 'NO'}) | "
            + ", ".join("-" if f["back_s"] is None else f"{f['back_s']:.1f}" for f in fails)
            + " | " + ", ".join(f"{f['survivor_lost_s']:.1f}" for f in fails)
            + f" | {clean['ft_job']['seconds']:.0f}, {job['seconds']:.0f} |")
    return "\n".join(rows)
