"""Trainer callbacks: the guard follows the trainer (protect at train begin, step per optimizer step, close at end)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import attnchecker
from attnchecker import AttnCheckerCallback, AttnCheckerLightningCallback, FaultPlan, Policy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The model zoo lives next to this file; make it importable under either pytest import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import VOCAB, batch, build

STEPS = 4


def test_hf_callback_drives_the_guard_without_a_trainer() -> None:
    """The TrainerCallback protocol by hand: what Trainer calls, in order."""
    model = build("gpt2")
    cb = AttnCheckerCallback(policy=Policy.full())
    cb.on_train_begin(None, None, None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    guard = cb.guard
    assert guard is not None
    assert attnchecker.is_protected(model)
    for _ in range(3):
        cb.on_step_end(None, None, None, model=model)
    assert guard.step_count == 3
    cb.on_train_end(None, None, None, model=model)
    assert guard.closed
    assert model.config._attn_implementation == "sdpa"


def test_hf_callback_leaves_a_given_guard_open() -> None:
    model = build("gpt2")
    with attnchecker.protect(model) as guard:
        cb = AttnCheckerCallback(guard)
        cb.on_train_begin(None, None, None, model=model)
        cb.on_step_end(None, None, None)
        cb.on_train_end(None, None, None)
        assert not guard.closed
        assert guard.step_count == 1
    with pytest.raises(TypeError, match="not both"):
        AttnCheckerCallback(guard, policy=Policy.full())
    with pytest.raises(TypeError, match="optimizer"):
        AttnCheckerCallback(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = batch("gpt2", i)["ids"][0]
        return {"input_ids": ids, "labels": ids}


def test_hf_trainer_with_callback_corrects_faults(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    import transformers as tf

    model = build("gpt2")
    plan = FaultPlan.random(steps=STEPS, layers=2, per_step=1, seed=5)
    cb = AttnCheckerCallback(policy=Policy.full(), faults=plan)
    args = tf.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = tf.Trainer(model=model, args=args, train_dataset=_Batches(), callbacks=[cb])
    result = trainer.train()
    guard = cb.guard
    assert guard is not None
    assert guard.closed
    report = guard.report()
    assert report.steps == STEPS
    assert len(guard.injector.injected) == STEPS
    assert report.detected >= STEPS
    assert report.corrected == report.detected
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("nan_filter", [True, False])
def test_hf_callback_warns_when_the_trainer_would_hide_a_nan_loss(tmp_path: Path, nan_filter: bool,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A NaN in an MLP weight (outside the checked ops) at step 1: the loss is NaN, the optimizer net keeps the NaN
    gradients out of the weights, and Trainer (logging_nan_inf_filter, its default) logs the mean of the earlier
    losses instead. The callback says so, at train begin and at that step; with the filter off it has nothing to say."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    import logging

    import transformers as tf

    model = build("gpt2")

    class NanWeight(tf.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                with torch.no_grad():
                    model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")

    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                                disable_tqdm=True, dataloader_num_workers=0, logging_nan_inf_filter=nan_filter)
    trainer = tf.Trainer(model=model, args=args, train_dataset=_Batches(),
                         callbacks=[NanWeight(), AttnCheckerCallback(policy=Policy.full())])
    with caplog.at_level(logging.WARNING, "attnchecker"):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    warned = [r.getMessage() for r in caplog.records if "logging_nan_inf_filter" in r.getMessage()]
    if nan_filter:
        assert all(torch.isfinite(torch.tensor(losses))), losses  # the NaN step's loss is hidden
        assert len(warned) == 2 and "step 2 had non-finite gradients" in warned[1], warned
    else:
        assert not torch.isfinite(torch.tensor(losses[-1])), losses
        assert warned == []


def lit_nano(lightning: Any) -> Any:
    """A LightningModule around the zoo's nanoGPT (AdamW, next-token loss)."""

    class LitNano(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build("nanogpt")

        def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.model(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return LitNano()


def test_lightning_callback_protects_the_module() -> None:
    lightning = pytest.importorskip("lightning")
    data = torch.utils.data.DataLoader([batch("nanogpt", i)["ids"][0] for i in range(16)], batch_size=2)
    module = lit_nano(lightning)
    plan = FaultPlan.random(steps=STEPS, layers=2, per_step=1, seed=6)
    cb = AttnCheckerLightningCallback(policy=Policy.full(), faults=plan)
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(module, data)
    guard = cb.guard
    assert guard is not None
    assert guard.closed
    assert guard.report().steps == STEPS
    assert len(guard.injector.injected) == STEPS
    assert guard.report().corrected == guard.report().detected >= STEPS
    assert not attnchecker.is_protected(module)


def _hf_train(tmp_path: Path, max_steps: int, callback: Any, resume: str | None = None) -> Any:
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2,
                                learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="steps", save_steps=10,
                                logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = tf.Trainer(model=build("gpt2"), args=args, train_dataset=_Batches(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_the_hf_callback_saves_the_guard_in_the_checkpoint_and_a_resumed_trainer_takes_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/adaptive.md, "Resuming". Trainer saves checkpoint-10; the callback writes the rank's guard state beside
    it. Trainer resumed from it: the guard starts at step 10 with the saved schedule (not every op due) and ends at
    14. The same checkpoint without the guard's file (written before attnchecker, say): the guard still counts
    Trainer's steps, from 10, checks every op in full until the schedule relaxes, and the log says where it looked."""
    first = AttnCheckerCallback()
    _hf_train(tmp_path, 10, first)
    path = tmp_path / "checkpoint-10" / "attnchecker_guard_rank0.json"
    saved = json.loads(path.read_text())
    assert saved["step"] == 10 and saved == first.guard.state_dict()

    def resume(max_steps: int) -> tuple[AttnCheckerCallback, tuple[int, frozenset[str]]]:
        """Trainer resumed from checkpoint-10 up to ``max_steps``: the callback, and the guard's step and due ops
        when the first resumed step began."""
        cb = AttnCheckerCallback()
        began: list[tuple[int, frozenset[str]]] = []

        def note_begin(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            began.append((cb.guard.step_count, cb.guard.check_config.checked_ops))

        cb.on_step_begin = note_begin  # type: ignore[method-assign]
        _hf_train(tmp_path, max_steps, cb, resume=str(tmp_path / "checkpoint-10"))
        return cb, began[0]

    resumed, began = resume(14)
    assert began == (10, frozenset()), began  # the default policy's quiet step 10, as the first run would have had
    assert resumed.guard.report().steps == 4 and resumed.guard.step_count == 14

    path.unlink()
    with caplog.at_level("INFO", "attnchecker"):
        without, began = resume(12)
    assert began == (10, frozenset(attnchecker.policy.OPS))
    assert without.guard.step_count == 12
    assert any("without a guard state at" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_the_lightning_callback_keeps_the_guard_state_in_its_checkpoint(tmp_path: Path) -> None:
    """Lightning saves the callback's state_dict in the checkpoint and restores it before fit starts: the resumed fit's
    guard starts where the saved one was (docs/adaptive.md, "Resuming")."""
    lightning = pytest.importorskip("lightning")
    data = torch.utils.data.DataLoader([batch("nanogpt", i)["ids"][0] for i in range(32)], batch_size=2)

    def fit(steps: int, cb: AttnCheckerLightningCallback, ckpt: Path | None) -> Any:
        trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
        trainer.fit(lit_nano(lightning), data, ckpt_path=ckpt)
        return trainer

    first = AttnCheckerLightningCallback()
    fit(10, first, None).save_checkpoint(tmp_path / "ten.ckpt")
    saved = torch.load(tmp_path / "ten.ckpt", weights_only=False)["callbacks"]
    (state,) = [s["guard"] for s in saved.values() if "guard" in s]
    assert state["step"] == 10

    resumed = AttnCheckerLightningCallback()
    fit(13, resumed, tmp_path / "ten.ckpt")
    assert resumed.guard is not None
    assert resumed.guard.step_count == 13 and resumed.guard.report().steps == 3
