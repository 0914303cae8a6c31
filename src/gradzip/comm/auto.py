"""``auto``: the 16-bit all-reduce, unless a candidate codec is measurably faster here.

``gradzip.attach(ddp_model, "auto")`` (or ``"auto(candidates='fp16; int8', margin=0.05)"``)
reduces every DDP bucket through one of its candidates, whole codecs tried in place:

- **What is compared** is what a step pays: the wall time from one step's first bucket
  to the next step's first bucket (forward, backward with the reductions it waits for,
  encode and decode, the optimizer step), the median over a trial's steps.
- **Trials.** After ``warmup`` steps (DDP's plain first step among them) every candidate
  runs ``trial_steps`` steps in turn, the current choice first, the first step of each
  left out (its caches and state warm up). A candidate whose first measured step costs
  more than ``cut`` (25%) above the cheapest median measured before it in the trial is
  cut short there: it would need to be 5% cheaper, and a loser's steps are what a trial
  costs. A trial that a jump (below) started runs the current choice last instead, so
  a choice a dropped link slowed is the one cut (six 16-bit steps at 25 Mbit/s were most
  of what deciding cost after a drop).
- **When.** The second trial comes ``every`` (50) steps after the first, and the interval
  doubles (up to ``max_every``) after each trial, except after a close switch (the
  winner less than ``cut`` cheaper), when it goes back to ``every``: a choice a settling
  run's noise got wrong is checked again within 50 steps, and a candidate that keeps
  losing is not paid for again and again. And as soon as the chosen candidate's step
  time drifts by more than ``drift`` from what its trial measured (the median of each
  ``window`` steps) in two windows running, as when a link slows down; one window alone
  is noise on a busy host, unless it moved by a factor of ``jump`` (2x), which no busy
  host does and a dropped link (or one that comes back) does. Every trial measures the
  current choice again beside the others: the window that drifted is no unbiased
  estimate of its cost (it was picked for being far off). A drop is acted on within one
  or two windows and a trial (``window=10``: some 20 to 35 steps).
- **Agreed on every rank.** The schedule is a function of the step count, and every
  figure a decision reads is first all-reduced with MAX over the ranks (one small
  collective per trial, per candidate checked for a cut and per window, on a gloo group
  of its own; a window's runs during the next step and is read as the one after
  begins): the slowest rank's cost decides, so ranks that measure differently still
  choose alike.
- **What deciding costs** is measured too: the time of those collectives, and each
  trial's steps run on a candidate that lost, over what the choice would have taken
  (``report()['overhead']``, as a fraction of all the steps' time).
- **Hysteresis.** The reference is the first candidate (the 16-bit all-reduce by
  default); another replaces the current choice only if its cost is lower by more than
  ``margin`` (5%).
- **Nothing lost in a switch.** Leaving a codec whose error feedback holds residuals,
  each bucket's residual is added to that bucket's next gradient; memories a stage keeps
  in another form stay in its codec's state, carried until it runs again.
- **Checkpointed and recorded.** ``state_dict`` holds the schedule, the choice, the
  measured costs and every candidate's codec state; ``report()`` lists what was chosen,
  from which step, on which agreed costs.

The candidates are codecs; ``auto`` never looks inside them. It runs on flat DDP and
on hierarchical DDP (``node_size``), where it decides per link: the intra-node link stays
plain (the hierarchy exists to keep it so) and the candidates compete for the
inter-node one, each step's time measuring both. FSDP and HSDP refuse it when attached.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
import torch.distributed as dist

from gradzip.codecs.chain import Codec
from gradzip.comm.ddp import DDPCommState, build_codec, reduce_bucket
from gradzip.comm.groups import private_group
from gradzip.comm.stats import CommStats

#: the default candidates: the 16-bit all-reduce first (the reference), then the codecs
#: whose loss the long race shows within seed noise of DDP (docs/benchmarks/long.md)
DEFAULT_CANDIDATES = ("fp16", "int8")
#: the 16-bit reference where the backend sums bf16 (NCCL): fp32's range, same bytes
BF16_BACKENDS = ("nccl",)
_AUTO = re.compile(r"^\s*auto\s*(?:\((?P<body>.*)\))?\s*$", re.DOTALL)
_OPTION = re.compile(r"\s*(\w+)\s*=\s*(\"[^\"]*\"|'[^']*'|[^,]+?)\s*(?:,|$)")


def is_auto(spec: Any) -> bool:
    """Whether ``spec`` names the ``auto`` method."""
    return isinstance(spec, AutoOptions) or (isinstance(spec, str)
                                             and _AUTO.match(spec) is not None)


@dataclass(frozen=True)
class AutoOptions:
    """``auto(...)``'s options, each with its default."""

    #: whole codecs, the reference (used unless another is measurably faster) first
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    #: how much cheaper (a fraction of the current choice's cost) a switch must be
    margin: float = 0.05
    #: synchronized steps before the first trial (DDP's plain first step among them)
    warmup: int = 3
    #: steps each candidate runs in a trial; the first of them is not measured
    trial_steps: int = 6
    #: steps from one trial to the next (doubled after each trial that keeps the choice)
    every: int = 50
    #: the longest interval the doubling reaches
    max_every: int = 4000
    #: steps between drift checks of the current choice (the median of each window)
    window: int = 10
    #: relative change of the current choice's step time that starts a new trial
    drift: float = 0.25
    #: a change by this factor or more starts the trial after one window, not two (no
    #: busy host moves a window's median 2x; a link that drops from 1 Gbit/s to 25 Mbit/s
    #: makes the 16-bit path's steps several times slower)
    jump: float = 2.0
    #: a candidate whose first measured trial step costs more than this fraction above
    #: the current choice's trial median runs no more steps of that trial
    cut: float = 0.25
    #: whether ``candidates`` is the default (the 16-bit reference then follows the
    #: backend: ``for_backend``), not a list the user named
    default_candidates: bool = field(default=True, compare=False)

    @classmethod
    def parse(cls, text: str | AutoOptions) -> AutoOptions:
        """``auto`` or ``auto(candidates="fp16; int8 | ans", margin=0.1, ...)``;
        ValueError names what is wrong (an unknown candidate raises its SpecError)."""
        if isinstance(text, AutoOptions):
            return text
        m = _AUTO.match(text)
        if m is None:
            raise ValueError(f"not an auto method: {text!r}")
        body = (m.group("body") or "").strip()
        values: dict[str, Any] = {}
        pos = 0
        while pos < len(body):
            opt = _OPTION.match(body, pos)
            if opt is None or opt.end() == pos:
                raise ValueError(f"auto: cannot read options {body[pos:]!r}: write them as "
                                 "name=value, e.g. auto(candidates=\"fp16; int8\")")
            values[opt.group(1)] = opt.group(2).strip("\"'")
            pos = opt.end()
        return cls.from_values(values)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> AutoOptions:
        known = [k for k in cls.__dataclass_fields__ if k != "default_candidates"]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"auto: unknown option(s) {', '.join(unknown)}; it takes "
                             f"{', '.join(known)}")
        out = cls()
        for name, raw in values.items():
            if name == "candidates":
                names = raw if isinstance(raw, list | tuple) else str(raw).split(";")
                out = replace(out, candidates=tuple(c.strip() for c in names if c.strip()),
                              default_candidates=False)
            else:
                kind = type(getattr(out, name))
                try:
                    out = replace(out, **{name: kind(raw)})
                except ValueError:
                    raise ValueError(f"auto: {name} must be a {kind.__name__}, got "
                                     f"{raw!r}") from None
        out.check()
        return out

    def check(self) -> None:
        """Values that cannot work, and candidates that are not gradzip codecs."""
        if len(self.candidates) < 1:
            raise ValueError("auto: name at least one candidate")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"auto: a candidate is named twice in {list(self.candidates)}")
        for c in self.candidates:
            if c.startswith("torch:") or c.startswith("auto"):
                raise ValueError(f"auto: candidate {c!r} is not a gradzip codec spec")
            Codec.from_spec(c)  # SpecError for an unknown stage or parameter
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"auto: margin must be in [0, 1), got {self.margin}")
        if self.trial_steps < 2:
            raise ValueError(f"auto: trial_steps must be >= 2 (the first is warm-up), "
                             f"got {self.trial_steps}")
        if self.warmup < 1 or self.window < 1 or self.drift <= 0:
            raise ValueError("auto: warmup and window must be >= 1, drift > 0")
        if self.jump <= 1.0 + self.drift:
            raise ValueError(f"auto: jump ({self.jump}) must be a factor above 1 + drift "
                             f"({1.0 + self.drift})")
        if not self.margin < self.cut:
            raise ValueError(f"auto: cut ({self.cut}) must be above margin ({self.margin})"
                             ": a candidate cut short could otherwise have won")
        if self.max_every < self.every:
            raise ValueError(f"auto: max_every ({self.max_every}) must be >= every "
                             f"({self.every})")
        if self.every < len(self.candidates) * self.trial_steps:
            raise ValueError(f"auto: every ({self.every}) must cover a whole trial "
                             f"({len(self.candidates)} x {self.trial_steps} steps)")

    def __str__(self) -> str:
        default = AutoOptions()
        parts = [] if self.default_candidates else [
            f'candidates="{"; ".join(self.candidates)}"']
        parts += [f"{k}={getattr(self, k)}" for k in self.__dataclass_fields__
                  if k not in ("candidates", "default_candidates")
                  and getattr(self, k) != getattr(default, k)]
        return f"auto({', '.join(parts)})" if parts else "auto"

    def to_json(self) -> dict[str, Any]:
        return {"auto": {k: (list(v) if isinstance(v, tuple) else v)
                         for k, v in self.__dict__.items() if k != "default_candidates"}}

    def for_backend(self, backend: str) -> AutoOptions:
        """The default candidates with the backend's 16-bit reference: bf16 where it is
        summed (NCCL), else fp16 (gloo has no bf16 sum on every build); a named list
        as it is."""
        if not self.default_candidates or backend.lower() not in BF16_BACKENDS:
            return self
        return replace(self, candidates=("bf16", *self.candidates[1:]))


@dataclass
class Decision:
    """One choice: from which step, which candidate, on which agreed costs (ms/step)."""

    from_step: int
    method: str
    costs_ms: dict[str, float]
    why: str


@dataclass
class AutoController:
    """The schedule and the choice, from step times only (no torch.distributed): ``agree``
    maps this rank's figures to the same figures on every rank (the MAX over ranks)."""

    options: AutoOptions
    agree: Callable[[list[float]], list[float]]
    #: ``agree`` begun now and read later (the drift checks: it overlaps a step);
    #: None: ``agree``, run when read
    agree_later: Callable[[list[float]], Callable[[], list[float]]] | None = None
    step: int = 0  # synchronized steps begun so far: the current step's number (from 1)
    choice: int = 0
    trial_start: int | None = None  # the step the running trial began at
    order: list[int] = field(default_factory=list)  # the running trial's candidates
    slot: int = 0  # the running trial's candidate: ``order[slot]``
    slot_start: int = 0  # the step it began at
    ran: dict[int, int] = field(default_factory=dict)  # candidate -> steps this trial
    next_trial: int = 0
    chosen_cost: float | None = None  # the agreed cost of the choice at its trial
    samples: dict[int, list[float]] = field(default_factory=dict)  # candidate -> ms
    window_ms: list[float] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    period: int = 0  # steps from this trial to the next periodic one
    #: whether the last window drifted (a second one running starts a trial)
    suspect: bool = False
    #: whether the next trial follows a jump (the choice then runs last)
    jumped: bool = False
    #: what deciding cost, in ms: ``agree`` (the collectives, added by the caller),
    #: ``trials`` (steps run on a losing candidate, over the choice's cost) and
    #: ``steps`` (every accounted step's time)
    overhead_ms: dict[str, float] = field(
        default_factory=lambda: {"agree": 0.0, "trials": 0.0, "steps": 0.0})

    def __post_init__(self) -> None:
        self.next_trial = self.next_trial or self.options.warmup
        self.period = self.period or self.options.every
        #: the last window's agreement in flight, read as the next step begins
        self._window: Callable[[], list[float]] | None = None

    def active(self) -> int:
        """The candidate that runs the current step."""
        if self.trial_start is None:
            return self.choice
        return self.order[self.slot]

    def begin_step(self, last_step_ms: float | None) -> int:
        """Account the step that just ended (``last_step_ms``; None for the first), move
        the schedule on, and return the candidate of the step that begins now."""
        self._check_drift()
        if last_step_ms is not None:
            self._account(last_step_ms)
        self.step += 1
        if self.trial_start is not None:
            self._advance_trial()
        if self.trial_start is None and self.step >= self.next_trial:
            if len(self.options.candidates) > 1:
                self._start_trial()
            self.next_trial = self.step + self.period
        if self.trial_start is not None:
            active = self.active()
            self.ran[active] = self.ran.get(active, 0) + 1
        return self.active()

    def pass_step(self) -> None:
        """A step that runs no candidate (DDP's plain first step, a resume's settling
        one): counted, so ``from_step`` numbers training steps, but neither timed nor
        part of a trial."""
        self.step += 1

    def _start_trial(self) -> None:
        """The current choice first (the figure a cut compares with), then the others;
        after a jump the others first and the choice last: what it costs now is what
        moved, and when a dropped link made it several times slower it is cut after
        one measured step instead of running a whole slot. (After a drift, which on a
        busy host is often noise, the choice stays first: it usually still wins, and a
        loser after it is cut.)"""
        n = len(self.options.candidates)
        others = [i for i in range(n) if i != self.choice]
        self.trial_start = self.slot_start = self.step
        self.order = [*others, self.choice] if self.jumped else [self.choice, *others]
        self.slot, self.samples, self.ran, self.jumped = 0, {}, {}, False

    def _advance_trial(self) -> None:
        """Move to the next candidate when this one has run its steps or is cut short;
        after the last, decide."""
        o, ran = self.options, self.step - self.slot_start
        over = ran >= o.trial_steps
        if not over and self.slot > 0 and ran == 2:  # its first measured step is in
            over = self._cut_short(self.order[self.slot])
        if over:
            self.slot, self.slot_start = self.slot + 1, self.step
            if self.slot >= len(self.order):
                self._decide()

    def _cut_short(self, candidate: int) -> bool:
        """Whether ``candidate``'s first measured step (agreed: the slowest rank's) costs
        more than ``cut`` above the cheapest trial median of the candidates before it
        (agreed too; a rank without a figure sends -inf, so the decision is the same on
        every rank)."""
        mine = self.samples.get(candidate, [])
        medians = [statistics.median(self.samples[i]) for i in self.order[:self.slot]
                   if self.samples.get(i)]
        first, base = self.agree([mine[0] if mine else -math.inf,
                                  min(medians) if medians else -math.inf])
        return math.isfinite(first) and math.isfinite(base) and base > 0 and \
            first > (1.0 + self.options.cut) * base

    def _account(self, ms: float) -> None:
        """File the step that just ended (its number is ``self.step``; steps count
        from 1)."""
        o, ended = self.options, self.step
        self.overhead_ms["steps"] += ms
        if self.trial_start is not None and ended >= self.trial_start:
            if ended > self.slot_start:  # the first step of each candidate warms it up
                self.samples.setdefault(self.order[self.slot], []).append(ms)
            return
        if self.chosen_cost is None or ended < o.warmup:
            return
        self.window_ms.append(ms)
        if len(self.window_ms) >= o.window:
            median = [statistics.median(self.window_ms)]
            self._window = (self.agree_later(median) if self.agree_later is not None
                            else lambda: self.agree(median))
            self.window_ms = []

    def _check_drift(self) -> None:
        """Read the last window's agreed median (begun a step ago); if the choice's step
        time moved by more than ``drift`` from its trial in this window and the one
        before, or by a factor of ``jump`` in this one, a trial begins now."""
        if self._window is None:
            return
        (agreed,) = self._window()
        self._window = None
        cost, o = self.chosen_cost, self.options
        if self.trial_start is not None or cost is None or cost <= 0:
            self.suspect = False
            return
        drifted = abs(agreed - cost) > o.drift * cost
        jumped = agreed >= o.jump * cost or agreed * o.jump <= cost
        if jumped or (drifted and self.suspect):
            self.next_trial = self.step + 1  # the step that begins now
            self.jumped = jumped  # the interval goes back to ``every`` only if the
            # trial switches: a drift that keeps the choice was noise or did not matter
            drifted = False
        self.suspect = drifted

    def _decide(self) -> None:
        """Agree on every candidate's cost and choose (module docstring: hysteresis)."""
        o = self.options
        local = [statistics.median(self.samples[i]) if self.samples.get(i) else float("inf")
                 for i in range(len(o.candidates))]
        agreed = self.agree(local)  # inf: some rank has no sample of it (a resume)
        measured = {i: c for i, c in enumerate(agreed) if math.isfinite(c)}
        current = self.choice
        best = min(measured, key=lambda i: (measured[i], i), default=current)
        if current not in measured:
            choice, why = current, "the current choice was not measured: kept"
        elif measured[best] < (1.0 - o.margin) * measured[current]:
            choice, why = best, (f"{(1 - measured[best] / measured[current]) * 100:.1f}% "
                                 f"cheaper than {o.candidates[current]}")
        else:
            choice, why = current, f"no candidate more than {o.margin:.0%} cheaper"
        cut = [o.candidates[i] for i in self.order[1:]
               if 0 < self.ran.get(i, o.trial_steps) < o.trial_steps]
        if cut:
            why += f"; cut short: {', '.join(cut)}"
        if choice in measured:  # the losers' trial steps, over what the choice costs
            self.overhead_ms["trials"] += sum(
                self.ran.get(i, o.trial_steps) * max(0.0, c - measured[choice])
                for i, c in measured.items() if i != choice)
        # a close switch is checked again soon (``every``); a clear one, or a kept
        # choice, lets the interval double (a link that changes back is a jump)
        close = choice != current and measured[choice] >= (1.0 - o.cut) * measured[current]
        self.period = o.every if close else min(2 * self.period, o.max_every)
        self.next_trial = (self.trial_start or self.step) + self.period
        self.choice, self.trial_start, self.suspect = choice, None, False
        self.chosen_cost, self.window_ms = measured.get(choice), []
        self.decisions.append(Decision(self.step, o.candidates[choice],
                                       {o.candidates[i]: c for i, c in measured.items()},
                                       why))

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "choice": self.choice, "trial_start": self.trial_start,
                "next_trial": self.next_trial, "chosen_cost": self.chosen_cost,
                "samples": {str(k): v for k, v in self.samples.items()},
                "order": list(self.order), "slot": self.slot, "slot_start": self.slot_start,
                "ran": {str(k): v for k, v in self.ran.items()},
                "window_ms": list(self.window_ms),
                "decisions": [d.__dict__ for d in self.decisions],
                "candidates": list(self.options.candidates),
                "period": self.period, "overhead_ms": dict(self.overhead_ms),
                "suspect": self.suspect, "jumped": self.jumped}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("candidates") != list(self.options.candidates):
            raise ValueError(f"auto state was saved for candidates {sd.get('candidates')}, "
                             f"this run has {list(self.options.candidates)}")
        self.step, self.choice = int(sd["step"]), int(sd["choice"])
        self.trial_start, self.next_trial = sd["trial_start"], int(sd["next_trial"])
        self.chosen_cost = sd["chosen_cost"]
        self.samples = {int(k): list(v) for k, v in sd["samples"].items()}
        self.order = [int(i) for i in sd.get("order", range(len(self.options.candidates)))]
        if "slot" in sd:
            self.slot, self.slot_start = int(sd["slot"]), int(sd["slot_start"])
        elif self.trial_start is not None:  # saved before trials had slots: fixed ones
            t = self.options.trial_steps
            self.slot = min((self.step - self.trial_start) // t, len(self.order) - 1)
            self.slot_start = self.trial_start + self.slot * t
        self.ran = {int(k): int(v) for k, v in sd.get("ran", {}).items()}
        self.window_ms = list(sd["window_ms"])
        self.decisions = [Decision(**d) for d in sd["decisions"]]
        self.period = int(sd.get("period", self.options.every))
        self.suspect = bool(sd.get("suspect", False))
        self.jumped = bool(sd.get("jumped", False))
        self.overhead_ms.update(sd.get("overhead_ms", {}))

    def overhead(self) -> dict[str, float]:
        """What deciding cost so far: the agreement collectives' and the trials' ms, and
        their sum as a fraction of all accounted steps' time."""
        spent = self.overhead_ms["agree"] + self.overhead_ms["trials"]
        total = self.overhead_ms["steps"]
        return {"agree_ms": round(self.overhead_ms["agree"], 3),
                "trials_ms": round(self.overhead_ms["trials"], 3),
                "steps_ms": round(total, 3),
                "fraction": round(spent / total, 6) if total > 0 else 0.0}


class AutoCore:
    """What ``auto`` keeps on every path: the candidates' codecs, the controller with its
    agreement group and clock, and the switch. ``next_step`` moves it on at each step's
    first reduction; ``take_residual`` hands a key's residual of the codec switched
    from to the caller, which adds it to that key's gradient (once per key)."""

    def __init__(self, options: AutoOptions, process_group: dist.ProcessGroup | None,
                 *, seed: int, nonfinite: str, links: dict[str, str | None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        options = options.for_backend(str(dist.get_backend(process_group)))
        self.options = options
        self.codecs = [build_codec(c, seed=seed, nonfinite=nonfinite)
                       for c in options.candidates]
        # the controller's own collectives: a few host numbers, on gloo whatever the
        # gradients' backend (NCCL takes device tensors only)
        self.group = private_group(process_group, backend="gloo")
        self.controller = AutoController(options, self._agree, self._agree_later)
        self.clock = clock
        #: each link's codec: a fixed spec, or None for the one ``auto`` chooses
        self.links = links
        self.current = 0
        self._began: float | None = None
        self._leaving: Codec | None = None  # the codec switched from
        self._flushed: set[str] = set()  # keys whose residual was handed over

    def _agree(self, values: list[float]) -> list[float]:
        """The MAX of ``values`` over the ranks (every rank gets the same list)."""
        began = time.perf_counter()
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.controller.overhead_ms["agree"] += (time.perf_counter() - began) * 1e3
        return t.tolist()

    def _agree_later(self, values: list[float]) -> Callable[[], list[float]]:
        """``_agree`` begun now (gloo's thread runs it while the step computes); the
        function returned waits for it, and only that wait is counted as its cost."""
        t = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

        def read() -> list[float]:
            began = time.perf_counter()
            work.wait()
            self.controller.overhead_ms["agree"] += (time.perf_counter() - began) * 1e3
            return cast(list[float], t.tolist())

        return read

    def next_step(self) -> int:
        """A step begins: account the last one's time, move the controller on, switch
        if it chose another candidate; the candidate of this step."""
        now = self.clock()
        last = None if self._began is None else (now - self._began) * 1e3
        self._began = now
        chosen = self.controller.begin_step(last)
        if chosen != self.current:
            self._leaving, self._flushed = self.codecs[self.current], set()
            self.current = chosen
        return chosen

    def restart_clock(self) -> None:
        """The time until the next step's first reduction is no candidate's."""
        self._began = None

    def take_residual(self, key: str, numel: int) -> torch.Tensor | None:
        """The residual of ``key`` the codec switched from still holds (once)."""
        if self._leaving is None or key in self._flushed:
            return None
        self._flushed.add(key)
        return self._leaving.take_residual(key, numel)

    def report(self) -> dict[str, Any]:
        """What ``auto`` chose, from which step, on which agreed costs, per link."""
        c = self.controller
        current = self.options.candidates[self.current]
        return {"method": str(self.options), "candidates": list(self.options.candidates),
                "current": current,
                "links": {k: current if v is None else v for k, v in self.links.items()},
                "decisions": [d.__dict__ for d in c.decisions],
                "overhead": c.overhead()}

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.controller.state_dict(), "current": self.current,
                "codecs": [c.state_dict() for c in self.codecs]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.controller.load_state_dict(sd["controller"])
        self.current = int(sd["current"])
        self.restart_clock()  # the time before the resume is no step of this process
        for codec, state in zip(self.codecs, sd["codecs"], strict=True):
            codec.load_state_dict(state)


class AutoState(AutoCore):
    """The DDP hook's state under ``auto``: one ``DDPCommState`` per candidate, one
    ``CommStats`` for all of them. With ``node_size`` (hierarchical DDP) the intra-node
    link stays plain and the candidates compete for the inter-node one."""

    def __init__(self, options: AutoOptions, process_group: dist.ProcessGroup | None,
                 *, seed: int, nonfinite: str, diagnose: bool, start_iteration: int,
                 node_size: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        links: dict[str, str | None] = ({"intra_node": "none", "inter_node": None}
                                        if node_size else {"all": None})
        super().__init__(options, process_group, seed=seed, nonfinite=nonfinite,
                         links=links, clock=clock)
        self.stats = CommStats()
        self.candidates = [DDPCommState(c, process_group, diagnose=diagnose,
                                        start_iteration=start_iteration, stats=self.stats,
                                        node_size=node_size)
                           for c in self.codecs]
        self.start_iteration = start_iteration
        self.iteration = 0  # synchronized backward passes, as DDPCommState counts them
        self._seen = -1  # the iteration whose first bucket came last

    def route(self, bucket: dist.GradBucket) -> DDPCommState:
        """The candidate that reduces ``bucket`` (the first bucket of a step moves the
        controller on; a switch queues the old codec's residuals for the new one)."""
        if self.iteration < self.start_iteration:  # a plain step (DDP's first, or a
            state = self.candidates[self.current]  # resume's settling one): no trial
            state.iteration = self.iteration      # times it, nothing is flushed
            if self._seen != self.iteration:
                self._seen = self.iteration
                self.controller.pass_step()
                self.restart_clock()
            if bucket.is_last():
                self.iteration += 1
            return state
        if self._seen != self.iteration:
            self._seen = self.iteration
            self.next_step()
        state = self.candidates[self.current]
        state.iteration = self.iteration  # one count of steps for every candidate
        if bucket.is_last():
            self.iteration += 1
        return state

    def flush(self, bucket: dist.GradBucket) -> None:
        """Add what the codec left behind holds for this bucket to its gradient."""
        buffer = bucket.buffer()
        residual = self.take_residual(f"bucket{bucket.index()}", buffer.numel())
        if residual is not None:
            buffer.add_(residual.to(buffer))

    def close(self) -> None:
        for state in self.candidates:
            state.close()


def auto_hook(state: AutoState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook of ``auto``: the bucket through the candidate the controller runs
    this step."""
    candidate = state.route(bucket)
    state.flush(bucket)
    return reduce_bucket(candidate, bucket)


auto_hook.__annotations__.update(bucket=dist.GradBucket,
                                 **{"return": torch.futures.Future[torch.Tensor]})


class AutoHandle:
    """What ``attach(model, "auto")`` returns: stats, report and checkpoint state, as
    ``Handle`` has them (``kind``: ddp, or fsdp2 for FSDP2 and HSDP)."""

    def __init__(self, state: Any, kind: str = "ddp") -> None:
        self.state = state
        self.kind = kind
        self.stats: CommStats = state.stats
        self.codecs: Sequence[Codec] = state.codecs
        self.capture: Any = None

    @property
    def codec(self) -> Codec:
        """The codec running now."""
        return cast(Codec, self.state.codecs[self.state.current])

    @property
    def chained(self) -> bool:
        candidates = getattr(self.state, "candidates", None)
        return bool(candidates and candidates[self.state.current].chained)

    def report(self) -> dict[str, Any]:
        return self.state.report()

    def restart_clock(self) -> None:
        """The time until the next step's first reduction (an evaluation, a checkpoint)
        is no step's: it is left out of what the trials and drift checks measure."""
        self.state.restart_clock()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "auto", **self.state.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != "auto":
            raise ValueError(f"comm state was saved for {sd.get('kind')!r}, this is auto")
        self.state.load_state_dict(sd)

    def close(self) -> None:
        self.state.close()

    def __repr__(self) -> str:
        return f"gradzip.comm.AutoHandle({self.state.options})"
