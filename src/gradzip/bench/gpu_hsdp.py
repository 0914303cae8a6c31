"""``gradzip bench gpu``: HSDP on a 1x1 mesh against FSDP2's native HSDP (issue 41).

One rank is a 1x1 ``("replicate", "shard")`` mesh: FSDP2 still runs its post-backward
path (the reduce-scatter's copy, the all-reduce hook) and gradzip's replicate hook with
it. With ``none`` the result must be bit-identical to native HSDP on the same mesh, and
the last backward is counted for host syncs: no unit's hook may read the host (the
summable replicate codecs run the future-chained all-reduce, ``int8`` and ``ef | topk``
the fixed-length exchange of ``aggregation.fixed``), and every unit's flags are read
once, when backward ends: at most one sync per backward, or the row fails.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

#: replicate codecs of the cell: the chained path, then the fixed-length exchanges
SPECS = ["none", "fp16", "int8", "ef | topk(ratio=0.01)"]


def _units(model: nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(1 for m in model.modules() if isinstance(m, FSDPModule)
               and any(True for _ in m.parameters(recurse=False)))


def _sharded(base: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: nn.Module, device: torch.device, steps: int,
           syncs: Callable[[], AbstractContextManager[list[int]]]) -> tuple[list[Any], int]:
    """Weights after ``steps`` SGD steps, and the host syncs of the last backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counted = 0
    for step in range(steps):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).to(device)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if step == steps - 1:
            with syncs() as box:
                loss.backward()
            counted = box[0]
        else:
            loss.backward()
        opt.step()
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for p in model.parameters()], counted


def hsdp_rows(device: torch.device, base: nn.Module,
              syncs: Callable[[], AbstractContextManager[list[int]]],
              steps: int = 4) -> list[dict[str, Any]]:
    """One row per replicate codec: bit-identity with native HSDP (``none``), finite
    weights, host syncs per unit of the last backward."""
    from torch.distributed.device_mesh import init_device_mesh

    import gradzip

    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("replicate", "shard"))
    native, _ = _train(_sharded(base, mesh), device, steps, syncs)
    rows = []
    for spec in SPECS:
        row: dict[str, Any] = {"replicate": spec}
        try:
            model = _sharded(base, mesh["shard"])
            handle = gradzip.attach(model, spec, replicate_group=mesh.get_group("replicate"))
            weights, counted = _train(model, device, steps, syncs)
            handle.close()
            diff = max(float((a - b).abs().max()) for a, b in zip(weights, native,
                                                                  strict=True))
            finite = all(bool(torch.isfinite(w).all()) for w in weights)
            row.update(finite=finite, max_diff_to_native=diff,
                       syncs_per_unit=round(counted / _units(model), 2),
                       syncs_per_backward=counted, error="",
                       ok=finite and counted <= 1 and (diff == 0.0 if spec == "none"
                                                       else True))
        except Exception as e:  # noqa: BLE001 - the row reports it
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:120])
        rows.append(row)
    return rows
