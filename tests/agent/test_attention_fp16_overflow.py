"""fp16 at the overflow edge: where the unscaled logits QKᵀ pass fp16's 65504 but PyTorch's attention stays finite,
the protected attention stays finite too, reports nothing on clean data, and still corrects a fault injected below
autograd into its scores product."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gemm_faults import GemmFault, GemmFaults
from hypothesis import given
from hypothesis import strategies as st

from attnchecker.attention.pipeline import protected_sdpa

FP16_MAX = 65504.0


def edge_qkv(max_logit: float, *, b=2, h=2, t=9, s=11, d=64, seed=0):
    """fp16 q, k, v whose largest unscaled logit |q·k| is about ``max_logit`` (one aligned pair per row)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(b, h, 1, d, generator=g), dim=-1)
    q = torch.randn(b, h, t, d, generator=g) * 0.1 + u * math.sqrt(max_logit)
    k = torch.randn(b, h, s, d, generator=g) * 0.1
    k[:, :, s // 2] += u[:, :, 0] * math.sqrt(max_logit)
    v = torch.randn(b, h, s, d, generator=g)
    return q.half(), k.half(), v.half()


@pytest.mark.parametrize("tolerance", ["roundoff", "extreme"])
def test_unscaled_logits_above_fp16_max_stay_finite(make_ctx, tolerance) -> None:
    q, k, v = edge_qkv(3e5)  # scaled by 1/8: ~3.7e4, inside fp16
    assert not torch.isfinite(q @ k.mT).all()  # an fp16 QKᵀ overflows here
    want = F.scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(want).all()
    ctx, rec = make_ctx(tolerance=tolerance)
    got = protected_sdpa(q, k, v, ctx=ctx)
    assert torch.isfinite(got).all()
    assert not rec.detections
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@given(
    max_logit=st.floats(1e3, 4e6),
    d=st.sampled_from([16, 64, 128]),
    t=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_property_finite_wherever_sdpa_is(make_ctx, max_logit, d, t, seed) -> None:
    """The round-off tolerance (the default). The paper's absolute threshold (extreme, E = 1) flags fp32 round-off
    itself once logits reach ~1e6, fp16 or not: it is tested at the edge above, not across this range."""
    q, k, v = edge_qkv(max_logit, d=d, t=t, seed=seed)
    want = F.scaled_dot_product_attention(q, k, v)
    ctx, rec = make_ctx(tolerance="roundoff")
    got = protected_sdpa(q, k, v, ctx=ctx)
    if torch.isfinite(want).all():
        assert torch.isfinite(got).all()
        assert not rec.detections, rec.detections[:1]
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e30])
def test_fault_at_the_edge_is_corrected(make_ctx, value) -> None:
    q, k, v = edge_qkv(2e5)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v)
    (wq,) = torch.autograd.grad(want.float().square().sum(), q)
    ctx, rec = make_ctx(tolerance="roundoff")
    # The protected scores product is (B*H, T, S) in fp32; the injector picks it by shape alone.
    with GemmFaults([GemmFault((4, 9, 11), value, index=3 * 11 + 5)]) as mode:
        got = protected_sdpa(q, k, v, ctx=ctx)
    assert mode.hits
    assert torch.isfinite(got).all()
    assert [d.action for d in rec.detections]
    assert all(d.action != "uncorrectable" for d in rec.detections)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    (gq,) = torch.autograd.grad(got.float().square().sum(), q)
    torch.testing.assert_close(gq, wq, rtol=2e-2, atol=2e-2)


def test_fp16_gpt2_layer_past_the_edge_matches_sdpa_finiteness() -> None:
    """An unmodified transformers GPT-2 in fp16 whose first layer's q and k align along one direction: unscaled logits
    ~1.9e5 (past 65504), scaled ones inside fp16. SDPA is finite; so is the protected model, with nothing reported."""
    from model_zoo import batch, build

    import attnchecker

    model = build("gpt2").half().eval()
    width = 64
    with torch.no_grad():
        weight = model.transformer.h[0].attn.c_attn.weight  # Conv1D: (in, 3 * width), columns q | k | v
        u = torch.nn.functional.normalize(torch.randn(width, generator=torch.Generator().manual_seed(0)), dim=0)
        weight[:, : 2 * width] = (u[:, None] * u[None, :] * 400).half().repeat(1, 2)
    ids = batch("gpt2", 0)["ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert torch.isfinite(want).all()
    with attnchecker.protect(model) as guard, torch.no_grad():
        got = model(input_ids=ids).logits
        rep = guard.report()
    assert rep.checks["scores"] == 2
    assert rep.detected == 0, guard.detections[:1]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
