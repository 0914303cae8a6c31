"""Results records as runs of a comparison: which link setting, which method, which seed.

A record written by ``gradzip compare`` carries a ``compare`` object (the method's spec,
seed, ranks, link rate and kind, whether the link was shaped, the achieved rate and a
description of the link model). A plain ``gradzip train`` record has none: it is its
``codec`` on ``world_size`` ranks over an unshaped loopback (rate null).

Records are checked once, here, so that the report can trust their types; a bad one
fails with where it came from (``file:line`` for files, ``record N`` for a list).
Figures that were not measured stay ``None`` and are shown as "-", never guessed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: record fields the report reads as numbers (each may be null)
NUMBER_FIELDS = (
    "val_loss", "step_time_ms_p50", "step_time_ms_mean", "tokens_per_s", "comm_ratio",
    "bytes_wire_total", "bytes_raw_total", "compression_ratio_steady", "steps",
    "resumed_from_step", "encode_ms", "decode_ms", "world_size", "params", "train_time_s",
    "timed_steps", "global_batch_tokens",
)

#: a run whose last validation loss is above its first evaluation's and this many times its
#: lowest has diverged: it rose back past where it started, which no schedule or noise does
DIVERGED_RISE = 1.10

_RATE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(bit|bps)\s*$", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def rate_bits_per_s(rate: str | None) -> float | None:
    """A tc rate (``100mbit``, ``1gbit``; ``kbps`` is kilobytes/s in tc) in bits/s."""
    m = _RATE.match(rate or "")
    if not m:
        return None
    bits = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    return bits * 8 if m.group(3).lower() == "bps" else bits


@dataclass(frozen=True)
class Workload:
    """What makes two runs' figures comparable besides the link: the same model and
    parameter count, tokens per optimizer step and data. A field a record does not carry
    is None (a script's record has no tokens or data). The steps a run reached are not
    part of it: a run stopped early (by ``--max-time``, or interrupted and resumed)
    still races the others of its setting, its shortfall shown in its own figures."""

    model: str | None = None
    params: int | None = None
    tokens_per_step: int | None = None
    dataset: str | None = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> Workload:
        """The workload a results record describes."""
        def number(name: str) -> int | None:
            v = record.get(name)
            return int(v) if isinstance(v, int | float) and _is_number(v) else None

        def text(name: str) -> str | None:
            v = record.get(name)
            return str(v) if v is not None else None

        return cls(text("model"), number("params"), number("global_batch_tokens"),
                   text("dataset"))

    def describe(self) -> str:
        """E.g. ``tiny (0.14M params), 4,096 tokens/step, data stdlib``."""
        parts = []
        if self.model is not None or self.params is not None:
            size = f" ({self.params / 1e6:.2f}M params)" if self.params is not None else ""
            parts.append(f"{self.model or 'model ?'}{size}")
        if self.tokens_per_step is not None:
            parts.append(f"{self.tokens_per_step:,} tokens/step")
        if self.dataset is not None:
            parts.append(f"data {self.dataset}")
        return ", ".join(parts) or "workload not recorded"

    def differences(self, other: Workload) -> list[str]:
        """What differs from ``other``, e.g. ``params 140000 vs 4260000``."""
        return [f"{name} {mine} vs {theirs}" for name in self.__dataclass_fields__
                if (mine := getattr(self, name)) != (theirs := getattr(other, name))]


@dataclass(frozen=True)
class Setting:
    """A link setting: runs compete only with runs of the same rate, ranks and link kind,
    and of the same workload (model, parameters, tokens per step, data)."""

    rate: str | None
    ranks: int | None
    link: str
    workload: Workload = field(default_factory=Workload)
    #: name the workload in the title and file names: set when another setting of the
    #: same report shares this link (otherwise the workload is a line under the title)
    qualified: bool = field(default=False, compare=False)

    def sort_key(self) -> tuple[float, int, str, str, str]:
        """Slowest link first, unlimited last; then ranks, then link kind, workload."""
        bits = rate_bits_per_s(self.rate)
        return (bits if bits is not None else math.inf, self.ranks or 0, self.link,
                self.rate or "", repr(self.workload))

    def link_title(self) -> str:
        """E.g. ``100mbit, 2 ranks, shared link``."""
        ranks = f"{self.ranks} ranks" if self.ranks is not None else "? ranks"
        return f"{self.rate or 'unlimited'}, {ranks}, {self.link} link"

    def title(self) -> str:
        """The link, and the workload when it is ``qualified``, e.g. ``100mbit, 2
        ranks, shared link; tiny (0.14M params), 4,096 tokens/step``."""
        if not self.qualified:
            return self.link_title()
        return f"{self.link_title()}; {self.workload.describe()}"

    def same_link(self, other: Setting) -> bool:
        """The same ranks, link kind and workload: ``other`` may differ in rate only."""
        return (self.ranks, self.link, self.workload) == (other.ranks, other.link,
                                                          other.workload)

    def slug(self) -> str:
        """A file-name-safe form of the title, for the plots of this setting (when
        ``qualified``, a short digest tells settings of different workloads apart)."""
        text = f"{self.rate or 'unlimited'}-{self.ranks or 'x'}r-{self.link}"
        if self.qualified:
            digest = hashlib.sha1(repr(self.workload).encode()).hexdigest()[:6]
            text += f"-{self.workload.model or 'model'}-{digest}"
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


@dataclass
class Run:
    """One record in a comparison, with the fields the report needs already checked."""

    setting: Setting
    method: str
    seed: int | None
    shaped: bool
    achieved_rate: float | None
    link_model: str | None
    record: dict[str, Any] = field(repr=False)
    where: str = ""
    #: the ``--tune`` trial the run belongs to (``lr=0.001``); empty without tuning
    trial: str = ""

    def num(self, name: str) -> float | None:
        """A numeric field, ``None`` when absent, null or not finite."""
        v = self.record.get(name)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def steps_run(self) -> float | None:
        """Steps this process ran (totals cover them; a resume starts counting again)."""
        steps = self.num("steps")
        return None if steps is None else steps - (self.num("resumed_from_step") or 0)

    def uplink_per_step(self) -> float | None:
        """On a ``nodes=NxL`` link: the bytes a node's uplink sent per step, the mean
        over nodes, as the kernel counted them (the whole run over its steps); None on
        other links."""
        uplinks = (self.record.get("compare") or {}).get("uplink_bytes")
        steps = self.steps_run()
        if not uplinks or not uplinks.get("sent") or not steps:
            return None
        return sum(uplinks["sent"]) / len(uplinks["sent"]) / steps

    def per_step(self, name: str) -> float | None:
        """A run total divided by the steps it covers; ``None`` if either is unknown."""
        total, steps = self.num(name), self.steps_run()
        return total / steps if total is not None and steps else None

    def history(self) -> list[tuple[float, float, float]]:
        """(step, time, val_loss) of every evaluation with a finite loss, in order; the
        time is the record's ``train_time_s`` plus what restarts before it cost
        (``charged_s``)."""
        out = []
        for h in self.record.get("eval_history") or []:
            loss = h.get("val_loss")
            if isinstance(loss, int | float) and math.isfinite(loss):
                step = float(h["step"])
                out.append((step, float(h["train_time_s"]) + self.charged_s(step),
                            float(loss)))
        return out

    def charged_s(self, step: float) -> float:
        """Seconds the race adds to the clock of an evaluation at ``step``: for every
        restart by torchrun that resumed from a checkpoint before ``step``, the training
        trained again and the time the run was down. The trainer's own clock resumes at
        the checkpoint's time: without this a run that dies would race for free. A
        torchft replica group's clock needs none: it is the job's (a group that comes back
        takes its live peer's clock and evaluations when it heals)."""
        if self.record.get("ft"):
            return 0.0
        each = (self.record.get("restarts") or {}).get("each") or []
        return sum(float(r.get("lost_train_s") or 0.0) + float(r.get("down_s") or 0.0)
                   for r in each if isinstance(r, dict)
                   and step > float(r.get("from_step") or 0))

    def diverged(self) -> str | None:
        """Why the run counts as diverged, or None: a validation loss that went non-finite
        (written as null: records are strict JSON), or a last one above the first
        evaluation's and ``DIVERGED_RISE`` times the lowest. A non-finite gradient stops a
        run with an error; a loss that grows without bound while staying finite (1.8e7
        after 2,000 steps) does not, and its early evaluations may have touched the
        target, so the race must not count it as reaching it. The rule needs two finite
        evaluations, and reads "above the first" as "worse than early in the run": a
        schedule's evaluations start within the first tenth of it."""
        for h in self.record.get("eval_history") or []:
            loss = h.get("val_loss")
            if loss is None or (isinstance(loss, int | float) and not math.isfinite(loss)):
                return f"its validation loss went non-finite at step {h['step']:g}"
        h = self.history()
        if len(h) < 2:
            return None
        (first_step, _, first), (last_step, _, last) = h[0], h[-1]
        low_step, _, low = min(h, key=lambda e: e[2])
        if last > first and last > low * DIVERGED_RISE:
            return (f"its last validation loss ({last:.4g} at step {last_step:g}) is above "
                    f"its first ({first:.4g} at step {first_step:g}) and its lowest "
                    f"({low:.4g} at step {low_step:g})")
        return None

    def reached(self, target: float) -> tuple[float, float] | None:
        """(step, time) of the run's first evaluation at or below ``target``; None if none
        was, or if the run diverged (``diverged``): what an evaluation of a run that then
        blew up touched is no result. Every time to target is read through this."""
        if self.diverged() is not None:
            return None
        return next(((step, t) for step, t, loss in self.history() if loss <= target), None)

    def unmeasured(self) -> str | None:
        """Why the run's time to target cannot be known, or None when it can: a run with
        no evaluation, or whose clock timed no training (a zero training time would
        otherwise "reach the target in 0.0 s")."""
        if not self.record.get("eval_history"):
            return "it logged no evaluation"
        timed = self.num("timed_steps")
        total = self.num("train_time_s")
        times = [t for _, t, _ in self.history()]
        if (timed == 0 and not total) or (total is not None and total <= 0) \
                or (times and max(times) <= 0):
            return ("its clock timed no training step (train_time_s 0, timed_steps "
                    f"{int(timed) if timed is not None else '?'})")
        return None

    def phase(self, name: str) -> float | None:
        """Mean ms per timed step of one phase (``phase_ms_mean``), ``None`` if unknown."""
        v = (self.record.get("phase_ms_mean") or {}).get(name)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {what}")


def _check_numbers(record: dict[str, Any], where: str) -> None:
    """Numeric fields are numbers or null; eval_history and phase_ms_mean are well formed."""
    for name in NUMBER_FIELDS:
        v = record.get(name)
        _check(v is None or _is_number(v), where,
               f"field {name!r} must be a number or null, got {v!r}")
    history = record.get("eval_history")
    _check(history is None or isinstance(history, list), where,
           f"field 'eval_history' must be a list, got {type(history).__name__}")
    for i, h in enumerate(history or []):
        _check(isinstance(h, dict) and _is_number(h.get("step"))
               and _is_number(h.get("train_time_s"))
               and (h.get("val_loss") is None or _is_number(h.get("val_loss"))), where,
               f"eval_history[{i}] must be {{step, train_time_s, val_loss}} numbers, got {h!r}")
    _check_auto(record.get("auto"), where)
    phases = record.get("phase_ms_mean")
    _check(phases is None or (isinstance(phases, dict)
                              and all(v is None or _is_number(v) for v in phases.values())),
           where, f"field 'phase_ms_mean' must map phases to numbers, got {phases!r}")


def _check_auto(auto: Any, where: str) -> None:
    """``auto``'s field: null, or its decisions as ``auto.py`` writes them."""
    if auto is None:
        return
    _check(isinstance(auto, dict) and isinstance(auto.get("decisions"), list), where,
           f"field 'auto' must be an object with a 'decisions' list, got {auto!r}")
    for i, d in enumerate(auto["decisions"]):
        _check(isinstance(d, dict) and _is_number(d.get("from_step"))
               and isinstance(d.get("method"), str) and isinstance(d.get("why"), str)
               and isinstance(d.get("costs_ms"), dict)
               and all(isinstance(k, str) and _is_number(v)
                       for k, v in d["costs_ms"].items()), where,
               f"auto.decisions[{i}] must be {{from_step, method, costs_ms, why}}, got {d!r}")
    over = auto.get("overhead")
    _check(over is None or (isinstance(over, dict) and all(
        _is_number(over.get(k)) for k in ("agree_ms", "trials_ms", "steps_ms", "fraction"))),
        where, f"auto.overhead must be {{agree_ms, trials_ms, steps_ms, fraction}}, "
        f"got {over!r}")


def _from_compare(c: Any, record: dict[str, Any], where: str) -> dict[str, Any]:
    """The Run fields given by a ``compare`` object (written by ``gradzip compare``)."""
    _check(isinstance(c, dict), where, f"field 'compare' must be an object, got {c!r}")
    _check(isinstance(c.get("method"), str) and c["method"].strip() != "", where,
           "compare.method must be a non-empty spec string")
    ranks = c["ranks"] if c.get("ranks") is not None else record.get("world_size")
    for name, ok, want in (
        ("seed", c.get("seed") is None or isinstance(c.get("seed"), int), "an integer"),
        ("ranks", ranks is None or isinstance(ranks, int), "an integer"),
        ("rate", c.get("rate") is None or isinstance(c.get("rate"), str), "a string or null"),
        ("link", c.get("link") is None or isinstance(c.get("link"), str), "a string"),
        ("shaped", isinstance(c.get("shaped", False), bool), "true or false"),
        ("achieved_rate_bits_per_s", c.get("achieved_rate_bits_per_s") is None
         or _is_number(c.get("achieved_rate_bits_per_s")), "a number or null"),
        ("link_model", c.get("link_model") is None or isinstance(c.get("link_model"), str),
         "a string or null"),
    ):
        _check(ok, where, f"compare.{name} must be {want}, got {c.get(name)!r}")
    trial = c.get("trial")
    _check(trial is None or (isinstance(trial, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in trial.items())), where,
        f"compare.trial must map options to value strings, got {trial!r}")
    shaped = bool(c.get("shaped", False))
    return {"setting": Setting(c.get("rate"), ranks, c.get("link") or "unknown",
                               Workload.of(record)),
            "method": c["method"].strip(), "seed": c.get("seed", record.get("seed")),
            "shaped": shaped, "achieved_rate": c.get("achieved_rate_bits_per_s"),
            "link_model": c.get("link_model"),
            "trial": ", ".join(f"{k}={v}" for k, v in (trial or {}).items())}


def _from_plain(record: dict[str, Any], where: str) -> dict[str, Any]:
    """The Run fields of a plain ``gradzip train`` record: its method over loopback
    (``method`` names it exactly, DiLoCo included; records before it have ``codec``)."""
    codec, ranks = record.get("method") or record.get("codec"), record.get("world_size")
    if not isinstance(codec, str) or not codec.strip():
        raise ValueError(f"{where}: a record needs a 'method' or 'codec' string (or a "
                         "'compare' object naming the method)")
    _check(ranks is None or isinstance(ranks, int), where,
           f"field 'world_size' must be an integer, got {ranks!r}")
    return {"setting": Setting(None, ranks, "unshaped", Workload.of(record)),
            "method": codec.strip(),
            "seed": record.get("seed"), "shaped": False, "achieved_rate": None,
            "link_model": "loopback, not rate-limited (a plain gradzip train record)"}


def parse_run(record: Any, where: str) -> Run:
    """Check one results record and place it in the comparison; ValueError names ``where``."""
    _check(isinstance(record, dict), where,
           f"a results record is a JSON object, got {type(record).__name__}")
    _check_numbers(record, where)
    c = record.get("compare")
    fields = _from_compare(c, record, where) if c is not None else _from_plain(record, where)
    _check(fields["seed"] is None or isinstance(fields["seed"], int), where,
           f"the seed must be an integer, got {fields['seed']!r}")
    source = record.get("gradzip_source")
    _check(source is None or isinstance(source, str), where,
           f"field 'gradzip_source' must be a string or absent, got {source!r}")
    return Run(record=record, where=where, **fields)


def _lines(path: Path) -> list[str]:
    """The file's lines, decoded; errors name the file (and the line for bad UTF-8)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such results file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from e
    lines = []
    for n, line in enumerate(raw.splitlines(), 1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{n}: not UTF-8 text ({e.reason})") from e
    return lines


def read_results(paths: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every record of the given results.jsonl files (or run directories), checked, and
    where each came from (``file:line``).

    Blank lines are skipped; a file without records, a line that is not JSON or a
    record the report cannot read raises ValueError naming the file and line.
    """
    records: list[dict[str, Any]] = []
    where: list[str] = []
    for path in map(Path, paths):
        path = path / "results.jsonl" if path.is_dir() else path  # a run directory
        found = 0
        for n, line in enumerate(_lines(path), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") \
                    from e
            parse_run(record, f"{path}:{n}")
            records.append(record)
            where.append(f"{path}:{n}")
            found += 1
        if not found:
            raise ValueError(f"{path}: empty, it holds no results records")
    return records, where


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """The records of ``read_results``, for ``write_report``."""
    return read_results(paths)[0]
