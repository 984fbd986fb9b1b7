"""abft.vector_rules: direction_bounds' rule factored into the scalars a kernel evaluates per vector (the Triton
attention backward's checks), held to direction_bounds itself, and the bound on Σ_j dS_ij held to real data."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import Tolerance, direction_bounds
from attnchecker.abft.tolerance import TF32_OPERAND_ROUNDOFF
from attnchecker.abft.vector_rules import (
    product_bound,
    product_rule,
    product_terms,
    softmax_grad_bound,
    softmax_grad_rule,
)

TOLERANCES = (Tolerance(), Tolerance(calibrated=False), Tolerance(mode="extreme"), Tolerance(factor=3.0))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 24), k=st.integers(1, 96), n=st.integers(1, 64), tol=st.sampled_from(TOLERANCES),
       tf32=st.booleans(), magnitude=st.sampled_from([1e-20, 1e-6, 1.0, 1e12]), seed=st.integers(0, 2**16))
def test_the_factored_rule_is_direction_bounds(m: int, k: int, n: int, tol: Tolerance, tf32: bool, magnitude: float,
                                               seed: int) -> None:
    """Every term, every mode, operand rounding (TF32) or not, from vanishing to huge operands: the same bound on |d1|
    and |d2| per row as direction_bounds (to fp32 round-off of the bound itself), so the kernel's verdicts are the
    engine's."""
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(shape, generator=g) * magnitude for shape in ((m, k), (k, n)))
    c = a @ b
    w = torch.stack([torch.ones(n), torch.arange(1, n + 1, dtype=torch.float32)], -1)
    ref = a @ (b @ w)
    r = TF32_OPERAND_ROUNDOFF if tf32 else None
    ref_norm = (b @ w).norm(dim=0)
    want = direction_bounds(("row",), a.norm(dim=-1), b.norm(dim=0), k=k, out_dtype=torch.float32, tol=tol,
                            operand_roundoff=r, ref_norms=(ref_norm, None))["row"].pair(None, c.square().sum(-1), ref)
    rule = product_rule(n, k, tol, operand_roundoff=r)
    got = product_bound(rule, a.norm(dim=-1), *product_terms(rule, b.norm(dim=0), ref_norm), c.square().sum(-1), ref)
    for x, y in zip(got, want, strict=True):
        # atol: bounds of ~1e-45 (operands of 1e-20), which direction_bounds keeps in fp32 subnormals.
        torch.testing.assert_close(x, y.double(), rtol=1e-4, atol=1e-40)


def test_the_kernel_scalars_carry_the_rule() -> None:
    """scalars() is what the kernels get: its square roots and flags in the documented order."""
    rule = product_rule(64, 128, Tolerance(), operand_roundoff=TF32_OPERAND_ROUNDOFF)
    s = rule.scalars()
    assert len(s) == 12 and s[3] == 1.0 and s[8] == 64.0
    assert math.isclose(s[5] ** 2, rule.var_b) and math.isclose(s[7] ** 2, rule.c_sq) and s[11] == rule.common > 0


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 48), s=st.integers(1, 48), d=st.sampled_from([8, 32, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), spread=st.sampled_from([0.3, 1.0, 3.0]),
       p=st.sampled_from([0.0, 0.2]), seed=st.integers(0, 2**16))
def test_the_row_sums_of_ds_and_ap_stay_within_their_bounds_on_clean_data(
        t: int, s: int, d: int, dtype: torch.dtype, spread: float, p: float, seed: int) -> None:
    """Σ_j dS_ij and Σ_j AP_ij - 1 of a backward recomputed in fp32 from the inputs' dtype, against a fused forward
    made in float64 (its output and lse rounded as a forward hands them on), dropout included: within their bounds,
    with room. At unit spread the bounds are small enough to see what they are for: in fp32 below 1e-3 of the size
    of Σ_j dS_ij's terms (2‖dO_i‖ max‖V_j‖), so a δ that far off is seen; in every dtype below 1e-3 for Σ_j AP_ij,
    so an lse 1e-3 off is."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (((torch.randn(n, d, generator=g) * spread).to(dtype)) for n in (t, s, s, t))
    scale = 1 / math.sqrt(d)
    keep = (torch.rand(t, s, generator=g) >= p).double() / (1 - p)
    z64 = (q.double() @ k.double().T) * scale
    lse = torch.logsumexp(z64, -1).float()
    out = ((torch.softmax(z64, -1) * keep) @ v.double()).to(dtype)
    delta = (do.float() * out.float()).sum(-1)
    probs = torch.exp((q.float() @ k.float().T) * scale - lse[:, None])
    dp = (do.float() @ v.float().T) * keep.float()
    rows = (probs * (dp - delta[:, None])).sum(-1)
    rule = softmax_grad_rule(t=t, s=s, d=d, dtype=dtype, tol=Tolerance())
    bound, bound_p = softmax_grad_bound(rule, scale=scale, q_norm_V=q.float().norm(dim=-1),
                                        k_max_V=k.float().norm(dim=-1).max().expand(t), mask_live_V=torch.zeros(t),
                                        lse_V=lse, do_norm_V=do.float().norm(dim=-1),
                                        v_max_V=v.float().norm(dim=-1).max().expand(t), dropout_p=p)
    assert bool((rows.abs().double() <= 0.5 * bound).all()), float((rows.abs().double() / bound).max())
    sums = (probs.sum(-1) - 1).abs().double()
    assert bool((sums <= 0.5 * bound_p).all()), float((sums / bound_p).max())
    if spread <= 1.0:
        assert bool((bound_p < 1e-3).all()), float(bound_p.max())
        if dtype == torch.float32:
            terms = 2 * do.float().norm(dim=-1) * v.float().norm(dim=-1).max() / (1 - p)
            assert bool((bound < 1e-3 * terms.double()).all()), float((bound / terms).max())
