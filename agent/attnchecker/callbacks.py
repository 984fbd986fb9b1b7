"""Trainer callbacks: the guard's step boundaries and lifetime follow the trainer's.

``AttnCheckerCallback`` (Hugging Face ``Trainer``) and ``AttnCheckerLightningCallback`` (Lightning). Each takes either
a guard you built with ``protect()`` (then you close it) or ``protect()`` keyword arguments (then the callback
protects the model when training begins and closes the guard when it ends).
"""

from __future__ import annotations

from typing import Any

from .runtime.guard import Guard, protect

__all__ = ["AttnCheckerCallback", "AttnCheckerLightningCallback"]

try:
    from transformers import TrainerCallback as _HFCallbackBase
except ImportError:  # transformers is optional for the agent
    _HFCallbackBase = object  # type: ignore[assignment,misc]

try:
    from lightning.pytorch.callbacks import Callback as _LightningCallbackBase
except ImportError:  # lightning is optional too
    _LightningCallbackBase = object  # type: ignore[assignment,misc]


class _GuardOwner:
    def __init__(self, guard: Guard | None, protect_kwargs: dict[str, Any]) -> None:
        if guard is not None and protect_kwargs:
            raise TypeError("give either guard= or protect() keyword arguments, not both")
        if "optimizer" in protect_kwargs:
            raise TypeError("the callback steps the guard itself; do not pass optimizer=")
        self.guard = guard
        self._protect_kwargs = protect_kwargs
        self._owns = guard is None

    def _begin(self, model: Any, optimizer: Any) -> None:
        if self.guard is None or (self._owns and self.guard.closed):
            if model is None:
                raise TypeError("AttnChecker callback: the trainer passed no model to protect")
            self.guard = protect(model, **self._protect_kwargs)
            self._owns = True
        if optimizer is not None:
            # Only for on_uncorrectable="skip_step": the callback, not the optimizer hook, marks step boundaries.
            self.guard.attach_optimizer(optimizer, step=False)

    def _step(self) -> None:
        if self.guard is not None:
            self.guard.step()

    def _end(self) -> None:
        if self.guard is not None and self._owns:
            self.guard.close()


class AttnCheckerCallback(_HFCallbackBase):
    """``Trainer(..., callbacks=[AttnCheckerCallback(policy=Policy.full())])``.

    on_train_begin: protect ``model`` (unless a guard was given); on_step_end: ``guard.step()`` (one optimizer step,
    after gradient accumulation); on_train_end: close the guard it created.
    """

    def __init__(self, guard: Guard | None = None, **protect_kwargs: Any) -> None:
        self._owner = _GuardOwner(guard, protect_kwargs)

    @property
    def guard(self) -> Guard | None:
        return self._owner.guard

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._owner._begin(model, kwargs.get("optimizer"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._owner._step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._owner._end()


class AttnCheckerLightningCallback(_LightningCallbackBase):
    """``L.Trainer(callbacks=[AttnCheckerLightningCallback(policy=Policy.full())])``: protects the LightningModule
    on fit start, steps after each optimizer step (``on_train_batch_end`` with accumulation respected), closes on
    fit end."""

    def __init__(self, guard: Guard | None = None, **protect_kwargs: Any) -> None:
        self._owner = _GuardOwner(guard, protect_kwargs)

    @property
    def guard(self) -> Guard | None:
        return self._owner.guard

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = getattr(trainer, "optimizers", None) or [None]
        self._owner._begin(pl_module, optimizers[0])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1)), 1)
        if (batch_idx + 1) % accumulate == 0:
            self._owner._step()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._owner._end()
