"""attention/vendor.py: the vendor's fused attention called through its aten ops for its output, log-sum-exp and
backward (tier 1's products on the Triton path). On the CPU the flash kernel runs for real; FlashAttention's CUDA ops
take meta tensors here, which checks what this module hands them (the forward's own results, in the order and types
the backward's schema asks for) and the shapes they give back, without a GPU."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.attention import vendor


def _qkv(b: int, h: int, hk: int, t: int, s: int, d: int, dtype: torch.dtype, seed: int,
         device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype).to(device)
                 for shape in ((b, h, t, d), (b, hk, s, d), (b, hk, s, d)))


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), causal=st.booleans(), group=st.sampled_from([1, 2]),
       t=st.integers(1, 40), extra_keys=st.integers(0, 9), seed=st.integers(0, 2**20))
def test_the_cpu_kernel_gives_sdpa_its_lse_and_its_gradient(dtype, causal, group, t, extra_keys, seed) -> None:
    """The forward is F.scaled_dot_product_attention's output with the row log-sum-exp beside it (float64
    reference), and the backward at those results is autograd's gradient of F.scaled_dot_product_attention, grouped
    key/value heads included (taken as they are: dK and dV on their own heads)."""
    s = t if causal else t + extra_keys
    q, k, v = _qkv(2, 2 * group, 2, t, s, 16, dtype, seed)
    assert vendor.not_supported_reasons(q, k, v, attn_mask=None, is_causal=causal, dropout_p=0.0) == []
    with torch.no_grad():
        made = vendor.forward(q, k, v, is_causal=causal, scale=0.25)
    assert made is not None and made.backward is not None and made.lse_BHT.is_contiguous()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=0.25, enable_gqa=group > 1)
    torch.testing.assert_close(made.out_BHTD, want.detach())
    z = 0.25 * q.double() @ k.double().repeat_interleave(group, 1).mT
    if causal:
        z = z.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(made.lse_BHT.double(), torch.logsumexp(z, -1), rtol=1e-4, atol=1e-4)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 7)).to(dtype)
    want.backward(grad_out)
    dq, dk, dv = made.backward(grad_out, q, k, v)
    _close(dq, leaves[0].grad)
    _close(dk, leaves[1].grad)
    _close(dv, leaves[2].grad)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 at assert_close's defaults; bf16 within 2 % of the largest gradient (SDPA with grouped heads may take
    another kernel, whose bf16 rounding differs by an ulp or two)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=2e-2 * float(want.float().abs().max()))


@pytest.mark.parametrize(("group", "expand"), [(1, False), (4, False), (4, True)])
def test_flash_attention_s_backward_takes_what_its_forward_returned(group: int, expand: bool) -> None:
    """The CUDA path's plumbing on meta tensors: FlashAttention's forward returns, for a dense batch, no sequence
    offsets (None), its lengths and the philox state; the backward this module builds hands them back in its
    schema's order and gets one gradient per operand, dK and dV on K's own heads: as they come with grouped heads
    taken natively, summed back over each group where the forward took them expanded."""
    q, k, v = (torch.empty(shape, device="meta", dtype=torch.bfloat16)
               for shape in ((2, 8, 128, 64), (2, 8 // group, 128, 64), (2, 8 // group, 128, 64)))
    k_in, v_in = (x.repeat_interleave(group, 1) for x in (k, v)) if expand else (k, v)
    got = torch.ops.aten._scaled_dot_product_flash_attention(q, k_in, v_in, 0.0, True, False, scale=0.125)
    backward = vendor._flash_backward(got[0], got[1], tuple(got[2:8]), is_causal=True, scale=0.125, expand=expand)
    dq, dk, dv = backward(torch.empty_like(got[0]), q, k, v)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_what_the_vendor_path_does_not_take_says_why() -> None:
    q, k, v = _qkv(1, 2, 2, 8, 12, 16, torch.float32, 0)
    mask = torch.ones(8, 12, dtype=torch.bool)
    assert vendor.not_supported_reasons(q, k, v, attn_mask=mask, is_causal=False, dropout_p=0.0) == [
        "a mask (the vendor's ops with a log-sum-exp take none here)"]
    assert "attention dropout" in vendor.not_supported_reasons(q, k, v, attn_mask=None, is_causal=False,
                                                               dropout_p=0.1)[0]
    assert "T != S" in vendor.not_supported_reasons(q, k, v, attn_mask=None, is_causal=True, dropout_p=0.0)[0]
    assert vendor.not_supported_reasons(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0) == []
