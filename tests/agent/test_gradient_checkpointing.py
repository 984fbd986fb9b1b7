"""Gradient (activation) checkpointing, as LLM training runs it: transformers' gradient_checkpointing_enable, which
runs each decoder layer's forward again inside backward. Protection must train exactly as the unprotected
checkpointed model does (the recomputed forward is checked again, and a correction in either pass leaves the same
values), in both scopes and both checkpoint implementations, with no detection on clean data. Faults injected into
the recomputation are covered by test_whole_step_tripwire.py."""
from __future__ import annotations

import pytest
import torch
from model_zoo import batch, build, loss_of

import attnchecker

STEPS = 6


def _losses(arch: str, *, scope: str | None, reentrant: bool) -> tuple[list[float], list]:
    model = build(arch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = attnchecker.protect(model, optimizer=opt, scope=scope) if scope else None
    losses = []
    try:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(arch, model, batch(arch, step))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, list(guard.detections) if guard else []
    finally:
        if guard:
            guard.close()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("scope", ["attention", "all"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_checkpointed_training_matches_the_unprotected_run(arch: str, scope: str, reentrant: bool) -> None:
    want, _ = _losses(arch, scope=None, reentrant=reentrant)
    got, detections = _losses(arch, scope=scope, reentrant=reentrant)
    assert detections == []
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)
