"""``auto``: options, the controller's schedule and choice, and the DDP hook on real
gloo ranks (agreement at W=3 with rank-dependent timings, no error-feedback mass lost in
a switch, resume continuing the same choice)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.codecs.registry import SpecError
from gradzip.comm.auto import AutoController, AutoOptions
from gradzip.comm.launch import run_ranks


# ---------------------------------------------------------------- options
def test_options_parse_print_and_refuse() -> None:
    assert AutoOptions.parse("auto") == AutoOptions()
    assert str(AutoOptions()) == "auto"
    o = AutoOptions.parse('auto(candidates="fp16; int8 | ans", margin=0.1, every=100)')
    assert o.candidates == ("fp16", "int8 | ans") and o.margin == 0.1 and o.every == 100
    assert AutoOptions.parse(str(o)) == o
    with pytest.raises(SpecError, match="tpok"):
        AutoOptions.parse('auto(candidates="fp16; tpok(ratio=0.1)")')
    with pytest.raises(ValueError, match="unknown option"):
        AutoOptions.parse("auto(speed=3)")
    with pytest.raises(ValueError, match="not a gradzip codec spec"):
        AutoOptions.parse('auto(candidates="torch:fp16; int8")')
    with pytest.raises(ValueError, match="margin must be"):
        AutoOptions.parse("auto(margin=1.5)")
    with pytest.raises(ValueError, match="every"):
        AutoOptions.parse("auto(every=4)")
    with pytest.raises(ValueError, match=r"max_every \(100\) must be >= every"):
        AutoOptions.parse("auto(every=200, max_every=100)")


def test_the_16_bit_reference_follows_the_backend() -> None:
    """bf16 where the backend sums it (NCCL), fp16 on gloo; a list the user named is
    kept as it is, and the method's name does not change."""
    assert AutoOptions().for_backend("nccl").candidates == ("bf16", "int8")
    assert AutoOptions().for_backend("gloo").candidates == ("fp16", "int8")
    named = AutoOptions.parse('auto(candidates="fp16; int8")')
    assert named.for_backend("nccl").candidates == ("fp16", "int8")
    assert str(AutoOptions().for_backend("nccl")) == "auto"
    assert "default_candidates" not in AutoOptions().to_json()["auto"]
    with pytest.raises(ValueError, match="unknown option"):
        AutoOptions.parse("auto(default_candidates=0)")


# ---------------------------------------------------------------- controller
def _run(controller: AutoController, cost_ms: dict[int, float], steps: int) -> list[int]:
    """The candidate of each step when candidate i's steps take ``cost_ms[i]``."""
    ran, last = [], None
    for _ in range(steps):
        active = controller.begin_step(last)
        ran.append(active)
        last = cost_ms[active]
    return ran


def test_a_candidate_replaces_the_reference_only_when_faster_by_the_margin() -> None:
    o = AutoOptions(warmup=3, trial_steps=3, every=20, window=5)
    ran = _run(AutoController(o, lambda v: v), {0: 10.0, 1: 7.0}, 30)
    # steps 1-2 the reference; the trial runs each candidate 3 steps; then int8
    assert ran[:2] == [0, 0] and ran[2:8] == [0, 0, 0, 1, 1, 1] and ran[8:22] == [1] * 14
    slight = AutoController(o, lambda v: v)
    assert set(_run(slight, {0: 10.0, 1: 9.7}, 30)[8:22]) == {0}  # 3%: within the margin
    assert slight.decisions[0].method == "fp16"
    assert "no candidate more than 5% cheaper" in slight.decisions[0].why


def test_a_drifting_step_time_starts_a_new_trial() -> None:
    o = AutoOptions(warmup=2, trial_steps=2, every=1000, window=4, drift=0.25)
    c = AutoController(o, lambda v: v)
    costs = {0: 10.0, 1: 20.0}
    _run(c, costs, 12)
    assert [d.method for d in c.decisions] == ["fp16"]
    costs[0], costs[1] = 40.0, 12.0  # the link slowed down: the 16-bit path suffers most
    more = _run(c, costs, 20)
    assert [d.method for d in c.decisions] == ["fp16", "int8"]
    assert more[-1] == 1


def test_trials_that_keep_the_choice_come_less_often() -> None:
    """A candidate that loses is not paid for every ``every`` steps: the interval doubles
    up to ``max_every`` while trials keep the choice, and a switch resets it."""
    o = AutoOptions(warmup=1, trial_steps=2, every=10, max_every=40)
    c = AutoController(o, lambda v: v)
    _run(c, {0: 10.0, 1: 30.0}, 200)
    starts = [d.from_step - 4 for d in c.decisions]  # a trial is 2 x 2 steps
    assert starts[:5] == [1, 21, 61, 101, 141] and all(d.method == "fp16" for d in c.decisions)
    noisy = AutoController(AutoOptions(warmup=1, trial_steps=2, every=10, max_every=80,
                                       window=4), lambda v: v)
    _run(noisy, {0: 10.0, 1: 30.0}, 40)  # trials at 1 and 21 keep fp16: next due at 61
    for ms in [14.0] * 8:  # two windows 40% off: a drift trial at once ...
        noisy.begin_step(ms)
    _run(noisy, {0: 10.0, 1: 30.0}, 10)
    assert len(noisy.decisions) == 3 and noisy.decisions[-1].method == "fp16"
    # ... which keeps fp16: the interval keeps doubling (40, then 80), not back to 10
    assert noisy.period == 80 and noisy.next_trial > noisy.decisions[-1].from_step + 60


def test_a_drop_of_the_link_is_acted_on_within_fifty_steps() -> None:
    """With the default window (10 steps), a step time that jumps in the middle of a
    window starts a trial once two windows running have drifted; the trial measures
    the current choice again beside the others, and the switch follows it."""
    c = AutoController(AutoOptions(), lambda v: v)
    costs = {0: 40.0, 1: 50.0}
    _run(c, costs, 125)  # trials at steps 3 and 53 keep fp16; the next is due at 253
    assert [d.method for d in c.decisions] == ["fp16", "fp16"]
    costs[0], costs[1] = 180.0, 90.0  # the link dropped between steps 125 and 126
    _run(c, costs, 60)
    assert [d.method for d in c.decisions] == ["fp16", "fp16", "int8"]
    # 4.5x slower: one window (the one that ends at step 130, read at 131) starts the
    # trial, and its 2 x 6 steps decide
    assert c.decisions[2].from_step - 125 <= 25
    assert c.decisions[2].costs_ms == {"fp16": 180.0, "int8": 90.0}


def test_after_a_jump_the_choice_runs_last_and_is_cut_when_far_behind() -> None:
    """A trial that a jump started measures the others first: the current choice, which
    the dropped link made several times slower, runs 2 steps of its slot, not 6; after
    a drift short of a jump (often noise) the choice runs first, as in a periodic one."""
    c = AutoController(AutoOptions(), lambda v: v)
    costs = {0: 40.0, 1: 50.0}
    _run(c, costs, 125)
    costs[0], costs[1] = 180.0, 90.0  # the link dropped
    ran = _run(c, costs, 40)
    start = ran.index(1)  # the trial: int8's slot, then fp16's
    assert ran[start:start + 9] == [1] * 6 + [0, 0, 1]
    d = c.decisions[-1]
    assert d.method == "int8" and "cut short: fp16" in d.why and d.from_step - 125 <= 20
    assert not c.jumped  # the next trial is a periodic one: the choice first again
    slower = AutoController(AutoOptions(), lambda v: v)
    costs = {0: 40.0, 1: 50.0}
    _run(slower, costs, 125)
    costs[0], costs[1] = 60.0, 90.0  # 1.5x: a drift, two windows running
    ran = _run(slower, costs, 60)
    start = ran.index(1) - 6
    assert ran[start:start + 9] == [0] * 6 + [1, 1, 0]  # fp16 first, int8 cut after it


def test_a_first_choice_is_checked_again_within_fifty_steps() -> None:
    """The default schedule: trials at step 3 and 50 steps after, the interval doubling
    while they keep the choice; a close switch (less than ``cut`` cheaper) brings the
    next trial back to 50 steps, a clear one does not."""
    c = AutoController(AutoOptions(), lambda v: v)
    _run(c, {0: 10.0, 1: 9.0}, 800)  # int8 10% cheaper: chosen at the first trial
    starts = [d.from_step - 2 * 6 for d in c.decisions]
    assert starts == [3, 53, 153, 353] + ([753] if len(starts) > 4 else [])
    assert [d.method for d in c.decisions][:2] == ["int8", "int8"]
    settling = AutoController(AutoOptions(), lambda v: v)
    costs = {0: 10.0, 1: 9.0}  # int8 looks cheaper while the run settles ...
    _run(settling, costs, 20)
    costs[1] = 10.8  # ... and is not (short of a drift): fp16 again at the next trial
    _run(settling, costs, 50)
    assert [(d.from_step, d.method) for d in settling.decisions] == [(15, "int8"),
                                                                     (65, "fp16")]
    clear = AutoController(AutoOptions(), lambda v: v)
    _run(clear, {0: 10.0, 1: 5.0}, 200)  # int8 half fp16's cost: no early re-check
    assert [d.from_step for d in clear.decisions] == [15, 111]  # trials at 3 and 103


def test_a_candidate_far_behind_is_cut_short() -> None:
    """The current choice runs first; a candidate whose first measured step costs more
    than ``cut`` above the choice's median runs 2 steps, not ``trial_steps``, and what
    deciding cost counts the steps it ran."""
    o = AutoOptions(warmup=1, trial_steps=6, every=100)
    c = AutoController(o, lambda v: v)
    ran = _run(c, {0: 10.0, 1: 13.0}, 20)  # 1.3x: past the 25% cut
    assert ran[:9] == [0] * 6 + [1, 1, 0]
    [d] = c.decisions
    assert d.from_step == 9 and "cut short: int8" in d.why
    assert c.overhead()["trials_ms"] == 2 * 3.0
    near = AutoController(o, lambda v: v)
    assert _run(near, {0: 10.0, 1: 12.0}, 20)[:13] == [0] * 6 + [1] * 6 + [0]  # 1.2x
    # the current choice (int8) first, fp16 cut after it: a drop with int8 running
    settled = AutoController(o, lambda v: v)
    _run(settled, {0: 10.0, 1: 5.0}, 20)
    assert settled.choice == 1
    settled.next_trial = settled.step + 1
    assert _run(settled, {0: 30.0, 1: 10.0}, 9) == [1] * 6 + [0, 0, 1]


def test_a_cut_is_agreed_on_every_rank() -> None:
    """The first step and the choice's median are agreed (the MAX) before a cut: a rank
    that measured the candidate slow cannot cut it while another does not, and a rank
    with no figure (-inf) leaves the decision to the others."""
    o = AutoOptions(warmup=1, trial_steps=4, every=100)
    others = [9.0, 20.0]  # another rank's first step and choice median
    sent: list[list[float]] = []

    def agree(values: list[float]) -> list[float]:
        sent.append(list(values))
        return [max(v, w) for v, w in zip(values, others, strict=False)] + values[2:]

    c = AutoController(o, agree)
    ran = _run(c, {0: 10.0, 1: 14.0}, 12)  # 1.4x here, 0.7x of the agreed median
    assert ran[:8] == [0] * 4 + [1] * 4 and "cut short" not in c.decisions[0].why
    assert sent[0] == [14.0, 10.0]
    lone = AutoController(o, lambda v: [v[0], -math.inf] if len(v) == 2 else v)
    assert _run(lone, {0: 10.0, 1: 30.0}, 12)[:8] == [0] * 4 + [1] * 4


def test_a_trial_saved_before_slots_resumes_at_its_place() -> None:
    """A checkpoint written before trials had slots (fixed ``trial_steps`` per candidate)
    resumes inside its trial at the same candidate."""
    o = AutoOptions(warmup=1, trial_steps=3, every=100)
    c = AutoController(o, lambda v: v)
    _run(c, {0: 10.0, 1: 10.0}, 5)  # the trial began at step 1: int8 runs step 5
    sd = c.state_dict()
    for key in ("order", "slot", "slot_start", "ran"):
        del sd[key]
    again = AutoController(o, lambda v: v)
    again.load_state_dict(sd)
    assert (again.slot, again.slot_start, again.active()) == (1, 4, 1)


def test_one_noisy_window_starts_no_trial() -> None:
    """A window whose median is far off, between windows that are not, is noise: no
    trial; two running are a change: a trial."""
    o = AutoOptions(warmup=1, trial_steps=2, every=1000, window=4)
    c = AutoController(o, lambda v: v)
    _run(c, {0: 10.0, 1: 20.0}, 8)  # trial at steps 1-4, then windows of 4
    steps = [10.0] * 4 + [15.0] * 4 + [10.0] * 8  # 1.5x: past drift, short of jump
    for ms in steps:
        c.begin_step(ms)
    assert len(c.decisions) == 1
    for ms in [15.0] * 20:
        c.begin_step(ms)
    assert len(c.decisions) == 2


def test_a_jump_starts_a_trial_after_one_window_and_a_drift_after_two() -> None:
    """A window 2x off (``jump``) is a changed link, not noise: a trial at once; a
    window 1.5x off must be followed by another (``drift``), in either direction."""
    o = AutoOptions(warmup=1, trial_steps=2, every=1000, window=4)
    for first, second, trials in ((20.0, 10.0, 2), (15.0, 10.0, 1), (15.0, 15.0, 2),
                                  (5.0, 10.0, 2), (7.0, 10.0, 1)):
        c = AutoController(o, lambda v: v)
        _run(c, {0: 10.0, 1: 30.0}, 8)  # the trial: steps 1-4, then windows of 4
        for ms in [first] * 4 + [second] * 4 + [10.0] * 8:
            c.begin_step(ms)
        assert len(c.decisions) == trials, (first, second)


def test_a_window_is_agreed_while_the_next_step_runs() -> None:
    """The drift check's collective is begun as a window ends and read as the step after
    the next begins, so it overlaps a step instead of stalling one."""
    o = AutoOptions(warmup=1, trial_steps=2, every=1000, window=4)
    events: list[tuple[str, int]] = []
    c = AutoController(o, lambda v: v)

    def later(values: list[float]):
        events.append(("begun", c.step))
        return lambda: (events.append(("read", c.step)), values)[1]

    c.agree_later = later
    _run(c, {0: 10.0, 1: 20.0}, 16)
    # the trial runs steps 1-4; the window is steps 5-8: begun as step 8 is accounted,
    # read before step 9's own accounting (step 9 ran meanwhile)
    assert events[:2] == [("begun", 8), ("read", 9)]


def test_the_cost_of_deciding_is_measured() -> None:
    """The losers' trial steps over the choice's cost, and the agreement collectives'
    time (the caller adds it), as a fraction of all steps' time."""
    o = AutoOptions(warmup=1, trial_steps=3, every=100)
    c = AutoController(o, lambda v: v)
    _run(c, {0: 10.0, 1: 12.0}, 101)  # one trial: int8's 3 steps cost 2 ms more each
    c.overhead_ms["agree"] += 2.0
    got = c.overhead()
    assert got["trials_ms"] == 6.0 and got["agree_ms"] == 2.0
    assert got["steps_ms"] == 100 * 10.0 + 3 * 2.0  # the last step is not yet accounted
    assert got["fraction"] == pytest.approx(8.0 / got["steps_ms"], abs=1e-6)


# ---------------------------------------------------------------- on gloo ranks
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def _fake_clock(handle: object, cost_ms: dict[int, float]) -> None:
    """Each step of candidate i takes ``cost_ms[i]``: the controller reads the clock at
    each step's first bucket, before it switches."""
    state = handle.state  # type: ignore[attr-defined]
    now = [0.0]

    def clock() -> float:
        now[0] += cost_ms[state.current] / 1e3
        return now[0]

    state.clock = clock


def _agree_ranks(rank: int, cost_sets: list[list[dict[int, float]]]) -> list[dict]:
    """One fresh DDP model and ``auto`` per cost set (each rank's fake costs), in turn on
    the same ranks: one spawn for every set."""
    reports = []
    for costs in cost_sets:
        model = DDP(_model())
        handle = gradzip.attach(model, "auto(trial_steps=3, every=50, window=5)")
        _fake_clock(handle, costs[rank])
        for step in range(16):
            model(_batch(step, rank)).pow(2).mean().backward()
            model.zero_grad()
        reports.append(handle.report())
        handle.close()
    return reports


@pytest.mark.dist
def test_ranks_that_measure_differently_still_choose_alike() -> None:
    """W=3; int8 looks faster on two ranks and slower on the third: the slowest rank's
    costs decide, so every rank keeps fp16, at the same step."""
    differ = [{0: 10.0, 1: 5.0}, {0: 10.0, 1: 12.0}, {0: 10.0, 1: 6.0}]
    everywhere = [{0: 10.0, 1: 5.0}] * 3  # faster on every rank: every rank switches
    by_rank = run_ranks(_agree_ranks, 3, [differ, everywhere])
    reports = [r[0] for r in by_rank]
    assert reports[0]["decisions"] == reports[1]["decisions"] == reports[2]["decisions"]
    [decision] = reports[0]["decisions"]
    assert decision["method"] == "fp16"
    assert decision["costs_ms"] == pytest.approx({"fp16": 10.0, "int8": 12.0})
    reports = [r[1] for r in by_rank]
    assert {r["decisions"][0]["method"] for r in reports} == {"int8"}
    assert {r["current"] for r in reports} == {"int8"}


def _conserves(rank: int) -> dict:
    """Gradients of fixed weights (no optimizer step), so every step's exact mean is
    known: what auto delivered over the steps against the sum of the exact means."""
    base = _model()
    model, local = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    handle = gradzip.attach(
        model, 'auto(candidates="ef | topk(ratio=0.1); fp16", trial_steps=3, every=50)')
    _fake_clock(handle, {0: 10.0, 1: 5.0})
    delivered = [torch.zeros_like(p) for p in base.parameters()]
    exact = [torch.zeros_like(p) for p in base.parameters()]
    for step in range(14):
        x = _batch(step, rank)
        model(x).pow(2).mean().backward()
        local(x).pow(2).mean().backward()
        for d, e, p, q in zip(delivered, exact, model.parameters(), local.parameters(),
                              strict=True):
            d.add_(p.grad)
            g = q.grad.clone()
            dist.all_reduce(g)
            e.add_(g / dist.get_world_size())
        model.zero_grad()
        local.zero_grad()
    codec = handle.codecs[0]  # ef | topk: left at the trial's switch to fp16
    leftover = sum(codec.residual_norm(f"bucket{i}") or 0.0 for i in range(4))
    err = max(float((d - e).abs().max()) for d, e in zip(delivered, exact, strict=True))
    scale = max(float(e.abs().max()) for e in exact)
    report = handle.report()
    handle.close()
    return {"err": err, "scale": scale, "leftover": leftover, "report": report}


@pytest.mark.dist
def test_a_switch_loses_no_error_feedback_mass() -> None:
    """Leaving ``ef | topk`` for ``fp16``: each bucket's residual joins its next gradient,
    so the gradients delivered over the run sum to the exact means (to fp16 rounding)."""
    r0, _ = run_ranks(_conserves, 2)
    assert r0["report"]["current"] == "fp16"
    assert r0["leftover"] == 0.0
    assert r0["err"] < 1e-2 * r0["scale"], r0


def _resumes(rank: int) -> dict:
    model = DDP(_model())
    handle = gradzip.attach(model, "auto(trial_steps=3, every=50, window=5)")
    _fake_clock(handle, {0: 10.0, 1: 5.0})
    for step in range(12):
        model(_batch(step, rank)).pow(2).mean().backward()
        model.zero_grad()
    saved, before = handle.state_dict(), handle.report()
    handle.close()
    again = DDP(_model())
    resumed = gradzip.attach(again, "auto(trial_steps=3, every=50, window=5)")
    resumed.load_state_dict(saved)
    _fake_clock(resumed, {0: 10.0, 1: 5.0})
    ran = []
    for step in range(12, 16):
        again(_batch(step, rank)).pow(2).mean().backward()
        again.zero_grad()
        ran.append(resumed.report()["current"])
    after = resumed.report()
    resumed.close()
    return {"before": before, "after": after, "ran": ran}


def _hierarchical(rank: int) -> dict:
    """2 nodes of 2 ranks; int8 measured cheaper: the inter-node link moves to int8,
    the intra-node one stays plain; each step's gradients against the exact mean."""
    model = DDP(_model())
    handle = gradzip.attach(model, "auto(trial_steps=3, every=50, window=5)", node_size=2)
    _fake_clock(handle, {0: 10.0, 1: 5.0})
    worst = 0.0
    for step in range(14):
        model.zero_grad()
        x = _batch(step, rank)
        model(x).pow(2).mean().backward()
        local = copy.deepcopy(model.module)
        local.zero_grad()
        local(x).pow(2).mean().backward()
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            exact = q.grad.clone()
            dist.all_reduce(exact)
            exact /= dist.get_world_size()
            worst = max(worst, float((p.grad - exact).abs().max() / exact.abs().max()))
        handle.stats.end_step()
    links = set(handle.stats.totals().get("links", {}))
    report = handle.report()
    handle.close()
    return {"report": report, "worst": worst, "links": links}


@pytest.mark.dist
def test_hierarchical_auto_compresses_only_between_nodes() -> None:
    reports = run_ranks(_hierarchical, 4)
    for r in reports:
        assert r["report"]["links"] == {"intra_node": "none", "inter_node": "int8"}
        assert r["report"]["decisions"] == reports[0]["report"]["decisions"]
        assert {"intra_node", "inter_node"} <= r["links"], r["links"]
        assert r["worst"] < 0.05  # int8 (and fp16) between nodes: close to the mean


@pytest.mark.dist
def test_a_resumed_run_continues_the_same_choice() -> None:
    r0, r1 = run_ranks(_resumes, 2)
    for r in (r0, r1):
        assert r["before"]["current"] == "int8" and set(r["ran"]) == {"int8"}
        assert r["after"]["decisions"] == r["before"]["decisions"]  # no new trial


def test_auto_is_refused_where_it_cannot_run_yet() -> None:
    store = dist.HashStore()  # one process, no environment touched
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DDP(_model())
        with pytest.raises(ValueError, match="replicate_group= is HSDP on FSDP2"):
            gradzip.attach(model, "auto", replicate_group=dist.group.WORLD)
        with pytest.raises(ValueError, match="does not take start_step"):
            gradzip.attach(model, "auto", start_step=3)
        with pytest.raises(SpecError, match="compresses gradient matrices"):
            gradzip.attach(model, 'auto(candidates="fp16; ef | powersgd(rank=2)")',
                           node_size=1)
        with pytest.raises(ValueError, match="DistributedDataParallel and fully_shard"):
            gradzip.attach(_model(), "auto")
        with pytest.raises(SpecError, match="tpok"):
            gradzip.attach(model, 'auto(candidates="tpok")')
    finally:
        dist.destroy_process_group()


def test_auto_is_a_method_of_the_grammar() -> None:
    from gradzip.comm.method import AutoMethod, parse_method

    m = parse_method('auto(candidates="fp16; int8 | ans")')
    assert isinstance(m, AutoMethod) and str(m) == 'auto(candidates="fp16; int8 | ans")'
    assert m.train_flags() == ["--codec", str(m)]
    assert m.to_json()["auto"]["candidates"] == ["fp16", "int8 | ans"]
    m.check(parallel="ddp")
    m.check(parallel="fsdp")
    with pytest.raises(ValueError, match="--parallel ddp, fsdp or hsdp"):
        m.check(parallel="none")
    with pytest.raises(SpecError, match="compresses gradient matrices"):
        parse_method('auto(candidates="fp16; ef | powersgd(rank=2)")').check(parallel="hsdp")
    with pytest.raises(ValueError, match="takes its own options"):
        parse_method("auto", start_step=5)


@pytest.mark.dist
def test_train_with_auto_records_its_choices(tmp_path_factory: pytest.TempPathFactory
                                             ) -> None:
    import subprocess

    from train_helpers import flags, last_result, launch

    out = tmp_path_factory.mktemp("auto") / "run"
    cache = tmp_path_factory.mktemp("cache")
    cmd = [*launch(2), "-m", "gradzip", "train", *flags(
        cache, out, "--parallel", "ddp", "--codec", "auto(trial_steps=2, every=8)",
        "--max-steps", "12", "--eval-every", "0")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = last_result(out)
    auto = rec["auto"]
    assert rec["method"] == "auto(trial_steps=2, every=8)" and auto["candidates"] == [
        "fp16", "int8"]
    assert auto["decisions"] and auto["decisions"][0]["from_step"] == 3 + 2 * 2
    assert set(auto["decisions"][0]["costs_ms"]) == {"fp16", "int8"}
    assert rec["bytes_wire_total"] < rec["bytes_raw_total"]  # fp16 or int8: compressed


def test_a_candidate_some_rank_did_not_measure_is_not_chosen_nor_recorded() -> None:
    """After a resume inside a trial a rank may lack a candidate's samples: its agreed
    cost is unknown (inf), so it is neither chosen nor written as a cost."""
    o = AutoOptions(warmup=1, trial_steps=2, every=100)
    c = AutoController(o, lambda v: [float("inf"), *v[1:]])  # candidate 0 unknown
    _run(c, {0: 10.0, 1: 5.0}, 8)
    [d] = c.decisions
    assert d.method == "fp16" and d.costs_ms == {"int8": 5.0} and "not measured" in d.why


def test_the_trainer_leaves_evaluations_out_of_the_step_clock() -> None:
    """After an evaluation or a checkpoint the loop restarts ``auto``'s clock: the step
    that ran before it is not measured (an evaluation is no candidate's cost)."""
    from types import SimpleNamespace

    from gradzip.train.parallel import Parallelism

    restarted: list[bool] = []
    Parallelism.not_a_step(SimpleNamespace(  # type: ignore[arg-type]
        handle=SimpleNamespace(restart_clock=lambda: restarted.append(True))))
    Parallelism.not_a_step(SimpleNamespace(handle=None))  # type: ignore[arg-type]
    assert restarted == [True]
    c = AutoController(AutoOptions(warmup=1, trial_steps=3, every=100), lambda v: v)
    for ms in (None, 10.0, 10.0, None, 10.0, 12.0, 12.0):  # None: the clock restarted
        c.begin_step(ms)
    assert c.samples == {0: [10.0], 1: [12.0, 12.0]}  # step 3 (fp16) left out
