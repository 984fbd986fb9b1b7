"""attnchecker.inject reaches the attention backward's products (protect(scope="all")): a FaultPlan that names
scores_bwd, grad_probs, grad_v, grad_q or grad_k is written right after that product, on every path that backward
takes: the fused CPU kernel's steps (which then run the products explicitly: the kernel keeps them to itself), the
checked PyTorch products off the CPU (ATTNCHECKER_ATTENTION_BACKWARD=torch), and the Triton kernels (under the
interpreter), which write it in their own tiles. An operator's fault campaign used to stop at the forward and the
Linear GEMMs: these ops were refused by Fault.

Each case is a GPT-2 step with one fault: the plan's ground truth records it, protection corrects it (gradients of
the clean step), and the same plan under the policy's mode "detect" leaves the step's gradients wrong, so the fault
is seen to reach them."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from gemm_injector import worst_rel
from model_zoo import SEQ, batch, build, loss_of

import attnchecker
from attnchecker import Policy
from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.attention.backward import fused, triton_backward
from attnchecker.inject import Fault, FaultPlan
from attnchecker.kernels import triton_attention_bwd

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on INF and NaN

SMALL = {"n_layer": 1, "n_head": 2}
"""One layer of two heads (of 32): the interpreter runs one program at a time."""
FEATURE = 5
# (op, kind, row, col): S and dP at a query and an earlier key (GPT-2 is causal: a later key's element is masked out
# and changes nothing on a tier-1 step), dV and dK at (key, feature), dQ at (query, feature).
FAULTS = [("scores_bwd", "inf", SEQ - 2, 3), ("grad_probs", "nan", SEQ - 3, 4), ("grad_v", "near_inf", 3, FEATURE),
          ("grad_q", "neg_inf", SEQ - 2, FEATURE), ("grad_k", "inf", 4, FEATURE)]
PATHS = ["cpu_kernel", "products", "triton"]
VENDOR = "triton_bf16_vendor"
"""bf16 through the Triton attention backend, the GPU's usual route: the vendor's forward (SDPA here), whose backward
(its own, or SDPA's read by tier 1) gives way to the Triton kernels on a step with a planned fault. (The other
paths' forward is the CPU's.)"""


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """cpu_kernel: the CPU's default (the fused kernel's backward, encoded on a checked step); products: the branch a
    GPU call takes, in the checked PyTorch products (the escape hatch); triton: that branch in the Triton kernels
    (VENDOR: in bf16, after the vendor's forward)."""
    if request.param in ("triton", VENDOR) and not triton_attention_bwd.available():
        pytest.skip("the Triton kernels cannot run here (no CUDA, interpreter off)")
    if request.param != "cpu_kernel":
        monkeypatch.setattr(fused, "cpu_kernel", False)
    if request.param == VENDOR:
        monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv(triton_backward.BACKWARD_ENV, "torch" if request.param == "products" else "auto")
    return request.param


def _plan(kind_of_tier: str) -> list[Fault]:
    """One fault a step from step 1 on (step 0 is clean: the reference), each in another product."""
    faults = []
    for step, (op, kind, row, col) in enumerate(FAULTS, start=1):
        if kind_of_tier == "tripwire" and kind == "neg_inf":
            kind = "inf"
        faults.append(Fault(op=op, layer=0, step=step, kind=kind, row=row, col=col, seed=step))
    return faults


def _steps(policy: Policy, faults: list[Fault], dtype: torch.dtype = torch.float32, device: str = "cpu"
           ) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """The same batch stepped up to the plan's last step (no optimizer: the weights stay), the gradients of each."""
    model = build("gpt2", **SMALL).to(device=device, dtype=dtype)
    guard = attnchecker.protect(model, policy=policy, scope="all", faults=FaultPlan(faults))
    data = {k: v.to(device) for k, v in batch("gpt2", 0).items()}
    grads = []
    for _ in range(max(f.step for f in faults) + 1):
        model.zero_grad(set_to_none=True)
        loss_of("gpt2", model, data).backward()
        guard.step()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return guard, grads


def _ruined(grads: dict[str, torch.Tensor], clean: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose gradient is not finite or off the clean one by more than 1e6 somewhere."""
    return [n for n, g in grads.items()
            if not bool(g.isfinite().all()) or float((g - clean[n]).abs().max()) > 1e6]


@pytest.mark.parametrize("tier", ["abft", "tripwire"])
@pytest.mark.parametrize("path", [*PATHS, VENDOR], indirect=True)
def test_a_planned_fault_in_each_attention_backward_product_is_corrected_on_every_path(path: str, tier: str) -> None:
    """tier abft: every step checks the whole step in full (Policy.full()); tripwire: only step 0 does, the others
    are tier-1 steps, whose tripwire reads dQ, dK and dV (an INF, NaN or near-INF fault in S or dP reaches them)."""
    dtype = torch.bfloat16 if path == VENDOR else torch.float32
    _corrected_each_step(tier, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", ["abft", "tripwire"])
def test_on_a_gpu_a_planned_fault_in_each_attention_backward_product_is_corrected(tier: str) -> None:
    """The same plan on CUDA, bf16: the default backends (the Triton forward over the vendor's, the Triton backward)."""
    _corrected_each_step(tier, torch.bfloat16, "cuda")


def _corrected_each_step(tier: str, dtype: torch.dtype, device: str) -> None:
    policy = Policy.full() if tier == "abft" else Policy(adaptive=False, op_periods={"out": 1000})
    guard, grads = _steps(policy, _plan(tier), dtype, device)
    first = {(i.op, i.step) for i in guard.injector.injected if i.attempt == 0}
    assert first == {(op, step) for step, (op, *_) in enumerate(FAULTS, start=1)}, guard.injector.injected
    for step, (op, *_) in enumerate(FAULTS, start=1):
        events = [d for d in guard.detections if d.step == step]
        assert events, (op, step)
        assert all(d.tier == tier and d.action in ("corrected", "recomputed") for d in events), events
        if tier == "abft":
            # The full check names the product the fault was in (the kernels also those of its block that the fault
            # flowed into: one recompute repairs them all); tier 1 names the gradient it tripped.
            assert op in {d.op for d in events}, events
        # bf16: a repaired block is our kernels' recompute, rounded to bf16, where the clean step's may be the vendor's.
        assert worst_rel(grads[step], grads[0]) <= (1e-5 if dtype == torch.float32 else 2e-2), (op, device)
    assert not [d for d in guard.detections if d.step == 0]
    guard.close()


def test_the_same_plan_in_detect_mode_leaves_the_gradients_wrong(path: str) -> None:
    """The policy's mode "detect": every fault is reported and none repaired, so each step's gradients keep it
    (the faults here are INF, NaN or 1e20): the plan reaches the gradients, not only the checks."""
    guard, grads = _steps(Policy.full(mode="detect"), _plan("abft"))
    assert len([i for i in guard.injector.injected if i.attempt == 0]) == len(FAULTS)
    assert all(bool(g.isfinite().all()) for g in grads[0].values())
    for step, (op, *_) in enumerate(FAULTS, start=1):
        events = {(d.op, d.action) for d in guard.detections if d.step == step}
        assert (op, "detected") in events and {a for _, a in events} == {"detected"}, events
        assert _ruined(grads[step], grads[0]), (op, path)
    guard.close()


@pytest.mark.usefixtures("path")
def test_a_persistent_planned_fault_that_comes_back_in_the_recompute_is_uncorrectable() -> None:
    """A persistent 2×2 block of 1e20 in dV (a block: the checksums cannot correct it in place, so the product is
    recomputed) strikes the recompute as well (attempt 1 in the ground truth): the step is reported uncorrectable,
    not recomputed, whichever path made the products."""
    fault = Fault(op="grad_v", layer=0, step=1, kind="near_inf", pattern="2d", row=3, col=FEATURE, persistent=True,
                  seed=1)
    guard, _ = _steps(Policy.full(), [fault])
    attempts = sorted(i.attempt for i in guard.injector.injected)
    assert attempts[0] == 0 and 1 in attempts, guard.injector.injected
    events = [(d.op, d.action) for d in guard.detections]
    assert ("grad_v", "uncorrectable") in events and all(op == "grad_v" for op, _ in events), events
    guard.close()


def test_a_fault_names_every_attention_backward_product_and_refuses_an_unknown_one() -> None:
    for op in ("scores_bwd", "grad_probs", "grad_v", "grad_q", "grad_k"):
        assert Fault(op=op, layer=0, step=0).op == op
    with pytest.raises(ValueError, match=r"fault\.op must be one of"):
        Fault(op="grad_scores", layer=0, step=0)
