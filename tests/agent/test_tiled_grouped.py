"""Grouped checksums on the tiled attention path (issue 13 on issue 12's tiles): a scores or context tile of >= 512
keys (queries, features) carries one checksum pair per run of >= GROUP_MIN, as the unfused path does, with the same
per-group calibrated bound. Pinned: with one planted error the tiled check flags exactly the vectors the unfused check
flags (where the tile spans the whole row, and its 256 query rows are one of the unfused path's column groups); the
engine corrects it in place on the tiled path; clean inputs of >= 512 keys raise nothing; ΣAS² per group from Grams
(the per-call key Gram cache included) equals the tile's own."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tolerance_calibrated import activations

from attnchecker.abft import GROUP_MIN, Tolerance, checksums_of, group_count
from attnchecker.abft.tiled import fold_scores, gram, grams_pay, square_sums
from attnchecker.attention.backends.tiled_torch import (
    PATH_ENV,
    TILE_ENV,
    _KeyGrams,
    context_tile_checks,
    scores_tile_checks,
)
from attnchecker.attention.pipeline import context_checks, protected_sdpa, scores_checks
from attnchecker.checks import product
from attnchecker.inject import Fault

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK_Q = 256  # the default query block: one of the unfused path's column groups at T = 512
T, H, D = 512, 2, 32


def _operands(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (1, H, T, D) from LLM-like hidden states (outlier features; keys share a direction, as real ones do)."""
    g = torch.Generator().manual_seed(seed + 1)
    x = activations((1, T, 64), seed, outliers=30.0 if dtype != torch.float16 else 10.0)
    wq, wk, wv = (torch.randn(H * D, 64, generator=g) / 8 for _ in range(3))
    q, k, v = ((x @ w.T).view(1, T, H, D).transpose(1, 2).contiguous() for w in (wq, wk, wv))
    return q.to(dtype), (k + 1.0).to(dtype), v.to(dtype)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """As a GPU GEMM with fp32 accumulation: fp32 products rounded once to the dtype."""
    return (a.float() @ b.float()).to(a.dtype)


def _tiled_scores_flags(q, k, s_bad, tol):
    """(row flags (1, H, T·g_r), column flags (1, H, S, T/BLOCK_Q)) of the tiled scores checks, tile by tile."""
    q_acc, k_acc = q.float(), k.float()
    rows, cols = [], []
    for r0 in range(0, T, BLOCK_Q):
        q_i = q_acc[..., r0 : r0 + BLOCK_Q, :]
        chk = scores_tile_checks(s_bad[..., r0 : r0 + BLOCK_Q, :], q_i, k_acc, q_i.norm(dim=-1), k_acc.norm(dim=-1),
                                 tol=tol)
        rows.append(chk["row"].bad)
        cols.append(chk["col"].bad)
        assert chk["col"].groups == 1  # a 256-row column is one group
    return torch.cat(rows, -1), torch.stack(cols, -1)


def _unfused_col_flags(bad_NV: torch.Tensor, groups: int) -> torch.Tensor:
    """Unfused column flags (…, S·g_c) as (…, S, g_c): group h of column j is rows h·T/g_c.. of it."""
    return bad_NV.unflatten(-1, (-1, groups))


def _plant(c: torch.Tensor, head: int, row: int, col: int, delta: float) -> torch.Tensor:
    bad = c.clone()
    bad[0, head, row, col] = (bad[0, head, row, col].float() + delta).to(c.dtype)
    return bad


@settings(max_examples=12, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(DTYPES), head=st.integers(0, H - 1), row=st.integers(0, T - 1), col=st.integers(0, T - 1),
       mag=st.sampled_from([2.0, 8.0, 100.0, 1e4]), sign=st.sampled_from([-1.0, 1.0]), seed=st.integers(0, 50))
def test_tiled_scores_check_flags_what_the_unfused_check_flags(dtype, head, row, col, mag, sign, seed) -> None:
    """T = S = 512, no mask: a 256-row tile over all 512 keys has 2 key groups per row, as the unfused row; its
    columns (256 rows) are the unfused path's 2 column groups. One error of mag × RMS anywhere: the same vectors
    flag on both paths, and they are the error's row group and column group."""
    q, k, _ = _operands(dtype, seed)
    s = _product(q, k.mT)
    rms = s.float().square().mean().sqrt().item()
    s_bad = _plant(s, head, row, col, sign * mag * rms)
    if torch.equal(s_bad, s):
        return  # the error rounded away in half precision
    tol = Tolerance()
    unfused = scores_checks(q, k, s_bad, {}, H, tol)
    g = group_count(T)
    assert g == 2 and unfused["row"].groups == g and unfused["col"].groups == g
    rows, cols = _tiled_scores_flags(q, k, s_bad, tol)
    assert torch.equal(rows, unfused["row"].bad)
    assert torch.equal(cols, _unfused_col_flags(unfused["col"].bad, g))
    want_rows = torch.zeros_like(rows)
    want_rows[0, head, row * g + col // (T // g)] = True
    want_cols = torch.zeros_like(cols)
    want_cols[0, head, col, row // BLOCK_Q] = True
    assert torch.equal(rows, want_rows) and torch.equal(cols, want_cols)


def _tiled_probs(q: torch.Tensor, k: torch.Tensor, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P̃ (1, H, T, S) fp32 as the tiled path's one-tile-per-block fold makes it, Σ P̃ per row, AP = P̃ / ΣP̃)."""
    scale = 1 / math.sqrt(D)
    p_rows, l_rows = [], []
    for r0 in range(0, T, BLOCK_Q):
        s_ij = q[..., r0 : r0 + BLOCK_Q, :].float() @ k.float().mT
        m0 = torch.full(s_ij.shape[:-1], -math.inf)
        off = r0 if causal else None
        p, _, _, l_, _ = fold_scores(s_ij, m0, torch.zeros_like(m0), scale=scale, blocked=None, additive=None,
                                     causal_offset=off)
        p_rows.append(p)
        l_rows.append(l_)
    p, l_ = torch.cat(p_rows, -2), torch.cat(l_rows, -1)
    return p, l_, p / l_[..., None]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(DTYPES), head=st.integers(0, H - 1), row=st.integers(0, T - 1), col=st.integers(0, D - 1),
       mag=st.sampled_from([2.0, 8.0, 100.0, 1e4]), sign=st.sampled_from([-1.0, 1.0]), seed=st.integers(0, 50))
def test_tiled_context_check_flags_what_the_unfused_check_flags(dtype, head, row, col, mag, sign, seed) -> None:
    """Causal T = S = 512: CL's columns are 2 groups of 256 queries on the unfused path and one 256-row tile each on
    the tiled path. One error of mag × RMS of CL in the output (e on the unfused CL is e·ΣP̃ on the tile's P̃V, the
    same error once the tiled path divides by ΣP̃): the same vectors flag on both paths."""
    q, k, v = _operands(dtype, seed)
    p, l_, ap = _tiled_probs(q, k, causal=True)
    p_c, ap_c = p.to(dtype), ap.to(dtype)
    cl = _product(ap_c, v)
    rms = cl.float().square().mean().sqrt().item()
    delta = sign * mag * rms
    cl_bad = _plant(cl, head, row, col, delta)
    pv_bad = _plant(_product(p_c, v), head, row, col, delta * float(l_[0, head, row]))
    if torch.equal(cl_bad, cl):
        return
    tol = Tolerance()
    unfused = context_checks(ap_c, v, cl_bad, None, H, tol)
    g = group_count(T)
    assert unfused["row"].groups == 1 and unfused["col"].groups == g
    v_acc = v.float()
    vw = checksums_of(v_acc)[0]  # V w per key, (1, H, S, 2)
    rows, cols = [], []
    for r0 in range(0, T, BLOCK_Q):
        # Causal: block i's tile spans its prefix of keys only (TilePlan.keys); the P̃ beyond it is 0.
        r1 = r0 + BLOCK_Q
        chk = context_tile_checks(pv_bad[..., r0:r1, :], p_c[..., r0:r1, :r1], v_acc[..., :r1, :], vw[..., :r1, :],
                                  l_[..., r0:r1], None, tol=tol, g_v=1)
        rows.append(chk["row"].bad)
        cols.append(chk["col"].bad)
    assert torch.equal(torch.cat(rows, -1), unfused["row"].bad)
    assert torch.equal(torch.stack(cols, -1), _unfused_col_flags(unfused["col"].bad, g))
    assert bool(unfused["row"].bad[0, head, row]) or bool(unfused["col"].bad[0, head, col * g + row // BLOCK_Q])


@pytest.fixture
def tiled(monkeypatch):
    monkeypatch.setenv(PATH_ENV, "tiled")
    monkeypatch.delenv(TILE_ENV, raising=False)


CASES = [("scores", 800.0, 300, 290, True), ("scores", 40.0, 100, 700, False), ("context", 100.0, 400, 33, True)]


@pytest.mark.usefixtures("tiled")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("op", "value", "row", "col", "causal"), CASES)
def test_one_error_in_a_second_group_is_corrected_in_place_on_the_tiled_path(make_ctx, dtype, op, value, row, col,
                                                                             causal) -> None:
    """Default tiles (256 queries × all keys): the scores error sits in the second key group of its row (causal
    block 1 spans 512 keys in 2 groups; S = 768 without a mask: 3 groups). It is located and corrected in place
    (action "corrected": the fault is persistent, so the slow path's recompute of the block sees it again), and the
    output equals the clean one."""
    _corrected_in_place(make_ctx, dtype, op, value, row, col, causal)


@pytest.mark.usefixtures("tiled")
@pytest.mark.parametrize(("op", "value", "row", "col", "causal"), CASES)
def test_a_bf16_error_is_caught_with_cublas_reduced_precision_reductions_at_their_default(
        make_ctx, monkeypatch, op, value, row, col, causal) -> None:
    """On a GPU PyTorch lets cuBLAS reduce bf16 partial sums in bf16 (allow_bf16_reduced_precision_reduction, True by
    default), and the bound of a product made that way models a bf16 accumulation, loose enough to hide a 40x error.
    The tile GEMMs are the engine's own: they run with fp32 reductions, which their bound models. The CUDA branch of
    the bound is forced here on the CPU (the product counts as cuBLAS's); the flag is the user's again after."""
    flags = torch.backends.cuda.matmul
    assert flags.allow_bf16_reduced_precision_reduction  # PyTorch's default
    monkeypatch.setattr(product, "_cublas_made", lambda _c: True)
    _corrected_in_place(make_ctx, torch.bfloat16, op, value, row, col, causal)
    assert flags.allow_bf16_reduced_precision_reduction


def _corrected_in_place(make_ctx, dtype, op, value, row, col, causal) -> None:
    gen = torch.Generator().manual_seed(5)
    s = 512 if causal else 768
    q = torch.randn(1, 2, 512, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, s, 64, generator=gen).to(dtype) for _ in range(2))
    ctx0, rec0 = make_ctx()
    with torch.no_grad():
        clean = protected_sdpa(q, k, v, ctx=ctx0, is_causal=causal)
    assert rec0.detections == []
    ctx, rec = make_ctx([Fault(op=op, layer=0, step=0, kind="add", value=value, batch=0, head=1, row=row, col=col,
                                persistent=True)])
    with torch.no_grad():
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=causal)
    assert [(d.op, d.action, d.row, d.col) for d in rec.detections] == [(op, "corrected", row, col)]
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(out.float(), clean.float(), rtol=tol, atol=tol)


@pytest.mark.usefixtures("tiled")
@settings(max_examples=4, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(DTYPES), causal=st.booleans(), d=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_clean_grouped_tiles_raise_nothing(make_ctx, dtype, causal, d, seed) -> None:
    """Clean attention over 1024 LLM-like tokens on the tiled path: up to 4 key groups per scores row; ΣAS² from Grams
    (D = 16, fp32) or from the tile (D = 64); causal and not."""
    x = activations((1, 1024, 4 * d), seed, outliers=30.0 if dtype != torch.float16 else 10.0)
    w = torch.randn(3 * 4 * d, 4 * d, generator=torch.Generator().manual_seed(seed + 1)) / math.sqrt(4 * d)
    q, k, v = ((x @ wp.T).view(1, 1024, 4, d).transpose(1, 2).to(dtype) for wp in w.split(4 * d))
    ctx, rec = make_ctx()
    with torch.no_grad():
        protected_sdpa(q, k, v, ctx=ctx, is_causal=causal)
    assert rec.detections == []


@settings(max_examples=20, deadline=None, derandomize=True)
@given(tq=st.sampled_from([256, 512]), s=st.sampled_from([256, 512, 768, 1000, 1024]), d=st.integers(1, 16),
       c0_blocks=st.integers(0, 2), seed=st.integers(0, 2**20))
def test_grouped_square_sums_from_cached_grams_equal_the_tile_s(tq, s, d, c0_blocks, seed) -> None:
    """ΣAS² per checksum group from the call's key Gram cache (chunks of GROUP_MIN keys summed per group, or a
    direct Gram off that grid) and a query block's Gram equals the grouped squaring pass over the tile."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, s + c0_blocks * GROUP_MIN, d, generator=g, dtype=torch.float64)
    c0, c1 = c0_blocks * GROUP_MIN, c0_blocks * GROUP_MIN + s
    groups = (group_count(s), group_count(tq))
    cache = _KeyGrams(k)
    rows, cols = square_sums(q, k[..., c0:c1, :], cache.of(c0, c1, groups[0]), gram(q, groups[1]))
    _, _, sums = checksums_of(q @ k[..., c0:c1, :].mT, with_abs=False, with_sq=True, groups=groups)
    assert sums is not None and sums.sq_sum is not None
    torch.testing.assert_close(rows, sums.sq_sum[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cols, sums.sq_sum[1], rtol=1e-10, atol=1e-10)
    # The cache: on the chunk grid, chunk Grams of all keys, made once; off it, the range's Grams, kept for the next
    # query block's visit.
    again = cache.of(c0, c1, groups[0])
    if cache.chunks is None:
        assert again is cache.off_grid[(c0, c1, groups[0])]
    else:
        assert cache.chunks.shape[-3] == k.shape[-2] // GROUP_MIN and not cache.off_grid


def test_grams_pay_only_where_cheaper_than_a_pass() -> None:
    """GPT-2-class heads (D = 32) over a 4096-key causal prefix: Grams; 7B-class heads (D = 128): the squaring pass,
    grouped or not."""
    assert grams_pay(256, 4096, 32, (16, 1))
    assert not grams_pay(256, 4096, 128, (16, 1))
    assert not grams_pay(256, 256, 128, (1, 1))


@pytest.mark.usefixtures("tiled")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_error_between_the_group_bound_and_the_plain_bound_is_caught_on_the_tiled_path(make_ctx, dtype) -> None:
    """S = 1024 keys, no mask: the row of the error has small ‖q‖, its block's other queries are large (a loose column
    bound) and the keys of the row's other groups are large (a loose whole-row bound). An error of 3 × its key group's
    bound is then below both the plain row bound and the column bound: only the grouped row check sees it. The tiled
    path catches and corrects it (before grouping reached the tiled path it was missed)."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 1, 256, 64, generator=gen) * 10
    k = torch.randn(1, 1, 1024, 64, generator=gen)
    v = torch.randn(1, 1, 1024, 64, generator=gen)
    row, col = 17, 100  # key group 0 of row 17
    q[0, 0, row] *= 0.01
    k[0, 0, 256:] *= 10
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = _product(q, k.mT)

    def bounds_at(tol: Tolerance) -> tuple[float, float]:
        chk = scores_checks(q, k, s, {}, 1, tol)
        g_r, g_c = chk["row"].groups, chk["col"].groups
        return (float(chk["row"].bound[0, 0, row * g_r + col // (1024 // g_r)]),
                float(chk["col"].bound[0, 0, col * g_c]))

    (b_group, b_col), (b_plain, _) = bounds_at(Tolerance()), bounds_at(Tolerance(grouped=False))
    value = 3 * b_group
    assert value < b_plain / 2 and value < b_col / 2  # the setting the test needs
    ctx, rec = make_ctx([Fault(op="scores", layer=0, step=0, kind="add", value=value, row=row, col=col,
                               persistent=True)])
    ctx0, _ = make_ctx()
    with torch.no_grad():
        clean = protected_sdpa(q, k, v, ctx=ctx0)
        out = protected_sdpa(q, k, v, ctx=ctx)
    assert [(d.op, d.row) for d in rec.detections] == [("scores", row)]
    if dtype == torch.float32:
        assert (rec.detections[0].action, rec.detections[0].col) == ("corrected", col)
    # Half precision: an error this close to its bound is placed by d2/d1 only to within a few columns, or not at all
    # (then escalated as uncorrectable, the fault persisting through the recompute); 3 bounds do not show in the
    # output either way.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), clean.float(), rtol=tol, atol=tol)


def test_a_tiles_worst_clean_ratio_takes_d2_as_the_unfused_path_does() -> None:
    """The margin histogram's per-tile ratio is the larger of |d1|/bound and |d2|/bound2 over unflagged vectors, as
    records._ratio takes it on the unfused path (d1 alone read 0.1 here, where d2 sits at 0.9 of its bound)."""
    from attnchecker.abft.checksum import DirectionCheck
    from attnchecker.abft.tolerance import Bound
    from attnchecker.attention.backends.tiled_torch import _keep

    def check(d1: float, d2: float) -> DirectionCheck:
        diff = torch.tensor([[[d1, d2], [0.0, 0.0]]])  # (1, V=2, 2)
        bound = torch.ones(1, 2)
        return DirectionCheck(ref=torch.zeros(1, 2, 2), diff=diff, bound=bound, bad=torch.zeros(1, 2, dtype=torch.bool),
                              rule=Bound(bound), bound2=10 * bound)

    flag, _, _, worst = _keep({"row": check(0.1, 9.0), "col": check(0.05, 0.0)})
    assert not bool(flag.any())
    assert float(worst) == pytest.approx(0.9)
