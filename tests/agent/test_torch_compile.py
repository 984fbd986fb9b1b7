"""torch.compile over a protected model, as users compile their training step's model: the engine's entry points
(integrations' engine_call and projection hooks, the whole-step Linear forward, the guard's root hooks) are kept out
of the compiled graphs (torch.compiler.disable), so Dynamo graph-breaks around them and the checks run eagerly.

Before, Dynamo traced into the engine and the first protected forward failed inside it (an AttributeError from a
resumed frame of checks.product._verify). The aot_eager backend runs Dynamo and AOT autograd, which is where the hooks
and custom autograd Functions meet the compiler, without Inductor's C++ build (tens of seconds per graph here); the
same model under Inductor was run by hand (docs/fault-coverage.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_zoo import NanoGPT

import attnchecker
from attnchecker import Policy
from attnchecker.inject import Fault, FaultPlan

VOCAB, T, STEPS = 64, 32, 3


def _run(scope: str | None, *, faults: FaultPlan | None = None) -> tuple[list[float], list]:
    torch.manual_seed(0)
    model = NanoGPT(vocab=VOCAB, n_embd=32, n_head=4, n_layer=2, block=T).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = (attnchecker.protect(model, optimizer=opt, scope=scope, policy=Policy(), faults=faults)
             if scope else None)
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    try:
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            logits = compiled(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, list(guard.detections) if guard else []
    finally:
        if guard:
            guard.close()
        torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["attention", "all"])
def test_a_compiled_protected_model_trains_as_the_compiled_unprotected_one(scope: str) -> None:
    want, _ = _run(None)
    got, detections = _run(scope)
    assert detections == []
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)


def test_a_fault_in_a_compiled_model_is_corrected() -> None:
    want, _ = _run(None)
    got, detections = _run("attention", faults=FaultPlan([Fault(op="scores", layer=1, step=1, kind="inf", seed=3)]))
    assert [(d.op, d.step, d.action) for d in detections] == [("scores", 1, "corrected")]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)
