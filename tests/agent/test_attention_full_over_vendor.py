"""The full check of a half-precision attention forward over the vendor's fused attention (ATTNCHECKER_ATTENTION=triton;
on CPU under Triton's interpreter, the vendor being the CPU flash kernel; FlashAttention on a GPU): the vendor computes
the call, kernels/triton_given_check.py tests its output and log-sum-exp against abft/given_forward.py's identities,
and the repair kernel recomputes a flagged block.

- A clean call: the vendor's op runs once, then 3 Triton launches (v·[e, w], the identities, the repair) and the key
  norms' running max; no host sync; both ops counted as checked; nothing flags; the output is the vendor's.
- A fault written below autograd into the vendor's output or log-sum-exp (a TorchDispatchMode that knows nothing of
  attnchecker), extreme or finite: reported at the step boundary by the full check ("abft"), recomputed, the output
  the clean one's.
- Through protect(): GPT-2 and Llama (grouped key/value heads) in bf16 under Policy.full(): the vendor's op is the
  attention of every layer, a fault in it is corrected and the step's loss and gradients are the clean step's within
  the repaired block's rounding, 0 false positives over clean steps in bf16 and fp16. And the default policy: its
  first full check after a quiet period, and the step after a fault, which verifies the faulty op alone.
- ATTNCHECKER_ATTENTION_FULL=kernel keeps the full check in our kernel; anything else is refused.
"""
from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gemm_injector import FUSED_FORWARD, FusedBackwardFault, worst_rel
from model_zoo import batch, build, loss_of
from quiet_period import step_until_due_after_quiet
from scoped_env import scoped_env
from sync_counter import SyncCounter
from test_attention_layer import seeded
from torch.utils._python_dispatch import TorchDispatchMode

import attnchecker
from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.attention.backends import triton as triton_backend
from attnchecker.attention.backends.tiled_torch import TILE_ENV
from attnchecker.attention.pipeline import protected_sdpa
from attnchecker.checks.deferred import drain
from attnchecker.kernels import triton_attention

pytestmark = pytest.mark.skipif(not triton_attention.available("cpu"), reason="no triton, or not under Triton's "
                                "interpreter (TRITON_INTERPRET=1, set by conftest.py where there is no GPU)")

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def force_triton() -> Iterator[None]:
    with scoped_env({BACKEND_ENV: "triton", TILE_ENV: None, triton_backend.FULL_ENV: None}):
        yield


class VendorForwardFault(FusedBackwardFault):
    """Corrupts element ``element`` of output ``which`` (0 the output, 1 the log-sum-exp) of the ``call``-th CPU
    flash attention forward (call -1: none, only counted), or with kind "add" adds ``value`` to it. Knows nothing of
    attnchecker."""

    op = FUSED_FORWARD

    def __init__(self, *, value: float = 0.0, **kw: Any) -> None:
        add = kw.get("kind") == "add"
        if add:
            kw["kind"] = "nan"  # replaced below
        super().__init__(**kw)
        self.add, self.value = add, value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if not self.add or func is not self.op or self.seen != self.call:
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        x = out[self.which]
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(self.element % x.numel()), x.shape))
        x[idx] = x[idx] + self.value
        self.hit = True
        self.seen += 1
        return out


def _qkv(dtype: torch.dtype, t: int = 32) -> tuple[torch.Tensor, ...]:
    return tuple(seeded((1, 2, t, 16), i, dtype) for i in range(3))


def _vendor_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = FUSED_FORWARD(q, k, v, 0.0, True, scale=None)[0]
    return out


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_clean_full_check_reads_the_vendor_forward_in_three_launches_and_no_sync(make_ctx, triton_launches,
                                                                                   dtype) -> None:
    """Both ops due, half precision, no mask: the vendor's forward computes the call (seen once, below autograd),
    and the check is v·[e, w] per key, the identities per query block and the repair launch (which returns at once
    on a clean block): 3 launches, the call's status memset and the key norms' running max, no host sync. Both ops
    are counted as checked in full; nothing flags; the output is the vendor's own."""
    q, k, v = _qkv(dtype)
    ctx, rec = make_ctx()
    counted = VendorForwardFault(call=-1, which=0, kind="nan", element=0)
    with torch.no_grad(), counted, SyncCounter() as syncs:
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert counted.seen == 1
    assert dict(triton_launches) == {"_value_sums": 1, "_check_given": 1, "_attention": 1}
    assert syncs.calls == []
    assert torch.equal(out, _vendor_out(q, k, v))
    assert ctx.runtime.stats.checks["scores"] == 1 and ctx.runtime.stats.checks["context"] == 1
    drain(ctx.runtime.deferred)  # the step boundary
    assert rec.detections == []


@pytest.mark.parametrize(("which", "kind"), [(0, "nan"), (0, "inf"), (0, "near_inf"), (0, "bitflip"), (0, "add"),
                                             (1, "nan"), (1, "near_inf"), (1, "add")])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_fault_below_autograd_in_the_vendor_forward_is_caught_by_the_full_check_and_recomputed(
        make_ctx, dtype: torch.dtype, which: int, kind: str) -> None:
    """A fault written below autograd into the vendor's output (op "context"; "add": 4 × the output's RMS on one
    element) or its log-sum-exp (op "scores"; "add": 0.01, every probability of the row 1 % off, which no value test
    sees) on a step that checks both ops: the full check reports it at the step boundary as recomputed, at its head
    and row (an output element at its column too), and the output is the clean call's there, SDPA's elsewhere."""
    q, k, v = _qkv(dtype)
    ctx, rec = make_ctx()
    clean = _vendor_out(q, k, v)
    row, col = 20, 3
    element = 1 * 32 * 16 + row * 16 + col if which == 0 else 32 + row  # head 1, in the (B, H, T[, D]) shapes
    rms = float(clean.float().square().mean().sqrt())
    fault = VendorForwardFault(call=0, which=which, kind=kind, element=element,
                               value=4 * rms if which == 0 else 0.01)
    with torch.no_grad(), fault:
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert fault.hit
    drain(ctx.runtime.deferred)  # the step boundary
    op = ("context", "scores")[which]
    got = [(d.op, d.action, d.tier, d.head, d.row) for d in rec.detections]
    assert got[0] == (op, "recomputed", "abft", 1, row), got
    assert all(g[1:] == ("recomputed", "abft", 1, row) for g in got), got
    if which == 0:
        assert rec.detections[0].col == col
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype] * float(v.abs().max())
    assert float((out.double() - want).abs().max()) <= tol
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[16:32] = False
    assert torch.equal(out[:, :, untouched], clean[:, :, untouched])


ZOO_ONE_LAYER = {"gpt2": {"n_layer": 2, "n_head": 2},
                 "llama": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _opt_step(arch: str, model: torch.nn.Module, opt: torch.optim.Optimizer, s: int = 0,
              fault: VendorForwardFault | None = None) -> VendorForwardFault:
    """One training step on batch ``s``, the optimizer's step being the guard's step boundary, its forward under
    ``fault`` (default: one that only counts the vendor's op); returns it."""
    mode = fault if fault is not None else VendorForwardFault(call=-1, which=0, kind="nan", element=0)
    opt.zero_grad(set_to_none=True)
    with mode:
        loss = loss_of(arch, model, batch(arch, s))
    loss.backward()
    opt.step()
    return mode


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_protect_full_policy_corrects_a_vendor_fault_and_leaves_the_clean_step(arch: str) -> None:
    """protect(model, policy=Policy.full()), bf16: every layer's attention is the vendor's forward (seen once per
    layer), checked in full. NaN written below autograd into the first layer's output is reported at the step
    boundary as recomputed by the full check; the loss is the clean step's, every gradient the clean step's within
    the repaired block's rounding (our kernel's in place of the vendor's), and an SGD step leaves finite weights."""
    model = build(arch, **ZOO_ONE_LAYER[arch]).to(torch.bfloat16)
    with attnchecker.protect(model, policy=attnchecker.Policy.full()) as guard:
        def step(m: torch.nn.Module, mode: VendorForwardFault) -> tuple[float, dict[str, torch.Tensor]]:
            m.zero_grad(set_to_none=True)
            with mode:
                loss = loss_of(arch, m, batch(arch, 0))
            loss.backward()
            guard.step()
            return float(loss.detach()), _grads(m)

        counted = VendorForwardFault(call=-1, which=0, kind="nan", element=0)
        want_loss, want = step(model, counted)
        assert counted.seen == 2 and not guard.detections
        fault = VendorForwardFault(call=0, which=0, kind="nan", element=77)
        loss, grads = step(model, fault)
        assert fault.hit
        assert [(d.op, d.action, d.tier) for d in guard.detections] == [("context", "recomputed", "abft")]
    assert abs(loss - want_loss) <= 1e-2 * abs(want_loss)
    assert worst_rel(grads, want) <= 3e-2
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_clean_full_steps_over_the_vendor_forward_flag_nothing(dtype: torch.dtype) -> None:
    """Three clean training steps of Llama (grouped key/value heads) under Policy.full() in each half precision:
    every attention call is checked over the vendor's forward (its op seen once per layer per step) and nothing
    is reported."""
    model = build("llama", **ZOO_ONE_LAYER["llama"]).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with attnchecker.protect(model, optimizer=opt, policy=attnchecker.Policy.full()) as guard:
        for s in range(3):
            assert _opt_step("llama", model, opt, s).seen == 2
        report = guard.report()
        assert report.steps == 3 and report.checks["scores"] == 6 and report.checks["context"] == 6
        assert guard.detections == [] and report.detected == 0


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[Any] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def test_attnchecker_attention_full_kernel_keeps_the_check_in_our_kernel(make_ctx, triton_launches) -> None:
    """ATTNCHECKER_ATTENTION_FULL=kernel: a full check computes the call in our checked kernel (its first pass and
    the repair launch; no vendor op), the escape hatch for comparing the two; any other value is refused, naming
    the variable and its choices."""
    q, k, v = _qkv(torch.bfloat16)
    ctx, rec = make_ctx()
    with scoped_env({triton_backend.FULL_ENV: "kernel"}), torch.no_grad():
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert triton_launches["_attention"] == 2 and "_check_given" not in triton_launches
    torch.testing.assert_close(out, _vendor_out(q, k, v), rtol=2e-2, atol=2e-2)
    drain(ctx.runtime.deferred)
    assert rec.detections == []
    with scoped_env({triton_backend.FULL_ENV: "sometimes"}), pytest.raises(ValueError,
                                                                           match="ATTNCHECKER_ATTENTION_FULL"):
        triton_backend.full_requested()


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu_backward", "gpu_route_backward"])
def test_under_scope_all_a_full_step_checks_over_the_vendor_and_flags_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                              cpu_kernel: bool) -> None:
    """protect(scope="all", Policy.full()): the step checks the attention backward in full, whose identities take
    the forward's lse as exact to fp32's rounding of the row's exp-sum, which the vendor's is not. The forward is
    the vendor's op, checked over, and its lse normalised by the check; clean bf16 steps flag nothing, on the CPU's
    encoded backward and on the Triton backward a GPU runs (with the vendor's lse as it came, the Triton backward
    flagged 16 clean blocks)."""
    from attnchecker.attention.backward import fused

    monkeypatch.setattr(fused, "cpu_kernel", cpu_kernel)
    model = build("gpt2", **ZOO_ONE_LAYER["gpt2"]).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with attnchecker.protect(model, optimizer=opt, policy=attnchecker.Policy.full(), scope="all") as guard:
        for s in range(2):
            assert _opt_step("gpt2", model, opt, s).seen == 2
        report = guard.report()
        assert report.checks["scores"] == 4 and report.checks["grad_q"] == 4
        assert guard.detections == [] and report.detected == 0


def test_the_default_policy_after_a_quiet_period_checks_over_the_vendor_forward(triton_launches) -> None:
    """protect(model, optimizer=opt) with the default policy, bf16 GPT-2: after the schedule has gone quiet (scores
    not checked in full for 7 steps or more, each step's attention the vendor's under the tripwire), the next full
    check runs over the vendor's forward and corrects NaN written below autograd into its output. That fault drops
    the context check's period to 1 while the scores check's stays: on the next step context alone is verified and
    scores trapped, and that step's full check runs over the vendor's forward too (one identities launch and one
    repair launch per layer, no first pass of our kernel), flags nothing clean, and corrects the same fault."""
    arch = "gpt2"
    model = build(arch, **ZOO_ONE_LAYER[arch]).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step the same computation
    with attnchecker.protect(model, optimizer=opt) as guard:
        def step(fault: VendorForwardFault) -> collections.Counter[str]:
            before = collections.Counter(triton_launches)
            assert _opt_step(arch, model, opt, fault=fault).seen == 2  # the vendor's op is each layer's attention
            return collections.Counter(triton_launches) - before

        def quiet_step(due: bool) -> None:
            launched = step(VendorForwardFault(call=-1, which=0, kind="nan", element=0))
            assert launched["_check_given"] == (2 if due else 0)

        step_until_due_after_quiet(guard, quiet_step)
        assert guard.detections == []
        launched = step(VendorForwardFault(call=0, which=0, kind="nan", element=77))
        assert [(d.op, d.action, d.tier) for d in guard.detections] == [("context", "recomputed", "abft")]
        assert launched["_check_given"] == 2

        assert guard.check_config.checks("context") and not guard.check_config.checks("scores")
        launched = step(VendorForwardFault(call=-1, which=0, kind="nan", element=0))
        assert launched == collections.Counter({"_value_sums": 2, "_check_given": 2, "_attention": 2})
        assert len(guard.detections) == 1
        assert guard.check_config.checks("context") and not guard.check_config.checks("scores")
        step(VendorForwardFault(call=1, which=0, kind="nan", element=77))
        assert [(d.op, d.action, d.tier) for d in guard.detections[1:]] == [("context", "recomputed", "abft")]
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(("op", "side"), [("scores_bwd", "keys"), ("grad_q", "queries"), ("grad_v", "keys")])
def test_under_scope_all_a_backward_fault_after_the_vendor_forward_is_corrected(monkeypatch: pytest.MonkeyPatch,
                                                                             op: str, side: str) -> None:
    """protect(scope="all", Policy.full()), bf16 GPT-2, the Triton backward a GPU runs: on the second step, INF
    emulated in a product of the first backward call (the last layer's). Every forward is the vendor's, checked over
    with its lse normalised for the backward, and the backward's check recomputes the flagged blocks: events at that
    layer and step, the faulty product's among them (an S fault is also seen in the dK and dV made from it), and the
    step's gradients are the clean step's, bit for bit."""
    from attnchecker.attention.backward import fused, triton_backward

    monkeypatch.setattr(fused, "cpu_kernel", False)
    model = build("gpt2", **ZOO_ONE_LAYER["gpt2"]).to(torch.bfloat16)
    with attnchecker.protect(model, policy=attnchecker.Policy.full(), scope="all") as guard:
        grads = []
        for step in range(2):
            counted = VendorForwardFault(call=-1, which=0, kind="nan", element=0)
            model.zero_grad(set_to_none=True)
            with counted:
                loss = loss_of("gpt2", model, batch("gpt2", 0))
            assert counted.seen == 2
            faults = [triton_backward.KernelFault(op=op, n=1, row=9, col=3, side=side)] if step == 1 else []
            with triton_backward.emulated_faults(faults):
                loss.backward()
            guard.step()
            grads.append(_grads(model))
        got = [(d.op, d.layer, d.step, d.action) for d in guard.detections]
    assert (op, 1, 1, "recomputed") in got and all(g[1:] == (1, 1, "recomputed") for g in got), got
    assert worst_rel(grads[1], grads[0]) == 0.0


def test_scope_all_default_policy_in_fp16_flags_nothing_through_a_quiet_period(monkeypatch: pytest.MonkeyPatch,
                                                                                triton_launches) -> None:
    """protect(model, optimizer=opt, scope="all") with the default policy, fp16 GPT-2, the Triton backward a GPU
    runs: every step's attention forward is the vendor's (tier 1 over it, or the full check over it with the lse
    normalised for the checked backward), through the schedule's quiet period to its next full check, and no clean
    step flags anything."""
    from attnchecker.attention.backward import fused

    monkeypatch.setattr(fused, "cpu_kernel", False)
    model = build("gpt2", **ZOO_ONE_LAYER["gpt2"]).to(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with attnchecker.protect(model, optimizer=opt, scope="all") as guard:
        def step(due: bool) -> None:
            before = triton_launches["_check_given"]
            assert _opt_step("gpt2", model, opt).seen == 2
            assert triton_launches["_check_given"] - before == (2 if due else 0)
            assert guard.detections == []

        step_until_due_after_quiet(guard, step)
        step(True)
        assert guard.report().checks["grad_q"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
