"""``gradzip.outer``: synchronizing rarely (DiLoCo, Streaming DiLoCo, post-local SGD).

    from gradzip.outer import DiLoCo
    outer = DiLoCo(model, inner_optimizer, sync_every=32, codec="int8", fragments=2)
    for batch in batches:
        loss(model, batch).backward(); inner_optimizer.step(); inner_optimizer.zero_grad()
        outer.step()

The implementation lives in ``gradzip.comm.outer`` (it is communication); this module is
its public name.
"""

from __future__ import annotations

from gradzip.comm.outer import OUTER_KINDS, DiLoCo, check_options, fragment_indices

__all__ = ["OUTER_KINDS", "DiLoCo", "check_options", "fragment_indices"]
