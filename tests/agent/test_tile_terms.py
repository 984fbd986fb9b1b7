"""abft.tile_terms: the rule the Triton kernel evaluates per tile vector is tolerance.direction_bounds', term by term,
in every tolerance mode, with and without TF32 operand rounding (Cauchy-Schwarz or moments)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import Tolerance, direction_bounds
from attnchecker.abft.tile_terms import tile_terms
from attnchecker.abft.tolerance import TF32_OPERAND_ROUNDOFF

TOLERANCES = {
    "calibrated": Tolerance(),
    "rigorous": Tolerance(calibrated=False),
    "extreme": Tolerance(mode="extreme"),
    "tight": Tolerance(factor=0.02, sigmas=2.0),
}


@settings(max_examples=60)
@given(v=st.integers(1, 20), n=st.integers(1, 64), k=st.integers(1, 256), tol=st.sampled_from(sorted(TOLERANCES)),
       rounding=st.sampled_from(["ieee", "tf32", "tf32-moments"]), magnitude=st.sampled_from([1e-12, 1.0, 1e6]),
       seed=st.integers(0, 2**20))
def test_tile_terms_give_direction_bounds_rule(v, n, k, tol, rounding, magnitude, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    a_V = torch.rand(v, generator=g) * magnitude
    b_N = torch.rand(n, generator=g) * magnitude
    ref_norm_2 = torch.rand(2, generator=g) * magnitude * n
    sq_V = torch.rand(v, generator=g) * magnitude**2 * n
    ref_V2 = torch.randn(v, 2, generator=g) * magnitude
    ref_V2[0, 0] = float("nan")  # a non-finite reference adds nothing to the truncation term
    moments = torch.rand(v, 4, generator=g) * magnitude**2 if rounding == "tf32-moments" else None
    u_in = None if rounding == "ieee" else TF32_OPERAND_ROUNDOFF
    rule = direction_bounds(("row",), a_V, b_N, k=k, out_dtype=torch.float32, tol=TOLERANCES[tol],
                            ref_norms=(ref_norm_2, None), operand_roundoff=u_in,
                            operand_moments=(moments, None))["row"]
    want = rule.pair(None, sq_V, ref_V2)
    terms = tile_terms(n, k, TOLERANCES[tol], operand_roundoff=u_in, moments=moments is not None)
    got = terms.pair(a_V, b_N, ref_norm_2, sq_V, ref_V2, moments)
    for g_, w in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w.expand_as(g_), rtol=2e-6, atol=0.0)
