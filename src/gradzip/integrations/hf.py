"""gradzip in a Hugging Face ``transformers`` ``Trainer`` (extra ``gradzip[hf]``).

    from gradzip.capture.capture import Capture
    from gradzip.integrations.hf import attach_trainer

    trainer = Trainer(model=model, args=args, train_dataset=data)
    attach_trainer(trainer, "none", capture=Capture("grads", every=10))
    trainer.train()   # under torchrun: DDP, each communicated bucket captured

The callback attaches gradzip's hook when training begins — by then the Trainer
(through Accelerate) has wrapped the model in DDP or FSDP2 — keeps the capture's
epoch and step in line with the Trainer's (step = ``state.global_step`` of the
optimizer step being computed, from 1; epoch = the whole epochs done), and closes the
hook and the archive when training ends (also when it ends with an error: the archive
then holds every step that completed).
"""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback


class GradzipCallback(TrainerCallback):
    """Attach ``spec`` (and ``capture``) to ``trainer``'s wrapped model at train begin."""

    def __init__(self, trainer: Any, spec: str = "none", capture: Any = None,
                 **attach_options: Any) -> None:
        self.trainer = trainer
        self.spec = spec
        self.capture = capture
        self.attach_options = attach_options
        self.handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        import gradzip

        if self.handle is not None:
            return  # a second train() call on the same Trainer keeps the hook
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("gradzip's Trainer callback compresses or captures what ranks "
                               "communicate: launch the training with torchrun (DDP)")
        self.handle = gradzip.attach(self.trainer.model_wrapped, self.spec,
                                     capture=self.capture, **self.attach_options)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.capture is not None:
            epoch = math.floor((state.epoch or 0.0) + 1e-9)
            self.capture.begin_step(state.global_step + 1, epoch=epoch)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.capture is not None:
            self.capture.end_step()
        if self.handle is not None:
            self.handle.stats.end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the hook's thread and close the archive (idempotent)."""
        if self.handle is not None:
            self.handle.close()
        elif self.capture is not None:
            self.capture.close()


def attach_trainer(trainer: Any, spec: str = "none", *, capture: Any = None,
                   **attach_options: Any) -> GradzipCallback:
    """Add a ``GradzipCallback`` for ``spec`` (a gradzip codec; ``none`` = the plain
    all-reduce) and ``capture`` to ``trainer``; returns it (``.handle.stats`` holds the
    communication figures once training began)."""
    callback = GradzipCallback(trainer, spec, capture, **attach_options)
    trainer.add_callback(callback)
    return callback
