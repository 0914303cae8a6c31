"""Time to target across bandwidths, from measured runs: a stated time model, its
validation against real shaped runs, and each method's break-even bandwidth.

**The model.** A run's training time to its target over a link of rate ``B`` is
``n`` steps of

    t(B) = tc + c * alpha + 8 * max(0, v - credit) / (eta * B),
    credit = min(beta, B * tc / 8)

- ``n``: optimizer steps to the target (the step of the first evaluation at or below
  it). The same seed trains the same on every link, so ``n`` does not depend on ``B``;
- ``v``: bytes per step on the run's slowest link: on a ``shared`` link all W ranks'
  link bytes (one token bucket carries them all), on ``per-rank`` links one rank's, on
  ``nodes=NxL`` one node's uplink as the kernel counted it;
- ``c``: collectives per step (reductions and the extra calls of multi-round codecs)
  and ``alpha`` the latency of one (``--latency-us``, default 50 us: a TCP round trip
  between hosts in a data centre);
- ``eta``: the payload share of the nominal rate, measured on the link (TCP/IP
  headers; ~0.96 on a veth link, ~1.0 on the shared loopback's 64 KiB frames);
- ``tc``: the rest of a step (compute, codec, framework, and the emulated link's own
  per-collective latency, tens of microseconds on a loopback);
- ``credit``: what the link sends at once after idling while the step computed. The
  emulated link is a token bucket of ``beta`` bytes (tc's burst: 10 ms of traffic, at
  least 256 KiB), refilled at ``B`` while idle, so a step's first ``credit`` bytes cost
  no link time and a link-bound step takes about ``8 v / B`` whatever it computes. A
  real NIC banks nothing: ``beta = 0``.

``tc`` is fitted from each run at the fitted rate (the fastest shaped one by default),
where the bucket refills fully between steps, by solving the model for it. The
validation projects every other shaped rate with that rate's own ``beta`` (and no
``alpha``: the emulated link's latency is in ``tc``) and compares against its measured
time to target; the projection across bandwidths, the break-even
and the recommendation are for real links (``beta = 0``). DDP's overlap of
communication with backward is not modelled: the built-in trainer's tiny and small
models fit one bucket, which starts after backward.

**Break-even.** With ``beta = 0`` and averaged over seeds, ``T(B) = A + K / B`` per
method. Against the best 16-bit all-reduce (``A16 + K16 / B``) a method wins where
``A - A16 < (K16 - K) / B``: below ``B* = (K16 - K) / (A - A16)`` when it sends fewer
bytes but costs more per step; at every rate when it costs no more per step either (or
the same bytes for less); only above ``B*`` when it sends more bytes but costs less per
step; never when it sends no fewer bytes and costs no less.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from gradzip.compare.runs import Run, Setting, rate_bits_per_s
from gradzip.compare.summary import SIXTEEN_BIT, SettingSummary

#: latency of one collective, the model's default (seconds)
DEFAULT_LATENCY_S = 50e-6
#: the bandwidths of the projection, bits/s: 10 Mbit/s to 100 Gbit/s
SWEEP_RATES = tuple(10 ** (7 + i / 8) for i in range(33))
#: rates of the report's table
TABLE_RATES = (10e6, 100e6, 1e9, 10e9, 100e9)
#: a step whose link time is at least this share of it is link-bound
LINK_BOUND = 0.9
#: the validation's bar: projected within this share of the measured time to target
VALIDATION_BAR = 0.15


@dataclass(frozen=True)
class Fit:
    """One run's time model: its measured figures (see the module docstring)."""

    method: str
    seed: int | None
    steps_to_target: float | None  # None: the run never reached its target
    t0_s: float  # tc
    collectives: float  # per step
    link_bytes: float  # per step, on the slowest link
    efficiency: float  # eta
    #: the fitted rate's link leaves a step link-bound even with a full bucket: ``tc``
    #: is then only bounded (the whole step is link time)
    link_bound: bool = False

    def step_s(self, bits_per_s: float, latency_s: float, burst: float = 0.0) -> float:
        """Modelled seconds per step at ``bits_per_s`` on a link banking up to ``burst``
        bytes while idle (0: a real NIC)."""
        credit = min(burst, bits_per_s * self.t0_s / 8)
        return (self.t0_s + self.collectives * latency_s
                + 8 * max(0.0, self.link_bytes - credit) / (self.efficiency * bits_per_s))

    def time_to_target(self, bits_per_s: float, latency_s: float,
                       burst: float = 0.0) -> float | None:
        if self.steps_to_target is None:
            return None
        return self.steps_to_target * self.step_s(bits_per_s, latency_s, burst)


def link_burst(rate: str | None) -> float:
    """``beta``: the bytes the emulated link's token bucket holds at ``rate``."""
    from gradzip.comm.netns import tbf_burst

    return float(int(tbf_burst(rate)[:-2]) * 1024) if rate else 0.0


def steps_to_target(run: Run, target: float | None) -> float | None:
    """Steps (in the units ``train_time_s / steps`` is per) until the run's first
    evaluation at or below ``target``: its training time there over the run's mean
    time per step. Counted in time, not in the evaluation's step number, so a script
    that numbers its steps otherwise (micro-batches, epochs) cannot skew ``n``."""
    train_s, steps = run.num("train_time_s"), run.steps_run()
    if target is None or not train_s or not steps:
        return None
    # the record's own clock (``history`` adds what restarts cost, which train_s lacks)
    hit = run.reached(target)
    return None if hit is None else (hit[1] - run.charged_s(hit[0])) * steps / train_s


def bottleneck_bytes(run: Run) -> float | None:
    """Bytes per step on the run's slowest link (module docstring), None if unknown."""
    if run.uplink_per_step() is not None:
        return run.uplink_per_step()
    per_rank = run.per_step("bytes_wire_total")
    if per_rank is None:
        return None
    ranks = run.setting.ranks or 1
    return per_rank * ranks if run.setting.link == "shared" else per_rank


def collectives_per_step(run: Run) -> float:
    """Reductions (codec calls of every aggregation path) and extra collective calls,
    per step; 1 when the record has neither."""
    steps = run.steps_run()
    paths = run.record.get("aggregation") or {}
    calls = sum(v for v in paths.values() if isinstance(v, int | float))
    calls += run.num("extra_collectives") or 0
    return calls / steps if steps and calls else 1.0


def fit_run(run: Run, target: float | None) -> Fit | None:
    """The run's time model, or None when its link rate or figures are unknown: ``tc``
    from its mean training time per step with the bucket's full ``beta`` as credit."""
    nominal = rate_bits_per_s(run.setting.rate)
    achieved = run.achieved_rate or nominal
    train_s, steps, v = run.num("train_time_s"), run.steps_run(), bottleneck_bytes(run)
    if not (run.shaped and nominal and achieved and train_s and steps) or v is None:
        return None
    c = collectives_per_step(run)
    # replicas model a real NIC (no token bucket): nothing is banked
    beta = 0 if run.setting.link == "replicas" else link_burst(run.setting.rate)
    # the emulated link's own per-collective latency stays in t0 (tens of us on a
    # loopback); a real link's latency_s is added on top when projecting
    t0 = train_s / steps - 8 * max(0.0, v - beta) / achieved
    # the link alone explains the step: a token bucket banks the compute's tokens, so
    # such a step takes 8 v / B whatever it computed, and tc is not identified
    bound = 8 * v / achieved >= LINK_BOUND * train_s / steps
    return Fit(run.method, run.seed, steps_to_target(run, target), max(t0, 0.0), c, v,
               achieved / nominal, bound)


@dataclass(frozen=True)
class Curve:
    """A method's modelled time to target, averaged over the seeds that reached it:
    ``A + K / B`` seconds (``K`` in bit-seconds per bit/s)."""

    method: str
    a_s: float
    k_bits: float
    reached: int
    runs: int
    fits: tuple[Fit, ...] = field(repr=False, default=())

    def at(self, bits_per_s: float) -> float:
        """Projected seconds to target on a real link (``beta = 0``)."""
        return self.a_s + self.k_bits / bits_per_s

    def emulated_at(self, bits_per_s: float) -> float:
        """The same on the emulated link of that rate: its token bucket's credit, and
        its own latency (in ``t0``) rather than ``alpha``."""
        burst = link_burst(f"{bits_per_s:.0f}bit")
        return statistics.fmean(f.time_to_target(bits_per_s, 0.0, burst) or 0.0
                                for f in self.fits)

    @property
    def steps(self) -> float:
        """Mean steps to target over the seeds that reached it."""
        return statistics.fmean(f.steps_to_target or 0 for f in self.fits)

    def mean(self, name: str) -> float:
        """The mean of a ``Fit`` figure over those seeds."""
        return statistics.fmean(float(getattr(f, name)) for f in self.fits)


def curve(method: str, fits: list[Fit], latency_s: float) -> Curve | None:
    """The mean curve of ``fits``; None when no run reached the target."""
    reached = [f for f in fits if f.steps_to_target is not None]
    if not reached:
        return None
    a = statistics.fmean((f.steps_to_target or 0) * (f.t0_s + f.collectives * latency_s)
                         for f in reached)
    k = statistics.fmean((f.steps_to_target or 0) * 8 * f.link_bytes / f.efficiency
                         for f in reached)
    return Curve(method, a, k, len(reached), len(fits), tuple(reached))


@dataclass(frozen=True)
class BreakEven:
    """Where a method stops beating the 16-bit baseline (module docstring)."""

    kind: str  # "below", "always", "never", "above"
    bits_per_s: float | None = None

    def describe(self) -> str:
        rate = rate_label(self.bits_per_s) if self.bits_per_s is not None else ""
        return {"below": f"wins below {rate}", "always": "wins at every rate",
                "never": "never wins", "above": f"wins only above {rate}"}[self.kind]


def break_even(m: Curve, base: Curve) -> BreakEven:
    """The rate below which ``m`` reaches the target before ``base``."""
    return weigh(m.a_s - base.a_s, base.k_bits - m.k_bits)


def weigh(a: float, k: float) -> BreakEven:
    """Where a method that costs ``a`` more seconds and saves ``k`` bits (either may be
    negative) against a baseline wins: ``a < k / B`` (the module docstring)."""
    if k > 0:
        return BreakEven("below", k / a) if a > 0 else BreakEven("always")
    if k == 0:
        return BreakEven("always") if a < 0 else BreakEven("never")
    return BreakEven("above", k / a) if a < 0 else BreakEven("never")


@dataclass(frozen=True)
class Check:
    """The model against one shaped setting it was not fitted on."""

    method: str
    rate: str
    measured_s: float
    projected_s: float

    @property
    def error(self) -> float:
        return self.projected_s / self.measured_s - 1


@dataclass
class Sweep:
    """Projection from one setting, checked against the others of the same ranks and
    link kind."""

    fitted: Setting
    latency_s: float
    curves: list[Curve]
    baseline: Curve | None
    checks: list[Check]

    def break_evens(self) -> dict[str, BreakEven]:
        if self.baseline is None:
            return {}
        return {c.method: break_even(c, self.baseline) for c in self.curves
                if c.method != self.baseline.method}

    def best_by_rate(self) -> list[tuple[float, float, str]]:
        """``(from, to, method)``: the method of lowest projected time to target over
        each span of ``SWEEP_RATES`` where it stays the best."""
        spans: list[tuple[float, float, str]] = []
        if not self.curves:
            return spans
        for bits in SWEEP_RATES:
            best = min(self.curves, key=lambda c: c.at(bits)).method
            if spans and spans[-1][2] == best:
                spans[-1] = (spans[-1][0], bits, best)
            else:
                spans.append((bits, bits, best))
        return spans

    def worst_error(self) -> float | None:
        return max((abs(c.error) for c in self.checks), default=None)


def _fits(summary: SettingSummary) -> dict[str, list[Fit]]:
    out: dict[str, list[Fit]] = {}
    for m in summary.methods:
        fits = [f for r in m.runs if (f := fit_run(r, summary.target_for(r)))]
        if fits:
            out[m.method] = fits
    return out


def _fit_setting(summaries: list[SettingSummary], rate: str | None) -> SettingSummary | None:
    """The setting to fit on: ``rate``'s, else the fastest shaped one."""
    shaped = [s for s in summaries if rate_bits_per_s(s.setting.rate)
              and any(r.shaped for r in s.runs)]
    if rate is not None:
        return next((s for s in shaped if s.setting.rate == rate), None)
    return max(shaped, key=lambda s: rate_bits_per_s(s.setting.rate) or 0.0, default=None)


def sweep(summaries: list[SettingSummary], fit_rate: str | None = None,
          latency_s: float = DEFAULT_LATENCY_S) -> Sweep | None:
    """The projection across bandwidths and its validation; None without a shaped
    setting to fit on."""
    fitted = _fit_setting(summaries, fit_rate)
    if fitted is None:
        return None
    fits = _fits(fitted)
    curves = [c for m, f in fits.items() if (c := curve(m, f, latency_s))]
    base = next((c for name in SIXTEEN_BIT for c in curves if c.method == name), None)
    checks = []
    for other in summaries:
        if other is fitted or not other.setting.same_link(fitted.setting):
            continue
        checks += _checks(other, fits)
    return Sweep(fitted.setting, latency_s, curves, base, checks)


def _checks(other: SettingSummary, fits: dict[str, list[Fit]]) -> list[Check]:
    """Each method's mean measured time to target in ``other`` against the model fitted
    elsewhere, at ``other``'s measured rate, over the seeds that reached it in both."""
    out = []
    for m in other.methods:
        by_seed = {f.seed: f for f in fits.get(m.method, [])}
        pairs = []
        for r in m.runs:
            fit, target = by_seed.get(r.seed), other.target_for(r)
            hit = r.reached(target) if target is not None else None
            measured = hit[1] if hit else None
            achieved = r.achieved_rate
            if fit is None or measured is None or measured <= 0 or not achieved \
                    or not r.shaped:
                continue
            # the nominal rate whose payload share is what this link delivered, and
            # the bucket of that rate; no latency added: the emulated link's own is
            # in t0 already
            projected = fit.time_to_target(achieved / fit.efficiency, 0.0,
                                           link_burst(other.setting.rate))
            if projected is not None:
                pairs.append((measured, projected))
        if pairs:
            out.append(Check(m.method, other.setting.rate or "?",
                             statistics.fmean(p[0] for p in pairs),
                             statistics.fmean(p[1] for p in pairs)))
    return out


def rate_label(bits: float, spec: str = ".3g") -> str:
    """``100 Mbit/s``, ``2.5 Gbit/s`` (``spec`` formats the number)."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:{spec}} {unit}"
    return f"{bits:{spec}} bit/s"
