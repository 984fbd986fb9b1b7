"""Grouped checksums (abft/checksum.py, issue 13): vectors of >= 2 × GROUP_MIN elements get one checksum pair per run
of L = n/g elements. Pinned: g per length, g = 1 unchanged, the vector layout, the per-group bound equals the plain
bound of the sub-product; through the engine: one error per matrix in any group is flagged, located and corrected
across fp32/bf16/fp16, and clean products of LLM-like data raise nothing."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tolerance_calibrated import activations  # LLM-like hidden states, one recipe for the calibrated tests

from attnchecker.abft import (
    Tolerance,
    bounds,
    checksums_of,
    group_count,
    group_sums_cols,
    group_sums_rows,
    vector_of,
)
from attnchecker.abft.checksum import spread, vector_sum
from attnchecker.attention.backends.tiled_torch import PATH_ENV
from attnchecker.attention.pipeline import _ProjectionInput, _verify, check_linear, protected_sdpa
from attnchecker.inject import Fault

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize(("n", "g"), [(8, 1), (64, 1), (511, 1), (512, 2), (768, 3), (1024, 4), (4096, 16),
                                      (4097, 1), (8192, 32)])
def test_group_count_keeps_groups_at_least_group_min_long(n: int, g: int) -> None:
    assert group_count(n) == g


def test_one_group_is_the_plain_checksum() -> None:
    c = torch.randn(2, 40, 24, dtype=torch.float64)
    rows, cols, sums = checksums_of(c, with_abs=True, with_sq=True)
    rows1, cols1, sums1 = checksums_of(c, with_abs=True, with_sq=True, groups=(1, 1))
    assert torch.equal(rows, rows1) and torch.equal(cols, cols1)
    assert sums is not None and sums1 is not None and sums.sq_sum is not None and sums1.sq_sum is not None
    assert all(torch.equal(a, b) for a, b in zip(sums.sq_sum, sums1.sq_sum, strict=True))
    assert torch.equal(group_sums_rows(c, 1)[..., 0, :], rows)
    assert torch.equal(group_sums_cols(c, 1)[..., 0, :], cols)


@pytest.mark.parametrize("shape", [(64, 96), (2, 768, 384)], ids=["in-cache", "cpu-blocked"])
def test_grouped_square_sums_are_the_squared_runs_in_both_cpu_forms(shape) -> None:
    """ΣC² per group: a C that fits in cache is squared in one pass, a larger one (> 2^18 elements) a block of rows at
    a time; both equal the runs' squared sums."""
    c = torch.randn(*shape, dtype=torch.float64)
    groups = (3, 4)
    _, _, sums = checksums_of(c, with_abs=False, with_sq=True, groups=groups)
    assert sums is not None and sums.sq_sum is not None
    r, n = shape[-2:]
    want_rows = c.square().reshape(*shape[:-1], 3, n // 3).sum(-1).flatten(-2)
    want_cols = c.square().reshape(*shape[:-2], 4, r // 4, n).sum(-2).transpose(-2, -1).flatten(-2)
    torch.testing.assert_close(sums.sq_sum[0], want_rows)
    torch.testing.assert_close(sums.sq_sum[1], want_cols)


def test_grouped_layout_vector_i_g_plus_h_holds_run_h_of_vector_i() -> None:
    """Row vector i·g + h = C[i, h·L:(h+1)·L]; column vector j·g + h = C[h·L:(h+1)·L, j]; weights restart per run."""
    c = torch.randn(64, 96, dtype=torch.float64)
    rows, cols, sums = checksums_of(c, with_abs=True, with_sq=True, groups=(3, 4))
    assert rows.shape == (64 * 3, 2) and cols.shape == (96 * 4, 2)
    w32, w16 = torch.arange(1, 33, dtype=c.dtype), torch.arange(1, 17, dtype=c.dtype)
    i, h, j, hc = 5, 2, 7, 3
    run = c[i, h * 32 : (h + 1) * 32]
    assert rows[i * 3 + h].tolist() == pytest.approx([run.sum().item(), (run * w32).sum().item()])
    col_run = c[hc * 16 : (hc + 1) * 16, j]
    assert cols[j * 4 + hc].tolist() == pytest.approx([col_run.sum().item(), (col_run * w16).sum().item()])
    assert sums is not None and sums.sq_sum is not None and sums.abs_sum is not None
    assert sums.sq_sum[0][i * 3 + h].item() == pytest.approx(run.square().sum().item())
    assert sums.sq_sum[1][j * 4 + hc].item() == pytest.approx(col_run.square().sum().item())
    assert sums.abs_sum[1][j * 4 + hc].item() == pytest.approx(col_run.abs().sum().item())
    # The plain checksum is the sum over the runs (d1), and the layout helpers agree with each other.
    assert torch.allclose(rows[:, 0].view(64, 3).sum(-1), c.sum(-1))
    r_idx, c_idx = torch.tensor([i, 63]), torch.tensor([h * 32 + 4, 95])
    assert vector_of("row", 3, 96, r_idx, c_idx).tolist() == [i * 3 + h, 63 * 3 + 2]
    assert vector_of("col", 4, 64, r_idx, c_idx).tolist() == [(h * 32 + 4) * 4 + i // 16, 95 * 4 + 3]
    v = torch.arange(64 * 3, dtype=c.dtype)
    assert torch.equal(vector_sum(spread(v, "row", 3, (64, 96)), "row", 3), v * 32)
    vc = torch.arange(96 * 4, dtype=c.dtype)
    assert torch.equal(vector_sum(spread(vc, "col", 4, (64, 96)), "col", 4), vc * 16)


def test_grouped_bound_is_the_plain_bound_of_each_sub_product() -> None:
    """Row group h of C = A·B is checked like the product A·B[:, h]: the same tolerance, vector for vector."""
    gen = torch.Generator().manual_seed(0)
    x = activations((1, 512, 64), 1)
    w = torch.randn(1024, 64, generator=gen) / 8
    y = F.linear(x, w)
    shared = _ProjectionInput.of(x)
    w_norm, _ = shared.weight_norms(w, None)
    tol = Tolerance()
    with torch.no_grad():
        grouped = _verify(y, shared.feature_ref(w, None, 4), shared.token_ref(w, None, 2),
                          shared.x_norm_NT, w_norm, k=64, tol=tol, ref_norms=shared.ref_norms(w, (4, 2)),
                          groups=(4, 2))
        for h in range(4):
            block = slice(h * 256, (h + 1) * 256)
            plain = _verify(y[..., block].contiguous(), shared.feature_ref(w[block], None), shared.token_ref(
                w[block], None), shared.x_norm_NT, w_norm[block], k=64, tol=tol, ref_norms=shared.ref_norms(w[block]))
            got = grouped["row"].bound[0].view(512, 4)[:, h]
            assert torch.allclose(got, plain["row"].bound[0], rtol=1e-6, atol=0)
            # The references agree up to their own round-off (other summation orders), far inside the bound.
            ref_gap = (grouped["row"].ref[0].view(512, 4, 2)[:, h, 0] - plain["row"].ref[0][:, 0]).abs()
            assert bool((ref_gap <= 0.1 * got).all())
    assert not any(bool(chk.bad.any()) for chk in grouped.values())
    rule = bounds(shared.x_norm_NT, w_norm, k=64, out_dtype=y.dtype, tol=tol, ref_norms=shared.ref_norms(w))[0]
    # A group's σ is ~√g below the whole row's: clean checks are ~2× (g = 4) tighter.
    assert float(grouped["row"].bound.median()) < 0.7 * float(rule.of(None, y.square().sum(-1)).median())


def _product(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As a GPU GEMM with fp32 accumulation would: fp32 products rounded once to the dtype."""
    return F.linear(x.float(), w.float()).to(dtype)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(DTYPES), row=st.integers(0, 511), col=st.integers(0, 767),
       mag=st.sampled_from([4.0, 30.0, 1000.0]), sign=st.sampled_from([-1.0, 1.0]))
def test_one_error_in_any_group_is_located_and_corrected(make_ctx, dtype, row, col, mag, sign) -> None:
    """A 512-token × 768-feature projection (2 token groups, 3 feature groups): one error of mag × RMS anywhere is
    flagged and the output ends equal to the clean product (corrected in place, or recomputed when the half-precision
    residual is too noisy to place it); errors ≥ 30 × RMS are located and corrected."""
    x = activations((1, 512, 256), 3).to(dtype)
    w = (torch.randn(768, 256, generator=torch.Generator().manual_seed(4)) / 16).to(dtype)
    y = _product(x, w, dtype)
    rms = y.float().square().mean().sqrt().item()
    y_bad = y.clone()
    y_bad[0, row, col] = (y_bad[0, row, col].float() + sign * mag * rms).to(dtype)
    ctx, rec = make_ctx()
    check_linear(x, y_bad, w, None, ctx=ctx, op="out")
    assert len(rec.detections) == 1
    det = rec.detections[0]
    assert det.action in ("corrected", "recomputed")
    # A recompute runs the dtype's own GEMM (CPU bf16/fp16 F.linear), which may differ from the fp32-accumulated
    # product by an ulp; a correction writes the exact dot product.
    assert torch.allclose(y_bad.float(), y.float(), rtol=1e-2, atol=0.02 * rms)
    if mag >= 30:
        assert det.action == "corrected"
        assert (det.row, det.col) == (row, col)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("op", "value", "row", "col"), [("scores", 800.0, 300, 290), ("context", 100.0, 400, 33)])
def test_grouped_scores_and_context_correct_one_error(make_ctx, monkeypatch, dtype, op, value, row, col) -> None:
    """T = 512, unfused path (test_tiled_grouped.py pins the tiled path's groups): scores have 2 groups per row and
    column, the context 2 per column. A ~100 × RMS error in a second group is corrected in place, and the attention
    output equals the clean one. (One op per run: a corrected AS rebuilds CL, which drops a CL fault.)"""
    monkeypatch.setenv(PATH_ENV, "unfused")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 512, 64, generator=gen).to(dtype) for _ in range(3))
    ctx0, rec0 = make_ctx()
    with torch.no_grad():
        clean = protected_sdpa(q, k, v, ctx=ctx0, is_causal=True)
    assert rec0.detections == []
    ctx, rec = make_ctx([Fault(op=op, layer=0, step=0, kind="add", value=value, batch=0, head=1, row=row, col=col)])
    with torch.no_grad():
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert [(d.op, d.action, d.row, d.col) for d in rec.detections] == [(op, "corrected", row, col)]
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(out.float(), clean.float(), rtol=tol, atol=tol)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(DTYPES), outliers=st.sampled_from([1.0, 30.0, 100.0]), seed=st.integers(0, 2**16))
def test_clean_grouped_checks_raise_nothing(make_ctx, dtype, outliers, seed) -> None:
    """Clean 1024-token products (4 groups per direction) of LLM-like data, projection and causal attention (unfused
    path)."""
    x = activations((1, 1024, 128), seed, outliers=outliers if dtype != torch.float16 else min(outliers, 30.0))
    w = (torch.randn(3 * 512, 128, generator=torch.Generator().manual_seed(seed + 1)) / math.sqrt(128)).to(dtype)
    # 512 features: 2 groups per token row; 1024 tokens: 4 per feature column and per score row and column.
    x = x.to(dtype)
    qkv = _product(x, w, dtype)
    ctx, rec = make_ctx()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setenv(PATH_ENV, "unfused")
        check_linear(x, qkv, w, None, ctx=ctx, splits=(("q", 512), ("k", 512), ("v", 512)))
        q, k, v = (z.view(1, 1024, 8, 64).transpose(1, 2) for z in qkv.split(512, -1))
        protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert rec.detections == []
