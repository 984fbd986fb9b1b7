"""The Triton backend on a GPU (marker gpu: skipped without CUDA; bench/gpu_suite.py runs them first). Run on one H200
so far (docs/performance.md §8)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scoped_env import scoped_env
from test_attention_layer import TOL, layer_params, run_layer, seeded

from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.attention.pipeline import protected_sdpa
from attnchecker.inject import Fault
from attnchecker.kernels import triton_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_gpu_checked_backward_gives_autograds_gradients_and_flags_nothing(make_ctx, dtype, d) -> None:
    """The Triton backward with its full checks compiled for this GPU, at the launcher's tiles and warps, on a clean
    causal GQA call over 8 blocks of queries and of keys: autograd's gradients (fp32, through the math) within the
    dtype's tolerance of test_triton_attention_backward, and nothing flagged. At head dim 64 the key pass's checked
    programs run on 2 warps (kernels/triton_attention_bwd.pass_warps), at 128 on 4. The interpreter runs every launch
    whatever its warps, so only a GPU shows that the 2-warp build computes what the 4-warp one does. Marked slow: its
    first run compiles the checked passes and their repairs (minutes on one core), which bench/gpu_suite.py's budgeted
    tests section leaves to `pytest -m "gpu and slow"`."""
    from test_triton_attention_backward import REL, backward, close, make

    from attnchecker.checks.deferred import drain

    a = make(dtype, h=4, hk=2, t=256, s=256, d=d, seed=3)
    on = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in a.items() if k != "want"}
    ctx, rec = make_ctx()
    got = backward(on, ctx, check="abft")
    drain(ctx.runtime.deferred)
    assert rec.detections == []
    assert close(tuple(g.cpu() for g in got), a, REL[dtype])


@pytest.mark.parametrize("tier1", [False, True], ids=["full_check", "tier1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_triton_forward_never_syncs_and_reports_at_the_step_boundary(make_ctx, dtype, tier1: bool) -> None:
    """CUDA's own detector (set_sync_debug_mode("error")) raises on any host-device sync inside the protected call,
    a fault in the kernel included; the report comes when the detections are read (the step boundary)."""
    dev = torch.device("cuda")
    q, k, v = (seeded((2, 8, 1024, 64), i, dtype).to(dev) for i in range(3))
    config = {"checked_ops": frozenset({"q", "k", "v", "out"})} if tier1 else {}
    ctx, rec = make_ctx(**config)
    fault = ("scores", 9, 700, 123, "set", math.inf, False)
    with scoped_env({BACKEND_ENV: None}):
        protected_sdpa(q, k, v, ctx=ctx, is_causal=True)  # compiles the kernels, makes the histogram's tensors
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with triton_attention.emulated_faults([fault]):
                out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert ctx.runtime.calls.ran_by.get((0, "triton"), 0) >= (0 if tier1 else 2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL[dtype])
    assert [(d.op, d.batch, d.head, d.row) for d in rec.detections] == [("scores", 1, 1, 700)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_triton_layer_corrects_faults_and_keeps_the_fault_free_gradients(make_ctx, dtype) -> None:
    """attnchecker.inject's faults written into the kernel's tiles on CUDA: corrected, loss and gradients the clean
    step's (the backward under the default scope: SDPA's recomputed at the verified q, k, v)."""
    dev = torch.device("cuda")
    x = seeded((2, 256, 128), 100, dtype).to(dev)
    p = {n: None if t is None else t.detach().to(dev).requires_grad_() for n, t in
         layer_params(128, 101, dtype).items()}
    with scoped_env({BACKEND_ENV: "triton"}):
        _, loss0, grads0, rec0, ctx0 = run_layer(make_ctx, x, p, 4, is_causal=True)
        faults = [Fault(op="scores", layer=0, step=0, kind="inf", seed=1),
                  Fault(op="context", layer=0, step=0, kind="nan", seed=2)]
        out, loss1, grads1, rec, _ = run_layer(make_ctx, x, p, 4, faults=faults, is_causal=True)
    assert ctx0.runtime.calls.ran_by == {(0, "triton"): 1}
    assert rec0.detections == []
    assert sorted((d.op, d.action) for d in rec.detections) == [("context", "recomputed"), ("scores", "recomputed")]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(loss1, loss0, **TOL[dtype])
    for g1, g0 in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(g1, g0, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_gpu_tier1_over_the_vendor_forward_never_syncs_and_recomputes_a_fault(dtype, gqa: bool) -> None:
    """Tier 1 over the vendor's forward on CUDA (FlashAttention for fp16/bf16, memory-efficient attention for fp32):
    the op takes the call, a clean pass leaves its output as it is, and a NaN and a huge log-sum-exp written into its
    results are recomputed by the repair, all under CUDA's sync detector; the result is SDPA's."""
    from attnchecker.attention import vendor

    dev = torch.device("cuda")
    q = seeded((2, 8, 1024, 64), 0, dtype).to(dev)
    k, v = (seeded((2, 2 if gqa else 8, 1024, 64), i, dtype).to(dev) for i in (1, 2))
    assert not vendor.not_supported_reasons(q, k, v, attn_mask=None, is_causal=True, dropout_p=0.0)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    checks = triton_attention.Checks(mode="tier1")
    first = vendor.forward(q, k, v, is_causal=True, scale=0.125)
    assert first is not None
    triton_attention.forward(q, k, v, scale=0.125, checks=checks, is_causal=True,
                             given=(first.out_BHTD, first.lse_BHT))  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        made = vendor.forward(q, k, v, is_causal=True, scale=0.125)
        assert made is not None
        clean = (made.out_BHTD, made.lse_BHT)
        kept = clean[0].clone()
        got = triton_attention.forward(q, k, v, scale=0.125, checks=checks, is_causal=True, given=clean)
        made = vendor.forward(q, k, v, is_causal=True, scale=0.125)
        assert made is not None
        faulty = (made.out_BHTD, made.lse_BHT)
        faulty[0][1, 5, 700, 3] = math.nan
        faulty[1][0, 2, 100] = 1e20
        fixed = triton_attention.forward(q, k, v, scale=0.125, checks=checks, is_causal=True, given=faulty)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.status[:2].tolist() == [0.0, 0.0] and torch.equal(got.out_BHTD, kept)
    torch.testing.assert_close(got.out_BHTD, want, **TOL[dtype])
    assert fixed.status[:2].tolist() == [1.0, 1.0]
    torch.testing.assert_close(fixed.out_BHTD, want, **TOL[dtype])
    torch.testing.assert_close(fixed.lse_BHT, clean[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_gpu_full_checks_over_flash_attention_flag_nothing_and_recompute_a_fault(dtype, gqa: bool, d: int) -> None:
    """The full checks over FlashAttention's forward (abft/given_forward.py) on this GPU: a clean causal call of 1,024
    queries flags nothing, its worst clean ratio stays under the bound, and the output is FlashAttention's own; one
    output element moved by 4 times its row's RMS and an lse off by 0.01 are flagged and recomputed to SDPA's; all
    under CUDA's sync detector. The bounds' constants come from the CPU flash kernel: this is where FlashAttention's
    own rounding meets them."""
    from attnchecker.attention import vendor

    dev = torch.device("cuda")
    q = seeded((2, 8, 1024, d), 0, dtype).to(dev)
    k, v = (seeded((2, 2 if gqa else 8, 1024, d), i, dtype).to(dev) for i in (1, 2))
    assert not vendor.not_supported_reasons(q, k, v, attn_mask=None, is_causal=True, dropout_p=0.0)
    scale = d ** -0.5
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    checks = triton_attention.Checks(mode="full")
    first = vendor.forward(q, k, v, is_causal=True, scale=scale)
    assert first is not None
    triton_attention.forward(q, k, v, scale=scale, checks=checks, is_causal=True,
                             given=(first.out_BHTD, first.lse_BHT))  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        made = vendor.forward(q, k, v, is_causal=True, scale=scale)
        assert made is not None
        clean = (made.out_BHTD, made.lse_BHT)
        kept = clean[0].clone()
        got = triton_attention.forward(q, k, v, scale=scale, checks=checks, is_causal=True, given=clean)
        made = vendor.forward(q, k, v, is_causal=True, scale=scale)
        assert made is not None
        faulty = (made.out_BHTD, made.lse_BHT)
        rms = faulty[0][1, 5, 700].float().square().mean().sqrt()
        faulty[0][1, 5, 700, 3] += (4 * rms).to(dtype)
        faulty[1][0, 2, 100] += 0.01
        fixed = triton_attention.forward(q, k, v, scale=scale, checks=checks, is_causal=True, given=faulty)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    status = got.status.tolist()
    assert status[:2] == [0.0, 0.0] and max(status[2:]) < 1.0, status
    assert torch.equal(got.out_BHTD, kept)
    torch.testing.assert_close(got.out_BHTD, want, **TOL[dtype])
    assert fixed.status[:2].tolist() == [1.0, 1.0]
    torch.testing.assert_close(fixed.out_BHTD, want, **TOL[dtype])
    torch.testing.assert_close(fixed.lse_BHT, clean[1], rtol=1e-4, atol=1e-4)


def test_gpu_a_checked_call_s_time_is_its_device_time_at_the_step_boundary(make_ctx) -> None:
    """A full-check call on CUDA leaves its start and end events on the runtime (the host's clock around its
    launches would miss the kernels); the step boundary adds the time between them to its ops' check time."""
    from attnchecker.checks.deferred import drain
    from attnchecker.checks.device_time import settle

    q, k, v = (seeded((1, 8, 2048, 64), i, torch.bfloat16).to("cuda") for i in range(3))
    ctx, _ = make_ctx()
    with scoped_env({BACKEND_ENV: None}):
        protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert len(ctx.runtime.device_spans) == 1 and ctx.runtime.stats.check_seconds["scores"] == 0.0
    drain(ctx.runtime.deferred)
    assert settle(ctx.runtime) > 0.0 and ctx.runtime.device_spans == []
    assert ctx.runtime.stats.check_seconds["scores"] > 0.0 and ctx.runtime.stats.check_seconds["context"] > 0.0
