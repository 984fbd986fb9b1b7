"""Training under ``torch.compile(backend="inductor")`` with the default (adaptive) policy and scope="all" (issue 35):
the schedule changes which ops are checked, and how, from step to step inside the ops' bodies, so it costs no
recompilation; every injected extreme fault is corrected, and the losses and the trained weights are the fault-free
ones, on the CPU's GEMM check path and on the Triton path a GPU takes. One tiny Llama, 20 steps: Inductor builds C++
here, tens of seconds per graph. And in bf16 on the Triton attention route, whose checks run over the vendor's fused
forward inside the compiled graphs' attention op."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from model_zoo import batch, build, loss_of, rel_diff

import attnchecker
from attnchecker.compiled import kept_count
from attnchecker.gemm import device
from attnchecker.inject import Fault, FaultPlan
from attnchecker.kernels import triton_gemm_check as tg

ARCH, STEPS = "llama", 20
# Layers: 0 and 1 are the attention layers; under scope="all" the Linear modules follow in module order (layer 0's
# q, k, v, o at 2-5, gate, up, down at 6-8; layer 1's at 9-15; lm_head 16). q/k/v/o are checked in forward by their
# projection hooks, so their "linear" op is their backward only.
PLAN = FaultPlan([
    Fault(op="scores", layer=0, step=1, kind="inf", seed=1),
    Fault(op="linear", layer=7, step=3, kind="inf", seed=2),
    # The attention backward, checked in full on every step here (the whole step's ops follow out's schedule, whose
    # period is back at 1 after the fault above): in S, and in dK on a step whose context gets tier 1 (below).
    Fault(op="scores_bwd", layer=0, step=6, kind="nan", seed=9),
    Fault(op="grad_k", layer=0, step=8, kind="inf", seed=10),
    # From step 8 on a quiet op is checked every other step: the even steps give it tier 1 (the tripwire).
    Fault(op="context", layer=1, step=8, kind="nan", seed=3),
    Fault(op="q", layer=1, step=10, kind="inf", seed=4),
    Fault(op="linear_dw", layer=12, step=12, kind="inf", seed=5),
    Fault(op="v", layer=0, step=14, kind="neg_inf", seed=6),
    Fault(op="out", layer=0, step=16, kind="near_inf", seed=7),
    Fault(op="linear_dx", layer=8, step=18, kind="nan", seed=8),
])


def _counting(compile_fx: Callable[..., Any] | None) -> tuple[Callable[..., Any], list[int]]:
    """A backend that counts the graphs Dynamo hands it (first compilations and recompilations alike)."""
    count = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        count[0] += 1
        return gm.forward if compile_fx is None else compile_fx(gm, example_inputs)

    return backend, count


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, backend: Any, steps: int = STEPS) -> list[float]:
    compiled = torch.compile(model, backend=backend)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(ARCH, compiled, batch(ARCH, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("gemm", ["cpu", "triton"])
def test_inductor_training_corrects_every_fault_without_recompiling(gemm: str, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    """On both GEMM check paths: the CPU's, and the Triton path a GPU takes (its kernels under Triton's interpreter
    here), whose projection and Linear checks then run inside the compiled graphs' checked ops."""
    from torch._inductor.compile_fx import compile_fx

    if gemm == "triton":
        if not (tg.available() and tg.interpreted()):
            pytest.skip("the Triton path on CPU tensors needs Triton's interpreter")
        monkeypatch.setenv(device.GEMM_ENV, "triton")
    tg.LAUNCHES.reset()

    # The reference: the unprotected model, fault-free, with its graphs counted by Dynamo (no Inductor needed).
    torch._dynamo.reset()
    want_model = build(ARCH)
    backend, unprotected_graphs = _counting(None)
    want = _train(want_model, torch.optim.AdamW(want_model.parameters(), lr=1e-3), backend)

    torch._dynamo.reset()
    model = build(ARCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend, graphs = _counting(compile_fx)
    try:
        with attnchecker.protect(model, optimizer=opt, scope="all", faults=PLAN) as guard:
            got = _train(model, opt, backend)
            detections = list(guard.detections)
            steps = guard.report().steps
    finally:
        torch._dynamo.reset()

    assert steps == STEPS
    assert graphs[0] <= unprotected_graphs[0] + 2, (graphs, unprotected_graphs)
    assert sorted((d.op, d.layer, d.step) for d in detections) == sorted(
        (f.op, f.layer, f.step) for f in PLAN.faults)
    assert {d.action for d in detections} <= {"corrected", "recomputed"}, detections
    # Caught by full checks and by tier 1 alike: the ops' tier changed from step to step inside one compiled graph.
    assert {d.tier for d in detections} == {"abft", "tripwire"}, detections
    assert all(math.isfinite(x) for x in got)
    # Inductor fuses the elementwise ops around the checked ones: equal to the eager-compiled losses up to rounding.
    assert max(rel_diff(a, b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)
    for (name, p), q in zip(model.named_parameters(), want_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert kept_count() == 0  # every graph a checked op kept for its backward was used and dropped
    assert (tg.LAUNCHES.by_kernel.get("check_pass", 0) > 0) == (gemm == "triton")


def test_inductor_bf16_attention_is_checked_over_the_vendor_forward_without_recompiling(
        monkeypatch: pytest.MonkeyPatch, triton_launches: Any) -> None:
    """A bf16 Llama under Inductor on the Triton attention route a GPU takes (its kernels under Triton's interpreter
    here), every other step checked in full: the compiled graphs call the checked attention op, inside which the
    vendor's fused forward computes each call and our passes test it, in full on the even steps and by tier 1 on the
    odd ones, never our kernel's first pass. The check changes from step to step inside one graph: no recompilation,
    nothing flagged, and the losses are the unprotected compiled model's within bf16 rounding. (A fault planned with
    attnchecker.inject goes into our kernel's products, so its runs take our kernel: the test above.)"""
    from torch._inductor.compile_fx import compile_fx

    from attnchecker.attention.backends import BACKEND_ENV
    from attnchecker.kernels import triton_attention

    if not triton_attention.available("cpu"):
        pytest.skip("the Triton attention on CPU tensors needs Triton's interpreter")

    steps = 6
    torch._dynamo.reset()
    want_model = build(ARCH).to(torch.bfloat16)
    backend, unprotected_graphs = _counting(None)
    want = _train(want_model, torch.optim.SGD(want_model.parameters(), lr=1e-2), backend, steps)
    assert not triton_launches  # the unprotected model's attention is SDPA's

    torch._dynamo.reset()
    monkeypatch.setenv(BACKEND_ENV, "triton")
    model = build(ARCH).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    backend, graphs = _counting(compile_fx)
    try:
        with attnchecker.protect(model, optimizer=opt, policy=attnchecker.Policy(period=2, adaptive=False)) as guard:
            got = _train(model, opt, backend, steps)
            detections = list(guard.detections)
            backends = {name for _, name in guard.coverage.backends}
    finally:
        torch._dynamo.reset()

    assert graphs[0] <= unprotected_graphs[0] + 2, (graphs, unprotected_graphs)
    assert backends == {"triton"}
    # Per layer, on each of the 3 full steps: v·[e, w] and the identities; on each of the 3 tier-1 steps, the pass
    # over the vendor's output and lse; on all 6, the repair launch (which returns at once on a clean block).
    assert triton_launches == {"_value_sums": 6, "_check_given": 6, "_trip_given": 6, "_attention": 12}, \
        triton_launches
    assert detections == []
    assert all(math.isfinite(x) for x in got)
    assert max(rel_diff(a, b) for a, b in zip(got, want, strict=True)) <= 2e-2, (got, want)


def test_inductor_scope_all_checks_the_vendor_backward_over_and_corrects_it_below_autograd(
        monkeypatch: pytest.MonkeyPatch, triton_launches: Any) -> None:
    """The opt-in check over the vendor's attention backward (ATTNCHECKER_ATTENTION_BACKWARD_FULL=vendor) under
    Inductor: a bf16 Llama, scope="all", every other step checked in full, the backward a GPU runs (the fused CPU
    kernel off).
    Inside the compiled graphs' attention backward op the vendor's backward runs and the identities test it on the
    full steps (one launch a layer), tier 1 reads it on the others; no recompilation. NaN written by a dispatch mode
    that knows nothing of attnchecker (it enters every custom op, to see the aten ops inside) into the vendor's dK
    of the last layer on a full step is reported as recomputed by the full check, and the losses stay the
    unprotected compiled model's within bf16 rounding."""
    from gemm_injector import FusedBackwardFault
    from torch._inductor.compile_fx import compile_fx

    from attnchecker.attention.backends import BACKEND_ENV
    from attnchecker.attention.backward import fused, triton_backward
    from attnchecker.kernels import triton_attention

    if not triton_attention.available("cpu"):
        pytest.skip("the Triton attention on CPU tensors needs Triton's interpreter")
    monkeypatch.setattr(fused, "cpu_kernel", False)
    steps, layers = 6, 2
    torch._dynamo.reset()
    want_model = build(ARCH).to(torch.bfloat16)
    backend, unprotected_graphs = _counting(None)
    want = _train(want_model, torch.optim.SGD(want_model.parameters(), lr=1e-2), backend, steps)

    torch._dynamo.reset()
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv(triton_backward.FULL_ENV, "vendor")
    model = build(ARCH).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    backend, graphs = _counting(compile_fx)
    compiled = torch.compile(model, backend=backend)
    got, checked, faulted = [], [], None
    try:
        with attnchecker.protect(model, optimizer=opt, scope="all",
                                 policy=attnchecker.Policy(period=2, adaptive=False)) as guard:
            for step in range(steps):
                due = guard.check_config.checks("out")
                if due and step >= 2 and faulted is None:
                    faulted = step
                before = triton_launches.get("_check_given_bwd", 0)
                fault = FusedBackwardFault(call=0 if step == faulted else -1, which=1, kind="nan", element=1000,
                                           into_custom_ops=True)
                opt.zero_grad(set_to_none=True)
                loss = loss_of(ARCH, compiled, batch(ARCH, step))
                with fault:
                    loss.backward()
                opt.step()
                got.append(loss.item())
                assert fault.seen == layers and fault.hit == (step == faulted)
                checked.append(triton_launches.get("_check_given_bwd", 0) - before)
            detections = [(d.op, d.layer, d.step, d.action, d.tier) for d in guard.detections]
    finally:
        torch._dynamo.reset()

    assert graphs[0] <= unprotected_graphs[0] + 2, (graphs, unprotected_graphs)
    assert sorted(checked) == [0] * (steps // 2) + [layers] * (steps // 2), checked
    assert faulted is not None and checked[faulted] == layers
    assert detections == [("grad_k", layers - 1, faulted, "recomputed", "abft")], detections
    assert all(math.isfinite(x) for x in got)
    assert max(rel_diff(a, b) for a, b in zip(got, want, strict=True)) <= 2e-2, (got, want)
