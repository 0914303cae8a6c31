"""``gradzip bench gpu``: resuming on the device, for every stateful codec and for
DiLoCo with an exchange in flight (issue 41, item 5).

A checkpoint loads on the CPU (``map_location="cpu"``); a run resumed on a GPU must move
each codec's state (residuals, momenta, warm starts) and each exchange in flight beside
the gradients, not mix host and device tensors. Each row trains a few steps, saves every
state through ``torch.save``, loads it on the CPU into a fresh model on the device, and
trains on: no error, finite weights, and the same weights as the same checkpoint loaded
where it was saved (the state moved, nothing else changed).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch import nn

#: codecs that keep tensors between steps
STATEFUL = ["ef | int8", "ef | topk(ratio=0.01)", "dgc", "demo", "ef | powersgd(rank=2)",
            "gradiveq"]


def _saved(state: Any, map_location: str | None) -> Any:
    """``state`` saved and loaded as a checkpoint is (``map_location="cpu"``: on the
    CPU; None: where it was)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location=map_location, weights_only=False)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
           steps: range, after: Any = None) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g).to(device)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if after is not None:
            after()


def _row(name: str, resumed: Any) -> dict[str, Any]:
    """Resumed from a checkpoint loaded on the CPU, against the same checkpoint loaded
    where it was saved: equal weights, or the moved state changed the run."""
    try:
        on_cpu, kept = resumed("cpu"), resumed(None)
    except Exception as e:  # noqa: BLE001 - the row reports it
        return {"state": name, "ok": False, "finite": False, "max_diff_to_kept": None,
                "error": f"{type(e).__name__}: {e}"[:120]}
    diff = max(float((a - b).abs().max()) for a, b in zip(on_cpu, kept, strict=True))
    finite = all(bool(torch.isfinite(t).all()) for t in on_cpu)
    return {"state": name, "ok": finite and diff == 0.0, "finite": finite,
            "max_diff_to_kept": diff, "error": ""}


def codec_resume(spec: str, device: torch.device, model: nn.Module,
                 map_location: str | None) -> list[torch.Tensor]:
    """The weights of a DDP run of ``spec`` saved after 3 steps and resumed for 2 more
    from its checkpoint loaded with ``map_location``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip

    def build(module: nn.Module) -> tuple[Any, Any, torch.optim.Optimizer]:
        ddp = DDP(module, bucket_cap_mb=0.1,
                  device_ids=[device.index] if device.type == "cuda" else None)
        return ddp, gradzip.attach(ddp, spec), torch.optim.SGD(ddp.parameters(), lr=0.05)

    first, f_handle, f_opt = build(copy.deepcopy(model))
    _steps(first, f_opt, device, range(3), f_handle.stats.end_step)
    saved = _saved({"model": first.module.state_dict(), "comm": f_handle.state_dict()},
                   map_location)
    second, s_handle, s_opt = build(copy.deepcopy(model))
    second.module.load_state_dict(saved["model"])
    s_handle.load_state_dict(saved["comm"])
    _steps(second, s_opt, device, range(3, 5), s_handle.stats.end_step)
    for h in (f_handle, s_handle):
        h.close()
    return [p.detach().clone() for p in second.parameters()]


def diloco_resume(device: torch.device, model: nn.Module,
                  map_location: str | None) -> list[torch.Tensor]:
    """The same for Streaming DiLoCo, saved with an exchange in flight (started after
    step 4, applied after step 6; saved after step 5)."""
    from gradzip.outer import DiLoCo

    def build(module: nn.Module) -> tuple[Any, torch.optim.Optimizer]:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        return DiLoCo(module, opt, sync_every=4, codec="ef | int8", overlap_steps=2), opt

    first = copy.deepcopy(model)
    f_outer, f_opt = build(first)
    _steps(first, f_opt, device, range(5), f_outer.step)
    saved = _saved({"model": first.state_dict(), "outer": f_outer.state_dict()},
                   map_location)
    second = copy.deepcopy(model)
    s_outer, s_opt = build(second)
    second.load_state_dict(saved["model"])
    s_outer.load_state_dict(saved["outer"])
    _steps(second, s_opt, device, range(5, 10), s_outer.step)
    for o in (f_outer, s_outer):
        o.close()
    return [p.detach().clone() for p in second.parameters()]


def resume_rows(device: torch.device, model: nn.Module) -> list[dict[str, Any]]:
    """One row per stateful codec, and one for DiLoCo with an exchange in flight."""
    rows = [_row(spec, lambda where, s=spec: codec_resume(s, device, model, where))
            for spec in STATEFUL]
    rows.append(_row("diloco, exchange in flight",
                     lambda where: diloco_resume(device, model, where)))
    return rows
