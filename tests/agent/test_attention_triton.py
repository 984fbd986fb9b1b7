"""The engine on the Triton backend (ATTNCHECKER_ATTENTION=triton; on CPU under Triton's interpreter), tiles of
16 × 16 so the suites' small shapes cross several.

- The engine suites (test_attention_layer.py, test_attention_fused_backward.py) re-run on it: equivalence with SDPA
  over shapes, dtypes, masks and GQA; every extreme fault in the scores and the context corrected; a bad row, column
  or block; a fault that repeats; loss and gradients equal to the fault-free step's; detect and extreme modes; the
  wire fields. The interpreter runs a tile in milliseconds, so the parametrised suites run a selection of their cases
  (every op-through-the-kernel case of each kind) and the property-based ones fewer examples of the same strategies.
- Through protect(): GPT-Neo (a global and a sliding-window layer), Llama (GQA, RoPE) and GPT-2 with attention dropout
  0.1, each with a fault attnchecker.inject writes into the kernel's tiles: reported at the step boundary, loss and
  gradients the fault-free step's, 0 false positives on the clean twin.
- A protected forward is a small, fixed number of launches whatever T (counted under the interpreter), and the
  backend's run makes no host-device sync, on full-check and tier-1 steps.
"""
from __future__ import annotations

import collections
import copy
import functools
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_attention_fused_backward as fused_suite
import test_attention_layer as layer_suite
import torch
import triton.runtime.interpreter as interpreter
from gemm_injector import FUSED_BACKWARD, FUSED_FORWARD, FusedBackwardFault
from hypothesis import given, settings
from model_zoo import batch, build, loss_of
from scoped_env import scoped_env
from sync_counter import SyncCounter
from test_attention_layer import layer_params, run_layer, seeded
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import attnchecker
from attnchecker.attention import pipeline, vendor
from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.attention.backends import triton as triton_backend
from attnchecker.attention.backends.tiled_torch import TILE_ENV
from attnchecker.attention.backward import fused, triton_backward
from attnchecker.attention.backward.replay import Replay, replay_backward
from attnchecker.attention.pipeline import protected_sdpa
from attnchecker.checks.deferred import drain
from attnchecker.inject import Fault, FaultPlan, Injector
from attnchecker.kernels import triton_attention, triton_dropout
from attnchecker.kernels.triton_attention_bwd import KernelFault

# The suites make CPU tensors: they reach the kernel under the interpreter only (on a GPU machine, test_triton_gpu.py
# runs the backend on CUDA tensors).
pytestmark = pytest.mark.skipif(not triton_attention.available("cpu"), reason="no triton, or not under Triton's "
                                "interpreter (TRITON_INTERPRET=1, set by conftest.py where there is no GPU)")


@pytest.fixture(autouse=True, scope="module")
def force_triton() -> Iterator[None]:
    """Module scope (hypothesis refuses function-scoped fixtures): set for this module's tests, restored after. The
    full checks in our kernel, as a planned fault puts them (its fault-free twins too, so that both run the same
    arithmetic): test_attention_full_over_vendor.py runs them over the vendor's forward."""
    with scoped_env({BACKEND_ENV: "triton", TILE_ENV: None, triton_backend.FULL_ENV: "kernel"}):
        yield


class AtTheStepBoundary:
    """A recorder whose detections are read at a step boundary: the records the backend left on the device
    (checks/deferred.py) are emitted first, as Guard.step() does. The suites re-run here read the detections right
    after a call, with no guard to end the step."""

    def __init__(self, recorder: Any, runtime: Any) -> None:
        self.recorder, self.runtime = recorder, runtime

    @property
    def detections(self) -> list[Any]:
        drain(self.runtime.deferred)
        return list(self.recorder.detections)

    def by_op(self, op: str) -> list[Any]:
        return [d for d in self.detections if d.op == op]


@pytest.fixture(scope="session")
def make_ctx(make_ctx: Callable[..., Any]) -> Callable[..., Any]:
    """conftest's make_ctx, its recorder read at a step boundary (AtTheStepBoundary)."""

    def build(*args: Any, **kwargs: Any) -> tuple[Any, AtTheStepBoundary]:
        ctx, rec = make_ctx(*args, **kwargs)
        return ctx, AtTheStepBoundary(rec, ctx.runtime)

    return build


def fewer(test: Any, examples: int) -> Any:
    """A suite's property-based test, its body and strategies, with fewer examples."""
    handle = test.hypothesis

    @functools.wraps(handle.inner_test)
    def body(*args: Any, **kwargs: Any) -> None:
        handle.inner_test(*args, **kwargs)

    return settings(max_examples=examples)(given(**handle._given_kwargs)(body))


# ------------------------------------------------------------------------------------------- the engine's suites

test_protected_sdpa_matches_sdpa_without_faults = fewer(layer_suite.test_protected_sdpa_matches_sdpa_without_faults,
                                                        8)
test_any_single_extreme_error_leaves_the_layer_output_fault_free = fewer(
    layer_suite.test_any_single_extreme_error_leaves_the_layer_output_fault_free, 3)

# Whole, every case. Left out: tests that never reach the attention's kernel (projections, paper mode), the sync
# count through a TorchDispatchMode (the backend declines under one: test_the_backend_makes_no_host_sync counts
# here), and the bitwise-SDPA tier-1 step (tier 1 runs in the kernel on this backend).
for _suite, _names in ((layer_suite, ("test_protected_layer_matches_the_unprotected_layer",
                                      "test_autocast_layer_never_flags_clean_and_corrects_faults",
                                      "test_detect_mode_reports_and_changes_nothing",
                                      "test_extreme_mode_corrects_extreme_errors_and_ignores_small_ones",
                                      "test_every_detection_carries_the_wire_fields",
                                      "test_stats_count_checks_and_bucketize_residuals_on_device",
                                      "test_dropout_recompute_reuses_the_mask")),
                       (fused_suite, ("test_fused_backward_with_grouped_query_heads",))):
    for _name in _names:
        globals()[_name] = getattr(_suite, _name)

THROUGH_KERNEL = ("scores", "context")


@pytest.mark.parametrize("case", [(op, kind, torch.float32) for op in THROUGH_KERNEL
                                  for kind in layer_suite.EXTREME_KINDS]
                         + [(op, "nan", dt) for op in THROUGH_KERNEL for dt in (torch.bfloat16, torch.float16)],
                         ids=str)
def test_single_extreme_error_in_any_op_is_corrected(make_ctx, case) -> None:
    op, kind, dtype = case
    layer_suite.test_single_extreme_error_in_any_op_is_corrected(make_ctx, op, kind, dtype)


@pytest.mark.parametrize("case", [("scores", "near_inf", torch.float32), ("context", "add", torch.float32),
                                  ("scores", "add", torch.bfloat16), ("context", "near_inf", torch.bfloat16)], ids=str)
def test_loss_and_every_gradient_equal_the_fault_free_step(make_ctx, case) -> None:
    op, kind, dtype = case
    layer_suite.test_loss_and_every_gradient_equal_the_fault_free_step(make_ctx, op, kind, dtype)


@pytest.mark.parametrize("case", [(op, axis, "add") for op in THROUGH_KERNEL for axis in ("row", "col")], ids=str)
def test_bad_row_or_column_of_scores_and_context_is_corrected(make_ctx, case) -> None:
    layer_suite.test_bad_row_or_column_of_scores_and_context_is_corrected(make_ctx, *case)


@pytest.mark.parametrize("op", THROUGH_KERNEL)
def test_block_fault_is_recomputed_and_ends_correct(make_ctx, op: str) -> None:
    layer_suite.test_block_fault_is_recomputed_and_ends_correct(make_ctx, op)


@pytest.mark.parametrize("op", THROUGH_KERNEL)
def test_persistent_fault_is_reported_uncorrectable(make_ctx, op: str) -> None:
    layer_suite.test_persistent_fault_is_reported_uncorrectable(make_ctx, op)


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "dead_rows", "additive", "causal_and_bool"])
def test_fused_backward_matches_the_unfused_graph(make_ctx, kind: str) -> None:
    """The suite's test, which also asserts the backward is the fused CPU kernel's at the kernel's output."""
    fused_suite.test_fused_backward_matches_the_unfused_graph(make_ctx, torch.float32, kind)


@pytest.mark.parametrize(("op", "value", "tripped"), [("scores", 1e20, "scores"), ("context", math.nan, "context")])
def test_tier1_on_the_backend_recovers_a_trip_on_the_device_and_reports_it_at_the_step_boundary(make_ctx, op, value,
                                                                                               tripped) -> None:
    """A step where neither op is due: the pipeline runs the kernel's tier-1 variant; a fault inside the kernel trips
    it, the repair recomputes the block with full checks, and the report (tier "tripwire") comes at the step
    boundary, the output SDPA's."""
    q, k, v = (seeded((1, 2, 32, 16), i, torch.float32) for i in range(3))
    ctx, rec = make_ctx(checked_ops=frozenset({"q", "k", "v", "out"}))
    fault = (op, 1, 20, 7 if op == "scores" else 2, "set", value, False)
    with triton_attention.emulated_faults([fault]):
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)
    assert ctx.runtime.stats.trip_checks["scores"] == 1 and ctx.runtime.stats.checks["scores"] == 0
    assert [(d.op, d.action, d.tier, d.head, d.row) for d in rec.detections] == [(tripped, "recomputed", "tripwire",
                                                                                  1, 20)]


# ------------------------------------------------------------------- tier 1 on the vendor's forward, below autograd

class VendorForwardFault(FusedBackwardFault):
    """Corrupts element ``element`` of output ``which`` (0 the output, 1 the log-sum-exp) of the ``call``-th CPU
    flash attention forward: a fault inside the vendor's kernel shows only there. Knows nothing of attnchecker."""

    op = FUSED_FORWARD


@pytest.mark.parametrize(("which", "kind"), [(0, "nan"), (0, "inf"), (0, "near_inf"), (0, "bitflip"),
                                             (1, "near_inf"), (1, "nan")])
def test_tier1_reads_the_vendor_forward_and_recomputes_a_fault_below_autograd_in_it(
        make_ctx, monkeypatch: pytest.MonkeyPatch, which: int, kind: str) -> None:
    """A step where neither op is due: the vendor's fused attention (the CPU flash kernel here; FlashAttention or
    memory-efficient attention on a GPU) computes the call, one Triton pass reads its output and log-sum-exp, and the
    repair recomputes a tripped block. A fault written below autograd into that kernel's output (op "context") or
    log-sum-exp (op "scores") is reported at the step boundary as recomputed by tier 1, the output is SDPA's, and the
    host's tier 1 (a sync per call) never runs."""
    monkeypatch.setattr(pipeline, "_tripwire_sdpa", None)  # the host path: calling it would raise
    q, k, v = (seeded((1, 2, 32, 16), i, torch.float32) for i in range(3))
    ctx, rec = make_ctx(checked_ops=frozenset({"q", "k", "v", "out"}))
    fault = VendorForwardFault(call=0, which=which, kind=kind, element=1 * 32 * 16 + 20 * 16 + 3 if which == 0
                               else 32 + 20)
    with fault:
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert fault.hit and fault.seen == 1
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)
    assert ctx.runtime.stats.trip_checks["scores"] == 1 and ctx.runtime.stats.checks["scores"] == 0
    op = ("context", "scores")[which]
    assert [(d.op, d.action, d.tier, d.head, d.row) for d in rec.detections] == [(op, "recomputed", "tripwire", 1,
                                                                                  20)]


def test_an_emulated_fault_on_a_tier1_step_runs_the_kernel_that_writes_it(make_ctx) -> None:
    """The kernel's emulated faults (kernels/triton_attention.emulated_faults) go into its own products, which the
    vendor's op does not have: a tier-1 call with one pending runs the kernel's tier 1 and its repair (two
    "_attention" launches), not the pass over the vendor's forward, and the fault is reported and recomputed.
    (attnchecker.inject's plan never reaches tier 1: a step with a fault planned checks the call in full.)"""
    launched: collections.Counter[str] = collections.Counter()
    run = interpreter.GridExecutor.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        launched[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    q, k, v = (seeded((1, 2, 32, 16), i, torch.float32) for i in range(3))
    ctx, rec = make_ctx(checked_ops=frozenset({"q", "k", "v", "out"}))
    with pytest.MonkeyPatch.context() as mp, triton_attention.emulated_faults([("context", 1, 20, 2, "set", math.nan,
                                                                                False)]):
        mp.setattr(interpreter.GridExecutor, "__call__", counted)
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert launched == {"_attention": 2}, launched
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)
    assert [(d.op, d.action, d.tier) for d in rec.detections] == [("context", "recomputed", "tripwire")]


def test_with_inject_attached_only_the_call_a_fault_is_planned_for_leaves_the_vendor_forward(
        make_ctx, triton_launches) -> None:
    """attnchecker.inject attached, one fault planned in layer 1's context, on a step where neither op is due: layer
    0 runs as it would without the injector (the vendor's forward, the tier-1 pass over it and the repair launch,
    which finds nothing), and only layer 1 runs our kernel, which writes the fault into its tile, trips on it and
    recomputes the block. A drill costs what training costs, but for the call it plants a fault in."""
    q, k, v = (seeded((1, 2, 32, 16), i, torch.bfloat16) for i in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    injector = Injector(FaultPlan([Fault(op="context", layer=1, step=3, kind="nan", head=1, row=20, col=2)]))
    # Layer 0, its vendor calls counted below autograd (a dispatch mode our kernel declines under: layer 0 only).
    ctx, rec = make_ctx(injector, layer=0, step=3, checked_ops=frozenset({"q", "k", "v", "out"}))
    counted = VendorForwardFault(call=-1, which=0, kind="nan", element=0)
    with counted:
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    drain(ctx.runtime.deferred)  # the step boundary
    assert counted.seen == 1
    assert dict(triton_launches) == {"_trip_given": 1, "_attention": 1}
    assert torch.equal(out, want) and rec.detections == [] and injector.injected == []
    triton_launches.clear()
    ctx, rec = make_ctx(injector, layer=1, step=3, checked_ops=frozenset({"q", "k", "v", "out"}))
    out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    drain(ctx.runtime.deferred)
    assert dict(triton_launches) == {"_kv_tiles": 1, "_attention": 2}
    assert [(d.op, d.action, d.tier, d.head, d.row) for d in rec.detections] == [
        ("context", "recomputed", "tripwire", 1, 20)]
    assert len(injector.injected) == 1
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


def test_a_vendor_op_that_fails_hands_tier1_to_the_kernel_for_good(make_ctx, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A build whose fused attention op fails at run time (here the CPU flash kernel made to raise, as a missing
    kernel would): the call still returns SDPA's output through the kernel's own tier 1, the failure is logged once,
    and later calls never try the op again."""
    tried = []

    def missing(*_args: Any, **_kwargs: Any) -> Any:
        tried.append(1)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(vendor, "_broken", [])
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", missing)
    q, k, v = (seeded((1, 2, 32, 16), i, torch.float32) for i in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ctx, rec = make_ctx(checked_ops=frozenset({"q", "k", "v", "out"}))
    with caplog.at_level("WARNING", logger="attnchecker"):
        outs = [protected_sdpa(q, k, v, ctx=ctx, is_causal=True) for _ in range(3)]
    assert len(tried) == 1
    assert len([r for r in caplog.records if "log-sum-exp" in r.message]) == 1
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert ctx.runtime.stats.trip_checks["scores"] == 3 and rec.detections == []


ZOO_ONE_LAYER = {"gpt2": {"n_layer": 1, "n_head": 2},
                 "llama": {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}}


@pytest.mark.parametrize(("arch", "compiled"), [("gpt2", False), ("llama", False), ("gpt2", True)],
                         ids=["gpt2", "llama", "gpt2_compiled"])
def test_a_fault_in_the_vendor_forward_on_a_tier1_step_leaves_the_clean_step(arch: str, compiled: bool) -> None:
    """protect(model) with the default scope on a step whose attention checks are not due, GPT-2 and Llama (grouped
    key/value heads), and GPT-2 under torch.compile (aot_eager: the checked attention op runs the same path inside
    the graph): every attention call's tier 1 reads the vendor's forward (the CPU flash kernel, seen once per
    layer), and NaN written below autograd into one of them is recomputed on the device, reported at the step
    boundary, and the loss and gradients are the clean step's."""
    model = build(arch, **ZOO_ONE_LAYER[arch])
    run = torch.compile(model, backend="aot_eager") if compiled else model
    policy = attnchecker.Policy(adaptive=False, op_periods={"scores": 1000, "context": 1000})
    with attnchecker.protect(model, policy=policy) as guard:
        loss_of(arch, run, batch(arch, 0)).backward()  # the first step checks every op
        guard.step()
        assert not guard.check_config.checks("scores") and not guard.check_config.checks("context")

        def step(mode: VendorForwardFault) -> tuple[float, dict[str, torch.Tensor]]:
            model.zero_grad(set_to_none=True)
            with mode:
                loss = loss_of(arch, run, batch(arch, 0))
            loss.backward()
            guard.step()
            return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        counted = VendorForwardFault(call=-1, which=0, kind="nan", element=0)
        want_loss, want = step(counted)
        assert counted.seen == 1 and not guard.detections
        fault = VendorForwardFault(call=0, which=0, kind="nan", element=77)
        loss, grads = step(fault)
        assert fault.hit
        assert [(d.op, d.action, d.tier) for d in guard.detections] == [("context", "recomputed", "tripwire")]
    assert loss == want_loss
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


class FusedCalls(TorchDispatchMode):
    """Counts the CPU flash kernel's forward and backward calls below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in (FUSED_FORWARD, FUSED_BACKWARD):
            self.counts["forward" if func is FUSED_FORWARD else "backward"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scope", ["attention", "all"])
@pytest.mark.parametrize(("arch", "fault"), [("gpt2", None), ("llama", None), ("gpt2", (0, "nan")),
                                             ("llama", (1, "near_inf"))], ids=str)
def test_off_the_cpu_a_tier1_step_differentiates_the_vendor_forward_without_running_it_again(
        monkeypatch: pytest.MonkeyPatch, scope: str, arch: str, fault: tuple[int, str] | None) -> None:
    """Off the CPU (the branch CUDA takes, here on CPU tensors with fused.cpu_kernel off), a tier-1 step's attention
    is the vendor's forward, and its backward is the vendor's backward op at that forward's output and log-sum-exp:
    one forward and one backward per layer, as the unprotected step runs, and SDPA's recompute (a second forward)
    never runs. Under scope="all" the backward's own tier 1 reads those gradients. The gradients are the
    unprotected model's. With a fault written below autograd into the vendor's output or log-sum-exp, the repair
    rewrites them in place before the backward reads them: the gradients are still the unprotected model's."""
    monkeypatch.setattr(fused, "cpu_kernel", False)
    model = build(arch, **ZOO_ONE_LAYER[arch])
    plain = copy.deepcopy(model)
    want_loss = loss_of(arch, plain, batch(arch, 0))
    want_loss.backward()
    pins = dict.fromkeys(("q", "k", "v", "scores", "context", "out"), 1000)
    with attnchecker.protect(model, policy=attnchecker.Policy(adaptive=False, op_periods=pins), scope=scope) as guard:
        loss_of(arch, model, batch(arch, 1)).backward()  # the first step checks every op
        guard.step()
        model.zero_grad(set_to_none=True)
        monkeypatch.setattr(fused, "_sdpa_backward", None)  # the recompute: calling it would raise
        monkeypatch.setattr(triton_backend, "_sdpa_backward", None)
        counted = FusedCalls()
        hit = VendorForwardFault(call=0 if fault else -1, which=fault[0] if fault else 0,
                                 kind=fault[1] if fault else "nan", element=77)
        with counted, hit:
            loss = loss_of(arch, model, batch(arch, 0))
            loss.backward()
        guard.step()
        dets = [(d.op, d.action, d.tier) for d in guard.detections]
    assert counted.counts == {"forward": 1, "backward": 1}, counted.counts
    assert hit.hit == (fault is not None)
    assert dets == ([(("context", "scores")[fault[0]], "recomputed", "tripwire")] if fault else [])
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-6, atol=0.0)
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


# --------------------------------------------------------------------------- attention dropout, through the layer


def test_dropout_gradients_are_those_of_the_forward_s_own_keep_mask() -> None:
    """Both backwards of a dropout call regenerate the kernel's keep mask from its seed (the Triton backward, and
    replay_backward, its PyTorch fallback): their gradients are autograd's through the unfused math with that mask
    (GQA, a padding mask and causal together)."""
    q = seeded((2, 4, 20, 8), 1, torch.float32).requires_grad_()
    k, v = (seeded((2, 2, 20, 8), i, torch.float32).requires_grad_() for i in (2, 3))
    mask = torch.arange(20)[None, None, None, :] < torch.tensor([20, 13])[:, None, None, None]
    seed = torch.tensor([99], dtype=torch.int64)
    got = triton_attention.forward(q.detach(), k.detach(), v.detach(), scale=0.3, is_causal=True, attn_mask=mask,
                                   dropout_p=0.1, seed=seed, checks=triton_attention.Checks(mode=None))
    keep = triton_dropout.keep_mask(99, (2, 4, 20, 20), 0.1, "cpu")
    k_rep, v_rep = (x.repeat_interleave(2, dim=1) for x in (k, v))
    z = (0.3 * q @ k_rep.mT).masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1) | ~mask, -math.inf)
    out = torch.softmax(z, -1) * keep / 0.9 @ v_rep
    torch.testing.assert_close(got.out_BHTD, out.detach(), rtol=1e-5, atol=1e-6)
    dout = seeded((2, 4, 20, 8), 4, torch.float32)
    want = torch.autograd.grad(out, (q, k, v), dout)
    how = Replay(out_BHTD=got.out_BHTD, lse_BHT=got.lse_BHT, attn_mask=mask, is_causal=True, scale=0.3,
                 dropout_p=0.1, seed=seed)
    for g, w in zip(replay_backward(q.detach(), k.detach(), v.detach(), got.out_BHTD, got.lse_BHT, dout, how), want,
                    strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    triton_grads = triton_backward.backward(q.detach(), k.detach(), v.detach(), got.out_BHTD, got.lse_BHT, dout,
                                            scale=0.3, is_causal=True, attn_mask=mask, dropout_p=0.1, seed=seed,
                                            check="off", ctx=None)
    for g, w in zip(triton_grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", THROUGH_KERNEL)
def test_with_dropout_a_fault_is_corrected_and_loss_and_gradients_are_the_fault_free_step_s(make_ctx, op) -> None:
    """Attention dropout 0.1 (GPT-2's and BERT's default), GQA, causal: the kernel draws its keep mask from the
    device generator, so the same torch seed gives the same mask; a fault's step equals the clean step."""
    x = seeded((2, 12, 16), 5, torch.float32)
    p = layer_params(16, 6, torch.float32, kv=8)
    torch.manual_seed(7)
    _, loss0, grads0, rec0, _ = run_layer(make_ctx, x, p, 2, kv_heads=1, is_causal=True, dropout_p=0.1)
    torch.manual_seed(7)
    _, loss1, grads1, rec1, _ = run_layer(make_ctx, x, p, 2, faults=[Fault(op=op, layer=0, step=0, kind="inf",
                                                                           seed=11)],
                                          kv_heads=1, is_causal=True, dropout_p=0.1)
    assert rec0.detections == []
    assert [(d.op, d.action) for d in rec1.detections] == [(op, "recomputed")]
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=0.0)
    for g1, g0 in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ protect(model)

def test_protect_reports_a_fault_in_the_kernel_at_the_step_boundary_and_the_step_is_the_unprotected_one() -> None:
    """GPT-Neo under protect(model, policy=full): its global layer and its sliding-window ("local") one on the kernel
    (the coverage says so), and a near-INF score in the local layer reported at the step boundary (guard.step), while
    the loss and every gradient are the unprotected model's."""
    model = build("gpt_neo", num_heads=2)
    plain = copy.deepcopy(model)
    want_loss = loss_of("gpt_neo", plain, batch("gpt_neo", 0))
    want_loss.backward()
    fault = Fault(op="scores", layer=1, step=0, kind="near_inf", seed=4)
    with attnchecker.protect(model, policy=attnchecker.Policy.full(), faults=FaultPlan([fault])) as guard:
        loss = loss_of("gpt_neo", model, batch("gpt_neo", 0))
        loss.backward()
        assert guard.detections == []  # not before the step boundary: the kernel's records stay on the device
        guard.step()
        dets = list(guard.detections)
        lines = guard.coverage.backend_lines()
    assert lines and all("triton (" in line for line in lines), lines
    assert [(d.op, d.layer, d.action, d.kind) for d in dets] == [("scores", 1, "recomputed", "near_inf")]
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-6, atol=0.0)
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("policy", ["full", "tier1"])
def test_a_kernel_that_fails_hands_its_calls_to_the_next_backend_and_the_step_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, policy: str) -> None:
    """A configuration the GPU's Triton cannot compile (the interpreter never compiles one) or a launch that raises:
    the failure is logged once, the call that failed runs on the next backend, the kernel is never tried again in
    this process, and the coverage says why. The step's loss and gradients are the unprotected model's, and a fault
    planned in the scores of a later step is still found and corrected on the backend that took over."""
    tried = []

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        tried.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(triton_backend, "_failed", [])
    monkeypatch.setattr(triton_attention, "forward", broken)
    model = build("gpt2", n_layer=1, n_head=2)
    plain = copy.deepcopy(model)
    want_loss = loss_of("gpt2", plain, batch("gpt2", 0))
    want_loss.backward()
    pol = attnchecker.Policy.full() if policy == "full" else attnchecker.Policy(
        adaptive=False, op_periods={"scores": 1000, "context": 1000})
    fault = Fault(op="scores", layer=0, step=1, kind="nan", seed=3)
    with caplog.at_level("ERROR", logger="attnchecker"), \
            attnchecker.protect(model, policy=pol, faults=FaultPlan([fault])) as guard:
        if policy == "tier1":
            guard.tripwire_only_this_step()
        loss = loss_of("gpt2", model, batch("gpt2", 0))
        loss.backward()
        guard.step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert guard.detections == []
        model.zero_grad(set_to_none=True)
        if policy == "tier1":
            guard.tripwire_only_this_step()
        loss_of("gpt2", model, batch("gpt2", 1)).backward()
        guard.step()
        # The call the fault is planned in takes the full path (a tier-1 step's others run SDPA's tier 1 after the
        # kernel failed there): the coverage names the backend that took it over, and why.
        lines = guard.coverage.backend_lines()
        dets = [(d.op, d.layer, d.kind) for d in guard.detections]
    assert len(tried) == 1
    assert len([r for r in caplog.records if "failed and is off" in r.message]) == 1
    assert lines and all("triton (the Triton kernel failed here once (RuntimeError" in line for line in lines), lines
    assert not any(line.startswith("layer 0: triton") for line in lines), lines
    assert dets == [("scores", 0, "nan")]
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-6, atol=0.0)
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(grads[n], q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def _dropout_step(model: torch.nn.Module, backward_faults: list[KernelFault]) -> tuple[dict[str, torch.Tensor],
                                                                                     list[Any], list[str]]:
    """One GPT-2 step with attention dropout under protect(scope="all", policy=full), the optimizer's: (gradients,
    detections, backend lines). faults: emulated inside the Triton backward's kernels."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with attnchecker.protect(model, optimizer=opt, policy=attnchecker.Policy.full(), scope="all") as guard:
        torch.manual_seed(5)  # the same keep masks in both runs
        loss = loss_of("gpt2", model, batch("gpt2", 0))
        with triton_backward.emulated_faults(backward_faults):
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()  # the step boundary: the optimizer's pre-step hook drains the deferred records
        return grads, list(guard.detections), guard.coverage.backend_lines()


def test_under_scope_all_a_dropout_call_s_backward_is_the_checked_triton_backward() -> None:
    """protect(scope="all"): the Triton forward's backward (attention dropout 0.1) is the Triton backward with its own
    checks, the forward's keep mask regenerated from its seed: a fault inside it (an INF in dV) is reported at the
    step boundary and the gradients are the clean twin's."""
    model = build("gpt2", n_layer=1, n_head=2, attn_pdrop=0.1)
    clean, clean_dets, lines = _dropout_step(copy.deepcopy(model), [])
    assert clean_dets == [] and lines and "triton (" in lines[0], lines
    grads, dets, _ = _dropout_step(model, [KernelFault(op="grad_v", n=1, row=5, col=3, kind="value", value=math.inf)])
    assert [(d.op, d.action, d.tier) for d in dets] == [("grad_v", "recomputed", "abft")]
    for n, g in grads.items():
        torch.testing.assert_close(g, clean[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_a_backward_kernel_that_fails_leaves_the_step_s_gradients(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The Triton backward runs inside autograd: where it fails (a configuration this Triton cannot compile, a launch
    that raises) the failure is logged once, that call's gradients come from the PyTorch replay of the forward's
    keep mask, the kernels are not tried again, and the gradients are the ones the Triton backward gives."""
    model = build("gpt2", n_layer=1, n_head=2, attn_pdrop=0.1)
    want, _, _ = _dropout_step(copy.deepcopy(model), [])
    tried = []

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        tried.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(triton_backward, "_failed", [])
    monkeypatch.setattr(triton_backward.kernels, "run", broken)
    with caplog.at_level("ERROR", logger="attnchecker"):
        grads, dets, _ = _dropout_step(model, [])
        again, _, _ = _dropout_step(copy.deepcopy(model), [])
    assert len(tried) == 1 and dets == []
    assert len([r for r in caplog.records if "backward failed and is off" in r.message]) == 1
    assert triton_backward.not_supported_reasons(*(torch.zeros(1, 1, 4, 4),) * 3, None)[0].startswith(
        "the Triton backward failed here once (RuntimeError")
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(again[n], want[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


# ------------------------------------------------------------------------------ launches and syncs per forward


class TorchCalls(TorchFunctionMode):
    """The torch calls attnchecker's own code makes, by name (not the interpreter's: it copies tensors to run kernels
    on numpy, which a GPU launch does not do). A TorchFunctionMode: the backend's check for a dispatch mode, which
    would send the call elsewhere, does not see it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("attnchecker"):
            self.names[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


DEVICE_WORK = ("zeros", "randint", "isfinite", "where", "bucketize", "index_add_", "double", "sum", "add_", "maximum",
               "to", "float", "linalg_vector_norm", "vector_norm", "nan_to_num_", "cummax", "norm", "amax",
               "contiguous", "reshape")
"""The torch calls that may launch device work (the rest are views, shapes, allocations and host bookkeeping)."""


def _one_forward(make_ctx: Callable[..., Any], t: int, tier1: bool, dropout_p: float = 0.0,
                 launches: collections.Counter[str] | None = None) -> tuple[TorchCalls, Any]:
    """One protected causal call (B·H = 2, D = 16) after a first one (which makes the histogram's tensors): the torch
    calls our code made in it, and the recorder. launches: cleared before the counted call."""
    config = {"checked_ops": frozenset({"q", "k", "v", "out"})} if tier1 else {}
    ctx, rec = make_ctx(**config)
    q, k, v = (seeded((1, 2, t, 16), i, torch.float32) for i in range(3))
    with torch.no_grad():
        protected_sdpa(q, k, v, ctx=ctx, is_causal=True, dropout_p=dropout_p)
        if launches is not None:
            launches.clear()
        with TorchCalls() as calls:
            protected_sdpa(q, k, v, ctx=ctx, is_causal=True, dropout_p=dropout_p)
    return calls, rec


@pytest.mark.parametrize("tier1", [False, True], ids=["full_check", "tier1"])
def test_a_protected_forward_is_a_few_launches_whatever_t(make_ctx, triton_launches, tier1: bool) -> None:
    """The kernel and its repair (2 Triton launches), the call's status a slice of the guard's zeroed arena (its
    memset made by the first call: checks/zeroed.py): the same at T = 32 and T = 64 (2 × 2 and 4 × 4 tiles), against
    thousands for the PyTorch tile loop. The full checks add one launch that
    makes what their row checks take from each key and value tile alone (_kv_tiles). Tier 1 runs the vendor's
    attention (the op the unprotected model runs), then in place of the kernel one pass over its output and
    log-sum-exp (_trip_given) and the repair, with the running max of the key norms (a norm, its NaNs zeroed, a
    cumulative max: once per call) and, on the CPU, the log-sum-exp made contiguous (the CPU kernel's is (B, T, H) in
    memory; FlashAttention's on CUDA is already contiguous). The residual histogram's update waits for the step
    boundary with the rest of the call's record (checks/deferred.py)."""
    counts = []
    for t in (32, 64):
        calls, _ = _one_forward(make_ctx, t, tier1, launches=triton_launches)
        device_ops = {name: n for name, n in calls.names.items() if name in DEVICE_WORK}
        counts.append((dict(triton_launches), device_ops))
    assert counts[0] == counts[1], counts
    key_norms = {"linalg_vector_norm": 1, "nan_to_num_": 1, "cummax": 1, "contiguous": 1} if tier1 else {}
    kernels = {"_trip_given": 1, "_attention": 1} if tier1 else {"_kv_tiles": 1, "_attention": 2}
    assert counts[0] == (kernels, key_norms), counts


@pytest.mark.parametrize(("tier1", "dropout_p"), [(False, 0.0), (True, 0.0), (False, 0.1)],
                         ids=["full_check", "tier1", "dropout"])
def test_the_backend_makes_no_host_sync(make_ctx, tier1: bool, dropout_p: float) -> None:
    config = {"checked_ops": frozenset({"q", "k", "v", "out"})} if tier1 else {}
    ctx, rec = make_ctx(**config)
    q, k, v = (seeded((1, 2, 32, 16), i, torch.float32) for i in range(3))
    with torch.no_grad(), SyncCounter() as syncs:
        protected_sdpa(q, k, v, ctx=ctx, is_causal=True, dropout_p=dropout_p)
    assert syncs.calls == []
    assert rec.detections == []


def test_the_sync_counter_sees_a_sync(make_ctx) -> None:
    """The counter is not blind: reading the detections (the step boundary) syncs, once."""
    _, rec = _one_forward(make_ctx, 32, False)
    with SyncCounter() as boundary:
        assert rec.detections == []
    assert boundary.calls == ["tolist"]
