"""Trainer callbacks: the guard's step boundaries and lifetime follow the trainer's.

``AttnCheckerCallback`` (Hugging Face ``Trainer``) and ``AttnCheckerLightningCallback`` (Lightning). Each takes either
a guard you built with ``protect()`` (then you close it) or ``protect()`` keyword arguments (then the callback
protects the model when training begins and closes the guard when it ends).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from .errors import GuardStateError
from .runtime.guard import STATE_FORMAT, Guard, protect

__all__ = ["AttnCheckerCallback", "AttnCheckerLightningCallback"]

log = logging.getLogger("attnchecker")

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
        self.resume_state: Mapping[str, Any] | None = None
        """A guard state (``Guard.state_dict()``) the trainer restored from its checkpoint before training began:
        the guard takes it at ``_begin``."""

    def _begin(self, model: Any, optimizer: Any) -> None:
        if self.guard is None or (self._owns and self.guard.closed):
            if model is None:
                raise TypeError("AttnChecker callback: the trainer passed no model to protect")
            self.guard = protect(model, **self._protect_kwargs)
            self._owns = True
        if optimizer is not None:
            # Only for on_uncorrectable="skip_step": the callback, not the optimizer hook, marks step boundaries.
            self.guard.attach_optimizer(optimizer, step=False)
        state, self.resume_state = self.resume_state, None
        if state is not None:
            try:
                self.guard.load_state_dict(state)
            except GuardStateError as e:
                # A damaged or foreign state file must not stop a resumed run: it trains on from a fresh schedule.
                log.warning("attnchecker: the checkpoint's guard state was not taken (%s); the schedule starts "
                            "afresh, every op checked in full until it relaxes", e)

    def _step(self) -> None:
        if self.guard is not None:
            self.guard.step()

    def _end(self) -> None:
        if self.guard is not None and self._owns:
            self.guard.close()


class AttnCheckerCallback(_HFCallbackBase):
    """``Trainer(..., callbacks=[AttnCheckerCallback(policy=Policy.full())])``.

    on_train_begin: protect ``model`` (unless a guard was given); on_step_end: ``guard.step()`` (one optimizer step,
    after gradient accumulation); on_train_end: close the guard it created. With ``logging_nan_inf_filter`` on (the
    Trainer's default, which logs a NaN loss as the mean of the others) it warns at train begin, and at each step
    whose gradients were not finite.
    """

    def __init__(self, guard: Guard | None = None, **protect_kwargs: Any) -> None:
        self._owner = _GuardOwner(guard, protect_kwargs)
        self._nan_filter = False

    @property
    def guard(self) -> Guard | None:
        return self._owner.guard

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        global_step = int(getattr(state, "global_step", 0) or 0)
        if global_step > 0:
            # Resumed from checkpoint-{global_step}: its guard state if on_save wrote one there; otherwise the step
            # number alone, so that events and stats count Trainer's steps (the schedule starts afresh).
            # Trainer does not tell its callbacks which folder it resumed from: its output_dir's checkpoint-N is
            # where resume_from_checkpoint=True, and on_save, put it.
            path = _state_path(args, global_step, self._rank())
            saved = _read_state(path)
            if saved is None:
                log.info("attnchecker: resumed at step %d without a guard state at %s; the schedule starts afresh",
                         global_step, path)
            self._owner.resume_state = saved or {"format": STATE_FORMAT, "step": global_step,
                                                 "schedule": {"ops": {}}}
        self._owner._begin(model, kwargs.get("optimizer"))
        # Trainer replaces a NaN or INF loss by the mean of the losses logged before it (0.0 on a first step): its
        # own logs then show a run that went NaN as healthy.
        self._nan_filter = bool(getattr(args, "logging_nan_inf_filter", False))
        if self._nan_filter:
            log.warning("attnchecker: TrainingArguments.logging_nan_inf_filter is on (Trainer's default): a NaN or INF "
                        "loss is logged as the mean of the losses before it (0.0 on the first step), so a run that "
                        "went NaN looks healthy in the Trainer's logs. attnchecker reports what it catches "
                        "(Guard.detections, Guard.report(), the collector) and warns at each step whose gradients "
                        "were not finite; logging_nan_inf_filter=False logs the loss as it is")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        guard = self._owner.guard
        stats = guard.step_stats if guard is not None else None
        if self._nan_filter and stats is not None and stats.catches.get(("optimizer", "grad"), 0):
            log.warning("attnchecker: step %s had non-finite gradients (a NaN or INF loss, or a fault outside the "
                        "checked ops; the optimizer net kept them from the weights), and Trainer's "
                        "logging_nan_inf_filter logs that step's loss as the mean of the others",
                        getattr(state, "global_step", "?"))
        self._owner._step()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Trainer has written ``checkpoint-{global_step}``: this rank's guard state goes beside it
        (``attnchecker_guard_rank{rank}.json``), for ``on_train_begin`` of a run resumed from it."""
        guard = self._owner.guard
        if guard is None:
            return
        path = _state_path(args, int(getattr(state, "global_step", 0) or 0), guard.rank)
        if not os.path.isdir(os.path.dirname(path)):
            log.debug("attnchecker: no checkpoint folder at %s; the guard state is not saved", os.path.dirname(path))
            return
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(guard.state_dict(), f)
            os.replace(tmp, path)  # a reader sees the old file or the whole new one
        except OSError as e:
            log.warning("attnchecker: could not save the guard state to %s (%s); a run resumed from this checkpoint "
                        "starts its schedule afresh", path, e)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._owner._end()

    def _rank(self) -> int:
        guard = self._owner.guard
        if guard is not None:
            return guard.rank
        rank = self._owner._protect_kwargs.get("rank")
        return int(rank) if rank is not None else int(os.environ.get("RANK", "0") or 0)


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

    def state_dict(self) -> dict[str, Any]:
        """Lightning saves this in each checkpoint: the guard's state (``Guard.state_dict()``; where it stopped, once
        closed), or nothing before fit starts."""
        guard = self._owner.guard
        return {"guard": guard.state_dict()} if guard is not None else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Lightning restores a checkpoint's callback states before ``on_fit_start``: the guard takes it there."""
        guard_state = state_dict.get("guard")
        if guard_state is not None:
            self._owner.resume_state = guard_state


def _state_path(args: Any, global_step: int, rank: int) -> str:
    """Where ``AttnCheckerCallback.on_save`` puts a rank's guard state: in Trainer's checkpoint folder of that step."""
    try:
        from transformers import trainer_utils

        prefix = trainer_utils.PREFIX_CHECKPOINT_DIR
    except ImportError:
        prefix = "checkpoint"
    output_dir = getattr(args, "output_dir", None) or "."
    return os.path.join(output_dir, f"{prefix}-{global_step}", f"attnchecker_guard_rank{rank}.json")


def _read_state(path: str) -> dict[str, Any] | None:
    """The guard state at ``path``; None when there is none (a checkpoint from before attnchecker, or elsewhere)."""
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("attnchecker: could not read the guard state %s (%s); the schedule starts afresh", path, e)
        return None
    return state if isinstance(state, dict) else None
