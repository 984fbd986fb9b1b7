"""The checked attention backward (protect(scope="all")) in fp16 at the overflow edge: where the unscaled logits QKᵀ
pass fp16's 65504 but the scaled ones and SDPA's gradients are finite, the recomputed scores must not overflow into a
false "uncorrectable" INF (found by bench/clean_campaign.py: fp16 BERT with massive activations; the forward has
the same guard, attention.backends.unfused._scores_product)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from test_attention_fp16_overflow import edge_qkv

from attnchecker.attention.backward.checked import checked_backward


def test_checked_backward_past_the_fp16_edge_is_finite_and_reports_nothing(make_ctx) -> None:
    q, k, v = edge_qkv(3e5)  # unscaled |q·k| ~3e5 (INF in fp16), scaled by 1/8: ~3.7e4
    assert not torch.isfinite(q @ k.mT).all()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    want = torch.autograd.grad(out, (q, k, v), grad_out)
    assert all(torch.isfinite(w).all() for w in want)
    scale = 1 / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scale * (q.detach().float() @ k.detach().float().mT), dim=-1)
    ctx, rec = make_ctx()
    *got, flagged = checked_backward(ctx, grad_out, q.detach(), k.detach(), v.detach(), out.detach(), lse, None,
                                     scale=scale, is_causal=False)
    assert not rec.detections and flagged == 0, rec.detections[:1]
    # Against float64 gradients, to fp16 SDPA's own accuracy (the two fp16 backwards round dS differently). Not fp32:
    # these rows are one-hot (AP's other entries underflow), so dQ and dK are 0 but for round-off, and an fp32
    # kernel's round-off (dS = AP ⊙ (dP - δ) with δ from the rounded output) reached 1e-4 on one CPU, more than
    # fp16 SDPA's own error, which made this reference wrong, not the checked backward (whose δ = rowsum(AP ⊙ dP)
    # gives the 0).
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    exact = torch.autograd.grad(F.scaled_dot_product_attention(q64, k64, v64), (q64, k64, v64), grad_out.double())
    for g, w, e in zip(got, want, exact, strict=True):
        assert torch.isfinite(g).all()
        sdpa_err = (w.double() - e).abs().max()
        assert (g.double() - e).abs().max() <= 2 * sdpa_err + 1e-3 * e.abs().max()
