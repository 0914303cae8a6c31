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

Under ``gradzip compare --script`` (``integrations/script.py``), a callback without a
spec takes the method from the environment (PyTorch's own hooks included), hands each
evaluation's ``eval_loss`` to the handle and writes the run's record when training
ends: a Trainer script is raced as it is, with ``attach_trainer(trainer)``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from transformers import TrainerCallback


class GradzipCallback(TrainerCallback):
    """Attach ``spec`` (and ``capture``) to ``trainer``'s wrapped model at train begin."""

    def __init__(self, trainer: Any, spec: str | None = None, capture: Any = None,
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
        from gradzip.integrations.script import Launch

        spec = self.spec if self.spec is not None or Launch.from_env() else "none"
        options = dict(self.attach_options)
        if self.capture is not None:
            options["capture"] = self.capture
        self.handle = gradzip.attach(self.trainer.model_wrapped, spec, **options)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.capture is not None:
            epoch = math.floor((state.epoch or 0.0) + 1e-9)
            self.capture.begin_step(state.global_step + 1, epoch=epoch)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.capture is not None:
            self.capture.end_step()
        if self.handle is not None and not self.launched:
            self.handle.stats.end_step()  # a launched run's clock ends its own steps

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._not_a_step()

    def _not_a_step(self) -> None:
        """An evaluation or a checkpoint ran: no step's time, so ``auto`` leaves it out
        of what it measures."""
        restart = getattr(self.handle, "restart_clock", None)
        if callable(restart):
            restart()

    def on_evaluate(self, args: Any, state: Any, control: Any,
                    metrics: dict[str, float] | None = None, **kwargs: Any) -> None:
        if not self.launched:  # a launched run's ``log_eval`` restarts the clock
            self._not_a_step()
        if self.launched and metrics and "eval_loss" in metrics:
            if self.handle.record is not None:
                warnings.warn("an evaluation after training ended is not in the race's "
                              "record (written at train end): evaluate inside train() "
                              "with eval_strategy='steps'", stacklevel=2)
                return
            self.handle.log_eval(state.global_step, metrics["eval_loss"])

    @property
    def launched(self) -> bool:
        """Whether the method came from ``gradzip compare --script``'s environment."""
        from gradzip.integrations.script import ScriptHandle

        return isinstance(self.handle, ScriptHandle)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the hook's thread and close the archive (idempotent)."""
        if self.handle is not None:
            self.handle.close()
        elif self.capture is not None:
            self.capture.close()


def attach_trainer(trainer: Any, spec: str | None = None, *, capture: Any = None,
                   **attach_options: Any) -> GradzipCallback:
    """Add a ``GradzipCallback`` for ``spec`` (a gradzip codec; ``none`` = the plain
    all-reduce; left out: the method of ``gradzip compare --script``, else ``none``) and
    ``capture`` to ``trainer``; returns it (``.handle.stats`` holds the communication
    figures once training began)."""
    callback = GradzipCallback(trainer, spec, capture, **attach_options)
    trainer.add_callback(callback)
    return callback
