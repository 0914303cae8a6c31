"""gradzip's own process groups stay inside the DDP model's group, and attaching on
NCCL runs its exchange on the model's device (issue 41, items 7 and 8).

Two DDP replicas side by side on 4 gloo ranks ({0, 2} and {1, 3}, interleaved so that a
layout over the world cannot pass by accident), each hierarchical with one rank per
node: every group gradzip makes must hold the replica's ranks only, so the replicas,
fed different data, train to different weights while the ranks of each agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gradzip.comm.groups import check_hosts, node_layout, on_device

REPLICAS = ((0, 2), (1, 3))


def test_nodes_of_a_group_are_its_consecutive_ranks() -> None:
    assert node_layout((1, 3, 5, 7), 2) == ([[1, 3], [5, 7]], [[1, 5], [3, 7]])
    assert node_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="must divide the group's size 3"):
        node_layout((0, 1, 2), 2)


class _FakeCudaModule(nn.Module):
    """A module whose parameters report a CUDA device (on a CPU-only build)."""

    class _Param:
        device = torch.device("cuda", 1)

    def parameters(self, recurse: bool = True) -> Iterator[Any]:  # type: ignore[override]
        yield self._Param()


def test_attaching_makes_the_models_cuda_device_current(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made_current: list[torch.device] = []

    @contextlib.contextmanager
    def device(d: torch.device) -> Iterator[None]:
        made_current.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    with on_device(_FakeCudaModule()):
        pass
    with on_device(nn.Linear(2, 2)):  # a CPU model: nothing made current
        pass
    assert made_current == [torch.device("cuda", 1)]


def _replicas(rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip
    from gradzip.comm import groups

    exchanges = []
    original = dist.all_gather_object

    def counted(*args: Any, **kw: Any) -> Any:
        exchanges.append(1)
        return original(*args, **kw)

    dist.all_gather_object = counted
    try:
        groups.rank_sets(None)
        world_exchanges = len(exchanges)
        subgroups = [dist.new_group(list(r)) for r in REPLICAS]
        mine = subgroups[rank % 2]
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)),
                    process_group=mine)
        handle = gradzip.attach(model, "int8", node_size=1)
    finally:
        dist.all_gather_object = original
    state = handle._ddp_state
    assert state is not None
    reducer = state.hierarchical[0]
    assert reducer is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 8, generator=g) * (1 + rank % 2)  # replicas see other data
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    handle.close()
    return {"world_exchanges": world_exchanges,
            "private": dist.get_process_group_ranks(state.group),
            "cross": dist.get_process_group_ranks(reducer.cross.group),
            "node": dist.get_process_group_ranks(reducer.node.group),
            "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.fixture(scope="module")
def replicas() -> list[dict[str, Any]]:
    from gradzip.comm.launch import run_ranks

    return run_ranks(_replicas, 4, timeout=300)


@pytest.mark.dist
def test_a_group_of_the_world_needs_no_exchange(replicas: list[dict[str, Any]]) -> None:
    assert [r["world_exchanges"] for r in replicas] == [0] * 4


@pytest.mark.dist
def test_every_group_stays_inside_the_replica(replicas: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(replicas):
        replica = sorted(REPLICAS[rank % 2])
        assert sorted(out["private"]) == replica
        assert sorted(out["cross"]) == replica  # one rank per node: nodes = the replica
        assert out["node"] == [rank]


@pytest.mark.dist
def test_replicas_train_apart_and_each_agrees(replicas: list[dict[str, Any]]) -> None:
    for a, b in REPLICAS:
        for x, y in zip(replicas[a]["weights"], replicas[b]["weights"], strict=True):
            assert torch.equal(x, y), (a, b)
    assert not all(torch.equal(x, y) for x, y in
                   zip(replicas[0]["weights"], replicas[1]["weights"], strict=True))


def test_a_node_that_spans_two_machines_is_refused() -> None:
    """Ranks numbered otherwise than machine by machine, or a node_size that is not the
    ranks per machine: the "intra-node" link would cross the network uncompressed."""
    nodes, _ = node_layout(4, 2)
    check_hosts(nodes, ["a", "a", "b", "b"], 2)  # torchrun's numbering: fine
    check_hosts(nodes, ["a"] * 4, 2)  # one machine (the tests' netns links): fine
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] in one node, but they run on a, b"):
        check_hosts(nodes, ["a", "b", "a", "b"], 2)  # round-robin placement
    with pytest.raises(ValueError, match="node_size=4"):
        check_hosts(node_layout(4, 4)[0], ["a", "a", "b", "b"], 4)  # 2 per machine



GROUP_TIMEOUTS = """
import json, socket
from datetime import timedelta
import torch, torch.distributed as dist
from gradzip.comm import groups
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                        world_size=1, timeout=timedelta(seconds=3))
made = [groups.private_group(None), *groups.node_groups(1)]
seconds = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in made]
print(json.dumps({"world": groups.world_timeout().total_seconds(), "groups": seconds}))
dist.destroy_process_group()
"""


def test_every_group_gradzip_makes_fails_as_soon_as_the_worlds() -> None:
    # torch's new_group takes its own 30-minute default: a run with --comm-timeout 3
    # hung in its private group's collective while its link was down
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", GROUP_TIMEOUTS], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen == {"world": 3.0, "groups": [3.0, 3.0, 3.0]}
