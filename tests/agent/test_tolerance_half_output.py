"""Half-precision outputs (bf16/fp16 GEMMs accumulating in fp32) in the calibrated tolerance (abft/tolerance.py):
correlated output rounding of near-equal values, and clean products far above NEAR_INF (diverged bf16 training), are
not flagged; single errors of a few RMS and near-INF faults still are. Both clean cases were false positives of the
clean training campaign (bench/clean_campaign.py, docs/fault-coverage.md)."""
from __future__ import annotations

import pytest
import torch

from attnchecker.abft import NEAR_INF, Tolerance
from attnchecker.abft.gemm import verify_gemm

BF16_LO, BF16_HI = 1.2421875, 1.25
"""Adjacent bf16 values (step 2^-7); their midpoint is 1.24609375."""


def uniform_attention_context(t: int = 64, d: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(P (t, t), V (t, d), C = P·V (t, d)) in bf16. P is a softmax of equal scores (exactly 1/t: attention at
    initialisation, or a padded row); each V column holds t/2 + 1 copies of 1.25 and the rest 1.2421875, so every
    exact C element is 1.24621582, just above the bf16 midpoint: all t·d outputs round up by the same 0.0038. The
    residual of a column (or row) adds t (or d) equal errors: linear, not √t as independent rounding would give."""
    gen = torch.Generator().manual_seed(seed)
    v_TD = torch.full((t, d), BF16_LO)
    for j in range(d):
        v_TD[torch.randperm(t, generator=gen)[: t // 2 + 1], j] = BF16_HI
    p_TT = torch.softmax(torch.zeros(t, t), -1).to(torch.bfloat16)
    v_TD = v_TD.to(torch.bfloat16)
    return p_TT, v_TD, p_TT @ v_TD


def flagged(chk: dict) -> int:
    return sum(int(c.bad.sum()) for c in chk.values())


def test_correlated_output_rounding_is_not_flagged() -> None:
    p, v, c = uniform_attention_context()
    exact = p.double() @ v.double()
    assert torch.all(c == BF16_HI) and torch.all(exact < 1.2463)  # the premise: one common rounding
    chk = verify_gemm(c, p, v, Tolerance())
    # Without the common-mode term every column was flagged: |d1| 0.242 over a variance-only bound of 0.226.
    assert flagged(chk) == 0
    col = chk["col"]
    assert float(col.diff[..., 0].abs().max()) == pytest.approx(64 * (BF16_HI - float(exact[0, 0])), rel=1e-3)


@pytest.mark.parametrize("magnitude", [2.0, 1.0])
@pytest.mark.parametrize("where", [(5, 7), (63, 0), (0, 31)])
def test_a_few_rms_error_in_such_a_column_is_still_flagged(magnitude: float, where: tuple[int, int]) -> None:
    p, v, c = uniform_attention_context()
    rms = float(c.float().square().mean().sqrt())
    bad = c.clone()
    bad[where] += magnitude * rms
    chk = verify_gemm(bad, p, v, Tolerance())
    assert bool(chk["row"].bad[0, where[0]]) and bool(chk["col"].bad[0, where[1]])
    assert flagged(chk) == 2


def huge_product(scale: float, b_scale: float | None = None, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """(A (64, 64), B (64, 48), C = A·B) in bf16, A of magnitude `scale`, B of `b_scale` (default the same):
    C ~ 8·scale·b_scale."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(64, 64, generator=gen) * scale).to(torch.bfloat16)
    b = (torch.randn(64, 48, generator=gen) * (scale if b_scale is None else b_scale)).to(torch.bfloat16)
    return a, b, a @ b


def test_a_clean_product_far_above_near_inf_is_not_flagged() -> None:
    """Gradients of a diverged bf16 run reach 1e13-1e21: the product is still correct to its own rounding, and a bound
    clamped at NEAR_INF (1e10) flagged it."""
    a, b, c = huge_product(1e6)
    assert float(c.float().abs().max()) > 1e13
    chk = verify_gemm(c, a, b, Tolerance())
    assert flagged(chk) == 0
    assert float(chk["row"].diff[..., 0].abs().max()) > NEAR_INF  # the premise: clean residuals above the old clamp


def test_errors_in_a_huge_product_and_near_inf_faults_are_still_flagged() -> None:
    a, b, c = huge_product(1e6)
    rms = float(c.float().square().mean().sqrt())
    bad = c.clone()
    bad[3, 4] += 2 * rms
    assert flagged(verify_gemm(bad, a, b, Tolerance())) >= 2
    # The injector's near-INF fault (1e20) in a product of ordinary operands, and a high exponent bit flipped.
    a, b, c = huge_product(1.0)
    for value in (1e20, float(c[7, 9]) * 2.0**64):
        bad = c.clone()
        bad[7, 9] = value
        chk = verify_gemm(bad, a, b, Tolerance())
        assert bool(chk["row"].bad[0, 7]) and bool(chk["col"].bad[0, 9])


def test_operand_norms_that_overflow_fp32_are_taken_in_float64_on_the_slow_path() -> None:
    """Elements of ~1e19 and up: ‖row‖² overflows fp32, the fast path's bound is undefined (NEAR_INF fallback) and
    flags; the slow path (gemm.check, wide_norms) bounds the same clean product, and still flags a 2× RMS error."""
    a, b, c = huge_product(1e19, 1e-3)
    assert float(c.float().abs().max()) > 1e16 and bool(torch.isfinite(c.float()).all())
    assert flagged(verify_gemm(c, a, b, Tolerance())) > 0  # the premise: fp32 norms are INF
    chk = verify_gemm(c, a, b, Tolerance(), wide_norms=True)
    assert flagged(chk) == 0
    rms = float(c.float().square().mean().sqrt())
    bad = c.clone()
    bad[3, 4] += 2 * rms
    chk = verify_gemm(bad, a, b, Tolerance(), wide_norms=True)
    assert bool(chk["row"].bad[0, 3]) and bool(chk["col"].bad[0, 4])

