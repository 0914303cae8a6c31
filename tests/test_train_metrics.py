"""Metrics and sinks: which rank logs where, the log line, timing statistics."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest

from gradzip.comm.stats import CommStats, Reduction
from gradzip.train.config import JobConfig
from gradzip.train.metrics import MetricLogger, RunMetrics, append_results, format_line


def sinks_config() -> JobConfig:
    cfg = JobConfig()
    cfg.run.wandb = cfg.run.tensorboard = cfg.run.progress = True
    return cfg


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    inits: list[dict] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: inits.append(kw) or fake
    fake.log = lambda data, step: None
    fake.finish = lambda: None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return inits


def test_only_rank_0_has_a_progress_bar_tensorboard_and_wandb(
        tmp_path: Path, fake_wandb: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # where tqdm draws the bar
    other = MetricLogger(tmp_path, 1, sinks_config(), total_steps=10, start_step=0)
    other.info("hello from rank 1")
    other.scalars(3, {"loss/train": 2.5, "note": "not a number"})
    other.close()
    assert other.bar is None and other.tb is None and other.wandb is None
    assert fake_wandb == [] and not (tmp_path / "tb").exists()
    lines = (tmp_path / "logs" / "rank1.log").read_text().splitlines()
    assert lines[0].endswith("hello from rank 1")
    assert json.loads(lines[1]) == {"step": 3, "loss/train": 2.5}  # its own log, numbers only

    main = MetricLogger(tmp_path, 0, sinks_config(), total_steps=10, start_step=4)
    assert main.bar is not None and main.bar.n == 4  # a resumed run's bar starts where it was
    assert main.tb is not None and len(fake_wandb) == 1
    main.advance()
    assert main.bar.n == 5
    main.close()
    assert (tmp_path / "logs" / "rank0.log").is_file() and list((tmp_path / "tb").iterdir())


def test_log_line_shows_loss_lr_throughput_comm_and_ratio() -> None:
    m = {"loss/train": 3.14159, "optim/lr": 3e-4, "throughput/tokens_per_s": 12345.6,
         "time/step(ms)": 41.7}
    assert format_line(7, 20, m) == "step 7/20 | loss 3.1416 | lr 3.00e-04 | 12,346 tok/s | " \
                                    "step 42ms"
    m.update({"comm/share(%)": 31.2, "comm/compression_ratio": 49.71, "loss/val": 2.5,
              "loss/val_ppl": 12.18})
    assert format_line(20, 20, m).endswith(
        "| step 42ms | comm 31% | ratio 49.7x | val 2.5000 (ppl 12.2)")


def test_run_metrics_exclude_warmup_from_timing_but_not_from_totals() -> None:
    m = RunMetrics(warmup=2, tokens_per_step=100, comm=None, grad_clip=1.0)
    for ms in (1000.0, 500.0, 10.0, 20.0, 30.0, 40.0, 50.0):
        m.end_step(ms, {"forward": ms / 2}, grad_norm=0.5)
    s = m.timing()
    assert s["timed_steps"] == 5 and s["step_time_ms_mean"] == 30.0
    assert s["step_time_ms_p50"] == 30.0 and s["step_time_ms_p90"] == pytest.approx(46.0)
    assert s["step_time_ms_p95"] == pytest.approx(48.0)
    assert s["tokens_per_s"] == pytest.approx(500 / 0.150)
    assert s["phase_share"]["forward"] == pytest.approx(0.5)
    assert s["comm_ratio"] is None  # no gradzip communication: not a fake zero
    assert all(v is None for v in m.communication().values())


def test_run_metrics_read_communication_from_comm_stats_only() -> None:
    """The first (uncompressed) step counts in the total ratio, not the steady one; comm
    time is CommStats' union of overlapping buckets; effective bandwidth is wire / time."""
    stats = CommStats()
    m = RunMetrics(warmup=0, tokens_per_step=10, comm=stats, grad_clip=1.0)
    stats.record(Reduction(numel=100, sent_values=100, bytes_raw=400, paths=["plain"],
                           bytes_by_op={"all_reduce": 400}, span=(0.0, 0.002)))
    m.end_step(10.0, {}, grad_norm=2.0)  # clipped
    for _ in range(3):
        stats.record(Reduction(numel=100, sent_values=1, bytes_raw=400, paths=["gather"],
                               bytes_by_op={"all_gather": 8}, span=(1.0, 1.001)))
        stats.record(Reduction(numel=100, sent_values=1, bytes_raw=400, paths=["gather"],
                               bytes_by_op={"all_gather": 8}, span=(1.0005, 1.002)))
        m.end_step(10.0, {}, grad_norm=float("nan"))
    c = m.communication()
    assert c["compression_ratio"] == pytest.approx(2800 / 448)
    assert c["compression_ratio_steady"] == pytest.approx(50.0)
    assert c["comm_time_ms_total"] == pytest.approx(2.0 + 3 * 2.0)
    assert c["effective_bandwidth_bytes_per_s"] == pytest.approx(448 / 0.008)
    assert m.counters() == {"nonfinite_grad_steps": 3, "clipped_steps": 1}
    assert m.timing()["comm_ratio"] == pytest.approx(8.0 / 40.0)


def test_results_are_strict_json_with_null_for_non_finite(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    append_results({"a": float("nan"), "b": {"c": [1.0, float("inf")]}, "d": 2}, [path])
    record = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert record == {"a": None, "b": {"c": [1.0, None]}, "d": 2}


def test_a_resumed_run_continues_the_same_wandb_run(
        tmp_path: Path, fake_wandb: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    for start in (0, 5):  # a run, then its --resume in the same directory
        MetricLogger(tmp_path, 0, sinks_config(), total_steps=10, start_step=start).close()
    first, resumed = fake_wandb
    assert first["id"] and first["id"] == resumed["id"] and resumed["resume"] == "allow"
    assert not list(tmp_path.glob("*.tmp*"))  # the id file was written atomically
    other = tmp_path / "other"
    MetricLogger(other, 0, sinks_config(), total_steps=10, start_step=0).close()
    assert fake_wandb[2]["id"] != first["id"]  # another run directory, another W&B run


def test_the_step_clock_keeps_every_step_then_thins_and_still_places_a_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A record keeps when each step ended; past ``STEP_CLOCK_MAX`` steps every n-th,
    and a change of the link is then placed to within n steps."""
    from gradzip.compare.harness import place_rate_changes
    from gradzip.train import metrics

    monkeypatch.setattr(metrics, "STEP_CLOCK_MAX", 10)
    m = RunMetrics(warmup=0, tokens_per_step=1, comm=None, grad_clip=0.0)
    for _ in range(8):
        m.end_step(1.0, {}, None)
    short = m.step_clock(first_step=5)
    assert short["every"] == 1 and len(short["end_unix"]) == 8
    m.step_end_unix = [100.0 + s for s in range(25)]  # step 5 + s ended at 100 + s
    thin = m.step_clock(first_step=5)
    assert thin["every"] == 3 and thin["end_unix"] == [100.0 + 3 * i for i in range(9)]
    [placed] = place_rate_changes([{"after_s": 1.0, "rate": "25mbit"}], "110.5 25mbit\n",
                                  thin)
    assert placed["at_step"] == 5 + 12  # the change came during step 16; kept: 17's end
