"""``dgc``: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally; ICLR 2018).

What each rank does per tensor and step (paper Algorithm 1 plus §3):

1. **Local gradient clipping** (§3.2): scale the fresh gradient g so its L2 norm is at
   most ``clip`` (the paper uses the global clipping threshold times N^-1/2 for N
   ranks; here the limit is given directly and applies per tensor/bucket).
2. **Momentum correction** (§3.1): accumulate the *velocity*, not the gradient::

       u <- m * u + g          (momentum, kept locally)
       v <- v + u              (local accumulation of velocities)

3. **Sparsify v** with the **sampled threshold** (§2, "to reduce the selection
   cost, we sample only 0.1% to 1% of the gradients and perform top-k selection on
   the samples to estimate the threshold for the entire population. If the number
   of gradients exceeding the threshold is far more than expected, a precise
   threshold is calculated from the already-selected gradients."): sample
   ``sample_ratio`` of |v|, take the sample's top ``density`` as the threshold, keep
   every entry above it; if more than ``REFINE_ABOVE`` (1.3) times k pass, select
   the exact top-k among those. So the count is close to, not exactly, k.
4. **Momentum factor masking** (§3.1): zero u and v where values were sent, so stale
   momentum does not keep pushing coordinates that were just applied.
5. **Warm-up** (§3.3): sparsity rises exponentially during ``warmup_steps``:
   density 25%, 6.25%, 1.5625%, 0.39%, ... (each 1/4 of the last, i.e. 75% →
   93.75% → 98.4375% → 99.6% sparsity), in equal phases, until the next step
   would be below ``ratio``; then ``ratio`` (99.9% sparsity by default, the paper's).

**Run the training optimizer without momentum** (plain SGD, ``momentum=0``): the
momentum lives here, in u, and what arrives is already the accumulated velocity.
Using momentum in both places would apply it twice. Do not put ``ef`` in front:
v already is DGC's error-feedback memory.

State per tensor (``slot.data``, so it checkpoints): ``u`` and ``v``, flat float32.

Wire: the shared sparse form (``gradzip.codecs.indices``): ``values`` float32 (the
entries of v that were sent, position order) + int32 gaps or a bitmap, whichever is
smaller (or all values densely if nearly everything is sent, as at ``ratio=1``).
Biased and not summable (each rank sends different positions).
"""

from __future__ import annotations

import math

import torch

from gradzip.codecs import indices
from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.indices import (
    Selection,
    abs_ge_positions,
    sparse_decode,
    sparse_payload,
)
from gradzip.codecs.payload import Payload
from gradzip.codecs.registry import Param, at_least, in_range, register
from gradzip.codecs.sparse import topk_among

#: selecting more than this many times k triggers the exact refinement (paper: "far more")
REFINE_ABOVE = 1.3
#: smallest sample; tensors this small or smaller are selected exactly
MIN_SAMPLE = 1024
#: each warm-up phase keeps this fraction of the previous phase's density
WARMUP_FACTOR = 0.25


def warmup_densities(ratio: float) -> list[float]:
    """The warm-up phase densities for a target ``ratio``: 0.25, 0.0625, ... while > ratio.

    For the paper's ratio 0.001 this gives four phases (75%, 93.75%, 98.4375%, 99.6%
    sparsity) before 99.9%.
    """
    phases = []
    d = WARMUP_FACTOR
    while d > ratio:
        phases.append(d)
        d *= WARMUP_FACTOR
    return phases


def density_at(step: int, ratio: float, warmup_steps: int) -> float:
    """The density DGC uses at ``step`` (0-based): warm-up phase density, then ``ratio``."""
    phases = warmup_densities(ratio)
    if step >= warmup_steps or not phases:
        return ratio
    return phases[step * len(phases) // warmup_steps]


def sampled_positions(v: torch.Tensor, k: int, sample_ratio: float, g: torch.Generator
                      ) -> torch.Tensor:
    """DGC's selection: about the top-``k`` |v|, from a threshold estimated on a sample.

    Returns ascending int64 positions. Exact top-k when the tensor is no bigger than
    the sample would be, or after the refinement.
    """
    n = v.numel()
    if k >= n:
        return torch.arange(n, device=v.device)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=v.device)
    s = max(math.ceil(n * sample_ratio), MIN_SAMPLE)
    if s >= n:
        return topk_among(v.abs(), torch.arange(n, device=v.device), k)
    sample = v[torch.randint(n, (s,), generator=g).to(v.device)].abs()
    top = max(1, math.ceil(s * k / n))
    threshold = float(sample.kthvalue(s - top + 1).values)
    selected = abs_ge_positions(v, threshold)
    if selected.numel() > REFINE_ABOVE * k:
        selected = topk_among(v[selected].abs(), selected, k)
    return selected


@register("dgc")
class DeepGradientCompression(Compressor):
    """Deep Gradient Compression (Lin et al. 2018): momentum-corrected, masked top-k.

    See the module docstring for the algorithm. The training optimizer must run
    **without momentum**: DGC keeps the momentum itself (momentum correction).
    """

    own_feedback = True
    positional_state = True  # u and v, one value per coordinate

    summary = "Deep Gradient Compression: momentum correction + masking, sampled top-k (Lin 2018)"
    values_field = "values"
    PARAMS = (
        Param("ratio", float, 0.001, "final density after warm-up, in (0, 1] "
              "(the paper's 99.9% sparsity is 0.001)", in_range(0.0, 1.0, lo_open=True)),
        Param("momentum", float, 0.9, "momentum m of u <- m*u + g, in [0, 1); "
              "set the optimizer's own momentum to 0", in_range(0.0, 1.0, hi_open=True)),
        Param("clip", float, 0.0, "local clipping: max L2 norm of each tensor's gradient before "
              "accumulation (paper: global threshold * N^-1/2); 0 disables", at_least(0.0)),
        Param("warmup_steps", int, 0, "steps of exponentially rising sparsity "
              "(75%, 93.75%, ...) before ratio applies (paper: 4 epochs); 0 = none",
              at_least(0)),
        Param("sample_ratio", float, 0.01, "fraction of entries sampled to estimate the "
              "threshold, in (0, 1] (paper: 0.001 to 0.01)", in_range(0.0, 1.0, lo_open=True)),
    )

    def _accumulate(self, g: torch.Tensor, slot: Slot) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Clip g, then u <- m*u + g and v <- v + u, in place in ``slot.data``."""
        clip, m = self.params["clip"], self.params["momentum"]
        scale = 1.0
        if clip > 0:
            norm = float(g.norm())
            if norm > clip:
                scale = clip / norm
        n = g.numel()
        u, v = slot.data.get("u"), slot.data.get("v")
        if v is not None and v.numel() != n:
            raise ValueError(
                f"dgc: key {slot.key!r} changed size {v.numel()} -> {n}; "
                "use a distinct key per tensor"
            )
        if v is None:
            v = indices.empty(n, g.device)
            torch.mul(g, scale, out=v)
            if m > 0:
                u = indices.empty(n, g.device)
                u.copy_(v)
        elif m > 0:
            if u is None:  # state saved without momentum: start the momentum at zero
                u = indices.zeros(n, g.device)
            if scale == 1.0:
                torch.add(g, u, alpha=m, out=u)  # one pass: u = g + m*u
            else:
                u.mul_(m).add_(g, alpha=scale)
            v.add_(u)
        else:
            v.add_(g, alpha=scale)
        slot.data["v"] = v
        if u is not None:
            slot.data["u"] = u
        return v, u

    def density(self, step: int) -> float:
        return density_at(step, self.params["ratio"], self.params["warmup_steps"])

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        g = x.detach().reshape(-1).float()
        v, u = self._accumulate(g, slot)
        n = g.numel()
        k = min(n, max(1, round(self.density(slot.step) * n)))
        positions = sampled_positions(v, k, self.params["sample_ratio"], slot.generator("cpu"))
        payload = sparse_payload(v, Selection(n, indices=positions))
        # momentum factor masking: what was sent leaves both accumulators
        v[positions] = 0.0
        if u is not None:
            u[positions] = 0.0
        return payload

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        return sparse_decode(p, shape)
