"""Tier 1 for the whole step: ``protect(model, optimizer=opt, scope="all")`` with the default Policy(), on a step whose
full checks are not due (a quiet step of the adaptive schedule, the steps a long clean run is mostly made of).

An injector below autograd that knows nothing of attnchecker corrupts one output element of one GEMM (every MLP and
projection GEMM, forward, dX and dW, in turn: gemm_injector) or of the fused attention backward kernel (dQ, dK or dV:
``gemm_injector.FusedBackwardFault``). The tripwire must catch it and the full check it falls back to must repair it:
the gradients equal the fault-free quiet step's to <= 1e-5 relative, every weight stays finite, and every event says
tier "tripwire" (not the optimizer net, which could only skip the step)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from gemm_injector import FusedBackwardFault, GemmInjector, is_model_gemm, worst_rel
from model_zoo import batch, build, loss_of
from torch.utils._python_dispatch import TorchDispatchMode

import attnchecker
from attnchecker import Policy

aten = torch.ops.aten
KINDS = ("inf", "nan", "near_inf", "bitflip")


def quiet_step(arch: str, mode: TorchDispatchMode, policy: Policy | None = None, *, checkpointing: bool = False,
               scheduled: bool = False) -> tuple[dict[str, torch.Tensor], bool, list, dict[str, int]]:
    """Protect a fresh seeded model as the README does, train (lr 0: every step the same function) until a step whose
    whole-step GEMMs are not due, and run that step under ``mode``: (gradients, weights finite after the optimizer
    step, detections of that step, tier checks of the run). checkpointing: transformers' gradient checkpointing, so
    each layer's forward runs again inside backward (its GEMMs are hit there too). scheduled: train on past that
    quiet step to the next one the schedule checks in full, and run that one under ``mode``. The first run of each
    kind trains there; the others resume from its guard state (Guard.load_state_dict), which reaches the same step
    with the same schedule: the callers' ``inj.hit == call`` holds each to the same GEMM calls as the trained run."""
    model = build(arch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = attnchecker.protect(model, optimizer=opt, scope="all", policy=policy or Policy())
    reached = _REACHED.get((arch, checkpointing, scheduled))
    try:
        if reached is not None:
            # A run of this kind has trained there before: go on from its state as a resumed run would
            # (Guard.load_state_dict), on the same step, rather than train the same clean steps again.
            guard.load_state_dict(reached)
        else:
            _train_to(arch, model, opt, guard, scheduled=scheduled)
            _REACHED[(arch, checkpointing, scheduled)] = guard.state_dict()
        assert guard.detections == []
        seen = len(guard.detections)
        opt.zero_grad(set_to_none=True)
        with mode:
            loss = loss_of(arch, model, batch(arch, 0))
            if isinstance(mode, GemmInjector):
                mode.phase = "backward"
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return grads, finite, list(guard.detections[seen:]), dict(guard.report().tier_checks)
    finally:
        guard.close()


_REACHED: dict[tuple[str, bool, bool], dict[str, Any]] = {}
"""The guard's state on the step quiet_step runs, per (arch, checkpointing, scheduled), once a run has trained there.
The policy is not in the key: clean steps move the schedule alike under any policy the callers pass (the control's
tripwire=False changes what a step tests, not when the whole step is checked)."""


def _train_to(arch: str, model: torch.nn.Module, opt: torch.optim.Optimizer, guard: attnchecker.Guard, *,
              scheduled: bool) -> None:
    """Train (clean, lr 0) to the default schedule's first quiet step, or with ``scheduled`` on past it to the next step
    it checks in full."""
    # The adaptive schedule's first quiet step: period 1 holds for 8 clean checks (docs/adaptive.md).
    for _ in range(16):
        if not guard.check_config.checks("out"):
            break
        opt.zero_grad(set_to_none=True)
        loss_of(arch, model, batch(arch, 0)).backward()
        opt.step()
    else:
        raise AssertionError("the default schedule checked the whole step on 16 steps running")
    if scheduled:
        for _ in range(16):
            opt.zero_grad(set_to_none=True)
            loss_of(arch, model, batch(arch, 0)).backward()
            opt.step()
            if guard.check_config.checks("out"):
                break
        else:
            raise AssertionError("the default schedule did not check the whole step again within 16 steps")


def uncorrected(arch: str, targets: list, clean: dict[str, torch.Tensor], *, tier: str, untouched_ok: bool = False,
                **step: Any) -> list:
    """Each target GEMM call corrupted in its own run of ``quiet_step(arch, ..., **step)`` (the kinds in turn): those
    whose step did not end with finite weights, the fault-free gradients (1e-5), and detections all of ``tier`` and
    corrected or recomputed. untouched_ok: a run with no detection passes when its gradients are bitwise the
    fault-free ones (the fault never reached the model)."""
    failures = []
    for n, call in enumerate(targets):
        kind = KINDS[n % len(KINDS)]
        inj = GemmInjector(target=call.index, kind=kind, element=7 + 13 * n)
        grads, finite, detections, _ = quiet_step(arch, inj, **step)
        assert inj.hit == call, "the faulty run made different GEMM calls before the target"
        worst = worst_rel(grads, clean)
        if not (finite and worst <= 1e-5 and (detections or (untouched_ok and worst == 0.0))
                and all(d.tier == tier and d.action in ("corrected", "recomputed") for d in detections)):
            failures.append((call, kind, worst, [(d.op, d.tier, d.action) for d in detections]))
    return failures


@pytest.mark.parametrize(("arch", "checkpointing", "kernel"),
                         [("gpt2", False, False), ("llama", False, False), ("bert", False, False),
                          ("gpt2", True, False), ("llama", True, False), ("gpt2", False, True)])
def test_a_fault_in_any_gemm_of_a_quiet_step_is_caught_by_the_tripwire_and_corrected(
    arch: str, checkpointing: bool, kernel: bool, kernel_everywhere: Callable[[], None]
) -> None:
    """With gradient checkpointing, the layers' forward GEMMs run a second time inside backward (the recomputation
    whose outputs the backward GEMMs read): those are hit too. kernel: the trips' full checks read their matrices
    through the one-pass kernel (conftest.kernel_everywhere)."""
    if kernel:
        kernel_everywhere()
    recorder = GemmInjector()
    clean, finite, detections, tiers = quiet_step(arch, recorder, checkpointing=checkpointing)
    assert finite and not detections
    assert tiers["tripwire"] > 0
    targets = [c for c in recorder.calls if is_model_gemm(c)]
    # Forward and backward GEMMs of the Linear layers; on a quiet step the attention core is the fused kernel.
    assert {c.phase for c in targets} == {"forward", "backward"}
    assert not uncorrected(arch, targets, clean, tier="tripwire", checkpointing=checkpointing)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_fault_in_the_fused_attention_backward_is_recomputed_through_the_checked_products(arch: str, which: int
                                                                                          ) -> None:
    clean, _, _, _ = quiet_step(arch, GemmInjector())
    fault = FusedBackwardFault(call=1, which=which, kind=KINDS[which], element=11)
    grads, finite, detections, _ = quiet_step(arch, fault)
    assert fault.hit, "no fused attention backward ran on the quiet step"
    assert finite and worst_rel(grads, clean) <= 1e-5
    op = ("grad_q", "grad_k", "grad_v")[which]
    assert [(d.op, d.tier, d.action) for d in detections] == [(op, "tripwire", "recomputed")], detections


def test_with_the_tripwire_off_the_same_fault_reaches_the_weights() -> None:
    """The control: an INF in the quiet step's MLP weight gradient under Policy(tripwire=False) reaches the gradient
    (at most the optimizer net sees it, which can only skip the step), so the test above can fail."""
    recorder = GemmInjector()
    quiet_step("gpt2", recorder)
    # GPT-2's MLP c_fc weight gradient: dW (I=64, O=256) = Xᵀ dY over the 48 tokens.
    target = next(c for c in recorder.calls if c.phase == "backward" and c.shape == (64, 256) and c.k == 48)
    grads, _, detections, _ = quiet_step("gpt2", GemmInjector(target=target.index, kind="inf"),
                                         policy=Policy(tripwire=False))
    assert not [d for d in detections if d.tier != "optimizer"]
    assert any(not torch.isfinite(g).all() for g in grads.values())


def test_a_trip_on_a_correct_gemm_is_silent_and_a_non_finite_input_is_reported(make_ctx) -> None:
    """trip_gemms after a trip: the full check decides. Real values past 1e10 (diverged training) that the operands
    explain are no fault: no event, C unchanged. An INF that came in with an input (its reference is not finite either)
    cannot be repaired here: one "detected" event. An INF written into C itself is corrected."""
    from attnchecker.gemm.check import trip_gemms
    from attnchecker.tripwire import extreme

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 48, generator=gen) * 1e6, torch.randn(48, 40, generator=gen) * 1e6
    ctx, rec = make_ctx(checked_ops=frozenset())
    huge = a @ b
    assert bool(extreme(huge)) and bool(huge.isfinite().all())  # it trips, and it is what the operands give
    want = huge.clone()
    trip_gemms(ctx, [("linear", huge, a, b, None)])
    assert rec.detections == [] and torch.equal(huge, want)
    assert ctx.runtime.stats.trip_checks["linear"] == 1

    bad_a = a.clone() / 1e6
    bad_a[3, 5] = float("inf")
    c = bad_a @ (b / 1e6)
    trip_gemms(ctx, [("linear_dx", c, bad_a, b / 1e6, None)])
    assert [(d.op, d.tier, d.action) for d in rec.detections] == [("linear_dx", "tripwire", "detected")]

    a1, b1 = a / 1e6, b / 1e6
    c = a1 @ b1
    want = c.clone()
    c[7, 9] = float("inf")
    trip_gemms(ctx, [("linear_dw", c, a1, b1, None)])
    assert [(d.op, d.action) for d in rec.detections[1:]] == [("linear_dw", "corrected")]
    torch.testing.assert_close(c, want)


def test_a_whole_step_catch_brings_the_whole_step_back_to_full_checks() -> None:
    """The whole-step GEMMs follow the "out" op's schedule: a fault caught in one of them (here by tier 1 on a quiet
    step) snaps "out" to min_period, so the next step checks the whole step in full, as after a fault in "out"."""
    recorder = GemmInjector()
    quiet_step("gpt2", recorder)
    target = next(c for c in recorder.calls if c.phase == "backward" and c.shape == (64, 256) and c.k == 48)
    model = build("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = attnchecker.protect(model, optimizer=opt, scope="all")
    try:
        while guard.check_config.checks("out"):
            opt.zero_grad(set_to_none=True)
            loss_of("gpt2", model, batch("gpt2", 0)).backward()
            opt.step()
        assert guard.periods["out"] > 1
        inj = GemmInjector(target=target.index, kind="inf")
        opt.zero_grad(set_to_none=True)
        with inj:
            loss = loss_of("gpt2", model, batch("gpt2", 0))
            inj.phase = "backward"
            loss.backward()
        opt.step()
        assert inj.hit == target
        assert [(d.op, d.tier) for d in guard.detections] == [("linear_dw", "tripwire")]
        assert guard.periods["out"] == Policy().min_period
        assert guard.check_config.checks("out")
    finally:
        guard.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_with_gradient_checkpointing_the_backward_reruns_each_layers_forward_gemms(arch: str) -> None:
    """What makes the checkpointed cases of the test above different: every checkpointed layer's forward GEMMs run
    again in the backward phase, so faults there land on the recomputation the backward GEMMs read."""
    plain, ckpt = GemmInjector(), GemmInjector()
    quiet_step(arch, plain)
    quiet_step(arch, ckpt, checkpointing=True)

    def count(rec: GemmInjector, phase: str) -> int:
        return sum(c.phase == phase and is_model_gemm(c) for c in rec.calls)

    assert count(ckpt, "forward") == count(plain, "forward")
    rerun = count(ckpt, "backward") - count(plain, "backward")
    # The layers' Linear GEMMs, once more each: all forward GEMMs but the LM head (outside the checkpointed layers).
    assert 0 < rerun < count(plain, "forward")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_after_a_quiet_period_the_scheduled_full_check_corrects_faults_on_the_shared_and_encoded_paths(
    arch: str, kernel_everywhere: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default policy after its first quiet period, on the next step it checks in full: with the kernel (the
    Linear checks take the operand sums their forward kept, gemm.check.linear_sums) and the tiled path forced with
    4-row blocks. An injector below autograd hits the step's GEMMs in turn (Conv1D for GPT-2, nn.Linear for Llama;
    the forward's tile products): every fault is corrected by the full check itself, the gradients are the
    fault-free step's. A fault in the checksum columns the tiled context product carries beside V ([V | V w]) never
    reaches the model: the gradients are then bitwise the fault-free ones, and nothing needs reporting. The
    attention backward is the fused kernel on encoded operands (attention.backward.encoded): a fault in its dQ, dK or dV is
    flagged and recomputed through the checked products, 4-row blocks of them."""
    from attnchecker.attention.backends.tiled_torch import PATH_ENV, TILE_ENV

    kernel_everywhere()
    monkeypatch.setenv(PATH_ENV, "tiled")
    monkeypatch.setenv(TILE_ENV, "4,4")
    recorder = GemmInjector()
    clean, finite, detections, _ = quiet_step(arch, recorder, scheduled=True)
    assert finite and not detections
    # Every 7th of the step's GEMMs (a few minutes otherwise): still Linear GEMMs both ways and the tiles' products.
    targets = [c for c in recorder.calls if is_model_gemm(c)][::7]
    kinds = {(c.phase, c.op) for c in targets}
    assert ("backward", "mm") in kinds and ("forward", "bmm") in kinds, kinds
    assert kinds & {("forward", "mm"), ("forward", "addmm")}, kinds
    assert not uncorrected(arch, targets, clean, tier="abft", untouched_ok=True, scheduled=True)
    for which in range(3):
        fault = FusedBackwardFault(call=which % 2, which=which, kind=KINDS[which], element=5 + 17 * which,
                                   head_dims=16)  # the zoo's heads: 64 wide, 4 of them
        grads, finite, detections, _ = quiet_step(arch, fault, scheduled=True)
        assert fault.hit, "no fused attention backward ran on the scheduled step"
        assert finite and worst_rel(grads, clean) <= 1e-5
        op = ("grad_q", "grad_k", "grad_v")[which]
        assert [(d.op, d.tier, d.action) for d in detections] == [(op, "abft", "recomputed")], detections
