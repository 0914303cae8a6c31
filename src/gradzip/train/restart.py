"""Restart without a person: a run that torchrun restarts resumes by itself.

``torchrun --max-restarts N`` starts every worker again when one dies, with the same
command line and ``TORCHELASTIC_RESTART_COUNT`` set to the attempt's number. An
attempt after the first resumes from the newest checkpoint that verifies, as
``--resume`` would (resume is exact: the weights after the last step equal an
uninterrupted run's), and says from which step and what the failure cost:

- **steps lost**: from the checkpoint to the last step the failed attempt logged (a
  lower bound, to within ``--log-every`` steps),
- **training time lost**: the training time of those steps (rank 0's log carries the
  run's training time at each logged step),
- **time down**: from the failed attempt's last log line to this attempt's resume
  (torchrun noticing the failure, stopping the other workers, starting them again,
  and this process's start-up).

Each restart is one line of ``restarts.jsonl`` in the run directory (rank 0, appended
and flushed), so restarts survive a failure before the next checkpoint; the results
record sums them (``restarts``).

``GRADZIP_KILL_AT="RANK@STEP,RANK@STEP,..."`` kills a rank with SIGKILL after the step:
the i-th entry in the i-th attempt (``TORCHELASTIC_RESTART_COUNT``), so a run is
killed again and again at chosen steps and every attempt goes further. It exists to show
that runs survive (tests, ``docs/benchmarks/faults.md``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESTARTS_FILE = "restarts.jsonl"
#: the training time at each logged step, in rank 0's log (``MetricLogger.scalars``)
TRAIN_TIME_KEY = "time/train_s"
_EVERY = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|m|h|min)?\s*$")
_SECONDS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Every:
    """``--ckpt-every``: a number of steps, or a span of training time."""

    steps: int = 0
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str | int) -> Every:
        """``"100"`` (steps), ``"30s"``, ``"10m"``, ``"1h"``; ``"0"``: never (only at the
        end). ValueError says what is accepted."""
        m = _EVERY.match(str(text))
        if m is None:
            raise ValueError(f"--ckpt-every {text!r}: give a number of steps (100) or a time "
                             f"(30s, 10m, 1h)")
        value, unit = m.group(1), m.group(2)
        if unit is None:
            if "." in value:
                raise ValueError(f"--ckpt-every {text!r}: a number of steps is whole; for "
                                 f"seconds write {value}s")
            return cls(steps=int(value))
        return cls(seconds=float(value) * _SECONDS[unit])

    def __bool__(self) -> bool:
        return self.steps > 0 or self.seconds > 0


@dataclass(frozen=True)
class Attempt:
    """Which start of the workers this is, as torchrun says in the environment."""

    number: int = 0  # 0: the first start; n: the n-th restart
    max_restarts: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Attempt:
        env = os.environ if environ is None else environ
        return cls(number=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                   max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0))

    @property
    def restarted(self) -> bool:
        return self.number > 0


def attempt_store(environ: Mapping[str, str] | None = None) -> Any:
    """A store of this attempt's own under torchrun's agent store, else None (then
    ``env://`` as usual). torchrun --standalone keeps one TCPStore, on one port, across
    restarts, and gloo's rendezvous keys carry no attempt: a restarted worker read the
    failed attempt's addresses and could not connect (or hung). A prefix per attempt
    keeps each attempt's keys apart."""
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env:
        return None
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                         int(env.get("WORLD_SIZE", "1")), is_master=False)
    return dist.PrefixStore(f"gradzip/attempt_{Attempt.from_env(env).number}", base)


def resumes(resume_flag: bool, has_checkpoint: bool, attempt: Attempt | None = None) -> bool:
    """Whether the run continues from a checkpoint: ``--resume``, or a restart of a run
    that saved one (a restart before the first save starts again from step 0)."""
    attempt = Attempt.from_env() if attempt is None else attempt
    return resume_flag or (attempt.restarted and has_checkpoint)


@dataclass
class Restart:
    """One restart, as ``restarts.jsonl`` holds it."""

    attempt: int
    from_step: int
    lost_steps: int
    lost_train_s: float
    down_s: float


def last_logged(run_dir: Path) -> tuple[int, float | None, float | None]:
    """The last step rank 0's log recorded (the log is appended to in time order, so
    its last JSON line is the failed attempt's), its training time (None if not
    logged), and when the log was last written (None: no log)."""
    log = run_dir / "logs" / "rank0.log"
    if not log.is_file():
        return 0, None, None
    step, train_s = 0, None
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by the kill
            continue
        if isinstance(row.get("step"), int):  # the last line is the failed attempt's
            step, train_s = row["step"], row.get(TRAIN_TIME_KEY, train_s)
    return step, train_s, log.stat().st_mtime


def measure(run_dir: Path, attempt: Attempt, from_step: int, from_train_s: float) -> Restart:
    """What the failure before this attempt cost (module docstring), from rank 0's log
    of the attempt that failed and the checkpoint this one resumes from."""
    step, train_s, written = last_logged(run_dir)
    lost_steps = max(0, step - from_step)
    lost_train_s = max(0.0, (train_s or from_train_s) - from_train_s) if lost_steps else 0.0
    down_s = max(0.0, time.time() - written) if written is not None else 0.0
    return Restart(attempt.number, from_step, lost_steps, round(lost_train_s, 3),
                   round(down_s, 3))


def append(run_dir: Path, restart: Restart) -> None:
    """One line in ``restarts.jsonl`` (rank 0), flushed to disk before training goes on."""
    with open(run_dir / RESTARTS_FILE, "a") as f:
        f.write(json.dumps(asdict(restart)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def summary(run_dir: Path) -> dict[str, Any]:
    """The run's restarts for the results record: how many, and what they cost."""
    path = run_dir / RESTARTS_FILE
    rows: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return {"count": len(rows),
            "lost_steps": sum(int(r.get("lost_steps", 0)) for r in rows),
            "lost_train_s": round(sum(float(r.get("lost_train_s", 0.0)) for r in rows), 3),
            "down_s": round(sum(float(r.get("down_s", 0.0)) for r in rows), 3),
            "each": rows}


def describe(r: Restart, attempt: Attempt) -> str:
    """The line a restarted run prints."""
    of = f" of at most {attempt.max_restarts}" if attempt.max_restarts else ""
    who = ("the --ft launcher restarted this replica group" if "GRADZIP_FT_LIGHTHOUSE"
           in os.environ else "torchrun restarted the workers")
    return (f"restart {r.attempt}{of} ({who}): resuming from step "
            f"{r.from_step}; {r.lost_steps} step(s) lost since that checkpoint "
            f"({r.lost_train_s:.2f} s of training), {r.down_s:.1f} s down")


def kills(environ: Mapping[str, str] | None = None) -> list[tuple[int, int]]:
    """``GRADZIP_KILL_AT`` as (rank, step) pairs, one per attempt."""
    env = os.environ if environ is None else environ
    text = env.get("GRADZIP_KILL_AT", "").strip()
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        rank, sep, step = item.partition("@")
        if not sep or not rank.isdigit() or not step.isdigit():
            raise ValueError(f"GRADZIP_KILL_AT: {item!r} is not RANK@STEP (e.g. 1@7,1@15)")
        out.append((int(rank), int(step)))
    return out


def kill_if_due(rank: int, step: int, attempt: Attempt | None = None,
                environ: Mapping[str, str] | None = None) -> None:
    """SIGKILL this process after ``step`` when ``GRADZIP_KILL_AT`` names it for this
    attempt (a failure with no clean-up at all, as a lost machine)."""
    attempt = Attempt.from_env(environ) if attempt is None else attempt
    planned = kills(environ)
    if attempt.number < len(planned) and planned[attempt.number] == (rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
