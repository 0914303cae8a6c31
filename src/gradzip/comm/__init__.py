"""Distributed integration: DDP comm hook, FSDP2 reduce-scatter, FSDP1 hook, stats.

``handle = gradzip.attach(model, "ef | topk(ratio=0.01)")`` is the one-liner;
``handle.stats`` (``CommStats``) reports what the communication really cost.
This package imports torch.distributed; ``import gradzip`` does not (it loads this
package lazily on first use of ``gradzip.attach`` / ``gradzip.ddp_hook``).
"""

from gradzip.comm.attach import Handle, attach
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.ddp import DDPCommState, ddp_hook, gradzip_hook
from gradzip.comm.fsdp import CompressedReduceScatter, FSDP1CommState, fsdp1_hook
from gradzip.comm.stats import CommStats

__all__ = [
    "CommStats", "CompressedReduceScatter", "DDPCommState", "FSDP1CommState", "Handle",
    "TorchCommunicator", "attach", "ddp_hook", "fsdp1_hook", "gradzip_hook",
]
