"""Gradient (activation) checkpointing, as LLM training runs it: transformers' gradient_checkpointing_enable, which
runs each decoder layer's forward again inside backward. Protection must train exactly as the unprotected
checkpointed model does (the recomputed forward is checked again, and a correction in either pass leaves the same
values), in both scopes and both checkpoint implementations, with no detection on clean data. Faults injected into
the recomputation are covered by test_whole_step_tripwire.py."""
from __future__ import annotations

import pytest
from model_zoo import build, rel_diff, train

import attnchecker

STEPS = 6


def _losses(arch: str, *, scope: str | None, reentrant: bool) -> tuple[list[float], list]:
    model = build(arch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    guard = attnchecker.protect(model, scope=scope) if scope else None
    try:
        run = train(arch, model, STEPS, on_step=guard.step if guard else None)
        return run.losses, list(guard.detections) if guard else []
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
    assert max(rel_diff(a, b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)
