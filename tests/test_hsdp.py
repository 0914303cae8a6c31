"""HSDP on FSDP2, 4 gloo ranks as 2 nodes x 2: the replicate link compressed and counted.

Native HSDP (``fully_shard(mesh=2-D mesh)``) is the reference: gradzip's ``none`` must
match it bit for bit. The bytes each mesh dimension carries are counted outside gradzip
(``CollectiveRecorder`` wraps torch.distributed's collectives, per process group); at 2
ranks per dimension every collective's link bytes equal the bytes it is handed
(all-reduce 2(W-1)/W n = n, all-gather (W-1) n = n), so the handed counts compare links.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gradzip.collectives.linkmodel import link_bytes

pytestmark = pytest.mark.dist

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    # ~70k parameters: enough that gloo's fixed cost per call (~1 KB) is not the figure
    return nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 255), nn.Tanh(),
                         nn.Linear(255, 1))  # odd sizes: FSDP pads the last shard


def _shard(base: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    m = copy.deepcopy(base)
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for p in model.parameters()]


def _counted(fn: Any, mesh: Any) -> tuple[Any, dict[str, int]]:
    from gradzip.comm.launch import CollectiveRecorder

    rep, shard = (CollectiveRecorder(mesh.get_group(d)) for d in ("replicate", "shard"))
    with rep, shard:
        out = fn()
    return out, {"replicate": rep.bytes, "shard": shard.bytes}


def _hsdp(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import gradzip
    from gradzip.bench.devicecheck import count_host_syncs

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rep_group = mesh.get_group("replicate")
    base = _model()
    out: dict[str, Any] = {}
    plain = _shard(base, mesh)
    out["plain"], out["plain_bytes"] = _counted(lambda: _train(plain, rank), mesh)
    for name, spec in (("none", "none"), ("topk", "ef | topk(ratio=0.05)"),
                       ("per_dim", {"replicate": "int8", "shard": "fp16"})):
        model = _shard(base, mesh["shard"])
        handle = gradzip.attach(model, spec, replicate_group=rep_group)
        with count_host_syncs() as syncs:
            out[name], out[f"{name}_bytes"] = _counted(lambda m=model: _train(m, rank), mesh)
        out[f"{name}_syncs"] = syncs.total / (STEPS * len(handle.reduce_scatters or
                                                          _units(model)))
        out[f"{name}_syncs_per_backward"] = syncs.total / STEPS
        handle.stats.end_step()
        out[f"{name}_totals"] = handle.stats.totals()
        out[f"{name}_state"] = handle.state_dict()
        out[f"{name}_scatters"] = len(handle.reduce_scatters)
        out[f"{name}_codecs"] = [str(c) for c in handle.codecs], \
            [str(c) for c in handle.replicate_codecs]
    for spec in ("fp16", "ef | int8"):  # a NaN on rank 0 only: the chained path, the other
        nan_model = _shard(base, mesh["shard"])
        gradzip.attach(nan_model, spec, replicate_group=rep_group)
        x = torch.randn(8, 16)
        if rank == 0:
            x[0, 0] = float("nan")
        try:
            (nan_model(x) - x[:, :1]).pow(2).mean().backward()
            out[f"nan_error/{spec}"] = None
        except gradzip.NonFiniteGradientError as e:
            out[f"nan_error/{spec}"] = str(e)
    try:  # native HSDP's own replicate all-reduce would be neither compressed nor counted
        gradzip.attach(_shard(base, mesh), "ef | topk(ratio=0.05)")
    except ValueError as e:
        out["native_refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    from gradzip.comm.launch import run_ranks

    return run_ranks(_hsdp, 4, timeout=300)


def test_none_is_bit_identical_to_native_hsdp(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        for a, b in zip(out["none"], out["plain"], strict=True):
            assert torch.equal(a, b), rank


def test_topk_carries_at_most_a_third_of_the_replicate_bytes(
        ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        plain, topk = out["plain_bytes"], out["topk_bytes"]
        assert plain["replicate"] > 0 and topk["replicate"] > 0
        assert topk["replicate"] <= plain["replicate"] / 3, (plain, topk)
        # the shard link runs `none` with either codec on the replicate link: FSDP2's
        # own reduce-scatter, which calls c10d directly, out of the recorder's sight
        # (what it sees is the non-finite agreement: 4 bytes per unit and step);
        # gradzip's (fp16 there) goes through torch.distributed
        assert topk["shard"] == out["none_bytes"]["shard"] == 4 * 3 * STEPS, (plain, topk)
        assert out["per_dim_bytes"]["shard"] > 0


def _units(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)
            and any(True for _ in m.parameters(recurse=False))]


def test_a_summable_replicate_codec_reads_the_host_once_per_unit(
        ranks: list[dict[str, Any]]) -> None:
    """``none`` on both links: FSDP2's own reduce-scatter, and the replicate all-reduce
    on the chained path (no host read of gradzip's on the autograd thread on CUDA; on the
    CPU the callback reads the agreed non-finite flag at once: 1 per unit and step)."""
    for out in ranks:
        assert out["none_syncs"] <= 1.0, out["none_syncs"]


def test_no_unit_reads_the_host_for_none_int8_or_ef_topk(ranks: list[dict[str, Any]]) -> None:
    """Issue 41, item 9: ``none`` (chained), ``ef | topk`` and ``int8`` (fixed-length
    exchanges, ``aggregation.fixed``) on the replicate link, ``fp16``'s reduce-scatter
    on the shard link: no host read in any unit's hook; every unit's flags are read
    once, when backward ends (counted as a GPU would make them)."""
    for out in ranks:
        for name in ("none", "topk", "per_dim"):
            assert out[f"{name}_syncs_per_backward"] == 1.0, (name, out)


@pytest.mark.parametrize("spec", ["fp16", "ef | int8"])
def test_a_nan_on_one_rank_stops_every_rank_in_the_same_unit(
        ranks: list[dict[str, Any]], spec: str) -> None:
    """Rank 0's NaN reaches only some ranks' shards (the last layer's dim-0 shard on
    rank 1 is padding): the shard group agrees first, so every replicate group raises in
    the same unit, with the same words, and nobody hangs in FSDP2's next all-gather."""
    errors = {out[f"nan_error/{spec}"] for out in ranks}
    assert len(errors) == 1 and next(iter(errors)), errors


def test_shard_spec_none_keeps_fsdp2s_own_reduce_scatter(
        ranks: list[dict[str, Any]]) -> None:
    """Uncompressed, gradzip's reduce-scatter would only add its own costs (host reads
    on the autograd thread): FSDP2 keeps its native one, and the replicate hook counts
    its bytes, the same raw bytes gradzip's fp16 reduce-scatter is measured against."""
    for out in ranks:
        assert out["none_scatters"] == out["topk_scatters"] == 0
        assert out["per_dim_scatters"] > 0
        native = out["none_totals"]["links"]["shard"]
        ours = out["per_dim_totals"]["links"]["shard"]
        assert native["bytes_raw"] == ours["bytes_raw"] > 0
        # the wire also carries the non-finite agreement: a 4-byte all-reduce per unit
        flags = native["bytes_wire"] - native["bytes_raw"]
        assert flags == 3 * STEPS * link_bytes("all_reduce", 4, 2, "gloo") > 0


def test_stats_report_each_link_and_their_sum(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for name in ("none", "topk", "per_dim"):
            totals = out[f"{name}_totals"]
            links = totals["links"]
            assert set(links) == {"replicate", "shard"}, name
            for key in ("bytes_raw", "bytes_wire"):
                assert sum(link[key] for link in links.values()) == totals[key], (name, key)
            # the replicate link's figure is the bytes gradzip handed that group
            assert links["replicate"]["bytes_handed"] == out[f"{name}_bytes"]["replicate"]
        topk = out["topk_totals"]["links"]
        assert topk["replicate"]["compression_ratio"] > 3
        assert out["none_totals"]["links"]["replicate"]["compression_ratio"] == \
            pytest.approx(1.0)
        # the overall ratio counts the uncompressed shard link too: less than the
        # replicate link's alone
        assert out["topk_totals"]["compression_ratio"] < topk["replicate"]["compression_ratio"]


def test_each_dimension_takes_its_codec_and_state_is_checkpointed(
        ranks: list[dict[str, Any]]) -> None:
    out = ranks[0]
    assert out["per_dim_codecs"] == (["fp16"], ["int8"])
    assert out["topk_codecs"] == (["none"], ["ef | topk(ratio=0.05)"])
    residuals = [r for r in out["topk_state"]["replicate"]["codec"]["state"]["records"]]
    assert residuals, out["topk_state"]["replicate"]


def test_native_hsdp_is_refused_with_the_way_to_compress_it(
        ranks: list[dict[str, Any]]) -> None:
    msg = ranks[0]["native_refused"]
    assert "replicate_group" in msg and "mesh[\"shard\"]" in msg
