"""torchft replica groups (``gradzip train --ft``): a failed round rolls back, a group that
comes back heals from a peer, the launcher's summary, and (dist tier) real jobs of 3
groups that lose groups at random steps and mid-round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from train_helpers import flags, last_result, launch

from gradzip.collectives.communicator import Communicator
from gradzip.comm.ft import FtJob, RoundFailed, RoundInfo, die_in_round, torchft_available
from gradzip.comm.outer import DiLoCo
from gradzip.train.ft_launch import Failure, cost, describe, rounds_agree

needs_torchft = pytest.mark.skipif(not torchft_available(),
                                   reason="torchft is not installed (the ft extra)")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Any:
    """DiLoCo needs torch.distributed: a 1-rank gloo group in this process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class OneGroupComm(Communicator):
    """A quorum of one; its payload collectives fail from ``fail_after`` calls on."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.events: list[Any] = []
        self.calls, self.fail_after = 0, None

    def on_events(self, t: torch.Tensor) -> bool:
        return False

    def _count(self) -> None:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RoundFailed("the peer's socket closed")

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        self._count()
        return t.clone()

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._count()
        return [t.clone()]

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        self._count()
        return [c.clone() for c in chunks]

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        self._count()
        return t[0].clone()


class FakeReplicas:
    """``gradzip.comm.ft.Replicas`` without torchft: every round commits unless told."""

    def __init__(self) -> None:
        self.communicator = OneGroupComm()
        self.step, self.heal_with = 0, None
        self.job = FtJob("http://127.0.0.1:1", 0, 1, "127.0.0.1", 5.0)
        self.quorum_s = 0.0

    def register(self, save: Any, load: Any) -> None:
        self.save, self.load = save, load

    def begin_round(self) -> RoundInfo:
        self.communicator.calls = 0
        healed = self.heal_with is not None
        if healed:
            self.load(self.heal_with)
            self.heal_with = None
        return RoundInfo(0, 1, healed)

    def commit(self, ok: bool) -> bool:
        self.step += ok
        return ok

    def close(self) -> None:
        pass


def _diloco(codec: str = "ef | int8") -> tuple[nn.Module, torch.optim.Optimizer, DiLoCo,
                                               FakeReplicas]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replicas = FakeReplicas()
    outer = DiLoCo(model, opt, sync_every=2, codec=codec, replicas=replicas)
    return model, opt, outer, replicas


def _inner_steps(model: nn.Module, opt: torch.optim.Optimizer, outer: DiLoCo, n: int) -> None:
    for step in range(n):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        outer.step()


def test_a_failed_round_rolls_back_residual_weights_and_anchor() -> None:
    model, opt, outer, replicas = _diloco("ef | topk(ratio=0.1) | int8")
    _inner_steps(model, opt, outer, 4)  # two committed rounds: a residual to keep
    assert [r["committed"] for r in outer.rounds] == [True, True]
    codec_before = outer.codecs[0].state_dict()
    anchor = [a.clone() for a in outer.anchor]
    momentum = outer.outer_digest()
    replicas.communicator.fail_after = 1  # the header passes, the payload fails
    _inner_steps(model, opt, outer, 2)
    failed = outer.rounds[-1]
    assert not failed["committed"]
    assert failed["codec_before"] == failed["codec_after"]
    after = outer.codecs[0].state_dict()["state"]["records"]
    assert after.keys() == codec_before["state"]["records"].keys()
    for key, rec in codec_before["state"]["records"].items():
        for name, value in rec.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after[key][name], value), (key, name)
    assert all(torch.equal(a, b) for a, b in zip(outer.anchor, anchor, strict=True))
    assert outer.outer_digest() == momentum
    assert all(torch.equal(p.detach(), a) for p, a in zip(outer.params, outer.anchor,
                                                         strict=True))
    replicas.communicator.fail_after = None  # the next round commits again
    _inner_steps(model, opt, outer, 2)
    assert outer.rounds[-1]["committed"] and outer.outer_digest() != momentum


def test_a_group_that_comes_back_heals_from_a_peer_and_sends_nothing() -> None:
    model, opt, peer, peer_replicas = _diloco()
    _inner_steps(model, opt, peer, 6)
    _, new_opt, fresh, fresh_replicas = _diloco()
    fresh_replicas.heal_with = peer_replicas.save()
    fresh.join()
    assert fresh.rounds[-1]["healed"] and fresh.outer_digest() == peer.outer_digest()
    assert fresh.inner_steps == peer.inner_steps == 6
    assert all(torch.equal(p.detach(), a) for p, a in zip(fresh.params, peer.anchor,
                                                         strict=True))
    peer_inner = opt.state_dict()["state"]
    for i, state in new_opt.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], peer_inner[i]["exp_avg"])
    assert not fresh.codecs[0].state_dict()["state"]["records"]  # its own residual: zero


def test_the_job_comes_from_the_environment() -> None:
    assert FtJob.from_env({}) is None
    job = FtJob.from_env({"GRADZIP_FT_LIGHTHOUSE": "http://127.0.0.1:29510",
                          "GRADZIP_FT_REPLICA": "2", "GRADZIP_FT_REPLICAS": "3"})
    assert job is not None and (job.replica, job.replicas, job.host) == (2, 3, "127.0.0.1")
    assert FtJob.from_env(job.environ()) == job
    with pytest.raises(ValueError, match="must be in"):
        FtJob.from_env({"GRADZIP_FT_LIGHTHOUSE": "x", "GRADZIP_FT_REPLICA": "3",
                        "GRADZIP_FT_REPLICAS": "3"})
    assert die_in_round(1, {"GRADZIP_FT_DIE_IN_ROUND": "0@2,1@4"}) == 4
    assert die_in_round(2, {"GRADZIP_FT_DIE_IN_ROUND": "0@2,1@4"}) is None
    again = {"GRADZIP_FT_DIE_IN_ROUND": "1@4,0@2,1@7", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert die_in_round(1, again) == 7 and die_in_round(0, again) is None


def _round(r: int, t: float, committed: bool = True, digest: str = "a", seconds: float = 0.1,
           healed: bool = False) -> dict[str, Any]:
    return {"round": r, "time": t, "committed": committed, "anchor_digest": digest,
            "seconds": seconds, "healed": healed}


def test_the_summary_says_what_each_failure_cost() -> None:
    rounds = {0: [_round(1, 10), _round(2, 11), _round(2, 12.5, False, seconds=1.0),
                  _round(3, 14, seconds=0.6), _round(4, 15)],
              1: [_round(1, 10), _round(3, 14, healed=True), _round(4, 15)]}
    f = Failure(replica=1, attempt=0, exit_code=-9, died_s=1.5)
    cost(f, rounds, launch_epoch=10.0)
    assert f.back_s == 2.5 and f.failed_rounds == 1
    assert f.survivor_lost_s == pytest.approx(1.0 + 0.5)
    agree = rounds_agree(rounds)
    assert agree == {"rounds": 4, "identical": True, "differ": []}
    rounds[1][-1]["anchor_digest"] = "b"
    assert rounds_agree(rounds)["differ"] == [4]
    text = describe({"replicas": 2, "seconds": 9.0, "failures": [vars(f)], "restarts": 1,
                     "rounds_agree": rounds_agree(rounds)})
    assert "DIFFERENT (rounds [4])" in text and "healed 2.5s later" in text


@pytest.mark.parametrize("extra, message", [
    (["--outer", "none"], "--outer diloco, average or sparseloco"),
    (["--outer", "diloco", "--overlap-steps", "2"], "drop --overlap-steps"),
    (["--outer", "diloco", "--ft-replica", "1"], "--ft-lighthouse"),
])
@needs_torchft
def test_ft_refuses_what_it_cannot_run(tmp_path: Path, capsys: Any, extra: list[str],
                                       message: str) -> None:
    from gradzip.cli import main

    code = main(["train", "--ft", "2", "--parallel", "ddp",
                 *flags(tmp_path / "cache", tmp_path / "out", "--max-steps", "4"), *extra])
    assert code != 0 and message in capsys.readouterr().err


def _ft_job(tmp_path: Path, outer: list[str], env: dict[str, str], steps: int = 200
            ) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "gradzip", "train", "--ft", "3", "--parallel", "ddp",
           *flags(tmp_path / "cache", out, "--max-steps", str(steps), "--sync-every", "5",
                  "--ckpt-every", "10", "--eval-every", "0", "--ft-timeout", "10"), *outer]
    proc = subprocess.run(cmd, env={**os.environ, "RUST_LOG": "warn", **env},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


def _rounds(out: Path, replica: int) -> list[dict[str, Any]]:
    path = out / f"replica_{replica}" / "ft_rounds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.dist
@needs_torchft
def test_diloco_int8_goes_on_while_groups_die_and_rejoin(tmp_path: Path) -> None:
    proc, out = _ft_job(tmp_path, ["--outer", "diloco", "--outer-codec", "int8"],
                        {"GRADZIP_KILL_AT": "1@12,2@23,1@31"}, steps=300)
    summary = json.loads((out / "ft.json").read_text())
    assert [f["replica"] for f in summary["failures"]] == [1, 2, 1]
    assert all(f["restarted"] for f in summary["failures"])
    # each group came back and healed (under a loaded CI the last restart may find the
    # run over: a restart takes about 150 steps' time here)
    assert sum(f["back_s"] is not None for f in summary["failures"]) >= 2, summary
    assert summary["rounds_agree"]["identical"] and summary["rounds_agree"]["rounds"] >= 30
    records = [json.loads(path.read_text().splitlines()[-1])
               for path in sorted(out.glob("replica_*/results.jsonl"))]
    finished = [r for r in records if r["steps"] == 300]
    assert len(finished) >= 2 and records[0]["ft"]["replicas"] == 3
    assert len({r["val_loss"] for r in finished}) == 1  # one anchor, evaluated alike
    job = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert job["ft_job"]["restarts"] == 3
    assert "healed" in proc.stderr and "bit-identical" in proc.stderr


@pytest.mark.dist
@needs_torchft
def test_sparseloco_survivors_keep_their_residual_when_a_round_fails(tmp_path: Path) -> None:
    codec = "ef(beta=0.95) | topk(k=64, chunk=4096) | centroid(bits=2) | ans | aggregate=gather"
    _, out = _ft_job(tmp_path, ["--outer", "sparseloco", "--outer-codec", codec],
                     {"GRADZIP_FT_DIE_IN_ROUND": "1@4"})
    for survivor in (0, 2):
        failed = [r for r in _rounds(out, survivor) if not r["committed"]]
        assert len(failed) == 1, failed
        assert failed[0]["codec_before"] == failed[0]["codec_after"]
        assert failed[0]["fragment"] == 0
    assert json.loads((out / "ft.json").read_text())["rounds_agree"]["identical"]


def test_the_lighthouse_refuses_a_quorum_of_none(capsys: Any) -> None:
    from gradzip.cli import main

    assert main(["lighthouse", "--min-replicas", "0"]) != 0
    assert "--min-replicas must be >= 1" in capsys.readouterr().err


@pytest.mark.dist
@needs_torchft
def test_without_faults_replica_groups_train_and_evaluate_as_ranks_do(tmp_path: Path) -> None:
    """Two torchft groups of DiLoCo equal two torchrun ranks of the same seed: the same
    shards of data, the same synchronized model and the same validation batches (a
    race of ``--ft`` runs measures what one without does)."""
    args = ["--parallel", "ddp", "--outer", "diloco", "--outer-codec", "int8",
            "--sync-every", "5", "--max-steps", "20", "--eval-every", "10"]
    ranks, groups = tmp_path / "ranks", tmp_path / "groups"
    for cmd, out in (([*launch(2), "-m", "gradzip", "train"], ranks),
                     ([sys.executable, "-m", "gradzip", "train", "--ft", "2"], groups)):
        proc = subprocess.run([*cmd, *flags(tmp_path / "cache", out, *args)],
                              env={**os.environ, "RUST_LOG": "warn"}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = last_result(ranks), last_result(groups)
    assert [h["val_loss"] for h in a["eval_history"]] == \
        [h["val_loss"] for h in b["eval_history"]]
    assert a["global_batch_tokens"] == b["global_batch_tokens"]
    assert a["bytes_wire_total"] == b["bytes_wire_total"]
