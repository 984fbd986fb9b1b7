"""Under protect(scope="all") the attention backward is checked on the ``out`` op's schedule (gemm/schedule.py), the
attention forward on its own ops' (``scores``, ``context``). The two part on the default policy's steps after a
fault in a Linear GEMM or in the backward: ``out``'s period drops to 1 and theirs stays long, so the forward gets
tier 1 while the backward is due in full. On such a step the backward used to go unprotected, neither checked nor
tripwired, on the CPU (the forward's fused kernel kept the kernel's own backward); on the GPU's route (the Triton
attention over the vendor's forward) our checked backward took the vendor's lse, which it cannot check against,
and reported every layer's S as an uncorrectable fault on every such step.

Here: a quiet run of the default policy, a fault that brings ``out`` back, and on the next step a fault in the
attention backward, written below autograd into the fused CPU kernel (a dispatch mode that knows nothing of our
code) or planned with attnchecker.inject on the GPU's route; and the same steps forced by a fixed schedule on every
route, with the policy's tripwire off and with attention dropout (the unfused backward)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from gemm_injector import FusedBackwardFault, worst_rel
from model_zoo import batch, build, loss_of
from quiet_period import step_until_due_after_quiet

import attnchecker
from attnchecker import Policy
from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.attention.backward import fused, triton_backward
from attnchecker.inject import Fault, FaultPlan
from attnchecker.kernels import triton_attention_bwd

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on INF and NaN

SMALL = {"n_layer": 1, "n_head": 2}
"""One layer of two heads (32 wide): the interpreter runs one program at a time."""
HEAD_DIM = 32


@pytest.fixture
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """cpu_kernel: the CPU's default (the fused kernel's backward, encoded on a checked step); products: the branch a
    GPU call takes, in the checked PyTorch products; triton: that branch in the Triton kernels (interpreter);
    triton_bf16_vendor: bf16 through the Triton attention backend over the vendor's forward, the GPU's usual route;
    triton_fp32_backend: that backend in fp32, whose tier 1 over the vendor cannot make the lse exact (the full
    checks over the vendor's forward take bf16 and fp16): our kernel makes the forward where the backward is due."""
    name: str = request.param
    if name.startswith("triton") and not triton_attention_bwd.available():
        pytest.skip("the Triton kernels cannot run here (no CUDA, interpreter off)")
    if name != "cpu_kernel":
        monkeypatch.setattr(fused, "cpu_kernel", False)
    if name in ("triton_bf16_vendor", "triton_fp32_backend"):
        monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv(triton_backward.BACKWARD_ENV, "torch" if name == "products" else "auto")
    return name


def _dtype(path: str) -> torch.dtype:
    return torch.bfloat16 if path == "triton_bf16_vendor" else torch.float32


def _tolerance(path: str) -> float:
    # bf16: a repaired block is our kernels' recompute, rounded to bf16, where the clean step's may be the vendor's.
    return 2e-2 if path == "triton_bf16_vendor" else 1e-5


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _unprotected_grads(dtype: torch.dtype, **config: Any) -> dict[str, torch.Tensor]:
    """The gradients of the same model and batch, unprotected: what every step here must give (no optimizer)."""
    model = build("gpt2", **SMALL, **config).to(dtype)
    torch.manual_seed(7)
    loss_of("gpt2", model, batch("gpt2", 0)).backward()
    return _grads(model)


_QUIET: dict[str, Any] = {}


def _quiet_state() -> dict[str, Any]:
    """The guard's state at the default policy's first step that checks the whole step in full after 7 steps that
    did not (clean, fp32, the CPU's kernels; the schedule does not depend on the route): trained once per process,
    then loaded as a resumed run would (Guard.load_state_dict)."""
    if not _QUIET:
        model = build("gpt2", **SMALL)
        data = batch("gpt2", 0)
        with attnchecker.protect(model, scope="all") as guard:
            def step(_due: bool) -> None:
                model.zero_grad(set_to_none=True)
                loss_of("gpt2", model, data).backward()
                guard.step()
                assert guard.detections == []

            step_until_due_after_quiet(guard, step, op="out")
            _QUIET.update(guard.state_dict())
    return dict(_QUIET)


@pytest.mark.parametrize("path", ["cpu_kernel", "triton_bf16_vendor"], indirect=True)
def test_after_a_fault_ends_a_quiet_period_the_attention_backward_is_checked_while_the_forward_gets_tier1(
        path: str) -> None:
    """Default policy, resumed at the first full check after a quiet period: a planned INF in the attention's dV
    there is corrected, and brings ``out`` (the whole step's schedule) back to every step while ``scores`` and
    ``context`` stay quiet. On the next step, tier 1 for the forward, the backward is checked in full: NaN in dK
    (written below autograd into the fused CPU kernel's output; planned on the GPU's route, whose kernels are no aten
    ops) is reported by the full check and repaired, and the step after, clean, reports nothing. Every step's
    gradients are the unprotected model's."""
    dtype = _dtype(path)
    state = _quiet_state()
    s = state["step"]
    faults = [Fault(op="grad_v", layer=0, step=s, kind="inf", row=3, col=5, seed=1)]
    if path != "cpu_kernel":
        faults.append(Fault(op="grad_k", layer=0, step=s + 1, kind="nan", row=20, col=5, seed=2))
    model = build("gpt2", **SMALL).to(dtype)
    data = batch("gpt2", 0)
    want = _unprotected_grads(dtype)
    with attnchecker.protect(model, scope="all", faults=FaultPlan(faults)) as guard:
        guard.load_state_dict(state)
        grads = []
        for step in range(s, s + 3):
            cfg = guard.check_config
            due = (cfg.checks("out"), cfg.checks("scores"), cfg.checks("context"))
            # s: the scheduled full check; s + 1 and s + 2: the whole step in full, the attention forward tier 1.
            assert due == ((True, True, True) if step == s else (True, False, False)), (step, due)
            assert step == s or (cfg.trips("scores") and cfg.trips("context"))
            below = FusedBackwardFault(call=0 if step == s + 1 and path == "cpu_kernel" else -1, which=1, kind="nan",
                                       element=77, head_dims=HEAD_DIM)
            model.zero_grad(set_to_none=True)
            loss = loss_of("gpt2", model, data)
            with below:
                loss.backward()
            guard.step()
            assert below.hit == (step == s + 1 and path == "cpu_kernel")
            grads.append(_grads(model))
        got = [(d.op, d.step, d.tier) for d in guard.detections]
        actions = {d.action for d in guard.detections}
    assert got == [("grad_v", s, "abft"), ("grad_k", s + 1, "abft")], got
    assert actions <= {"corrected", "recomputed"}, actions
    for step, g in enumerate(grads, start=s):
        assert worst_rel(g, want) <= _tolerance(path), (step, worst_rel(g, want))


@pytest.mark.parametrize(("path", "variant"), [
    *[(p, v) for p in ("cpu_kernel", "products") for v in ("tier1", "tripwire_off", "dropout")],
    ("cpu_kernel", "compiled"),
    # The Triton kernels under the interpreter (seconds a step): the backward after the CPU's forward, and the GPU's
    # route with either forward. (Dropout keeps the vendor out: its keep mask is not ours.)
    ("triton", "tier1"), ("triton_bf16_vendor", "tier1"), ("triton_bf16_vendor", "tripwire_off"),
    ("triton_fp32_backend", "tier1")], indirect=["path"])
def test_a_step_that_checks_the_whole_step_but_not_the_attention_forward_checks_its_backward(path: str,
                                                                                             variant: str) -> None:
    """A fixed schedule that checks ``out`` (and with it the whole step) on every step and the attention's ops only
    on step 0; the forward gets tier 1 from step 1 on (tier1; compiled: the same under torch.compile, whose graphs
    call the checked attention as a custom op), nothing (the policy's tripwire off) or, with attention dropout 0.1,
    tier 1 on the unfused path. A planned INF in dV on step 1 and NaN in dQ on step 2 are each reported by
    the backward's full check and repaired, and nothing else is reported (the GPU's route flagged S on every such
    step); the gradients of every step are step 0's (the same dropout mask: the generator is seeded alike before
    each step)."""
    _planned_faults_on_a_tier1_forward_step_are_corrected(variant, _dtype(path), "cpu", _tolerance(path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["tier1", "tripwire_off"])
def test_on_a_gpu_a_step_that_checks_the_whole_step_but_not_the_attention_forward_checks_its_backward(
        variant: str) -> None:
    """The same on CUDA, bf16, the default backends: tier 1 over the vendor's forward (FlashAttention's lse made
    exact by the full checks over it, for the Triton backward's full check), or our kernel unchecked."""
    _planned_faults_on_a_tier1_forward_step_are_corrected(variant, torch.bfloat16, "cuda", 2e-2)


def _planned_faults_on_a_tier1_forward_step_are_corrected(variant: str, dtype: torch.dtype, device: str,
                                                          tolerance: float) -> None:
    config = {"attn_pdrop": 0.1} if variant == "dropout" else {}
    model = build("gpt2", **SMALL, **config).to(device=device, dtype=dtype)
    data = {k: v.to(device) for k, v in batch("gpt2", 0).items()}
    policy = Policy(adaptive=False, op_periods={"scores": 1000, "context": 1000}, tripwire=variant != "tripwire_off")
    plan = FaultPlan([Fault(op="grad_v", layer=0, step=1, kind="inf", row=3, col=5, seed=1),
                      Fault(op="grad_q", layer=0, step=2, kind="nan", row=20, col=5, seed=2)])
    torch._dynamo.reset()
    try:
        with attnchecker.protect(model, scope="all", policy=policy, faults=plan) as guard:
            stepped = torch.compile(model, backend="aot_eager") if variant == "compiled" else model
            grads = []
            for _ in range(3):
                torch.manual_seed(7)
                model.zero_grad(set_to_none=True)
                loss_of("gpt2", stepped, data).backward()
                guard.step()
                grads.append(_grads(model))
            got = [(d.op, d.step, d.tier) for d in guard.detections]
            actions = {d.action for d in guard.detections}
            injected = [(i.op, i.step) for i in guard.injector.injected]
    finally:
        torch._dynamo.reset()
    assert injected == [("grad_v", 1), ("grad_q", 2)], injected
    assert got == [("grad_v", 1, "abft"), ("grad_q", 2, "abft")], got
    assert actions <= {"corrected", "recomputed"}, actions
    for step, g in enumerate(grads[1:], start=1):
        assert worst_rel(g, grads[0]) <= tolerance, (step, worst_rel(g, grads[0]))
