"""Every input the original attention call differentiates through keeps its gradient under protection: a learned
relative bias passed as SDPA's attn_mask (T5/Swin/ALiBi style), a float mask with grad to nn.MultiheadAttention.
Gradients equal the unprotected model's to <= 1e-5 relative (fp32, GRAD_RTOL), with no fault and with a fault
injected below autograd (gemm_faults) and corrected."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gemm_faults import GemmFault, GemmFaults
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import attnchecker
from attnchecker.attention.pipeline import protected_sdpa

B, T, C, H = 2, 12, 32, 4


# The protected path computes attention with its own GEMMs and softmax, not the unprotected kernel, so gradients
# agree to fp32 round-off accumulated through the backward: measured up to 1.01e-6 of the largest element (T5's
# layer-norm weight on an AVX-512 CPU, about 8 ulp). A wrong correction or a lost gradient is O(1), far above this.
GRAD_RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


class BiasAttention(nn.Module):
    """A learned (H, T, T) relative bias handed to F.scaled_dot_product_attention as its additive mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.rel_bias = nn.Parameter(torch.randn(H, T, T) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel_bias[:, :t, :t])
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MHAWithLearnedMask(nn.Module):
    """nn.MultiheadAttention given a float (T, T) mask that is a parameter."""

    need_weights = False

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(C, H, batch_first=True)
        self.mask = nn.Parameter(torch.randn(T, T) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.mha(x, x, x, attn_mask=self.mask, need_weights=self.need_weights)
        # With need_weights the averaged weights join the loss: their gradient reaches the mask too.
        return out if weights is None else out + weights.mean()


class MHAWithLearnedMaskAndWeights(MHAWithLearnedMask):
    need_weights = True


def _loss_and_grads(model: nn.Module, x: torch.Tensor, faults: list[GemmFault] | None = None):
    model.zero_grad(set_to_none=True)
    if faults is None:
        loss = model(x).square().mean()
        hits = None
    else:
        with GemmFaults(faults) as mode:
            loss = model(x).square().mean()
        hits = mode.hits
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, hits


@pytest.mark.parametrize("cls", [BiasAttention, MHAWithLearnedMask, MHAWithLearnedMaskAndWeights])
@pytest.mark.parametrize("fault", [None, "inf", "nan", "near_inf"])
def test_learned_mask_gradient_equals_unprotected(cls, fault) -> None:
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(B, T, C)
    want_loss, want, _ = _loss_and_grads(model, x)
    assert want["rel_bias" if cls is BiasAttention else "mask"].abs().sum() > 0
    faults = None
    if fault is not None:
        value = {"inf": math.inf, "nan": math.nan, "near_inf": 3e20}[fault]
        # The scores product of the unfused attention: (B*H, T, T), chosen by shape alone.
        faults = [GemmFault((B * H, T, T), value, index=5 * T + 3)]
    with attnchecker.protect(model) as guard:
        got_loss, got, hits = _loss_and_grads(model, x, faults)
        rep = guard.report()
    assert rep.checks["scores"] == 1
    assert rep.uncorrectable == 0
    if fault is not None:
        assert hits, "the injector hit nothing"
        assert rep.detected >= 1
        assert rep.corrected >= 1
    else:
        assert rep.detected == 0
    assert rel_err(got_loss, want_loss) <= GRAD_RTOL
    assert set(got) == set(want)
    for name in want:
        assert got[name] is not None, name
        assert rel_err(got[name], want[name]) <= GRAD_RTOL, (name, rel_err(got[name], want[name]))


def test_mask_alone_requiring_grad_gets_its_gradient(make_ctx) -> None:
    """q/k/v that need no gradient (frozen projections) and a bias that does: the output is still differentiable."""
    ctx, rec = make_ctx()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, 8, generator=g) for _ in range(3))
    bias = (torch.randn(H, T, T, generator=g) * 0.5).requires_grad_()
    out = protected_sdpa(q, k, v, ctx=ctx, attn_mask=bias)
    assert out.requires_grad
    (got,) = torch.autograd.grad(out.square().sum(), bias)
    ref = bias.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=ref).square().sum(), ref)
    assert rel_err(got, want) <= GRAD_RTOL
    assert not rec.detections


@given(
    heads=st.sampled_from([1, 2, 4]),
    t=st.integers(1, 17),
    s=st.integers(1, 17),
    d=st.sampled_from([4, 8, 16]),
    bias_shape=st.sampled_from(["HTS", "TS", "BHTS", "1H1S"]),
    causal=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_property_bias_gradients_match_sdpa(make_ctx, heads, t, s, d, bias_shape, causal, dtype, seed) -> None:
    if causal:
        s = t  # SDPA's is_causal with an attn_mask is rejected; the causal part goes into the mask below
    g = torch.Generator().manual_seed(seed)
    shape = {"HTS": (heads, t, s), "TS": (t, s), "BHTS": (2, heads, t, s), "1H1S": (1, heads, 1, s)}[bias_shape]
    q0 = torch.randn(2, heads, t, d, generator=g)
    k0, v0 = (torch.randn(2, heads, s, d, generator=g) for _ in range(2))
    bias0 = torch.randn(shape, generator=g)
    if causal:
        bias0 = bias0 + torch.full((t, s), -math.inf).triu(1)
    upstream = torch.randn(2, heads, t, d, generator=g).to(dtype)

    def run(fn):
        q, k, v, bias = (z.to(dtype).requires_grad_() for z in (q0, k0, v0, bias0))
        out = fn(q, k, v, bias)
        grads = torch.autograd.grad(out, (q, k, v, bias), upstream)
        return (out, *grads)

    ctx, rec = make_ctx()
    got = run(lambda q, k, v, m: protected_sdpa(q, k, v, ctx=ctx, attn_mask=m))
    want = run(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    limit = 1e-5 if dtype == torch.float32 else 4e-2
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert rel_err(torch.nan_to_num(a), torch.nan_to_num(b)) <= limit
    assert not rec.detections


def _t5(seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return tf.T5ForConditionalGeneration(cfg).train()


def _t5_step(model: nn.Module, faults: list[GemmFault] | None = None):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 64, (2, 9), generator=g)
    keep = torch.ones_like(ids)
    keep[1, -3:] = 0  # a padded encoder row: the bias meets a padding mask
    model.zero_grad(set_to_none=True)
    if faults is None:
        loss, hits = model(input_ids=ids, attention_mask=keep, labels=ids).loss, None
    else:
        with GemmFaults(faults) as mode:
            loss = model(input_ids=ids, attention_mask=keep, labels=ids).loss
        hits = mode.hits
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, hits


@pytest.mark.parametrize("fault", [None, "inf", "nan", "near_inf"])
def test_t5_learned_relative_bias_is_protected_and_keeps_its_gradient(fault) -> None:
    """T5 passes its learned relative bias to the AttentionInterface as position_bias: it is protected (no fallback,
    the coverage map complete under strict=True) and relative_attention_bias gets the unprotected model's gradient."""
    pytest.importorskip("transformers")
    model = _t5()
    want_loss, want, _ = _t5_step(model)
    assert any("relative_attention_bias" in n for n in want)
    faults = None
    if fault is not None:
        # The first (B*H, T, T) GEMM: the encoder's first scores product.
        faults = [GemmFault((2 * 4, 9, 9), {"inf": math.inf, "nan": math.nan, "near_inf": 1e20}[fault], index=11)]
    with attnchecker.protect(model, strict=True) as guard:
        assert guard.coverage.complete
        assert len(guard.coverage.protected) == 6 * 6
        got_loss, got, hits = _t5_step(model, faults)
        rep = guard.report()
        assert not guard.coverage.fallbacks
    assert rep.checks["scores"] == 6
    assert rep.uncorrectable == 0
    assert (rep.detected >= 1 and hits) if fault is not None else rep.detected == 0
    assert rel_err(got_loss, want_loss) <= GRAD_RTOL
    assert set(got) == set(want)
    for name in want:
        assert rel_err(got[name], want[name]) <= GRAD_RTOL, (name, rel_err(got[name], want[name]))


@pytest.mark.parametrize("shape", [(H, T, T), (T, T), (1, H, T, T), (B, 1, T, T), (1, H, 1, T)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_fixed_mask_of_any_broadcastable_rank_through_the_fused_backward(make_ctx, shape, dtype) -> None:
    """A mask that needs no gradient goes through the fused CPU backward, which misread a 3-D (H, T, S) mask."""
    ctx, rec = make_ctx()
    g = torch.Generator().manual_seed(2)
    q0, k0, v0 = (torch.randn(B, H, T, 8, generator=g) for _ in range(3))
    mask = torch.randn(shape, generator=g)
    if dtype == torch.bool:
        mask = (mask > -0.5) | torch.eye(T, dtype=torch.bool)[-1]  # no row fully masked
    upstream = torch.randn(B, H, T, 8, generator=g)

    def run(fn):
        q, k, v = (z.clone().requires_grad_() for z in (q0, k0, v0))
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), upstream))

    got = run(lambda q, k, v: protected_sdpa(q, k, v, ctx=ctx, attn_mask=mask))
    want = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert type(got[0].grad_fn).__name__ == "_VerifiedAttentionBackward"
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) <= 1e-5
    assert not rec.detections
