"""Hierarchical DDP on 4 gloo ranks as 2 nodes x 2: compressed between nodes only.

The bytes each group is handed are counted outside gradzip (torch.distributed's
collectives wrapped, bucketed by the ranks of the group they ran on): the two node
groups ({0, 1}, {2, 3}) are the intra-node links, the two cross-node groups ({0, 2},
{1, 3}) the inter-node ones.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.dist

STEPS = 4
NODES = {(0, 1), (2, 3)}
CROSS = {(0, 2), (1, 3)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 255), nn.Tanh(),
                         nn.Linear(255, 1))


class _ByGroup:
    """Bytes handed to collectives, by the ranks of the group they ran on."""

    #: each collective's argument holding what this rank hands it
    INPUT = {"all_reduce": "tensor", "all_gather": "tensor",
             "all_to_all": "input_tensor_list", "reduce_scatter_tensor": "input"}

    def __init__(self) -> None:
        self.bytes: dict[tuple[int, ...], int] = defaultdict(int)
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> _ByGroup:
        import torch.distributed as dist

        for name in self.INPUT:
            fn = self.saved[name] = getattr(dist, name)

            signature = inspect.signature(fn)

            def counted(*args: Any, _fn: Any = fn, _name: str = name,
                        _sig: Any = signature, **kw: Any) -> Any:
                bound = _sig.bind(*args, **kw).arguments
                group = bound.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None \
                    else tuple(range(dist.get_world_size()))
                sent = bound[self.INPUT[_name]]
                inputs = list(sent) if isinstance(sent, list | tuple) else [sent]
                self.bytes[ranks] += sum(t.numel() * t.element_size() for t in inputs)
                return _fn(*args, **kw)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def total(self, groups: set[tuple[int, ...]], rank: int) -> int:
        return sum(v for k, v in self.bytes.items() if k in groups and rank in k)


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=g)
        (model(x) - x[:, :1]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _hierarchical(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    base = _model()
    out: dict[str, Any] = {"plain": _train(DDP(copy.deepcopy(base)), rank)}
    for name, spec in (("none", "none"), ("int8", "int8"), ("topk", "ef | topk(ratio=0.05)")):
        model = DDP(copy.deepcopy(base))
        handle = gradzip.attach(model, spec, node_size=2)
        with _ByGroup() as counted:
            out[name] = _train(model, rank)
        handle.stats.end_step()
        out[f"{name}_totals"] = handle.stats.totals()
        out[f"{name}_bytes"] = {"intra": counted.total(NODES, rank),
                                "inter": counted.total(CROSS, rank)}
        handle.close()
    try:
        gradzip.attach(DDP(copy.deepcopy(base)), "powersgd(rank=2)", node_size=2)
    except ValueError as e:
        out["matrices_refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    from gradzip.comm.launch import run_ranks

    return run_ranks(_hierarchical, 4, timeout=300)


def test_none_matches_plain_ddp(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        for a, b in zip(out["none"], out["plain"], strict=True):
            assert torch.equal(a, b), rank


def test_none_runs_ddps_flat_all_reduce(ranks: list[dict[str, Any]]) -> None:
    """Uncompressed, a hierarchy sends no fewer bytes, and its other summation order
    would break bit-identity with DDP: `none` keeps the flat all-reduce (one link)."""
    for out in ranks:
        assert out["none_bytes"] == {"intra": 0, "inter": 0}
        assert out["none_totals"]["links"] == {}


def test_inter_node_bytes_fall_by_the_codecs_ratio(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        int8, topk = out["int8_bytes"], out["topk_bytes"]
        links = out["int8_totals"]["links"]
        # the chunk's uncompressed all-reduce between nodes, against int8's, counted
        # outside gradzip (at 2 nodes an all-reduce's link bytes are its input's)
        raw = links["inter_node"]["bytes_raw"]
        assert int8["inter"] > 0 and raw / int8["inter"] > 3.5, (raw, int8)
        assert topk["inter"] < raw / 5
        assert int8["intra"] == topk["intra"] > 0  # inside the node: uncompressed


def test_stats_count_each_link_as_it_was_counted_outside(
        ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for name in ("int8", "topk"):
            links = out[f"{name}_totals"]["links"]
            assert set(links) == {"intra_node", "inter_node"}, name
            assert links["inter_node"]["bytes_handed"] == out[f"{name}_bytes"]["inter"]
            assert links["intra_node"]["bytes_handed"] == out[f"{name}_bytes"]["intra"]
        int8 = out["int8_totals"]["links"]
        assert int8["inter_node"]["compression_ratio"] > 3.5
        assert int8["intra_node"]["compression_ratio"] == pytest.approx(1.0)


def test_a_codec_of_matrices_is_refused_on_chunks(ranks: list[dict[str, Any]]) -> None:
    assert "chunk" in ranks[0]["matrices_refused"]
