"""W replicas in one process train as W gloo ranks (issue 43, items 1 and 2).

``gradzip train --replicas W`` runs the same trainer on W threads, each the rank of a
threaded world (``comm/replicas.py``). At W = 2 a run of replicas equals the real gloo run
of the same seed bit for bit (losses at every evaluation, the final train loss, link
bytes); at W = 4 gloo's ring adds the four ranks' partial sums in another order than the
replicas' rank order, so per-step methods agree to float rounding (measured: 2e-8 to
2e-7 relative after 12 steps; asserted: 1e-5) and link bytes exactly. DiLoCo and
SparseLoCo reduce in an order of their own and agree bit for bit at both.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import flags, last_result, launch

from gradzip.comm import replicas
from gradzip.comm.replicas import LinkModel, ReplicaClock, run_replicas
from gradzip.train.interrupt import StopRequest, forward_signals

#: the five methods item 2 names (``none`` is gradzip's, the torch:none equivalent)
METHODS = {"none": ["--codec", "none"], "int8": ["--codec", "int8"],
           "ef_topk": ["--codec", "ef | topk(ratio=0.01)"],
           "diloco_int8": ["--codec", "diloco(sync_every=4) | int8"],
           "sparseloco": ["--codec", "sparseloco(sync_every=4)"]}
STEPS = ["--max-steps", "12", "--eval-every", "6", "--parallel", "ddp"]


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_replica_clock_counts_cpu_time_of_its_threads_not_the_wall() -> None:
    def replica(rank: int) -> tuple[float, float]:
        clock = replicas.current().clock  # type: ignore[union-attr]
        t0 = clock.now()
        _spin(0.05)
        time.sleep(0.2)  # waiting (a collective, a peer) is not the replica's time
        start = replicas.inherit()

        def helper() -> None:  # a communication thread it started
            start()
            _spin(0.05)
            replicas.leave()

        t = threading.Thread(target=helper)
        t.start()
        t.join()
        return t0, clock.now()

    [(t0, t1)] = run_replicas(1, replica)
    assert 0.09 < t1 - t0 < 0.18, t1 - t0  # both threads' 0.1 s of CPU, not the 0.2 s sleep


def test_a_thread_that_ended_without_leaving_keeps_its_last_reading() -> None:
    clock = ReplicaClock()
    done = threading.Event()

    def helper() -> None:
        clock.add_current_thread()
        _spin(0.03)
        clock.now()
        done.set()

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert done.is_set() and clock.now() >= 0.03


def test_replicas_are_the_ranks_of_one_world() -> None:
    import torch.distributed as dist

    def replica(rank: int) -> tuple[int, int, float]:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), float(t)

    assert run_replicas(3, replica) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_a_failing_replica_stops_the_others_and_its_error_is_raised() -> None:
    import torch.distributed as dist

    def replica(rank: int) -> None:
        if rank == 1:
            raise ValueError("replica 1 failed")
        dist.all_reduce(torch.ones(1))  # would wait for rank 1 forever

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="replica 1 failed"):
        run_replicas(3, replica)
    assert time.monotonic() - t0 < 30


def test_the_link_model_is_a_latency_per_collective_plus_bytes_over_the_rate() -> None:
    link = LinkModel(1e9, 50e-6, "1gbit")
    assert math.isclose(link.seconds(125_000_000, 2), 1.0001)
    assert link.seconds(0, 0) == 0.0


def test_a_signal_reaches_the_loop_of_every_replica_thread() -> None:
    ready, go = threading.Barrier(3), threading.Event()
    seen: list[str | None] = []

    def loop() -> None:
        stop = StopRequest(announce=False).install()  # not the main thread: it listens
        ready.wait()
        go.wait(10)
        seen.append(stop.signal_name)
        stop.restore()

    threads = [threading.Thread(target=loop) for _ in range(2)]
    with forward_signals():
        for t in threads:
            t.start()
        ready.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs in this thread between bytecodes
        go.set()
        for t in threads:
            t.join()
    assert seen == ["SIGTERM", "SIGTERM"]


@pytest.mark.parametrize("extra, message", [
    (["--parallel", "fsdp"], "use --parallel ddp"),
    (["--parallel", "ddp", "--threads", "2"], "drop --threads 2"),
    (["--parallel", "ddp", "--replica-link", "100mbps"], "bits per second"),
])
def test_what_replicas_cannot_run_is_refused_before_any_work(
        tmp_path: Path, extra: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "gradzip", "train", "--replicas", "2",
                           "--out", str(tmp_path / "run"), *extra],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def _train(argv: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout}\n{proc.stderr}"


def _losses(record: dict[str, Any]) -> list[float]:
    return [record["train_loss"], *(h["val_loss"] for h in record["eval_history"])]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", list(METHODS))
def test_replicas_train_as_gloo_ranks_do(cache: Path, tmp_path: Path, world: int,
                                         method: str) -> None:
    run = [*STEPS, *METHODS[method]]
    _train([*launch(world), "-m", "gradzip", "train",
            *flags(cache, tmp_path / "ranks", *run)])
    _train([sys.executable, "-m", "gradzip", "train", "--replicas", str(world),
            *flags(cache, tmp_path / "replicas", *run)])
    ranks, sim = last_result(tmp_path / "ranks"), last_result(tmp_path / "replicas")
    assert ranks["replicas"] is None and sim["replicas"]["count"] == world
    assert sim["world_size"] == ranks["world_size"] == world
    assert len(sim["eval_history"]) == 2
    for field in ("bytes_wire_total", "bytes_raw_total", "bytes_handed_total"):
        assert sim[field] == ranks[field], field
    if world == 2 or method in ("diloco_int8", "sparseloco"):
        assert _losses(sim) == _losses(ranks)
    else:
        assert _losses(sim) == pytest.approx(_losses(ranks), rel=1e-5)


def test_ctrl_c_stops_every_replica_at_one_step_and_the_run_resumes(cache: Path,
                                                                    tmp_path: Path) -> None:
    from test_train_shutdown import Run

    from gradzip.train import checkpoint as ckpt

    out = tmp_path / "run"
    run = Run([sys.executable, "-m", "gradzip", "train", "--replicas", "2",
               *flags(cache, out, "--max-steps", "100000", "--parallel", "ddp",
                      "--codec", "ef | topk(ratio=0.1)")], out)
    run.wait_for("tok/s")
    os.killpg(run.proc.pid, signal.SIGINT)  # reaches the main thread, which hands it on
    code, text = run.finish()
    assert code == 130 and "Traceback" not in text, text
    record = last_result(out)
    step = record["steps"]
    assert record["interrupted"] == "SIGINT" and step % 5 == 0, step  # a logged step
    [saved] = ckpt.step_dirs(out)
    assert sorted(p.name for p in saved.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    assert f"go on with: gradzip train --resume --out {out}" in text, text

    run = Run([sys.executable, "-m", "gradzip", "train", "--resume", "--out", str(out),
               "--max-steps", str(step + 3), "--decay-steps", "100000"], out)
    code, text = run.finish(timeout=120)
    assert code == 0 and "2 replicas" in text, text
    resumed = last_result(out)
    assert resumed["resumed_from_step"] == step and resumed["replicas"]["count"] == 2


@pytest.mark.dist
def test_a_race_of_replicas_models_its_link_and_says_so(tmp_path: Path) -> None:
    import json

    from test_results_schema import documented_compare_fields

    from gradzip.cli import main

    out = tmp_path / "race"
    assert main(["compare", "--replicas", "3", "--methods", "torch:none;int8", "--rate",
                 "100mbit", "--steps", "8", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["compare"]["method"] for r in records] == ["torch:none", "int8"]
    for r in records:
        c = r["compare"]
        assert c["link"] == "replicas" and c["ranks"] == 3 and c["shaped"]
        assert set(c) == documented_compare_fields()
        assert r["replicas"]["count"] == 3 and r["replicas"]["link"] == "100mbit"
    # PyTorch's all-reduce sends the same bytes every step: the step's modelled link time
    # is those bytes at 100 Mbit/s (and 50 us per collective, under 0.1% of it here)
    ddp = records[0]
    per_step = ddp["bytes_wire_total"] / ddp["steps"]
    assert ddp["phase_ms_mean"]["comm"] == pytest.approx(1e3 * 8 * per_step / 1e8, rel=0.01)
    assert ddp["step_time_ms_p50"] > ddp["phase_ms_mean"]["comm"]
    assert "modelled" in (out / "report.md").read_text()


def test_a_replicas_record_times_its_link_by_the_model_not_by_the_threads() -> None:
    from gradzip.train.metrics import RunMetrics

    class Stats:  # one step of 1.25 MB in 2 collectives
        def end_step(self) -> None:
            pass

        def summary(self) -> dict[str, Any]:
            return {"comm_ms": 0.4, "bytes_raw": 2_500_000, "bytes_wire": 1_250_000,
                    "calls_by_op": {"all_reduce": 2}}

        def totals(self) -> dict[str, Any]:
            return {"comm_ms": 0.4, "comm_ms_by_op": {"all_reduce": 0.4},
                    "extra_collective_ms": 0.0, "bytes_raw": 2_500_000,
                    "bytes_wire": 1_250_000, "bytes_handed": 1_250_000, "aggregation": {},
                    "compression_ratio": 2.0, "encode_ms": 0.0, "decode_ms": 0.0,
                    "extra_collectives": 1, "index_bytes": 0, "bits_per_kept_value": None,
                    "density": None, "residual_norm": None, "grad_rel_error": None,
                    "grad_cos_sim": None, "links": {}}

        def steady_bytes(self) -> dict[str, int]:
            return {"bytes_raw": 2_500_000, "bytes_wire": 1_250_000}

    metrics = RunMetrics(0, 1024, Stats(), 0.0, link=LinkModel(1e8, 50e-6, "100mbit"))
    phases: dict[str, float] = {"forward": 30.0}
    step_ms = metrics.end_step(40.0, phases, None)
    assert phases["comm"] == pytest.approx(100.1) and step_ms == pytest.approx(140.1)
    fields = metrics.communication()
    assert fields["comm_time_ms_total"] == pytest.approx(100.1)
    assert fields["comm_time_ms_by_op"] is None
    assert fields["effective_bandwidth_bytes_per_s"] == pytest.approx(1_250_000 / 0.1001)
    interval = metrics.interval(1.0, 1e-3, step_ms, phases, None, torch.device("cpu"))
    assert interval["comm/share(%)"] == pytest.approx(100 * 100.1 / 140.1)


def test_a_race_goes_on_past_a_run_that_fails_and_its_report_names_it(
        tmp_path: Path) -> None:
    """A method that diverges (here an outer step of 1e30) fails its run; the others still
    run, the report and verdict list the failure, the exit status says it, and a rerun
    retries only the failed run."""
    import json

    from gradzip.cli import main

    out = tmp_path / "race"
    argv = ["compare", "--replicas", "2", "--methods",
            "torch:none;diloco(sync_every=2, lr=1e30, momentum=0);int8", "--rate", "100mbit",
            "--steps", "8", "--out", str(out)]
    assert main(argv) == 1
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["compare"]["method"] for r in records] == ["torch:none", "int8"]
    for text in ((out / "report.md").read_text(), (out / "verdict.txt").read_text()):
        assert "1 run(s) failed" in text
        assert "diloco(sync_every=2, lr=1e30, momentum=0) (seed 0, 2 ranks, 100mbit): " \
               "gradzip train: error:" in text
    kept = (out / "results.jsonl").read_text()
    assert main(argv) == 1  # the two finished runs are kept as they were, the failed one
    assert (out / "results.jsonl").read_text() == kept  # runs again (and fails again)
    assert "1 run(s) failed" in (out / "verdict.txt").read_text()


def test_a_replica_seeding_late_does_not_reset_rank_0s_weights_while_they_are_drawn(
        cache: Path, tmp_path: Path) -> None:
    """Replicas share torch's one random generator. Rank 0's initial weights (which DDP
    broadcasts) must be the seed's whatever the threads do meanwhile: here rank 1 starts
    late, so it seeds while rank 0 is half-way through drawing its model (the interleaving
    a loaded CI machine produced, where a W = 4 run then trained from other weights)."""
    from gradzip.train.components import Components, build_model
    from gradzip.train.config import JobConfig
    from gradzip.train.loop import train

    def job(out: Path) -> JobConfig:
        cfg = JobConfig()
        d, t = cfg.data, cfg.train
        d.cache_dir, d.max_tokens, d.vocab_size = str(cache), 40000, 384
        d.seq_len, d.batch_size, d.prefetch = 32, 2, 0
        t.max_steps, t.eval_every, t.parallel, t.device, t.threads = 1, 0, "ddp", "cpu", 1
        cfg.run.out, cfg.run.tensorboard, cfg.run.progress = str(out), False, False
        cfg.validate()
        return cfg

    drawn: dict[int, dict[str, torch.Tensor]] = {}

    def model_in_two_draws(m: Any) -> torch.nn.Module:
        replica = replicas.current()
        first = torch.randn(8)
        if replica is not None and replica.rank == 0:
            time.sleep(1.0)  # rank 1 seeds now (it started 0.5 s late)
        model = build_model(m)
        weights = {"first": first, **{n: p.detach().clone()
                                      for n, p in model.named_parameters()}}
        drawn[replica.rank if replica is not None else -1] = weights
        return model

    parts = Components(model=model_in_two_draws)
    train(job(tmp_path / "one-rank"), components=parts)  # what the seed draws

    def replica(rank: int) -> dict[str, Any]:
        time.sleep(0.5 * rank)
        return train(job(tmp_path / "replicas"), components=parts)

    run_replicas(2, replica)
    for name, expected in drawn[-1].items():
        assert torch.equal(drawn[0][name], expected), name
