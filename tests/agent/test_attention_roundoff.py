"""Round-off tolerance through the engine: zero false positives over 10,000+ clean checks per dtype (scores,
softmax-probability × V, projections; causal and padding masks, fully masked rows), and detection of single errors
of 10× the bound in the probability × V product."""
from __future__ import annotations

import pytest
import torch

from attnchecker.abft import Tolerance
from attnchecker.attention.backends.unfused import _probs, context_checks
from attnchecker.attention.pipeline import check_linear, protected_sdpa

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (batch, heads, queries, keys, head dim, mask): batch × heads matrices per op and call.
CONFIGS = [
    (50, 14, 33, 33, 17, "causal"),
    (40, 16, 21, 45, 9, "padding"),
    (60, 20, 1, 7, 64, "none"),
    (64, 12, 17, 17, 5, "causal+padding"),
    (25, 24, 64, 64, 32, "padding"),
    (100, 7, 9, 13, 3, "none"),
    (60, 12, 27, 27, 15, "causal"),
]


def seeded(shape: tuple[int, ...], seed: int, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def attention_inputs(config: tuple, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v with per-(batch, head) magnitudes from flat to nearly one-hot softmax rows, and the mask."""
    b, h, t, s, d, mask = config
    gen = torch.Generator().manual_seed(seed)
    sharp = 10 ** (torch.rand(b, h, 1, 1, generator=gen) * 1.5 - 0.5)
    q = seeded((b, h, t, d), seed + 1, sharp).to(dtype)
    k = seeded((b, h, s, d), seed + 2).to(dtype)
    v = seeded((b, h, s, d), seed + 3, 10 ** (torch.rand(b, h, 1, 1, generator=gen) * 2 - 1)).to(dtype)
    attn_mask = None
    if "padding" in mask:
        # Some rows of the batch have every key padded away (length 0): fully masked rows.
        lengths = torch.randint(0, s + 1, (b,), generator=gen)
        attn_mask = (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :].expand(b, 1, t, s)
    return q, k, v, attn_mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clean_attention_never_flags_over_ten_thousand_checks(make_ctx, dtype: torch.dtype) -> None:
    ctx, rec = make_ctx(tolerance="roundoff")
    for i, config in enumerate(CONFIGS):
        q, k, v, attn_mask = attention_inputs(config, 100 * i, dtype)
        with torch.no_grad():
            protected_sdpa(q, k, v, ctx=ctx, attn_mask=attn_mask, is_causal="causal" in config[-1])
    assert rec.detections == []
    checks = sum(b * h for b, h, *_ in CONFIGS)
    assert checks >= 5000, "scores and context: two checks per (batch, head) matrix"
    stats = ctx.runtime.stats
    assert stats.checks["scores"] == stats.checks["context"] == len(CONFIGS)
    assert int(stats.residual_counts[-2:].sum()) == 0, "no clean ratio above 1"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clean_projections_never_flag_over_ten_thousand_checks(make_ctx, dtype: torch.dtype) -> None:
    ctx, rec = make_ctx(tolerance="roundoff")
    shapes = [(2500, 7, 33, 21), (2500, 16, 64, 48), (2500, 3, 130, 5), (2600, 11, 9, 27)]
    for i, (n, t, d_in, d_out) in enumerate(shapes):
        x = seeded((n, t, d_in), 7 * i, 10 ** (torch.rand(n, 1, 1) * 3 - 1.5)).to(dtype)
        w = seeded((d_out, d_in), 7 * i + 1, d_in**-0.5).to(dtype)
        bias = seeded((d_out,), 7 * i + 2, 0.5).to(dtype)
        with torch.no_grad():
            check_linear(x, torch.nn.functional.linear(x, w, bias), w, bias, ctx=ctx, op="out")
    assert rec.detections == []
    assert sum(n for n, *_ in shapes) >= 10_000


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_probability_times_v_detects_errors_ten_times_the_bound(dtype: torch.dtype) -> None:
    b, h, t, s, d = 40, 25, 19, 23, 11
    q, k, v, attn_mask = attention_inputs((b, h, t, s, d, "causal+padding"), 9, dtype)
    tol = Tolerance()
    probs, _ = _probs(q @ k.mT, scale=d**-0.5, attn_mask=attn_mask, is_causal=True, dropout_p=0.0, keep_BHTS=None)
    out = probs @ v
    base = context_checks(probs, v, out, None, h, tol)
    assert not any(bool(c.bad.any()) for c in base.values())
    gen = torch.Generator().manual_seed(10)
    rows, cols = torch.randint(t, (b, h), generator=gen), torch.randint(d, (b, h), generator=gen)
    bi, hi = torch.meshgrid(torch.arange(b), torch.arange(h), indexing="ij")
    bound = torch.minimum(base["row"].bound[bi, hi, rows], base["col"].bound[bi, hi, cols])
    faulty = out.clone()
    clean_values = out[bi, hi, rows, cols].float()
    faulty[bi, hi, rows, cols] = (clean_values + 11 * bound).to(dtype)
    eligible = (faulty[bi, hi, rows, cols].float() - clean_values).abs() >= 10 * bound
    checks = context_checks(probs, v, faulty, None, h, tol)
    hit = checks["row"].bad[bi, hi, rows] | checks["col"].bad[bi, hi, cols]
    assert float(eligible.float().mean()) > 0.9
    assert float(hit[eligible].float().mean()) >= 0.99
