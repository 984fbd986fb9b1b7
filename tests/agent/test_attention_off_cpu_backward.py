"""The attention backward of the tile paths off the CPU under protect(scope="all") (attention.backward.fused.
_off_cpu_backward): a GPU has no fused CPU kernel, and this branch used to differentiate SDPA unchecked. It is run
here on CPU tensors with ``fused.cpu_kernel = False``, which sends a CPU call down the branch a CUDA call takes: the
Triton kernels under the interpreter (attention.backward.triton_backward), or, with ATTNCHECKER_ATTENTION_BACKWARD=torch
(the escape hatch), the checked PyTorch products, whose GEMMs a fault injector below autograd reaches.

Whole GPT-2 steps (2 layers, 4 heads of 16, T = 24), a step's detections drained at Guard.step(); faults injected
from below autograd (gemm_injector, by shape) or, inside the kernels, emulated (triton_backward.emulated_faults)."""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from gemm_injector import FusedBackwardFault, GemmInjector, worst_rel
from model_zoo import BATCH, SEQ, batch, build, loss_of

import attnchecker
from attnchecker import Policy
from attnchecker.attention.backward import fused, triton_backward
from attnchecker.attention.backward.checked import BACKWARD_OPS
from attnchecker.kernels import triton_attention_bwd

HEADS, HEAD_DIM, LAYERS = 4, 16, 2
# The interpreter's numpy warnings (overflow in exp, INF - INF) are what the injected faults do.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
needs_triton = pytest.mark.skipif(not triton_attention_bwd.available(),
                                  reason="the Triton kernels cannot run here (no CUDA, interpreter off)")


@pytest.fixture(autouse=True)
def off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "cpu_kernel", False)


def _step(model: torch.nn.Module, guard: Any, injector: Any = None) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward of the fixed batch, then the step boundary (where deferred records are emitted)."""
    model.zero_grad(set_to_none=True)
    b = batch("gpt2", 0)
    if injector is None:
        loss = loss_of("gpt2", model, b)
        loss.backward()
    else:
        with injector:
            loss = loss_of("gpt2", model, b)
            injector.phase = "backward"
            loss.backward()
    guard.step()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _unprotected(**config: object) -> tuple[float, dict[str, torch.Tensor]]:
    model = build("gpt2", **config)
    model.zero_grad(set_to_none=True)
    loss = loss_of("gpt2", model, batch("gpt2", 0))
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_the_products_check_the_backward_and_correct_a_fault_below_autograd(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """The escape hatch: the checked products, a block of query rows at a time. Each of the five is checked (this
    read raised KeyError: 'scores_bwd' while the branch was unchecked), the step's gradients are the unprotected
    model's, and an INF that an injector below autograd writes into each layer's recomputed scores is corrected."""
    monkeypatch.setenv(triton_backward.BACKWARD_ENV, "torch")
    model = build("gpt2")
    guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    recorder = GemmInjector()
    want_loss, want = _step(model, guard, recorder)
    checks = guard.report().checks
    assert all(checks[op] == LAYERS for op in BACKWARD_OPS), checks
    assert not guard.detections
    plain_loss, plain = _unprotected()
    assert want_loss == pytest.approx(plain_loss, rel=1e-6) and worst_rel(want, plain) <= 1e-5
    # The recomputed scores Q Kᵀ of each layer: the backward's first (B·H, T, S) product per layer.
    scores = [c for c in recorder.calls if c.phase == "backward" and c.shape[-2:] == (SEQ, SEQ)
              and c.k == HEAD_DIM][::2]
    assert len(scores) == LAYERS, [(c.shape, c.k) for c in recorder.calls if c.phase == "backward"]
    for i, call in enumerate(scores):
        before = len(guard.detections)
        injector = GemmInjector(target=call.index, kind="inf", element=7 + 13 * i)
        loss, grads = _step(model, guard, injector)
        assert injector.hit is not None
        events = guard.detections[before:]
        assert [(e.op, e.action, e.layer) for e in events] == [("scores_bwd", "corrected", LAYERS - 1 - i)], events
        assert loss == want_loss and worst_rel(grads, want) <= 1e-5
    guard.close()


def test_tier_one_on_the_products_recomputes_a_faulty_sdpa_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps whose whole-step checks are not due: SDPA's gradient with the tripwire on dQ, dK, dV; an INF in the
    fused backward's dK is caught there and the backward recomputed through the checked products."""
    monkeypatch.setenv(triton_backward.BACKWARD_ENV, "torch")
    model = build("gpt2")
    # The whole step (the "out" schedule) checked in full on the first step only.
    guard = attnchecker.protect(model, policy=Policy(adaptive=False, op_periods={"out": 1000}), scope="all")
    _step(model, guard)
    assert not guard.check_config.checks("out")
    want_loss, want = _step(model, guard)
    assert guard.report().tier_checks["tripwire"] > 0 and not guard.detections
    before = len(guard.detections)
    injector = FusedBackwardFault(call=0, which=1, kind="inf", element=5)
    loss, grads = _step(model, guard, injector)
    assert injector.hit
    events = guard.detections[before:]
    assert [(e.op, e.action, e.tier) for e in events] == [("grad_k", "recomputed", "tripwire")], events
    assert loss == want_loss and worst_rel(grads, want) <= 1e-5
    guard.close()


SMALL = {"n_layer": 1, "n_head": 2}
"""The Triton test's GPT-2: one layer of 2 heads (of 32), as the interpreter runs one program at a time."""


@needs_triton
def test_the_triton_kernels_check_the_backward_and_repair_a_fault_inside_them() -> None:
    """The default off the CPU: the Triton kernels (here under the interpreter). A clean step's gradients are the
    unprotected model's, each of the kernels' five products is counted as checked, and nothing is emitted; an
    emulated fault in the layer's dV product is flagged in the kernel, its block recomputed and reported at the step
    boundary, and the step's gradients are the clean step's."""
    model = build("gpt2", **SMALL)
    guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    want_loss, want = _step(model, guard)
    checks = guard.report().checks
    assert all(checks[op] == 1 for op in triton_attention_bwd.OPS), checks
    assert not guard.detections
    plain_loss, plain = _unprotected(**SMALL)
    assert want_loss == pytest.approx(plain_loss, rel=1e-6) and worst_rel(want, plain) <= 1e-5
    fault = triton_backward.KernelFault(op="grad_v", n=BATCH * 2 - 1, row=SEQ // 2, col=3, value=1e20)
    with triton_backward.emulated_faults([fault]):
        loss, grads = _step(model, guard)
    events = guard.detections
    assert [(e.op, e.action, e.batch, e.head, e.row) for e in events] == [
        ("grad_v", "recomputed", BATCH - 1, 1, SEQ // 2)], events
    assert loss == want_loss and worst_rel(grads, want) == 0.0
    guard.close()


@needs_triton
def test_a_near_inf_that_comes_back_in_a_tier_one_backward_is_uncorrectable_and_the_step_skipped() -> None:
    """A step whose whole-step checks are not due: SDPA's backward, whose dV a fault below autograd makes 1e20, and
    the kernels' tier-1 pass trips on it; their repair's recompute writes 1e20 into that block again (a persistent
    fault, emulated in the kernels, where the table reaches the repair). That is past what the layer's inputs can
    give dV, so it is reported uncorrectable at the optimizer's step, which on_uncorrectable="skip_step" skips: the
    weights stay as they were. It used to be taken for diverged training: no event, and SGD stepped on a gradient of
    1e20 whatever the policy."""
    model = build("gpt2", **SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = attnchecker.protect(model, optimizer=opt, policy=Policy(adaptive=False, op_periods={"out": 1000},
                                                                         on_uncorrectable="skip_step"), scope="all")

    def train(injector: Any = None, faults: tuple[Any, ...] = ()) -> None:
        opt.zero_grad(set_to_none=True)
        with triton_backward.emulated_faults(list(faults)), injector or contextlib.nullcontext():
            loss = loss_of("gpt2", model, batch("gpt2", 0))
            if injector is not None:
                injector.phase = "backward"
            loss.backward()
        opt.step()

    train()  # the first step's whole-step checks are due
    assert not guard.check_config.checks("out") and not guard.detections
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    injector = FusedBackwardFault(call=0, which=2, kind="near_inf", element=19)  # dV of batch 0, head 0
    train(injector, (triton_backward.KernelFault(op="grad_v", n=0, row=SEQ // 2, col=3, value=1e20,
                                                 persistent=True),))
    assert injector.hit
    assert [(e.op, e.action, e.tier) for e in guard.detections] == [("grad_v", "uncorrectable", "tripwire")], \
        guard.detections
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    guard.close()


@needs_triton
@pytest.mark.parametrize(("which", "kind"), [(0, "nan"), (1, "inf"), (2, "near_inf"), (1, "bitflip")])
def test_tier_one_off_the_cpu_reads_sdpas_gradient_in_the_kernels_and_recomputes_a_tripped_block(
        monkeypatch: pytest.MonkeyPatch, which: int, kind: str) -> None:
    """The default off the CPU on a step whose whole-step checks are not due: SDPA's own backward (the vendor's
    kernels an unprotected step runs), whose dQ, dK and dV the Triton kernels' tier-1 pass reads once, then their
    repair recomputes only a block that tripped (fused.sdpa_tier1_on_device). A fault written below autograd into
    the fused backward's output is reported at the step boundary as recomputed by tier 1, and the step's gradients
    are the clean step's; the host's tier 1 (a sum and a read per gradient, then the checked products) never runs."""
    given_calls = []
    run = triton_attention_bwd.run

    def watched(*args: Any, **kwargs: Any) -> Any:
        given_calls.append(kwargs.get("given") is not None)
        return run(*args, **kwargs)

    monkeypatch.setattr(triton_attention_bwd, "run", watched)
    monkeypatch.setattr(fused, "_tripwire_backward", None)  # the host path: calling it would raise
    model = build("gpt2", **SMALL)
    guard = attnchecker.protect(model, policy=Policy(adaptive=False, op_periods={"out": 1000}), scope="all")
    _step(model, guard)
    assert not guard.check_config.checks("out")
    given_calls.clear()
    want_loss, want = _step(model, guard)
    assert given_calls == [True] and guard.report().tier_checks["tripwire"] > 0 and not guard.detections
    injector = FusedBackwardFault(call=0, which=which, kind=kind, element=5 + 7 * which)
    loss, grads = _step(model, guard, injector)
    assert injector.hit
    op = ("grad_q", "grad_k", "grad_v")[which]
    assert [(e.op, e.action, e.tier) for e in guard.detections] == [(op, "recomputed", "tripwire")], guard.detections
    assert loss == want_loss and worst_rel(grads, want) <= 1e-5
    guard.close()
