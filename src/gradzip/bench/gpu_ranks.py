"""``gradzip bench gpu``: several ranks on the one GPU (issue 41).

A one-rank NCCL group never runs a branch that needs two ranks. Here 3 and 4 processes
share ``cuda:0`` (``--smoke``: the CPU) over gloo, with NCCL's rules enforced on every
collective gradzip and FSDP2 issue from Python (``strict.StrictCollectives``: tensors on
the ranks' device, equal shapes and dtypes on every rank). They run:

* every aggregation path of DDP at W = 3 (chained all-reduce, two-phase, the
  fixed-length gather, the byte gather of an entropy coder, PowerSGD's rounds), the
  ranks' weights equal bit for bit after three steps;
* a NaN on one rank under three paths: every rank raises the same error, none hangs;
* Streaming DiLoCo with two fragments and an exchange overlapping the next step, and
  SparseLoCo's gather of entropy-coded top-k: the ranks' anchors equal;
* FSDP2 at W = 3 (gradzip's reduce-scatter, the fixed-length exchange), hierarchical
  DDP at W = 4 in nodes of 2, and HSDP on a 2 x 2 mesh, the shard link FSDP2's own or
  gradzip's (the replicate peers' shards equal);
* a negative control: an all-gather whose length differs between ranks must be refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: DDP at W = 3, one spec per aggregation path
PATH_SPECS = ["none", "fp16 | aggregate=two_phase", "ef | int8",
              "ef | topk(ratio=0.1) | aggregate=two_phase", "int8 | ans", "ef | powersgd(rank=2)"]
#: a NaN on rank 1: the chained flag, the fixed-length buffer's byte, the size exchange
NAN_SPECS = ["fp16", "ef | int8", "int8 | ans"]
#: hierarchical DDP (nodes of 2) at W = 4
NODE_SPECS = ["fp16", "ef | int8"]
#: HSDP 2 x 2: the replicate link's codec (the shard link ``none``, FSDP2's own), and
#: both links compressed (gradzip's reduce-scatter on the shard link)
HSDP_SPECS: list[Any] = ["none", "fp16", "ef | int8",
                         {"replicate": "fp16", "shard": "ef | int8"}]


def rank_device(kind: str) -> torch.device:
    """The device every rank of a ``kind`` ("cuda" or "cpu") run uses: the one GPU."""
    if kind == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _model(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 33), nn.Tanh(),
                         nn.Linear(33, 1)).to(device)


class Blocks(nn.Module):
    """The same layers, named ``blocks.i`` (Streaming DiLoCo's fragments need them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 64),
                                     nn.Linear(64, 33), nn.Linear(33, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x) if i == len(self.blocks) - 1 else torch.tanh(block(x))
        return x


def batch(step: int, rank: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s input at ``step`` (the same on every run)."""
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(
        1000 * step + rank)).to(device)


def flat(tensors: Any) -> torch.Tensor:
    """Tensors as one flat fp32 host tensor (to compare ranks and runs)."""
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


def _attempt(fn: Any) -> Any:
    """``fn()``, or the error's words (a row reports it; the others still run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported per case
        return f"{type(e).__name__}: {e}"[:300]


def _ddp(spec: str, rank: int, device: torch.device, steps: int = 3,
         nan: bool = False, **attach: Any) -> torch.Tensor:
    """The weights after ``steps`` SGD steps of DDP under ``spec`` (``nan``: rank 1's
    input holds a NaN in the last step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    model = DDP(_model(device), device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=0.005)
    handle = gradzip.attach(model, spec, **attach)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(steps):
            x = batch(step, rank, device)
            if nan and rank == 1 and step == steps - 1:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    finally:
        handle.close()
    return flat(model.parameters())


def _outer(codec: str, rank: int, device: torch.device, **options: Any) -> torch.Tensor:
    """DiLoCo's anchors after 8 inner steps (``options``: fragments, overlap, ...)."""
    from gradzip.comm.outer import DiLoCo

    model = Blocks().to(device)
    outer = DiLoCo(model, codec=codec, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for step in range(8):
            opt.zero_grad()
            model(batch(step, rank, device)).pow(2).mean().backward()
            opt.step()
            outer.step()
    finally:
        outer.close()
    return flat(outer.anchor)


def _sharded(spec: Any, rank: int, device: torch.device, mesh: Any = None,
             **attach: Any) -> nn.Module:
    """The model after 3 SGD steps, every layer ``fully_shard``-ed over ``mesh`` (None:
    every rank) and ``attach``-ed with ``spec``."""
    from torch.distributed.fsdp import fully_shard

    import gradzip

    model = _model(device)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = gradzip.attach(model, spec, **attach)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(3):
            opt.zero_grad()
            model(batch(step, rank, device)).pow(2).mean().backward()
            opt.step()
    finally:
        handle.close()
    return model


def _hsdp(spec: Any, rank: int, device: torch.device) -> torch.Tensor:
    """This rank's shards after 3 steps of HSDP on a 2 x 2 mesh under ``spec``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(spec, rank, device, mesh["shard"],
                     replicate_group=mesh.get_group("replicate"))
    return flat(p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())


def _fsdp2(spec: str, rank: int, device: torch.device) -> torch.Tensor:
    """The full weights after 3 steps of FSDP2 over every rank under ``spec`` (gradzip's
    reduce-scatter: the fixed-length exchange for ``ef | int8``)."""
    model = _sharded(spec, rank, device)
    return flat(_gathered(p) for p in model.parameters())


def _gathered(p: Any) -> torch.Tensor:
    """A parameter's full value: a DTensor's dim-0 shards gathered through the host.
    ``full_tensor()`` runs a functional all-gather on the shards' device, outside the
    shim: gloo on CUDA tensors, which crashed the rank (SIGSEGV, torch 2.11, H200)."""
    import torch.distributed as dist

    if not hasattr(p, "to_local"):
        return p
    group = p.device_mesh.get_group()
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, p.to_local().detach().cpu(), group=group)
    return torch.cat(parts, dim=0)


def _unequal_gather(rank: int, device: torch.device) -> str:
    """The negative control: NCCL would hang on this; the shim must refuse it."""
    import torch.distributed as dist

    t = torch.zeros(4 + rank, device=device)
    out = [torch.zeros(4 + rank, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return "not refused"


def rank_cases(rank: int, kind: str, world: int) -> dict[str, Any]:
    """One rank's results by case name (run by ``run_ranks``, every rank the same
    cases in the same order, each a tensor or an error's words)."""
    from gradzip.bench.strict import StrictCollectives
    from gradzip.comm.method import sparseloco_codec

    device = rank_device(kind)
    out: dict[str, Any] = {}
    with StrictCollectives(device) as strict:
        if world == 3:
            for spec in PATH_SPECS:
                out[f"ddp W=3: {spec}"] = _attempt(lambda s=spec: _ddp(s, rank, device))
            for spec in NAN_SPECS:
                out[f"NaN on rank 1: {spec}"] = _attempt(
                    lambda s=spec: _ddp(s, rank, device, nan=True))
            out["streaming DiLoCo, F=2, overlap 1: ef | int8"] = _attempt(lambda: _outer(
                "ef | int8", rank, device, sync_every=4, fragments=2, overlap_steps=1))
            out["SparseLoCo's gather"] = _attempt(lambda: _outer(
                sparseloco_codec(k=4, chunk=64), rank, device, sync_every=2, outer_lr=1.0,
                outer_momentum=0.0))
            out["FSDP2 W=3: ef | int8"] = _attempt(lambda: _fsdp2("ef | int8", rank, device))
            out["negative control: unequal all-gather"] = _attempt(
                lambda: _unequal_gather(rank, device))
        else:
            for spec in NODE_SPECS:
                out[f"hierarchical W=4, nodes of 2: {spec}"] = _attempt(
                    lambda s=spec: _ddp(s, rank, device, node_size=2))
            for spec in HSDP_SPECS:
                out[f"HSDP 2x2: {spec}"] = _attempt(lambda s=spec: _hsdp(s, rank, device))
    out["_checked_collectives"] = sum(strict.calls.values())
    return out


def _row(case: str, world: int, results: list[Any], peers: list[list[int]]) -> dict[str, Any]:
    """Whether the ranks agree as the case requires (module doc)."""
    if case.startswith("NaN"):  # DDP wraps a hook's error: its words are what agree
        words = {r if isinstance(r, str) else "finished" for r in results}
        ok = len(words) == 1 and "held non-finite values" in next(iter(words))
        return {"case": case, "world": world, "ok": ok, "detail": "; ".join(sorted(words))[:160]}
    if case.startswith("negative"):
        ok = all(isinstance(r, str) and r.startswith("StrictViolation") for r in results)
        return {"case": case, "world": world, "ok": ok, "detail": str(results[0])[:160]}
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        return {"case": case, "world": world, "ok": False, "detail": errors[0][:160]}
    finite = all(bool(torch.isfinite(r).all()) for r in results)
    equal = all(torch.equal(results[group[0]], results[j]) for group in peers for j in group)
    return {"case": case, "world": world, "ok": finite and equal,
            "detail": f"finite={finite}, equal across ranks={equal}"}


def ranks_rows(kind: str, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Every case of both launches (W = 3, then W = 4), one row each."""
    from gradzip.comm.launch import run_ranks

    rows: list[dict[str, Any]] = []
    for world in (3, 4):
        try:
            per_rank = run_ranks(rank_cases, world, kind, world, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a launch that failed is a failed row
            rows.append({"case": f"W={world} launch", "world": world, "ok": False,
                         "detail": f"{type(e).__name__}: {e}"[:300]})
            continue
        checked = min(r["_checked_collectives"] for r in per_rank)
        for case in per_rank[0]:
            if case.startswith("_"):
                continue
            # HSDP: a rank's shards equal its replicate peer's (mesh rows are replicas)
            peers = [[0, 2], [1, 3]] if case.startswith("HSDP") else [list(range(world))]
            row = _row(case, world, [r[case] for r in per_rank], peers)
            row["checked_collectives"] = checked
            rows.append(row)
    return rows
