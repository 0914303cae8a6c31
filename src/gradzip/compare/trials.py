"""An equal tuning budget per method: ``--tune "lr=1e-3,3e-3;warmup-steps=10,50"``.

Every method runs every trial (the product of the values given) with every seed; the
report keeps, per setting and method, the trial with the lowest mean final validation
loss over its seeds and races that one. All trials stay in ``results.jsonl`` (each
record's ``compare.trial``) and in the report's tuning table, so a reader sees what
the choice was made from. Choosing by validation loss, not by time to target, keeps the
choice independent of the link.
"""

from __future__ import annotations

import itertools
import re
import statistics
from dataclasses import dataclass

_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


def parse_tune(text: str) -> list[tuple[tuple[str, str], ...]]:
    """The trials of a ``--tune`` value: each a tuple of (option, value); ``[()]`` (one
    trial, nothing changed) for an empty text. ValueError says what is malformed."""
    if not text.strip():
        return [()]
    axes: list[list[tuple[str, str]]] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, values = part.partition("=")
        name = name.strip()
        options = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not _NAME.match(name) or not options:
            raise ValueError(f"--tune {text!r}: each part is OPTION=V1,V2,... (e.g. "
                             f"lr=1e-3,3e-3), got {part!r}")
        if name in (a[0][0] for a in axes):
            raise ValueError(f"--tune {text!r}: {name} is given twice")
        axes.append([(name, v) for v in options])
    return [tuple(t) for t in itertools.product(*axes)]


#: built-in trainer options compare sets itself for every run: tuning them would make
#: trials that differ only in name
RESERVED = ("seed", "out", "cache-dir", "codec", "codec-start-step", "codec-groups",
            "parallel", "outer", "outer-codec", "node-size", "hierarchical", "no-progress",
            "no-tensorboard", "sync-every", "outer-lr", "outer-momentum")


def check_trials(trials: list[tuple[tuple[str, str], ...]], given: tuple[str, ...]) -> None:
    """ValueError for a tuned option compare sets itself, or one also given as a fixed
    flag (``--lr 3e-3`` beside ``--tune lr=...``: the trial's value would win unseen)."""
    for name in dict.fromkeys(n for t in trials for n, _ in t):
        if name in RESERVED:
            raise ValueError(f"--tune {name}: compare sets --{name} for every run itself; "
                             "tune training options (lr, warmup-steps, weight-decay, ...)")
        if f"--{name}" in given:
            raise ValueError(f"--tune {name} and a fixed --{name} were both given: keep one")


def trial_flags(trial: tuple[tuple[str, str], ...]) -> list[str]:
    """``--lr 1e-3 --warmup-steps 10``: how a trial reaches the trainer or a script."""
    return [x for name, value in trial for x in (f"--{name}", value)]


def trial_label(trial: tuple[tuple[str, str], ...] | dict[str, str] | None) -> str:
    """``lr=1e-3, warmup-steps=10``; empty for no trial."""
    items = trial.items() if isinstance(trial, dict) else (trial or ())
    return ", ".join(f"{k}={v}" for k, v in items)


@dataclass(frozen=True)
class TrialResult:
    """One trial of a method in a setting: its mean final validation loss over seeds."""

    trial: str
    val_loss: float | None
    seeds: int
    chosen: bool


def best_trial(losses: dict[str, list[float | None]]) -> str:
    """The trial with the lowest mean final loss (a trial with any unfinished seed, or
    none finite, ranks last; ties go to the first given)."""
    def key(item: tuple[str, list[float | None]]) -> tuple[bool, float]:
        values = item[1]
        known = [v for v in values if v is not None]
        return (len(known) < len(values) or not known,
                statistics.fmean(known) if known else float("inf"))

    return min(losses.items(), key=key)[0]
