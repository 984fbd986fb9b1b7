"""The tier-1 tests themselves (attnchecker.tripwire): no trip on clean data, a trip for every extreme value planted,
across shapes and dtypes; the fused kernel's log-sum-exp under its q/k bound, with masks and fully masked rows."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.attention.pipeline import protected_linear, protected_sdpa
from attnchecker.inject import Fault
from attnchecker.tripwire import NEAR_INF, extreme, extreme_each, extreme_value, lse_over_bound, tripped

sys.path.insert(0, str(Path(__file__).parent))
from test_attention_layer import SyncCounter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXTREMES = (math.inf, -math.inf, math.nan, 1e20, -1e20, 3e10)

shapes = st.lists(st.integers(1, 24), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 99))
def test_clean_outputs_never_trip(shape: list[int], dtype: torch.dtype, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    assert not bool(extreme(x))
    # The host's reading (eager CPU calls) decides the same.
    assert extreme_each([x, x.transpose(0, -1)]) == [False, False]
    assert not tripped([], x)
    assert not tripped([torch.tensor(False)], x, x)
    assert tripped([torch.tensor(False), torch.tensor(True)], x)  # a flag alone trips


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), bad=st.sampled_from(EXTREMES), seed=st.integers(0, 99),
       where=st.floats(0, 1, exclude_max=True))
def test_one_extreme_value_always_trips(shape: list[int], dtype: torch.dtype, bad: float, seed: int,
                                        where: float) -> None:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(shape, generator=g).to(dtype)
    x = clean.clone()
    flat = x.view(-1)
    pos = int(where * flat.numel())
    flat[pos] = bad  # fp16 turns 1e20 into INF: still extreme
    assert bool(extreme(clean, x))
    assert bool(extreme(x.transpose(0, -1)))  # strided views too
    assert extreme_each([clean, x, x.transpose(0, -1)]) == [False, True, True]
    assert tripped([], clean, x) and tripped([torch.tensor(False)], x.transpose(0, -1))
    value, index = extreme_value(x)
    assert x[index].float().isnan() if math.isnan(value) else abs(value) >= min(abs(bad), NEAR_INF)


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                           scale=scale)
    return out, lse


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 20), d=st.sampled_from([4, 16, 32]),
       dtype=st.sampled_from(DTYPES), masking=st.sampled_from(["none", "causal", "pad", "dead", "hf_min"]),
       magnitude=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 99))
def test_fused_lse_stays_under_the_bound(b: int, h: int, t: int, d: int, dtype: torch.dtype, masking: str,
                                         magnitude: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(b, h, t, d, generator=g) * magnitude).to(dtype) for _ in range(3))
    scale = 1 / math.sqrt(d)
    mask = None
    if masking in ("pad", "dead", "hf_min"):
        fill = torch.finfo(dtype).min if masking == "hf_min" else -math.inf
        mask = torch.zeros(b, 1, t, t, dtype=dtype)
        mask[..., t // 2:] = fill  # padded keys
        if masking != "pad":
            mask[:, :, 0, :] = fill  # a query row with every key masked
    out, lse = _fused(q, k, v, mask, masking == "causal", scale)
    assert not bool(lse_over_bound(q, k, lse, scale=scale))
    assert not bool(extreme(out))


@pytest.mark.parametrize("bad", [1e20 / 8, math.inf, -math.inf, math.nan])
def test_fused_lse_of_a_huge_score_trips(bad: float) -> None:
    """What the kernel returns when one score inside it is near INF: lse ≈ scale·score. (The score itself never
    reaches memory, so the test writes the row's lse the kernel would have produced.)"""
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    _, lse = _fused(q, k, v, None, True, 1 / math.sqrt(8))
    lse[1, 2, 5] = bad
    assert bool(lse_over_bound(q, k, lse, scale=1 / math.sqrt(8)))


def test_positive_mask_values_join_the_bound() -> None:
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    mask = torch.full((1, 1, 8, 8), 50.0)  # an ALiBi-style positive bias
    _, lse = _fused(q, k, v, mask, False, 0.35)
    assert bool(lse_over_bound(q, k, lse, scale=0.35))  # the fast test, without the mask: a trip to look at
    assert not bool(lse_over_bound(q, k, lse, scale=0.35, mask_max=50.0))  # the slow path clears it


# ------------------------------------------------------------------------------------------- the engine on tier 1


def test_one_sync_per_protected_call_on_a_tier1_step(make_ctx) -> None:
    """Tier 1 keeps the engine's budget: one host-device sync per protected call, fused path and unfused alike."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 16, generator=g)
    w, b = torch.randn(48, 16, generator=g) * 0.2, torch.randn(48, generator=g) * 0.1
    for faults in (None, [Fault(op="q", layer=0, step=5, kind="inf")]):  # an injector routes attention unfused
        ctx, _ = make_ctx(faults, checked_ops=frozenset())
        with torch.no_grad():
            protected_linear(x, w, b, ctx=ctx, splits=(("q", 16), ("k", 16), ("v", 16)))  # warm caches
            with SyncCounter() as counter:
                qkv = protected_linear(x, w, b, ctx=ctx, splits=(("q", 16), ("k", 16), ("v", 16)))
            assert counter.count == 1
            q, k, v = (t.view(2, 9, 2, 8).transpose(1, 2) for t in qkv.split(16, dim=-1))
            with SyncCounter() as counter:
                protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
            assert counter.count == 1
        stats = ctx.runtime.stats
        assert stats.trip_checks["scores"] == stats.trip_checks["context"] == 1
        assert sum(stats.checks.values()) == 0  # nothing fully checked: the trips were tier 1 alone


@pytest.mark.parametrize("op", ["q", "k", "v", "scores", "context"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trip_gives_the_fault_free_output_and_gradients(make_ctx, op: str, dtype: torch.dtype) -> None:
    """Below the guard: a layer on a tier-1 step with one INF gives the output and q/k/v/W gradients of the same layer
    without the fault (the fault-free layer on a tier-1 step runs the fused kernel, the faulty one recovers through
    the checked path: equal to rounding)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 12, 32, generator=g).to(dtype)

    def layer(faults):
        w = (torch.randn(96, 32, generator=torch.Generator().manual_seed(5)) * 0.2).to(dtype).requires_grad_()
        ctx, rec = make_ctx(faults, checked_ops=frozenset())
        qkv = protected_linear(x, w, None, ctx=ctx, splits=(("q", 32), ("k", 32), ("v", 32)))
        q, k, v = (t.view(2, 12, 4, 8).transpose(1, 2) for t in qkv.split(32, dim=-1))
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
        out.float().square().sum().backward()
        return out.detach().float(), w.grad.float(), rec

    clean_out, clean_grad, clean_rec = layer(None)
    out, grad, rec = layer([Fault(op=op, layer=0, step=0, kind="inf", seed=2)])
    assert not clean_rec.detections
    assert [(d.op, d.tier) for d in rec.detections] == [(op, "tripwire")]
    # bf16: the fused kernel and the checked path round differently (clean, they already differ by ~0.5 % of the
    # gradient's scale), so equality is to that rounding; fp32 is strict.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, clean_out, rtol=tol, atol=tol * float(clean_out.abs().max()))
    torch.testing.assert_close(grad, clean_grad, rtol=tol, atol=tol * float(clean_grad.abs().max()))
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("case", ["mask_3d", "head_size_v", "mask_2d", "bool_4d"])
def test_tier1_fused_path_equals_sdpa_whatever_the_kernel_takes(make_ctx, case: str) -> None:
    """Inputs the CPU flash kernel refuses (a 3-D mask, v with its own head size) take F.sdpa with the output test;
    the others take the kernel. Either way the result is F.scaled_dot_product_attention's."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 8, 16, generator=g), torch.randn(2, 4, 8, 16, generator=g)
    v = torch.randn(2, 4, 8, 12 if case == "head_size_v" else 16, generator=g)
    mask = {"mask_3d": torch.zeros(4, 8, 8), "mask_2d": torch.randn(8, 8, generator=g).clamp_max(0),
            "bool_4d": torch.rand(2, 1, 8, 8, generator=g) > 0.3, "head_size_v": None}[case]
    ctx, rec = make_ctx(checked_ops=frozenset())
    out = protected_sdpa(q, k, v, ctx=ctx, attn_mask=mask)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert not rec.detections
    assert ctx.runtime.stats.trip_checks["context"] == 1
