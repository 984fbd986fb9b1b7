"""The protected attention layer end to end: equivalence with SDPA, every op's faults corrected, gradients equal to
the fault-free step's, the recovery ladder, modes, paper-faithful checksum passing, syncs per call."""
from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.attention.pipeline import (
    check_linear,
    protected_linear,
    protected_sdpa,
    protected_self_attention,
)
from attnchecker.checks.context import OPS
from attnchecker.checks.deferred import drain
from attnchecker.inject import Fault

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXTREME_KINDS = ("inf", "neg_inf", "nan", "near_inf", "bitflip")
TOL = {  # a whole layer's output: several roundings of two GEMMs, softmax and two projections
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def tiled() -> bool:
    """This module's tests also run on the backends that compute in tiles: the PyTorch tile loop and the Triton kernel
    (test_attention_tiled.py and test_attention_triton.py re-run them with one forced)."""
    return os.environ.get("ATTNCHECKER_ATTENTION") in ("tiled", "triton")


def fixed(op: str) -> str:
    """The action for a repaired transient fault: corrected in place on the unfused path; on a tiled backend a scores
    or context tile is recomputed (it was folded into the output before anything learns of the fault)."""
    return "recomputed" if tiled() and op in ("scores", "context") else "corrected"


def seeded(shape: tuple[int, ...], seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def layer_params(c: int, seed: int, dtype: torch.dtype, *, bias: bool = True, kv: int | None = None) -> dict[str, Any]:
    kv = kv or c
    shapes = {"w_q": (c, c), "w_k": (kv, c), "w_v": (kv, c), "w_o": (c, c)}
    params: dict[str, Any] = {n: seeded(s, seed + i, dtype, 1 / math.sqrt(c)).requires_grad_() for i, (n, s) in
                              enumerate(shapes.items())}
    for i, (n, s) in enumerate(shapes.items()):
        params["b" + n[1:]] = seeded(s[:1], seed + 10 + i, dtype, 0.1).requires_grad_() if bias else None
    return params


def reference_layer(x: torch.Tensor, p: dict[str, Any], heads: int, kv_heads: int, **sdpa: Any) -> torch.Tensor:
    b, t, _ = x.shape
    q = F.linear(x, p["w_q"], p["b_q"]).view(b, t, heads, -1).transpose(1, 2)
    k = F.linear(x, p["w_k"], p["b_k"]).view(b, t, kv_heads, -1).transpose(1, 2)
    v = F.linear(x, p["w_v"], p["b_v"]).view(b, t, kv_heads, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != heads, **sdpa)
    return F.linear(out.transpose(1, 2).reshape(b, t, -1), p["w_o"], p["b_o"])


def run_layer(make_ctx, x, p, heads, faults=(), kv_heads=None, **kw: Any):
    """Forward + backward of sum(out²) through the protected layer: (out, loss, grads, recorder, ctx)."""
    config = {k: kw.pop(k) for k in ("mode", "tolerance", "source_repair", "tolerance_factor") if k in kw}
    ctx, rec = make_ctx(faults=list(faults), **config)
    out = protected_self_attention(x, ctx=ctx, num_heads=heads, num_kv_heads=kv_heads, **p, **kw)
    loss = out.float().pow(2).sum()
    params = [t for t in p.values() if t is not None]
    grads = torch.autograd.grad(loss, params)
    # The step boundary: records a backend left on the device (checks/deferred.py) are emitted, stats completed.
    drain(ctx.runtime.deferred)
    return out.detach(), loss.detach(), grads, rec, ctx


# ------------------------------------------------------------------------------------------------ no faults


@settings(max_examples=30)
@given(
    b=st.integers(1, 3),
    h=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    t=st.integers(1, 19),
    s=st.integers(1, 19),
    d=st.integers(1, 13),
    dtype=st.sampled_from(DTYPES),
    mask=st.sampled_from(["none", "causal", "padding", "additive"]),
    seed=st.integers(0, 2**20),
)
def test_protected_sdpa_matches_sdpa_without_faults(make_ctx, b, h, group, t, s, d, dtype, mask, seed) -> None:
    hk = max(1, h // group)
    q = seeded((b, h, t, d), seed, dtype)
    k = seeded((b, hk, s, d), seed + 1, dtype)
    v = seeded((b, hk, s, d), seed + 2, dtype)
    kwargs: dict[str, Any] = {}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "padding":
        lengths = torch.randint(0, s + 1, (b,), generator=torch.Generator().manual_seed(seed))
        kwargs["attn_mask"] = (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    elif mask == "additive":
        kwargs["attn_mask"] = seeded((1, h, t, s), seed + 3, dtype)
    ctx, rec = make_ctx()
    out = protected_sdpa(q, k, v, ctx=ctx, enable_gqa=hk != h, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=hk != h, **kwargs)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    assert rec.detections == []
    assert ctx.runtime.stats.checks["scores"] == ctx.runtime.stats.checks["context"] == 1


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_protected_layer_matches_the_unprotected_layer(make_ctx, fused: bool, bias: bool) -> None:
    x = seeded((2, 11, 24), 1, torch.float32)
    p = layer_params(24, 2, torch.float32, bias=bias)
    expected = reference_layer(x, p, 3, 3, is_causal=True)
    ctx, rec = make_ctx()
    if fused:
        w_qkv = torch.cat([p["w_q"], p["w_k"], p["w_v"]])
        b_qkv = torch.cat([p["b_q"], p["b_k"], p["b_v"]]) if bias else None
        out = protected_self_attention(x, ctx=ctx, num_heads=3, w_qkv=w_qkv, b_qkv=b_qkv, w_o=p["w_o"], b_o=p["b_o"],
                                       is_causal=True)
    else:
        out = protected_self_attention(x, ctx=ctx, num_heads=3, is_causal=True, **p)
    torch.testing.assert_close(out, expected)
    assert rec.detections == []
    assert all(ctx.runtime.stats.checks[op] == 1 for op in OPS)


@pytest.mark.parametrize("fault", [None, "k", "scores", "out"])
def test_autocast_layer_never_flags_clean_and_corrects_faults(make_ctx, fault: str | None) -> None:
    """fp32 parameters under bf16 autocast: the GEMMs round their operands, the checksums must not (they run with
    autocast off and the bound covers the operand rounding)."""
    x = seeded((2, 13, 32), 50, torch.float32)
    p = layer_params(32, 51, torch.float32)
    faults = [] if fault is None else [Fault(op=fault, layer=0, step=0, kind="nan", seed=5)]
    ctx, rec = make_ctx(faults=faults)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = protected_self_attention(x, ctx=ctx, num_heads=4, is_causal=True, **p)
        expected = reference_layer(x, p, 4, 4, is_causal=True)
    assert [(d.op, d.action) for d in rec.detections] == ([] if fault is None else [(fault, fixed(fault))])
    torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])


# ---------------------------------------------------------------------------------------------- corrections


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", EXTREME_KINDS)
def test_single_extreme_error_in_any_op_is_corrected(make_ctx, op: str, kind: str, dtype: torch.dtype) -> None:
    x = seeded((2, 9, 16), 3, dtype)
    p = layer_params(16, 4, dtype)
    clean = run_layer(make_ctx, x, p, 2, is_causal=True)[0]
    # A seed whose scores fault lies on or below the diagonal: the tiled path never computes a causally masked score,
    # so a fault drawn there is not injected at all on it.
    fault = Fault(op=op, layer=0, step=0, kind=kind, seed=20)
    out, _, _, rec, ctx = run_layer(make_ctx, x, p, 2, faults=[fault], is_causal=True)
    truth = ctx.runtime.injector.injected
    assert len(truth) == 1
    assert [(d.op, d.pattern, d.action) for d in rec.detections] == [(op, "0d", fixed(op))]
    det = rec.detections[0]
    assert (det.batch, det.row, det.col) == (truth[0].batch, truth[0].rows[0], truth[0].cols[0])
    if op in ("scores", "context"):
        assert det.head == truth[0].head
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, **TOL[dtype])


@settings(max_examples=40)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    t=st.integers(1, 13),
    head_dim=st.integers(1, 7),
    dtype=st.sampled_from(DTYPES),
    mask=st.sampled_from(["none", "causal", "padding"]),
    fused=st.booleans(),
    op=st.sampled_from(OPS),
    kind=st.sampled_from(EXTREME_KINDS),
    seed=st.integers(0, 2**20),
)
def test_any_single_extreme_error_leaves_the_layer_output_fault_free(
    make_ctx, b, h, t, head_dim, dtype, mask, fused, op, kind, seed
) -> None:
    c = h * head_dim
    x = seeded((b, t, c), seed, dtype)
    p = layer_params(c, seed + 1, dtype)
    kw: dict[str, Any] = {"is_causal": mask == "causal"}
    if mask == "padding":
        lengths = torch.randint(0, t + 1, (b,), generator=torch.Generator().manual_seed(seed))
        kw["attn_mask"] = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
    if fused:
        p = {"w_qkv": torch.cat([p["w_q"], p["w_k"], p["w_v"]]), "b_qkv": torch.cat([p["b_q"], p["b_k"], p["b_v"]]),
             "w_o": p["w_o"], "b_o": p["b_o"]}
    clean = run_layer(make_ctx, x, p, h, **kw)[0]
    out, _, _, rec, ctx = run_layer(make_ctx, x, p, h, faults=[Fault(op=op, layer=0, step=0, kind=kind, seed=seed)],
                                    **kw)
    injected = ctx.runtime.injector.injected
    if not injected:
        # Tiled and causal: the fault fell in a tile above the diagonal, which is never computed.
        assert tiled() and op == "scores" and mask == "causal" and rec.detections == []
    elif not math.isfinite(injected[0].value) or abs(injected[0].value) > 1e10:
        assert [(d.op, d.action) for d in rec.detections] == [(op, fixed(op))]
    assert all(d.action == fixed(d.op) for d in rec.detections)
    torch.testing.assert_close(out, clean, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["nan", "near_inf", "add"])
def test_loss_and_every_gradient_equal_the_fault_free_step(make_ctx, op: str, kind: str, dtype: torch.dtype) -> None:
    x = seeded((2, 10, 16), 5, dtype)
    p = layer_params(16, 6, dtype)
    _, loss0, grads0, _, _ = run_layer(make_ctx, x, p, 4, is_causal=True)
    fault = Fault(op=op, layer=0, step=0, kind=kind, value=3.0 if kind == "add" else None, seed=23)
    _, loss1, grads1, rec, _ = run_layer(make_ctx, x, p, 4, faults=[fault], is_causal=True)
    assert [d.action for d in rec.detections] == [fixed(op)]
    # The loss is an fp32 sum of the layer's output: compare it at the layer dtype's tolerance (torch's defaults).
    loss_tol = {torch.float32: {}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5}}[dtype]
    torch.testing.assert_close(loss1, loss0, **loss_tol)
    for g1, g0 in zip(grads1, grads0):
        torch.testing.assert_close(g1, g0)


@pytest.mark.parametrize("op", ["scores", "context"])
@pytest.mark.parametrize("axis", ["row", "col"])
@pytest.mark.parametrize("kind", ["inf", "nan", "near_inf", "add"])
def test_bad_row_or_column_of_scores_and_context_is_corrected(make_ctx, op: str, axis: str, kind: str) -> None:
    x = seeded((2, 12, 16), 7, torch.float32)
    p = layer_params(16, 8, torch.float32)
    clean = run_layer(make_ctx, x, p, 2, is_causal=True)[0]
    fault = Fault(op=op, layer=0, step=0, kind=kind, pattern="1d", axis=axis, value=2.0 if kind == "add" else None,
                  seed=29)
    out, _, _, rec, ctx = run_layer(make_ctx, x, p, 2, faults=[fault], is_causal=True)
    truth = ctx.runtime.injector.injected[0]
    # A row or column crosses several tiles on the tiled path: one detection per tile it crosses. A causal tile is cut
    # at the diagonal (its masked keys are never computed), so the cut can leave one element of the row in a tile.
    assert len(rec.detections) == 1 or tiled()
    for det in rec.detections:
        line = (det.row, det.col) if det.pattern == "1d" else (det.row, None) if axis == "row" else (None, det.col)
        assert (det.op, det.action) == (op, fixed(op))
        assert det.pattern == "1d" or (tiled() and op == "scores" and det.pattern == "0d")
        assert line == ((truth.rows[0], None) if axis == "row" else (None, truth.cols[0]))
    torch.testing.assert_close(out, clean)


@pytest.mark.parametrize("op", OPS)
def test_block_fault_is_recomputed_and_ends_correct(make_ctx, op: str) -> None:
    x = seeded((2, 9, 16), 9, torch.float32)
    p = layer_params(16, 10, torch.float32)
    _, loss0, grads0, _, _ = run_layer(make_ctx, x, p, 2)
    fault = Fault(op=op, layer=0, step=0, kind="near_inf", pattern="2d", block=(3, 2), seed=31)
    _, loss1, grads1, rec, _ = run_layer(make_ctx, x, p, 2, faults=[fault])
    if tiled() and op in ("scores", "context"):
        # The block may straddle tiles: each part is its own (smaller) pattern, every one recomputed.
        assert rec.detections and all((d.op, d.action) == (op, "recomputed") for d in rec.detections)
    else:
        assert [(d.op, d.pattern, d.action) for d in rec.detections] == [(op, "2d", "recomputed")]
    torch.testing.assert_close(loss1, loss0)
    for g1, g0 in zip(grads1, grads0):
        torch.testing.assert_close(g1, g0)


@pytest.mark.parametrize("op", OPS)
def test_persistent_fault_is_reported_uncorrectable(make_ctx, op: str) -> None:
    x = seeded((1, 8, 16), 11, torch.float32)
    p = layer_params(16, 12, torch.float32)
    fault = Fault(op=op, layer=0, step=0, kind="inf", pattern="2d", persistent=True, seed=37)
    _, _, _, rec, ctx = run_layer(make_ctx, x, p, 2, faults=[fault])
    actions = [(d.op, d.action) for d in rec.detections]
    assert (op, "uncorrectable") in actions
    assert not any(a == "corrected" for _, a in actions if _ == op)
    assert [i.attempt for i in ctx.runtime.injector.injected] == [0, 1], "the recompute saw the fault again"
    assert ctx.runtime.stats.faults[(op, "inf")][2] >= 1


# -------------------------------------------------------------------------------------------------- modes


def test_detect_mode_reports_and_changes_nothing(make_ctx) -> None:
    x = seeded((1, 8, 16), 13, torch.float32)
    p = layer_params(16, 14, torch.float32)
    fault = Fault(op="context", layer=0, step=0, kind="near_inf", seed=41)
    off, *_ = run_layer(make_ctx, x, p, 2, faults=[fault], mode="off")
    detected, _, _, rec, _ = run_layer(make_ctx, x, p, 2, faults=[fault], mode="detect")
    # By op, not by position: a backend that reports at the step boundary (Triton) logs the downstream ops' first.
    first = next(d for d in rec.detections if d.op == "context")
    assert (first.action, first.kind) == ("detected", "near_inf")
    # The fault travels on unrepaired: an op fed the 1e20 may report it again, never "correct" anything.
    assert {d.action for d in rec.detections} == {"detected"}
    torch.testing.assert_close(detected, off)


def test_off_mode_injects_and_checks_nothing(make_ctx) -> None:
    """Mode "off": the planned NaN is written into q and nothing is checked, so the output is wrong. (Not
    necessarily NaN: with nothing due the call is SDPA's fused kernel, and the CPU's flash kernel turns this NaN in q
    into finite values.)"""
    x = seeded((1, 8, 16), 15, torch.float32)
    p = layer_params(16, 16, torch.float32)
    clean = run_layer(make_ctx, x, p, 2, mode="off")[0]
    out, _, _, rec, ctx = run_layer(make_ctx, x, p, 2, faults=[Fault(op="q", layer=0, step=0, kind="nan")],
                                    mode="off")
    assert rec.detections == [] and sum(ctx.runtime.stats.checks.values()) == 0
    assert [(i.op, i.kind) for i in ctx.runtime.injector.injected] == [("q", "nan")]
    assert not torch.equal(out, clean)


def test_extreme_mode_corrects_extreme_errors_and_ignores_small_ones(make_ctx) -> None:
    x = seeded((2, 8, 16), 26, torch.float32)
    p = layer_params(16, 27, torch.float32)
    clean = run_layer(make_ctx, x, p, 2)[0]
    extreme = Fault(op="scores", layer=0, step=0, kind="inf", seed=1)
    out, _, _, rec, _ = run_layer(make_ctx, x, p, 2, faults=[extreme], tolerance="extreme")
    assert [(d.op, d.kind, d.action) for d in rec.detections] == [("scores", "inf", fixed("scores"))]
    torch.testing.assert_close(out, clean)
    small = Fault(op="context", layer=0, step=0, kind="add", value=0.5, seed=2)
    out, _, _, rec, _ = run_layer(make_ctx, x, p, 2, faults=[small], tolerance="extreme")
    assert rec.detections == [] and not torch.allclose(out, clean)  # below E = 1: missed by design


def test_paper_mode_corrects_the_output_but_not_the_gradients(make_ctx) -> None:
    """Paper-faithful checksum passing repairs AS but leaves the faulty Q in what autograd saved: the loss is right,
    the gradients are not. Source repair (the default) makes them equal."""
    x = seeded((2, 10, 16), 17, torch.float32)
    p = layer_params(16, 18, torch.float32)
    _, loss0, grads0, _, _ = run_layer(make_ctx, x, p, 2)
    fault = Fault(op="q", layer=0, step=0, kind="add", value=4.0, seed=43)
    _, loss_p, grads_p, rec_p, _ = run_layer(make_ctx, x, p, 2, faults=[fault], source_repair=False)
    assert [(d.op, d.action) for d in rec_p.detections] == [("scores", "corrected")]
    torch.testing.assert_close(loss_p, loss0)
    assert any(not torch.allclose(g1, g0, rtol=1e-4, atol=1e-4) for g1, g0 in zip(grads_p, grads0))
    _, loss_s, grads_s, rec_s, _ = run_layer(make_ctx, x, p, 2, faults=[fault], source_repair=True)
    assert [(d.op, d.action) for d in rec_s.detections] == [("q", "corrected")]
    torch.testing.assert_close(loss_s, loss0)
    for g1, g0 in zip(grads_s, grads0):
        torch.testing.assert_close(g1, g0)


@pytest.mark.parametrize("op", ["q", "k", "v"])
@pytest.mark.parametrize("kind", ["inf", "nan", "near_inf", "add"])
def test_paper_mode_corrects_qkv_faults_downstream(make_ctx, op: str, kind: str) -> None:
    x = seeded((2, 9, 16), 19, torch.float32)
    p = layer_params(16, 20, torch.float32)
    clean = run_layer(make_ctx, x, p, 2, is_causal=True)[0]
    fault = Fault(op=op, layer=0, step=0, kind=kind, value=3.0 if kind == "add" else None, seed=47)
    out, _, _, rec, ctx = run_layer(make_ctx, x, p, 2, faults=[fault], is_causal=True, source_repair=False)
    downstream = "context" if op == "v" else "scores"
    assert {d.op for d in rec.detections} == {downstream}
    assert all(d.action == "corrected" for d in rec.detections)
    assert not ctx.passed, "attention consumed the passed checksums"
    torch.testing.assert_close(out, clean, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- projections API


def test_fused_conv1d_projection_checks_each_slice_as_its_own_op(make_ctx) -> None:
    """GPT-2's c_attn: Conv1D weight (in, out), one fused output split into q, k, v."""
    x = seeded((2, 7, 12), 21, torch.float32)
    w_IO = seeded((12, 36), 22, torch.float32, 0.3)
    bias = seeded((36,), 23, torch.float32, 0.1)
    splits = (("q", 12), ("k", 12), ("v", 12))
    faults = [Fault(op="k", layer=0, step=0, kind="nan", seed=53), Fault(op="v", layer=0, step=0, kind="inf", seed=59)]
    ctx, rec = make_ctx(faults=faults)
    y = protected_linear(x, w_IO, bias, ctx=ctx, splits=splits, weight_layout="in_out")
    torch.testing.assert_close(y, x @ w_IO + bias)
    assert sorted((d.op, d.action) for d in rec.detections) == [("k", "corrected"), ("v", "corrected")]
    truth = {i.op: i for i in ctx.runtime.injector.injected}
    for det in rec.detections:
        assert (det.batch, det.row, det.col) == (truth[det.op].batch, truth[det.op].rows[0], truth[det.op].cols[0])
    assert [ctx.runtime.stats.checks[op] for op in ("q", "k", "v")] == [1, 1, 1]


def test_check_linear_on_a_hooked_output_keeps_autograd_fault_free(make_ctx) -> None:
    lin = torch.nn.Linear(10, 6)
    x = seeded((3, 5, 10), 24, torch.float32)
    ctx, rec = make_ctx(faults=[Fault(op="out", layer=0, step=0, kind="near_inf", seed=61)])
    handle = lin.register_forward_hook(lambda m, args, y: check_linear(args[0], y, m.weight, m.bias, ctx=ctx, op="out"))
    y = lin(x)
    handle.remove()
    (y.sum()).backward()
    g_faulty = lin.weight.grad.clone()
    lin.weight.grad = None
    lin(x).sum().backward()
    assert [d.action for d in rec.detections] == ["corrected"]
    torch.testing.assert_close(g_faulty, lin.weight.grad)


def test_dropout_recompute_reuses_the_mask(make_ctx) -> None:
    q, k, v = (seeded((2, 2, 9, 8), 25 + i, torch.float32) for i in range(3))
    ctx0, _ = make_ctx()
    torch.manual_seed(0)
    clean = protected_sdpa(q, k, v, ctx=ctx0, dropout_p=0.3)
    ctx1, rec = make_ctx(faults=[Fault(op="scores", layer=0, step=0, kind="inf", pattern="2d", seed=67)])
    torch.manual_seed(0)
    out = protected_sdpa(q, k, v, ctx=ctx1, dropout_p=0.3)
    assert [d.action for d in rec.detections] == ["recomputed"]
    torch.testing.assert_close(out, clean)


def test_every_detection_carries_the_wire_fields(make_ctx) -> None:
    q, k, v = (seeded((2, 3, 7, 8), 30 + i, torch.float32) for i in range(3))
    ctx, rec = make_ctx(faults=[Fault(op="context", layer=0, step=0, kind="nan", batch=1, head=2, row=4, col=5)],
                        layer=0, step=0)
    protected_sdpa(q, k, v, ctx=ctx)
    wire = rec.detections[0].to_wire()
    assert wire["location"] == {"batch": 1, "head": 2, "row": 4, "col": 5}
    assert (wire["op"], wire["kind"], wire["pattern"], wire["value"], wire["residual"]) == (
        "context", "nan", "0d", "nan", None)
    assert wire["bound"] > 0
    assert ctx.runtime.stats.faults[("context", "nan")] == [1, 1, 0]


# ----------------------------------------------------------------------------------------------- fast path


class SyncCounter(TorchDispatchMode):
    """Counts the dispatches that force a device-to-host sync (on an accelerator: .item(), bool(), nonzero…)."""

    SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_at_most_one_sync_per_protected_call(make_ctx) -> None:
    x = seeded((2, 9, 16), 40, torch.float32)
    p = layer_params(16, 41, torch.float32)
    w_qkv = torch.cat([p["w_q"], p["w_k"], p["w_v"]])
    b_qkv = torch.cat([p["b_q"], p["b_k"], p["b_v"]])
    for source_repair in (True, False):
        ctx, _ = make_ctx(source_repair=source_repair)
        with torch.no_grad():
            qkv = protected_linear(x, w_qkv, b_qkv, ctx=ctx, splits=(("q", 16), ("k", 16), ("v", 16)))  # warm caches
            with SyncCounter() as counter:
                qkv = protected_linear(x, w_qkv, b_qkv, ctx=ctx, splits=(("q", 16), ("k", 16), ("v", 16)))
            assert counter.count <= 1
            q, k, v = (t.view(2, 9, 2, 8).transpose(1, 2) for t in qkv.split(16, dim=-1))
            with SyncCounter() as counter:
                out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True, attn_mask=torch.ones(9, 9, dtype=torch.bool))
            assert counter.count <= 1
            with SyncCounter() as counter:
                protected_linear(out.transpose(1, 2).reshape(2, 9, 16), p["w_o"], p["b_o"], ctx=ctx, op="out")
            assert counter.count <= 1
    # The counter does see syncs: the slow path after a fault takes several.
    ctx, _ = make_ctx(faults=[Fault(op="scores", layer=0, step=0, kind="inf")])
    with torch.no_grad(), SyncCounter() as counter:
        protected_sdpa(q, k, v, ctx=ctx)
    assert counter.count > 1


def test_stats_count_checks_and_bucketize_residuals_on_device(make_ctx) -> None:
    x = seeded((2, 9, 16), 42, torch.float32)
    p = layer_params(16, 43, torch.float32)
    _, _, _, _, ctx = run_layer(make_ctx, x, p, 2)
    stats = ctx.runtime.stats
    assert all(stats.checks[op] == 1 for op in OPS)
    assert all(stats.check_seconds[op] > 0 for op in OPS)
    assert int(stats.residual_counts.sum()) == int(stats.residual_count) == len(OPS)
    assert float(stats.residual_sum) / len(OPS) <= 1.0
    assert int(stats.residual_counts[-1]) == 0, "clean ratios are never above the largest bucket"
