"""FlexAttention calls, checked (attention/flex.py): the protected call computes flex_attention's function (score_mod
and BlockMask applied per tile), its gradients are the math reference's (FlexAttention has no backward on CPU), faults
in its scores and context are corrected, clean calls never flag, and tier 1 on the caller's own flex_attention trips
on a kernel fault and recovers through the checked path."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scoped_env import scoped_env
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from attnchecker.attention.backends.tiled_torch import TILE_ENV
from attnchecker.attention.flex import protected_flex_attention
from attnchecker.inject import Fault

# flex_attention called eagerly (the forward reference here) warns that it is not compiled.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, H, HK, T, D = 2, 4, 2, 96, 16
DOCS = torch.tensor([0] * 30 + [1] * 45 + [2] * 21)
SLOPES = torch.tensor([2.0 ** -(i + 1) for i in range(H)])


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv < 24)


def document(b, h, q, kv):
    return (DOCS[q] == DOCS[kv]) & (q >= kv)


def alibi(score, b, h, q, kv):
    return score + SLOPES[h] * (kv - q)


def softcap(score, b, h, q, kv):
    return 10.0 * torch.tanh(score / 10.0)


CASES: dict[str, tuple[Callable[..., Any] | None, Callable[..., Any] | None]] = {
    "causal": (causal, None),
    "sliding_window": (sliding, None),
    "document": (document, None),
    "alibi": (causal, alibi),
    "softcap": (None, softcap),
}


@pytest.fixture(autouse=True, scope="module")
def small_tiles():
    """Tiles of 32 queries × 40 keys against the BlockMask's 32 × 32 blocks: a call crosses many tiles, and tiles
    cut across mask blocks."""
    with scoped_env({TILE_ENV: "32,40"}):
        yield


def seeded(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(seed: int, dtype: torch.dtype = torch.float32, *, t: int = T, b: int = B, h: int = H, hk: int = HK,
        d: int = D) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return seeded((b, h, t, d), seed, dtype), seeded((b, hk, t, d), seed + 1, dtype), seeded((b, hk, t, d), seed + 2,
                                                                                             dtype)


def reference(q, k, v, mask_mod, score_mod, scale=None):
    """flex_attention's function, materialised in fp64: the gradient reference."""
    b, h, t, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.double() @ k.double().mT) * (scale if scale is not None else 1 / math.sqrt(d))
    bb, hh, qq, kk = torch.meshgrid(*(torch.arange(n) for n in (b, h, t, k.shape[2])), indexing="ij")
    if score_mod is not None:
        s = score_mod(s, bb, hh, qq, kk)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(bb, hh, qq, kk), -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v.double()


def block_mask_of(mask_mod, t: int = T):
    return None if mask_mod is None else create_block_mask(mask_mod, None, None, t, t, device="cpu", BLOCK_SIZE=32)


def grads_of(fn, inputs, g):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    (out.double() * g).sum().backward()
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("case", list(CASES))
def test_flex_call_equals_flex_forward_and_math_gradients(make_ctx, case: str) -> None:
    mask_mod, score_mod = CASES[case]
    q, k, v = qkv(0)
    bm = block_mask_of(mask_mod)
    want, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                               return_aux=AuxRequest(lse=True))
    ctx, rec = make_ctx()
    g = seeded((B, H, T, D), 9, torch.float64)

    def protected(q, k, v):
        out, lse = protected_flex_attention(q, k, v, ctx=ctx, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                            return_lse=True)
        torch.testing.assert_close(lse.detach(), aux.lse, rtol=1e-5, atol=1e-5)
        return out

    got, grads = grads_of(protected, (q, k, v), g)
    _, ref_grads = grads_of(lambda *x: reference(*x, mask_mod, score_mod), (q, k, v), g)
    assert rec.detections == []
    assert ctx.runtime.stats.checks["scores"] == ctx.runtime.stats.checks["context"] == 1
    # Through the backend contract: the tile loop ran it; the native pass ahead of it said why not.
    assert ctx.runtime.calls.ran_by == {(0, "tiled"): 1}
    assert any("score_mod / BlockMask" in r for r in ctx.runtime.calls.declined[(0, "native")])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, r in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@settings(max_examples=12)
@given(case=st.sampled_from(list(CASES)), dtype=st.sampled_from(list(TOL)), t=st.integers(20, 110),
       d=st.sampled_from([8, 16, 32]), heads=st.sampled_from([(2, 2), (4, 1), (4, 2)]), seed=st.integers(0, 2**16))
def test_clean_flex_calls_never_flag_and_match_the_reference(make_ctx, case, dtype, t, d, heads, seed) -> None:
    mask_mod, score_mod = CASES[case]
    if mask_mod is document:
        mask_mod = causal  # DOCS is sized for T; the document case runs at T above
    h, hk = heads
    q, k, v = qkv(seed, dtype, t=t, b=1, h=h, hk=hk, d=d)
    ctx, rec = make_ctx()
    out = protected_flex_attention(q, k, v, ctx=ctx, score_mod=score_mod, block_mask=block_mask_of(mask_mod, t),
                                   enable_gqa=hk != h)
    assert rec.detections == []
    torch.testing.assert_close(out.double(), reference(q, k, v, mask_mod, score_mod), rtol=TOL[dtype],
                               atol=TOL[dtype])


@pytest.mark.parametrize(("op", "kind", "persistent"), [
    ("scores", "inf", False), ("scores", "nan", True), ("context", "near_inf", False), ("context", "neg_inf", True),
    ("scores", "bitflip", True)])
def test_faults_in_a_flex_call_are_corrected(make_ctx, op: str, kind: str, persistent: bool) -> None:
    """A transient fault is gone when the flagged query block is recomputed ("recomputed"); a persistent one comes back
    and is located and corrected in the recomputed tile ("corrected"). Either way out and gradients are the clean
    call's."""
    mask_mod = CASES["document"][0]
    q, k, v = qkv(3)
    bm = block_mask_of(mask_mod)
    g = seeded((B, H, T, D), 4, torch.float64)
    clean_ctx, _ = make_ctx()
    want, want_grads = grads_of(lambda *x: protected_flex_attention(*x, ctx=clean_ctx, block_mask=bm,
                                                                    enable_gqa=True), (q, k, v), g)
    # Row 60 of document 1 (rows 30-74) attends keys 30-60: the fault lands in a tile the mask keeps.
    fault = Fault(op=op, layer=0, step=0, kind=kind, batch=1, head=2, row=60, col=41 if op == "scores" else 5,
                  persistent=persistent, seed=1)
    ctx, rec = make_ctx(faults=[fault])
    got, grads = grads_of(lambda *x: protected_flex_attention(*x, ctx=ctx, block_mask=bm, enable_gqa=True),
                          (q, k, v), g)
    assert len(ctx.runtime.injector.injected) == (2 if persistent else 1)
    action = "corrected" if persistent else "recomputed"
    assert [(d.op, d.action) for d in rec.detections] == [(op, action)], rec.detections
    assert (rec.detections[0].batch, rec.detections[0].head, rec.detections[0].row) == (1, 2, 60)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, r in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_a_score_mod_bias_that_learns_gets_flex_gradient(make_ctx) -> None:
    """A score_mod closing over a learned per-head bias (relative-position bias, T5/ALiBi style): its gradient is
    found through the autograd graph score_mod builds and returned as FlexAttention's backward returns it."""
    bias = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.1, 0.5]))

    def learned(score, b, h, q, kv):
        return score + bias[h] * (kv - q).float() / T

    q, k, v = qkv(5)
    bm = block_mask_of(causal)
    g = seeded((B, H, T, D), 6, torch.float64)
    ctx, _ = make_ctx()
    got = protected_flex_attention(q, k, v, ctx=ctx, score_mod=learned, block_mask=bm, enable_gqa=True)
    (got.double() * g).sum().backward()
    mine = bias.grad.clone()
    bias.grad = None
    (reference(q, k, v, causal, learned) * g).sum().backward()
    torch.testing.assert_close(mine, bias.grad, rtol=1e-4, atol=1e-6)


def test_tier1_on_the_callers_flex_trips_on_a_kernel_fault_and_recovers(make_ctx) -> None:
    """No op due on this step: the caller's own flex_attention runs and tier 1 reads its output and log-sum-exp. A
    NaN its kernel wrote trips it; the call is run again checked, and the event says the fault was recomputed."""
    q, k, v = qkv(7)
    bm = block_mask_of(causal)
    want = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)

    def faulty_kernel() -> tuple[torch.Tensor, torch.Tensor]:
        out, aux = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_aux=AuxRequest(lse=True))
        out[0, 1, 17, 3] = math.nan
        return out, aux.lse

    ctx, rec = make_ctx(checked_ops=frozenset())
    with torch.no_grad():
        got = protected_flex_attention(q, k, v, ctx=ctx, block_mask=bm, enable_gqa=True, fused=faulty_kernel)
    assert [(d.op, d.action, d.tier) for d in rec.detections] == [("context", "recomputed", "tripwire")]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    clean_ctx, clean_rec = make_ctx(checked_ops=frozenset())
    with torch.no_grad():
        protected_flex_attention(q, k, v, ctx=clean_ctx, block_mask=bm, enable_gqa=True,
                                 fused=lambda: (want.clone(), torch.zeros(B, H, T)))
    assert clean_rec.detections == []
    assert clean_ctx.runtime.stats.trip_checks["scores"] == 1
    assert clean_ctx.runtime.stats.checks["scores"] == 0


def test_a_block_mask_made_for_other_lengths_is_refused(make_ctx) -> None:
    q, k, v = qkv(8)
    ctx, _ = make_ctx()
    with pytest.raises(ValueError, match=r"made for \(Q_LEN, KV_LEN\) = \(64, 64\)"):
        protected_flex_attention(q, k, v, ctx=ctx, block_mask=block_mask_of(causal, 64), enable_gqa=True)


def test_a_transformers_model_on_flex_attention_trains_protected_on_cpu() -> None:
    """transformers' "flex_attention" implementation: protect() switches the model to its checked interface function,
    which computes the same attention as the model's SDPA implementation (compared here: transformers' flex path on
    CPU compiles its BlockMask and kernel first, ~15 s, and has no backward), so the model trains on CPU, and gets its
    implementation back on close."""
    import model_zoo as mz

    import attnchecker
    from attnchecker import Policy

    model = mz.build("llama")
    b = mz.batch("llama", 0)
    with torch.no_grad():
        want = mz.loss_of("llama", model, b)  # the zoo's llama runs "sdpa"
    model.set_attn_implementation("flex_attention")
    with attnchecker.protect(model, policy=Policy.full()) as guard:
        loss = mz.loss_of("llama", model, b)
        loss.backward()
        guard.step()
        assert guard.coverage.complete, guard.coverage.gaps()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert model.config._attn_implementation == "flex_attention"
