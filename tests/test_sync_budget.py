"""Host syncs on the DDP hook's hot path, counted per bucket and held to a budget.

On CUDA every ``.item()``, ``int(t)``, ``.tolist()``, ``.numpy()`` or ``.cpu()`` of a
device tensor stalls the host until the GPU catches up. ``count_host_syncs`` counts the
calls that would be syncs there, on every thread (the communication thread included),
during backward, where the hooks run. The budget per spec is what the path needs and
no more (docs/architecture.md, "Device and host"); a new host read on the hot path
fails here. The future-chained path checks finiteness on the device: on CUDA its one
read per bucket becomes a pinned copy read once, at the step's last bucket.

The count is a lower bound: syncs a CUDA kernel implies (``nonzero``, boolean-mask
indexing) are not Python calls and are not counted here; ``gradzip bench gpu`` counts
every one with ``torch.cuda.set_sync_debug_mode`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.bench.devicecheck import count_host_syncs
from gradzip.comm.launch import run_ranks

pytestmark = pytest.mark.dist

#: the most host reads per reduced bucket at W=2, on CPU (measured; docs/architecture.md,
#: "Device and host"). ``stats`` is the comm thread's ``residual_norm`` for CommStats.
BUDGET = {
    # the agreed non-finite flag: under the count, as on CUDA, read once per step
    "none": 1,
    "fp16": 1,
    "randomk(ratio=0.1)": 1,     # (its positions are drawn on the host by design)
    # finiteness, the flag in the sum's head (P's all-reduce for PowerSGD), the residual
    # norms (read once per step, all keys together)
    "ef | fp16": 3,
    "ef | powersgd(rank=2)": 3,
    # fixed layouts (``aggregation.fixed``): no size exchange, no parse on the host; the
    # senders' flags and the payload checks in one read (+ the residual norms)
    "int8": 1,
    "qsgd": 1,
    "fp8": 1,
    "topk(ratio=0.1)": 1,
    # the received bin codes checked on the device, read with the flags (issue 44)
    "centroid": 1,
    "ef | topk(ratio=0.1)": 2,
    # finiteness and the size exchange (on CUDA +1: every received blob comes to the
    # host in one copy, ``collectives.communicator.on_host``)
    "int8 | ans": 2,
}
STEPS = 3


def _reductions(handle: object) -> int:
    return sum(handle.stats.totals()["aggregation"].values())  # type: ignore[attr-defined]


def _count(rank: int, specs: list[str]) -> dict[str, float]:
    """Host reads per reduced bucket of each spec, over STEPS compressed steps."""
    out = {}
    for spec in specs:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                  nn.Linear(64, 4)), bucket_cap_mb=0.01)
        handle = gradzip.attach(model, spec)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).mean().backward()  # the uncompressed first step
        handle.stats.end_step()
        before = _reductions(handle)
        autograd = 0
        with count_host_syncs() as syncs:
            for _ in range(STEPS):
                model.zero_grad()
                with count_host_syncs() as in_backward:
                    model(x).pow(2).mean().backward()
                autograd += in_backward.threads["MainThread"]
                handle.stats.end_step()
        reduced = _reductions(handle) - before
        handle.close()
        out[spec] = syncs.total / reduced
        out[f"{spec} @ autograd"] = autograd / reduced
    return out


#: the future-chained path reads its flags at the step's last bucket, in backward; every
#: other path reads on gradzip's comm thread, none on the thread that runs backward
CHAINED = {"none", "fp16", "randomk(ratio=0.1)", "ef | fp16"}


def test_host_syncs_per_bucket_stay_within_budget() -> None:
    counts, _ = run_ranks(_count, 2, list(BUDGET), timeout=300.0)
    over = {s: (round(counts[s], 2), b) for s, b in BUDGET.items() if counts[s] > b}
    assert not over, f"host reads per bucket above budget (measured, budget): {over}"
    in_backward = {s: counts[f"{s} @ autograd"] for s in BUDGET
                   if s not in CHAINED and counts[f"{s} @ autograd"] > 0}
    assert not in_backward, f"host reads on the autograd thread: {in_backward}"
