"""torch.compile over a protected model, as users compile their training step's model: while Dynamo traces, the
checked attention, the projection checks and the whole-step Linear forward are torch.library custom ops
(attnchecker/compiled/), so they stay in the compiled graph as opaque calls whose bodies run the eager engine, forward
and backward (docs/abft.md, "Under torch.compile"). test_torch_compile_graphs.py counts the graphs; this file trains.

The aot_eager backend runs Dynamo and AOT autograd, which is where the ops' fakes and registered backwards meet the
compiler, without Inductor's C++ build (tens of seconds per graph here: test_torch_compile_inductor.py pays it once).
Each attention backend is forced in turn (ATTNCHECKER_ATTENTION), as each one runs inside the op's body."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_zoo import NanoGPT

import attnchecker
from attnchecker import Policy
from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.inject import Fault, FaultPlan

VOCAB, T, STEPS = 64, 32, 3


def _run(scope: str | None, *, faults: FaultPlan | None = None) -> tuple[list[float], list, set[str]]:
    """Losses, detections, and the attention backends that ran the checked calls."""
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
        if guard is None:
            return losses, [], set()
        return losses, list(guard.detections), {name for (_, name) in guard.coverage.backends}
    finally:
        if guard:
            guard.close()
        torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["attention", "all"])
def test_a_compiled_protected_model_trains_as_the_compiled_unprotected_one(scope: str) -> None:
    want, _, _ = _run(None)
    got, detections, _ = _run(scope)
    assert detections == []
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)


@pytest.mark.parametrize("backend", ["auto", "unfused", "tiled", "native", "triton"])
def test_a_fault_in_a_compiled_model_is_corrected(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, backend)
    want, _, _ = _run(None)
    got, detections, backends = _run("attention", faults=FaultPlan([Fault(op="scores", layer=1, step=1, kind="inf", seed=3)]))
    # The tiled backend recomputes the tile it locates the fault in; the others correct the element.
    assert [(d.op, d.step, d.action in ("corrected", "recomputed")) for d in detections] == [("scores", 1, True)]
    if backend != "auto":
        # The forced backend ran the calls it takes (the native kernel leaves a call with an injected fault to the
        # next backend: its faults are its own, fused_attention.emulated_faults).
        assert backend in backends, backends
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)
