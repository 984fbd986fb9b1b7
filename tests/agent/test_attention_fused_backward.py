"""protected_sdpa's performance paths keep its numerics: the fused CPU backward (_VerifiedAttention) gives the gradients
of the unfused graph, and a call with nothing to check or inject is plain SDPA (docs/abft.md, performance)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_attention_layer import tiled

from attnchecker.attention.backends.unfused import _probs
from attnchecker.attention.pipeline import protected_sdpa

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 5e-2, "atol": 5e-2}}


def reference(q, k, v, *, attn_mask=None, is_causal=False, scale):
    """Autograd through the unfused math the engine checks: softmax(scale·QKᵀ + mask)·V, dead rows 0."""
    h, hk = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(h // hk, dim=1) for x in (k, v))
    probs, _ = _probs(q @ k.mT, scale=scale, attn_mask=attn_mask, is_causal=is_causal, dropout_p=0.0, keep_BHTS=None)
    return probs @ v


def qkv(dtype, *, heads=4, kv_heads=4, t=13, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, heads, t, d), (2, kv_heads, t, d), (2, kv_heads, t, d))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def grads(fn, q, k, v, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kw)
    g = torch.Generator().manual_seed(9)
    # A non-contiguous upstream gradient, as after transformers' transpose(1, 2).
    grad = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3], generator=g).to(out.dtype)
    out.backward(grad.transpose(1, 2))
    return out, q.grad, k.grad, v.grad


def masks(kind: str) -> dict:
    g = torch.Generator().manual_seed(3)
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool":
        return {"attn_mask": torch.rand(2, 1, 13, 13, generator=g) > 0.3}
    if kind == "dead_rows":
        m = torch.rand(2, 1, 13, 13, generator=g) > 0.3
        m[:, :, 4] = False
        return {"attn_mask": m}
    if kind == "additive":
        return {"attn_mask": torch.randn(2, 1, 13, 13, generator=g)}
    if kind == "causal_and_bool":
        # The diagonal stays allowed: a row the two masks empty together is NaN in the unfused math too.
        m = torch.rand(13, 13, generator=g) > 0.2
        return {"is_causal": True, "attn_mask": m.fill_diagonal_(True)}
    return {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "dead_rows", "additive", "causal_and_bool"])
def test_fused_backward_matches_the_unfused_graph(make_ctx, dtype, kind) -> None:
    ctx, rec = make_ctx()
    q, k, v = qkv(dtype)
    kw = masks(kind)
    scale = 1 / math.sqrt(q.shape[-1])
    got = grads(lambda *a, **x: protected_sdpa(*a, ctx=ctx, scale=scale, **x), q, k, v, **kw)
    want = grads(lambda *a, **x: reference(*a, scale=scale, **x), q, k, v, **kw)
    assert got[0].grad_fn is not None and type(got[0].grad_fn).__name__ == "_VerifiedAttentionBackward"
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert ctx.runtime.stats.checks["scores"] == 1 and not rec.detections


@pytest.mark.parametrize("kind", ["none", "causal", "dead_rows", "additive"])
def test_fp64_inputs_with_grad_give_the_unprotected_loss_and_gradients(make_ctx, kind) -> None:
    """fp64 end to end: the fused backward takes the log-sum-exp in the inputs' dtype (an fp32 one is refused), and
    a softmax in fp32 would cost fp64 its precision."""
    ctx, rec = make_ctx()
    q, k, v = qkv(torch.float64)
    kw = masks(kind)
    if "attn_mask" in kw:
        kw["attn_mask"] = kw["attn_mask"].to(torch.float64) if kw["attn_mask"].is_floating_point() else kw["attn_mask"]
    got = grads(lambda *a, **x: protected_sdpa(*a, ctx=ctx, **x), q, k, v, **kw)
    want = grads(lambda *a, **x: reference(*a, scale=1 / math.sqrt(q.shape[-1]), **x), q, k, v, **kw)
    if kind != "dead_rows":  # SDPA's math path gives NaN on a dead row; the reference (and the engine) give 0
        sdpa = grads(F.scaled_dot_product_attention, q, k, v, **kw)
        for a, b in zip(want, sdpa, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert type(got[0].grad_fn).__name__ == "_VerifiedAttentionBackward"
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert ctx.runtime.stats.checks["scores"] == 1 and not rec.detections


def test_fused_backward_with_grouped_query_heads(make_ctx) -> None:
    ctx, _ = make_ctx()
    q, k, v = qkv(torch.float32, heads=4, kv_heads=2)
    got = grads(lambda *a: protected_sdpa(*a, ctx=ctx, is_causal=True, enable_gqa=True), q, k, v)
    want = grads(lambda *a: reference(*a, is_causal=True, scale=1 / math.sqrt(8)), q, k, v)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_dropout_keeps_the_unfused_graph(make_ctx) -> None:
    # The fused backward cannot replay our dropout mask: autograd goes through the unfused ops.
    ctx, _ = make_ctx()
    q, k, v = qkv(torch.float32)
    out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True, dropout_p=0.5)
    assert type(out.grad_fn).__name__ != "_VerifiedAttentionBackward"


def test_nothing_due_and_nothing_injected_runs_plain_sdpa(make_ctx) -> None:
    ctx, _ = make_ctx(checked_ops=frozenset({"q", "k", "v", "out"}))
    q, k, v = qkv(torch.float32)
    got = grads(lambda *a: protected_sdpa(*a, ctx=ctx, is_causal=True), q, k, v)
    want = grads(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True), q, k, v)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ctx.runtime.stats.checks["scores"] == 0


@pytest.mark.parametrize(("op", "kind", "pattern"), [("scores", "inf", "0d"), ("scores", "nan", "1d"),
                                                   ("context", "nan", "0d"), ("context", "near_inf", "1d")])
def test_a_fault_corrected_in_the_forward_leaves_clean_gradients(make_ctx, op, kind, pattern) -> None:
    from attnchecker.inject import Fault

    q, k, v = qkv(torch.float32)
    clean_ctx, _ = make_ctx()
    faulty_ctx, rec = make_ctx([Fault(op=op, layer=0, step=0, kind=kind, pattern=pattern, seed=4)])
    clean = grads(lambda *a: protected_sdpa(*a, ctx=clean_ctx, is_causal=True), q, k, v)
    fixed = grads(lambda *a: protected_sdpa(*a, ctx=faulty_ctx, is_causal=True), q, k, v)
    # One detection; on the tiled path a row fault is one per tile it crosses.
    assert len(rec.detections) == 1 or tiled()
    assert all(d.op == op and d.action in ("corrected", "recomputed") for d in rec.detections)
    for a, b in zip(fixed, clean, strict=True):
        torch.testing.assert_close(a, b)
