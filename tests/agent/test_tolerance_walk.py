"""The calibrated bound's random-walk model (abft/tolerance.py `bounds(walk=...)`, docs/abft.md "The random-walk
model"): the model pinned by hand at a small size, clean projections never flagged on data built against it (a
common sign, massive channels, near-collinear tokens, partial sums sorted by sign), a single error a few times the
new threshold flagged, and the gain over the Cauchy-Schwarz model where it applies (projection rows)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tolerance_calibrated import activations

from attnchecker.abft import Tolerance, abs_max, bounds
from attnchecker.abft.tolerance import DRIFT, RANDOM_WALK
from attnchecker.emulate import emulate_fp32_matmul
from attnchecker.gemm.projection import _ProjectionInput

U64 = 2.0**-53


def test_walk_model_is_pinned_at_a_small_size() -> None:
    """Row of a = (3, -4) times B = [[1, 2], [2, -1]] (K = 2, n = 2), float64, every term by hand."""
    a_NR = torch.tensor([[3.0, -4.0]], dtype=torch.float64)
    b_KC = torch.tensor([[1.0, 2.0], [2.0, -1.0]], dtype=torch.float64)
    bw_K2 = b_KC @ torch.tensor([[1.0, 1.0], [1.0, 2.0]], dtype=torch.float64)  # B·1 = (3, 1), B·(1, 2) = (5, 0)
    row, _ = bounds(
        torch.linalg.vector_norm(a_NR, dim=-1), torch.linalg.vector_norm(b_KC, dim=-2), k=2, out_dtype=torch.float64,
        tol=Tolerance(sigmas=1.0), ref_norms=(torch.linalg.vector_norm(bw_K2, dim=-2), None),
        a_max_NR=abs_max(a_NR, dim=-1), b_max_NC=abs_max(b_KC, dim=-2), ref_maxes=(abs_max(bw_K2, dim=-2), None),
        walk=(True, False),
    )
    u2 = U64**2 / 3
    # Hölder per column: min(‖a‖²‖b_j‖∞², ‖a‖∞²‖b_j‖²) = min(25·4, 16·5) = 80 for both; reference: min(25·9, 16·10)
    # = 160 (d1), min(25·25, 16·25) = 400 (d2); forming Bw: ‖a‖²·n·(rw·Σw²‖b_j‖∞² + dr·‖Bw‖∞²), ‖Bw‖∞² = 9, 25.
    rw, dr = RANDOM_WALK, DRIFT
    var1 = 160 * (rw * 2 + 1) + 160 * rw * 2 + 25 * 2 * (rw * 8 + dr * 9)
    var2 = 400 * (rw * 2 + 1) + 400 * rw * 2 + 25 * 2 * (rw * 20 + dr * 25)
    c_NR = a_NR @ b_KC  # (-5, 10)
    sq = float(c_NR.square().sum())  # 125
    ref_12 = torch.tensor([[[5.0, 15.0]]], dtype=torch.float64)  # Σ_j w_j C_j for w = 1 and 1..2
    var1 += (rw * 2 + dr * 2) * sq + dr * (2 + 2) * 25  # checksum walk + product drift per ΣC²; drift per ref²
    var2 += (rw * 2 + dr * 2) * 4 * sq + dr * (2 + 2) * 225
    d1, d2 = row.pair(None, torch.tensor([[sq]], dtype=torch.float64), ref_12)
    under = float(row.offset_NV)  # the underflow offset (a float for a plain product)
    assert d1.item() == pytest.approx(math.sqrt(var1 * u2) + under, rel=1e-12)
    assert d2.item() == pytest.approx(math.sqrt(var2 * u2) + 1.5 * under, rel=1e-12)
    # With the exact second moments (Σ_j w_j² Σ_k a_k²b_kj² = 2·(9·1 + 16·4) = ... by hand below) in place of Hölder.
    mom_N14 = torch.tensor([[[9 * 1 + 16 * 4 + 9 * 4 + 16 * 1, 9 * 1 + 16 * 4 + 4 * (9 * 4 + 16 * 1),
                              9 * 9 + 16 * 1, 9 * 25 + 16 * 0]]], dtype=torch.float64)
    exact, _ = bounds(
        torch.linalg.vector_norm(a_NR, dim=-1), torch.linalg.vector_norm(b_KC, dim=-2), k=2, out_dtype=torch.float64,
        tol=Tolerance(sigmas=1.0), ref_norms=(torch.linalg.vector_norm(bw_K2, dim=-2), None),
        a_max_NR=abs_max(a_NR, dim=-1), b_max_NC=abs_max(b_KC, dim=-2), ref_maxes=(abs_max(bw_K2, dim=-2), None),
        walk=(True, False), moments_NR4=mom_N14[0],
    )
    p1, p2, r1, r2 = (float(v) * 1.01 for v in mom_N14[0, 0])  # (1.01: the fp32 GEMM's rounding slack)
    ex1 = p1 * (rw * 2 + 1) + min(r1, 160) * rw * 2 + min(25 * 2 * (rw * 8 + dr * 9), 2 * (rw * p1 + dr * r1))
    ex2 = p2 * (rw * 2 + 1) + min(r2, 400) * rw * 2 + min(25 * 2 * (rw * 20 + dr * 25), 2 * (rw * p2 + dr * r2))
    ex1 += (rw * 2 + dr * 2) * sq + dr * (2 + 2) * 25
    ex2 += (rw * 2 + dr * 2) * 4 * sq + dr * (2 + 2) * 225
    e1, e2 = exact.pair(None, torch.tensor([[sq]], dtype=torch.float64), ref_12)
    assert e1.item() == pytest.approx(math.sqrt(ex1 * u2) + under, rel=1e-9)
    assert e2.item() == pytest.approx(math.sqrt(ex2 * u2) + 1.5 * under, rel=1e-9)
    assert e1.item() < d1.item()
    # The drift term needs the reference: without it the rule falls back to its rigorous part.
    assert row.pair(None, torch.tensor([[sq]], dtype=torch.float64))[0].item() == row.of(None).item()


def test_walk_is_per_direction_and_the_other_keeps_cauchy_schwarz() -> None:
    gen = torch.Generator().manual_seed(0)
    a_NR, b_NC = torch.rand(1, 5, generator=gen) + 1, torch.rand(1, 7, generator=gen) + 1
    maxes = {"a_max_NR": a_NR / 2, "b_max_NC": b_NC / 2}
    plain = bounds(a_NR, b_NC, k=64, out_dtype=torch.float32, tol=Tolerance())
    row_only = bounds(a_NR, b_NC, k=64, out_dtype=torch.float32, tol=Tolerance(), walk=(True, False), **maxes)
    col, col_plain = row_only[1], plain[1]
    assert col_plain.var_NV2 is not None and col.var_NV2 is not None
    assert torch.equal(col.var_NV2, col_plain.var_NV2) and torch.equal(col.base, col_plain.base)
    assert (col.sq_coef, col.ref_coef, col.ref_sq_coef) == (col_plain.sq_coef, col_plain.ref_coef, 0.0)
    assert row_only[0].ref_sq_coef > 0 and plain[0].ref_sq_coef == 0
    assert bool((row_only[0].var_NV2 < plain[0].var_NV2).all())


def _operands(kind: str, t: int, d_in: int, d_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(X (1, T, I), W (O, I)) fp32 of one data kind the random-walk model must not be fooled by."""
    gen = torch.Generator().manual_seed(seed)
    x = activations((1, t, d_in), seed)
    w = torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)
    if kind == "drift":  # every product of one sign: post-GELU inputs, positive-mean weights
        x, w = F.gelu(x), w.abs() + 0.1 * w
    elif kind == "massive":  # a few channels ±300x on every token: the rows of X nearly collinear
        ch = torch.randperm(d_in, generator=gen)[:3]
        sign_T1 = torch.where(torch.rand(t, 1, generator=gen) < 0.5, -1.0, 1.0)
        x[0, :, ch] = 300.0 * sign_T1 * (1 + 0.01 * torch.randn(t, 3, generator=gen))
    elif kind == "sorted":  # X ≥ 0, W's first half of the inputs one sign, the rest the other: partial sums climb
        half_I = torch.where(torch.arange(d_in) < d_in // 2, 1.0, -1.0)  # and fall back, C ≈ 0
        x, w = x.abs(), w.abs() * half_I
    return x, w


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["llm", "drift", "massive", "sorted"]),
    dtype=st.sampled_from(["fp32", "tf32", "bf16", "fp16"]),
    t=st.integers(1, 80),
    d_in=st.sampled_from([16, 64, 256, 512]),
    d_out=st.sampled_from([8, 96, 512, 1024]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_clean_projections_never_flag_under_the_walk_model(kind, dtype, t, d_in, d_out, bias, seed) -> None:
    """Through the engine's projection check (rows on the random-walk model, columns Cauchy-Schwarz). tf32: emulated
    with truncated operands (the biased case)."""
    x, w = _operands(kind, t, d_in, d_out, seed)
    b = torch.randn(d_out, generator=torch.Generator().manual_seed(seed + 1)) * 0.1 if bias else None
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if half is not None:
        if dtype == "fp16":
            x = x / 8  # 300x channels times unit weights overflow fp16 in the unprotected model too
        x, w = x.to(half), w.to(half)
        b = None if b is None else b.to(half)
    with emulate_fp32_matmul("tf32", truncate=True) if dtype == "tf32" else torch.no_grad(), torch.no_grad():
        if half is not None:  # a GPU GEMM: fp32 accumulation, one rounding to the half dtype
            y = F.linear(x.float(), w.float(), None if b is None else b.float()).to(half)
        else:
            y = F.linear(x, w, b)
        checks = _ProjectionInput.of(x).checks(y, w, b, tol=Tolerance())
    for direction, chk in checks.items():
        assert not bool(chk.bad.any()), (direction, float((chk.diff[..., 0].abs() / chk.bound).max()))


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["llm", "drift", "massive"]),
    t=st.integers(1, 48),
    d_in=st.sampled_from([64, 512, 2048]),
    d_out=st.sampled_from([32, 512]),
    times=st.sampled_from([3.0, 5.0]),
    seed=st.integers(0, 2**16),
)
def test_a_single_error_a_few_times_the_walk_threshold_is_flagged(kind, t, d_in, d_out, times, seed) -> None:
    """fp32: an error of `times` × the row's threshold at a random element flags that row vector."""
    x, w = _operands(kind, t, d_in, d_out, seed)
    y = F.linear(x, w)
    clean = _ProjectionInput.of(x).checks(y, w, None, tol=Tolerance())["row"]
    gen = torch.Generator().manual_seed(seed + 2)
    row, col = int(torch.randint(t, (1,), generator=gen)), int(torch.randint(d_out, (1,), generator=gen))
    g = clean.groups
    v = row * g + col // (d_out // g)
    y_bad = y.clone()
    y_bad[0, row, col] += times * float(clean.bound[0, v])
    chk = _ProjectionInput.of(x).checks(y_bad, w, None, tol=Tolerance())["row"]
    assert bool(chk.bad[0, v])
    assert int(chk.bad.sum()) == 1


def test_the_walk_threshold_is_far_below_cauchy_schwarz_at_a_long_reduction() -> None:
    """K = 4096 LLM-like rows, 384 outputs (one group): the projection rows' threshold is over 10x below the
    Cauchy-Schwarz one made from the same norms (the reason for the model), and an error at 3x the new threshold,
    which the Cauchy-Schwarz threshold would pass, is flagged."""
    x, w = _operands("llm", 8, 4096, 384, 3)
    y = F.linear(x, w)
    new = _ProjectionInput.of(x).checks(y, w, None, tol=Tolerance())["row"]
    assert new.groups == 1
    w_sums_I2 = w.T @ torch.stack([torch.ones(384), torch.arange(1, 385, dtype=torch.float32)], -1)
    old_rule, _ = bounds(torch.linalg.vector_norm(x, dim=-1), torch.linalg.vector_norm(w, dim=-1), k=4096,
                         out_dtype=torch.float32, tol=Tolerance(),
                         ref_norms=(torch.linalg.vector_norm(w_sums_I2, dim=0)[None], None))
    old_bound = old_rule.pair(None, y.square().sum(-1), new.ref)[0]
    assert float((old_bound / new.bound).median()) > 10
    y_bad = y.clone()
    y_bad[0, 5, 7] += 3 * float(new.bound[0, 5])
    assert 3 * float(new.bound[0, 5]) < float(old_bound[0, 5])
    assert bool(_ProjectionInput.of(x).checks(y_bad, w, None, tol=Tolerance())["row"].bad[0, 5])


@pytest.mark.parametrize("d_out", [96, 1024])
def test_second_moments_are_exact_per_group(d_out) -> None:
    """_ProjectionInput.second_moments against Σ_j w_j² Σ_i X_ti² W_ji² and Σ_i X_ti² (Wᵀw)_i² by hand (d_out = 1024:
    4 groups of 256)."""
    from attnchecker.abft import group_count

    x, w = _operands("llm", 5, 64, d_out, 7)
    g = group_count(d_out)
    got_NV4 = _ProjectionInput.of(x).second_moments(w, g)
    x64, w64 = x[0].double(), w.double().view(g, -1, 64)
    pos_L = torch.arange(1, d_out // g + 1, dtype=torch.float64)
    per_TgL = torch.einsum("ti,gli->tgl", x64.square(), w64.square())
    ww_gI2 = torch.einsum("gli,lc->gic", w64, torch.stack([torch.ones_like(pos_L), pos_L], -1))
    want_Tg4 = torch.cat([torch.stack([per_TgL.sum(-1), (per_TgL * pos_L.square()).sum(-1)], -1),
                          torch.einsum("ti,gic->tgc", x64.square(), ww_gI2.square())], -1)
    torch.testing.assert_close(got_NV4[0].double(), want_Tg4.flatten(0, 1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(3, 200, 1024), (2, 7, 16)], ids=["blocked", "one-block"])
def test_square_times_matches_the_plain_product(shape) -> None:
    """abft.square_times squares a block of rows at a time on CPU (a batch blocked along its rows too)."""
    from attnchecker.abft import square_times

    gen = torch.Generator().manual_seed(1)
    a, m = torch.randn(shape, generator=gen), torch.randn(shape[-1], 8, generator=gen)
    want = a.double().square() @ m.double()
    torch.testing.assert_close(square_times(a, m).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
