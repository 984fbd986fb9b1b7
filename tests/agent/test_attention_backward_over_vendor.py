"""The full check of an attention backward over the vendor's (kernels/triton_given_backward_check.py: the identities
of abft/given_backward.py in one Triton launch; on CPU under Triton's interpreter, the vendor being the CPU flash
backward; FlashAttention's on a GPU), then our kernels' repair of what it flags:

- a clean vendor backward, bf16 and fp16, causal or not, grouped key heads or not, sequences that end inside a
  block: nothing flags, every clean row under half its bound, the gradients the vendor's bit for bit, grad_v, grad_k
  and grad_q counted as checked in full, no host sync;
- one wrong element of the vendor's dV, dK or dQ, extreme or finite (4 × its row's RMS): reported at the step boundary
  under its op, at its head and row, as recomputed; the block that holds it is our kernels' recompute, every other
  element the vendor's, and the gradients those of the clean backward within the dtype's rounding;
- through protect(scope="all", Policy.full()), GPT-2 and Llama (grouped key heads) in bf16, the backward a GPU runs:
  every layer's backward is the vendor's op, seen below autograd, checked in one launch per layer; a fault written
  below autograd into its output is corrected, the step's gradients the clean step's within bf16; and under the
  default policy, on its first whole-step check after a quiet period;
- opt-in (ATTNCHECKER_ATTENTION_BACKWARD_FULL=vendor, set here): by default our kernels check the backward.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gemm_injector import FUSED_BACKWARD, FusedBackwardFault
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import batch, build, loss_of
from quiet_period import step_until_due_after_quiet
from scoped_env import scoped_env
from sync_counter import SyncCounter

import attnchecker
from attnchecker.abft import Tolerance
from attnchecker.abft.given_backward import CPU_FLASH
from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.attention.backends import triton as triton_backend
from attnchecker.attention.backends.tiled_torch import TILE_ENV
from attnchecker.attention.backward import triton_backward
from attnchecker.checks.deferred import drain
from attnchecker.kernels import triton_attention
from attnchecker.kernels import triton_attention_bwd as kernels

pytestmark = [pytest.mark.skipif(not triton_attention.available("cpu"), reason="no triton, or not under Triton's "
                                 "interpreter (TRITON_INTERPRET=1, set by conftest.py where there is no GPU)"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def force_triton() -> Iterator[None]:
    """The Triton route on CPU tensors, under the interpreter (as a GPU takes it), the vendor's forward for full
    checks, and its backward checked over (ATTNCHECKER_ATTENTION_BACKWARD_FULL=vendor: opt-in)."""
    with scoped_env({BACKEND_ENV: "triton", TILE_ENV: None, triton_backend.FULL_ENV: None,
                     triton_backward.FULL_ENV: "vendor"}):
        yield


def _vendor(dtype: torch.dtype, *, t: int, s: int, d: int, hk: int, group: int, causal: bool, seed: int,
            peaky: float = 1.0, v_mean: float = 0.0) -> dict[str, Any]:
    """q, dO (1, hk·group, t, d), k, v (1, hk, s, d), and the CPU flash kernel's forward and backward, grouped heads
    as they are (what attention/vendor.py calls)."""
    g = torch.Generator().manual_seed(seed)
    h = hk * group
    q = (torch.randn(1, h, t, d, generator=g) * peaky).to(dtype)
    k = (torch.randn(1, hk, s, d, generator=g) * peaky).to(dtype)
    v = (torch.randn(1, hk, s, d, generator=g) + v_mean).to(dtype)
    do = torch.randn(1, h, t, d, generator=g).to(dtype)
    scale = d ** -0.5
    out, lse = FORWARD(q, k, v, 0.0, causal, scale=scale)[:2]
    lse = lse.contiguous()
    grads = FUSED_BACKWARD(do, q, k, v, out, lse, 0.0, causal, scale=scale)
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "do": do, "grads": tuple(grads), "scale": scale,
            "causal": causal}


def _check(a: dict[str, Any], ctx: Any, given: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    got: tuple[torch.Tensor, ...] = triton_backward.backward(
        a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], scale=a["scale"], is_causal=a["causal"], check="abft",
        ctx=ctx, given=given, accumulation=CPU_FLASH(a["q"].shape[-2]))
    return got


def _identities(dtype: torch.dtype, t: int) -> kernels.GivenIdentities:
    return kernels.GivenIdentities.of(dtype, Tolerance(), CPU_FLASH(t))


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(HALF), causal=st.booleans(), hk=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
       t=st.integers(1, 80), extra_keys=st.integers(0, 40), d=st.sampled_from([16, 32]),
       peaky=st.sampled_from([1.0, 3.0]), v_mean=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**20))
def test_a_clean_vendor_backward_flags_nothing_and_keeps_its_gradients(make_ctx, dtype, causal, hk, group, t,
                                                                       extra_keys, d, peaky, v_mean, seed) -> None:
    s = t if causal else t + extra_keys  # the vendors' causal masks align as SDPA's only where T = S
    a = _vendor(dtype, t=t, s=s, d=d, hk=hk, group=group, causal=causal, seed=seed, peaky=peaky, v_mean=v_mean)
    vendor = tuple(g.clone() for g in a["grads"])
    # The kernels as the route runs them, to read every program's worst clean ratio.
    dq, dk, dv, launch = kernels.run(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], scale=a["scale"],
                                     is_causal=causal, window=None, attn_mask=None, dropout_p=0.0, seed=0,
                                     check="abft", rules=None, repair=False, given=tuple(g.clone() for g in vendor),
                                     identities=_identities(dtype, t))
    assert launch is not None
    assert not bool((launch.status_P != 0).any())
    worst = launch.summary_PO6[:, [kernels.OPS.index(op) for op in kernels.GIVEN_OPS], 0]
    assert float(worst.max()) <= 0.5
    for got, want in zip((dq, dk, dv), vendor, strict=True):
        assert torch.equal(got, want)
    # Through the engine: nothing reported, the three outputs counted as checked in full, no host sync.
    ctx, rec = make_ctx()
    with SyncCounter() as syncs:
        got = _check(a, ctx, tuple(g.clone() for g in vendor))
    assert syncs.calls == []
    drain(ctx.runtime.deferred)
    assert rec.detections == []
    assert all(torch.equal(x, y) for x, y in zip(got, vendor, strict=True))
    checks = ctx.runtime.stats.checks
    assert [checks[op] for op in kernels.GIVEN_OPS] == [1, 1, 1] and checks.get("scores_bwd", 0) == 0


@pytest.mark.parametrize(("which", "at"), [(0, (0, 1, 40, 3)), (1, (0, 0, 9, 5)), (2, (0, 1, 63, 0)),
                                           (2, (0, 0, 0, 15))])
@pytest.mark.parametrize("kind", ["nan", "inf", "near_inf", "bitflip", "add"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_one_wrong_gradient_element_is_reported_and_its_block_recomputed(make_ctx, dtype: torch.dtype, which: int,
                                                                         at: tuple[int, ...], kind: str) -> None:
    """T = S = 64 (two blocks of queries and of keys), causal, two query heads on two key heads. dQ's element is in a
    query block of one head (a query program recomputes it); dK's and dV's in a key block of one key head (a key
    program recomputes both)."""
    a = _vendor(dtype, t=64, s=64, d=16, hk=2, group=1, causal=True, seed=7)
    clean = a["grads"]
    given_grads = [g.clone() for g in clean]
    grad = given_grads[which]
    rms = float(grad[at[:3]].float().square().mean().sqrt())
    if kind == "bitflip":
        # The exponent's top bit where |x| < 1 (huge and finite), else the next one down (x / 2³² in bf16, / 2⁸ in
        # fp16: an error of |x|).
        bits = grad[at].view(torch.int16)
        grad[at] = (bits ^ (1 << 14 if abs(float(grad[at])) < 1 else 1 << 13)).view(dtype)
        assert float(grad[at]) != float(clean[which][at])
    else:
        grad[at] = {"nan": math.nan, "inf": math.inf, "near_inf": 1e4 if dtype == torch.float16 else 1e20,
                    "add": float(grad[at]) + 4 * max(rms, 1e-3)}[kind]
    ctx, rec = make_ctx()
    got = _check(a, ctx, tuple(given_grads))
    assert rec.detections == []  # nothing crosses to the host before the step boundary
    drain(ctx.runtime.deferred)
    op = ("grad_q", "grad_k", "grad_v")[which]
    assert [(d.op, d.action, d.tier, d.batch, d.head, d.row) for d in rec.detections] == [
        (op, "recomputed", "abft", 0, at[1], at[2])], rec.detections
    # Our kernels' own gradients, unchecked: what the repair writes into the flagged block.
    ours = triton_backward.backward(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], scale=a["scale"],
                                    is_causal=True, check="off", ctx=None)
    block = slice(at[2] // 32 * 32, at[2] // 32 * 32 + 32)
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    for i, (g, vendor, kernel) in enumerate(zip(got, clean, ours, strict=True)):
        owned = (which == 0) == (i == 0)  # the query program owns dQ; the key program dK and dV
        for h in range(g.shape[1]):
            mine = owned and h == at[1]
            assert torch.equal(g[0, h, block], kernel[0, h, block] if mine else vendor[0, h, block])
            rest = torch.ones(g.shape[2], dtype=torch.bool)
            rest[block] = False
            assert torch.equal(g[0, h, rest], vendor[0, h, rest])
        torch.testing.assert_close(g.float(), vendor.float(), rtol=tol, atol=tol)


def test_the_check_refuses_what_the_identities_do_not_take(make_ctx) -> None:
    a = _vendor(torch.bfloat16, t=8, s=8, d=16, hk=1, group=1, causal=True, seed=1)
    with pytest.raises(ValueError, match="how their backward rounds"):
        triton_backward.backward(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], scale=a["scale"],
                                 is_causal=True, check="abft", ctx=make_ctx()[0], given=a["grads"])
    with pytest.raises(ValueError, match="no mask, dropout or window"):
        kernels.run(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], scale=a["scale"], is_causal=True, window=4,
                    attn_mask=None, dropout_p=0.0, seed=0, check="abft", rules=None, given=a["grads"],
                    identities=_identities(torch.bfloat16, 8))
    with pytest.raises(ValueError, match="not 'off'"):
        kernels.run(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], scale=a["scale"], is_causal=True,
                    window=None, attn_mask=None, dropout_p=0.0, seed=0, check="off", rules=None, given=a["grads"])


ZOO = {"gpt2": {"n_layer": 2, "n_head": 2},
       "llama": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("arch", "which"), [("gpt2", 1), ("llama", 2), ("llama", 0)])
def test_protect_scope_all_checks_the_vendor_backward_and_corrects_a_fault_below_autograd(
        monkeypatch: pytest.MonkeyPatch, triton_launches, arch: str, which: int) -> None:
    """protect(scope="all", Policy.full()), bf16, the backward a GPU runs (the fused CPU kernel's off). Every layer's
    attention backward is the vendor's op (seen below autograd by a dispatch mode that knows nothing of attnchecker),
    its gradients checked in one launch per layer, and the repair launches find nothing on a clean step. On the
    second step NaN is written into the vendor's dK, dV or dQ of the first backward call (the last layer's): one event
    there, recomputed by the full check, and the step's gradients the clean step's within bf16's rounding of the
    recomputed block (measured: 5·10⁻³ of a parameter's gradient norm, 10⁻³ an element, at most)."""
    from attnchecker.attention.backward import fused

    monkeypatch.setattr(fused, "cpu_kernel", False)
    layers = 2
    model = build(arch, **ZOO[arch]).to(torch.bfloat16)
    with attnchecker.protect(model, policy=attnchecker.Policy.full(), scope="all") as guard:
        grads = []
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss = loss_of(arch, model, batch(arch, 0))
            before = dict(triton_launches)
            fault = FusedBackwardFault(call=0 if step else -1, which=which, kind="nan", element=1000)
            with fault:
                loss.backward()
            guard.step()
            assert fault.seen == layers and fault.hit == bool(step)
            launched = {name: n - before.get(name, 0) for name, n in triton_launches.items()}
            assert launched["_check_given_bwd"] == layers and "_trip_given" not in launched
            # The repair launches: each program that flagged nothing returns at once.
            assert launched["_query_pass"] == launched["_key_pass"] == layers
            grads.append(_grads(model))
        got = [(d.op, d.layer, d.step, d.action, d.tier) for d in guard.detections]
    op = ("grad_q", "grad_k", "grad_v")[which]
    assert got == [(op, layers - 1, 1, "recomputed", "abft")], got
    for name, g in grads[1].items():
        torch.testing.assert_close(g.float(), grads[0][name].float(), rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("env", [None, "kernel"], ids=["default", "kernel"])
def test_by_default_our_kernels_check_the_backward(monkeypatch: pytest.MonkeyPatch, triton_launches,
                                                   env: str | None) -> None:
    """ATTNCHECKER_ATTENTION_BACKWARD_FULL unset or "kernel": a scope="all" full step whose forward the vendor made
    checks the backward in our kernels (the vendor's stays opt-in until a GPU run times the two); the vendor's
    backward op never runs, nor the check over it. Anything else is refused, naming the variable."""
    from attnchecker.attention.backward import fused

    monkeypatch.setattr(fused, "cpu_kernel", False)
    model = build("gpt2", **ZOO["gpt2"]).to(torch.bfloat16)
    with scoped_env({triton_backward.FULL_ENV: env}), \
            attnchecker.protect(model, policy=attnchecker.Policy.full(), scope="all") as guard:
        loss = loss_of("gpt2", model, batch("gpt2", 0))
        counted = FusedBackwardFault(call=-1, which=0, kind="nan", element=0)
        with counted:
            loss.backward()
        guard.step()
        assert guard.detections == []
    assert counted.seen == 0
    assert "_check_given_bwd" not in triton_launches and triton_launches["_key_pass"] == 2 * 2
    with scoped_env({triton_backward.FULL_ENV: "flash"}), pytest.raises(ValueError,
                                                                     match="ATTNCHECKER_ATTENTION_BACKWARD_FULL"):
        triton_backward.full_requested()


def test_the_default_policy_after_a_quiet_period_checks_the_vendor_backward_and_corrects_it(
        monkeypatch: pytest.MonkeyPatch, triton_launches) -> None:
    """protect(model, optimizer=opt, scope="all") with the default policy, bf16 GPT-2, opted in: through the
    schedule's ramp and quiet period no clean step flags anything, and the identities run on exactly the steps whose
    whole-step checks are due (one launch a layer). On the first such step after the quiet period, NaN written below
    autograd into the vendor's dK of the last layer is reported as recomputed by the full check, and the weights stay
    finite."""
    from attnchecker.attention.backward import fused

    monkeypatch.setattr(fused, "cpu_kernel", False)
    model = build("gpt2", **ZOO["gpt2"]).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with attnchecker.protect(model, optimizer=opt, scope="all") as guard:
        def step(due: bool, fault: FusedBackwardFault | None = None) -> FusedBackwardFault:
            before = triton_launches["_check_given_bwd"]
            mode = fault or FusedBackwardFault(call=-1, which=0, kind="nan", element=0)
            opt.zero_grad(set_to_none=True)
            loss = loss_of("gpt2", model, batch("gpt2", 0))
            with mode:
                loss.backward()
            opt.step()
            assert triton_launches["_check_given_bwd"] - before == (2 if due else 0)
            assert mode.seen == 2
            return mode

        def clean(due: bool) -> None:
            step(due)
            assert guard.detections == []

        step_until_due_after_quiet(guard, clean, op="out")
        assert step(True, FusedBackwardFault(call=0, which=1, kind="nan", element=1000)).hit
        got = [(d.op, d.layer, d.action, d.tier) for d in guard.detections]
    assert got == [("grad_k", 1, "recomputed", "abft")], got
    assert all(torch.isfinite(p).all() for p in model.parameters())
