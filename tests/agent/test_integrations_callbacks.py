"""Trainer callbacks: the guard follows the trainer (protect at train begin, step per optimizer step, close at end)."""

from __future__ import annotations

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


def test_lightning_callback_protects_the_module() -> None:
    lightning = pytest.importorskip("lightning")

    class LitNano(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build("nanogpt")

        def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.model(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader([batch("nanogpt", i)["ids"][0] for i in range(16)], batch_size=2)
    module = LitNano()
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
