"""The tier-1 tests themselves (attnchecker.tripwire): no trip on clean data, a trip for every extreme value planted,
across shapes and dtypes; the fused kernel's log-sum-exp under its q/k bound, with masks and fully masked rows."""
from __future__ import annotations

import math

import pytest
import torch
from attnchecker.tripwire import NEAR_INF, extreme, extreme_value, lse_over_bound
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXTREMES = (math.inf, -math.inf, math.nan, 1e20, -1e20, 3e10)

shapes = st.lists(st.integers(1, 24), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 99))
def test_clean_outputs_never_trip(shape: list[int], dtype: torch.dtype, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    assert not bool(extreme(x))


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
