"""The attention backward with attention dropout under protect(scope="all") (unfused_backward.py): the fused kernel
cannot replay the protected softmax's keep-mask, so autograd differentiates the unfused graph, and its four GEMMs
(dQ, dK, dAP, dV) are checked like a Linear layer's. Faults come from a TorchDispatchMode below autograd
(gemm_injector), chosen by shape: the model's attention products, never the checks' own skinny ones."""
from __future__ import annotations

from typing import Any

import attnchecker
import pytest
import torch
from attnchecker import Policy
from gemm_injector import GemmInjector, worst_rel
from model_zoo import BATCH, SEQ, batch, build, loss_of
from quiet_period import step_until_due_after_quiet

DROPOUT: dict[str, dict[str, Any]] = {"gpt2": {"attn_pdrop": 0.1}, "llama": {"attention_dropout": 0.1},
                                      "bert": {"attention_probs_dropout_prob": 0.1}}
"""Each model's attention dropout at the value its library defaults to (GPT-2 and BERT: 0.1)."""
HEADS, HEAD_DIM, LAYERS = 4, 16, 2
KINDS = ("inf", "nan", "near_inf", "bitflip")
BACKWARD_OPS = {"grad_q", "grad_k", "grad_v", "grad_probs"}


def _attention_shapes() -> set[tuple[int, ...]]:
    """The attention products' output shapes in backward (B·H batched): dAP (T, S), dQ/dK/dV (T or S, D)."""
    return {(BATCH * HEADS, SEQ, SEQ), (BATCH * HEADS, SEQ, HEAD_DIM)}


def _step(arch: str, model: torch.nn.Module, injector: GemmInjector | None = None
          ) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward on the fixed batch, the dropout keep-mask fixed by the seed (the same in every run)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    b = batch(arch, 0)
    if injector is None:
        loss = loss_of(arch, model, b)
        loss.backward()
    else:
        with injector:
            loss = loss_of(arch, model, b)
            injector.phase = "backward"
            loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", sorted(DROPOUT))
def test_every_attention_backward_gemm_under_dropout_is_corrected(arch: str) -> None:
    model = build(arch, **DROPOUT[arch])
    guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    recorder = GemmInjector()
    want_loss, want = _step(arch, model, recorder)
    targets = [c for c in recorder.calls
               if c.phase == "backward" and c.op == "bmm" and c.shape in _attention_shapes()]
    assert len(targets) == 4 * LAYERS, [(c.shape, c.k) for c in targets]
    seen: list[str] = []
    for i, call in enumerate(targets):
        before = len(guard.detections)
        injector = GemmInjector(target=call.index, kind=KINDS[i % len(KINDS)], element=5 + 11 * i)
        loss, grads = _step(arch, model, injector)
        assert injector.hit is not None
        events = guard.detections[before:]
        # Backward runs the last layer first.
        layer = LAYERS - 1 - i // 4
        assert [(e.op in BACKWARD_OPS, e.action, e.layer) for e in events] == [(True, "corrected", layer)], events
        seen.append(events[0].op)
        assert loss == want_loss
        assert worst_rel(grads, want) <= 1e-5, (call, events)
    # Each layer's four products, each hit once.
    assert sorted(seen) == sorted(list(BACKWARD_OPS) * LAYERS)
    guard.close()


def test_the_gradients_of_a_clean_step_are_the_unprotected_models() -> None:
    """The checked products are the same GEMMs autograd runs: with the same keep-mask, the unprotected and the
    protected step's gradients agree to round-off (the protected softmax draws its own mask from the same seed)."""
    plain = build("gpt2", **DROPOUT["gpt2"])
    protected = build("gpt2", **DROPOUT["gpt2"])
    guard = attnchecker.protect(protected, policy=Policy.full(), scope="all")
    _, want = _step("gpt2", plain)
    _, grads = _step("gpt2", protected)
    assert guard.report().checks["grad_q"] == LAYERS  # the unfused backward was checked, not left to autograd
    assert not guard.detections
    assert worst_rel(grads, want) <= 1e-5
    guard.close()


def test_after_a_quiet_period_the_scheduled_full_check_corrects_the_attention_backward_under_dropout() -> None:
    """The default policy, the path a long clean run takes: the first full check after the schedule went quiet
    checks the dropout attention's backward too."""
    model = build("gpt2", **DROPOUT["gpt2"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = attnchecker.protect(model, optimizer=opt, scope="all")

    def step(_due: bool) -> None:
        _step("gpt2", model)
        opt.step()

    step_until_due_after_quiet(guard, step, op="out")
    recorder = GemmInjector()
    _, want = _step("gpt2", model, recorder)  # the due step, fault-free: its full check runs, nothing to find
    opt.step()
    assert not guard.detections
    step_until_due_after_quiet(guard, step, op="out")
    target = next(c for c in recorder.calls
                  if c.phase == "backward" and c.op == "bmm" and c.shape == (BATCH * HEADS, SEQ, HEAD_DIM))
    injector = GemmInjector(target=target.index, kind="inf", element=3)
    _, grads = _step("gpt2", model, injector)
    opt.step()
    assert [(e.op in BACKWARD_OPS, e.action) for e in guard.detections] == [(True, "corrected")]
    assert worst_rel(grads, want) <= 1e-5
    guard.close()
