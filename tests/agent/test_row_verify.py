"""The native clean row check (row_verify.c, issue 17): the verdict the engine acts on for fp32 products checked by
rows is the eager rule's (direction_bounds, Bound.pair, verify_direction), vector by vector.

- Over shapes, checksum groups, a bias or none, the random-walk model (projection rows, with and without moments) or
  Cauchy-Schwarz (whole-step GEMM rows), five tolerance settings, and 0 to 3 faults from 1e-6 to 1e21, INF and NaN:
  the same vectors flagged, the same bounds and residuals, the same worst ratio.
- A non-finite reference never flags (an upstream fault), a NaN residual always does.
- Through the engine: a projection check and a whole-step GEMM check take the native verdict (the eager rule is not
  evaluated on a clean check), and a flagged one is still repaired, by a check made again with rules.
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from gemm_injector import GemmCall, GemmInjector, worst_rel
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import Tolerance, checksum_weights, direction_bounds, verify_direction
from attnchecker.abft.checksum import DirectionCheck, group_sums_rows
from attnchecker.abft.gemm import verify_gemm
from attnchecker.abft.tolerance import row_rule
from attnchecker.checks.product import _row_rule
from attnchecker.checks.records import _ratio, _worst_ratio
from attnchecker.kernels import row_verify
from attnchecker.kernels.fused_pass import fused_pass

pytestmark = pytest.mark.skipif(not row_verify.available(), reason="no C compiler: the native verifier is not built")

TOLERANCES = {
    "calibrated": Tolerance(),
    "rigorous": Tolerance(calibrated=False),
    "tight": Tolerance(factor=0.02),
    "ungrouped": Tolerance(grouped=False),
    "sigmas": Tolerance(sigmas=3.0),
}


def product(n: int, rows: int, k: int, groups: int, width: int, *, bias: bool, seed: int, scale: float
            ) -> dict[str, Any]:
    """C = A·B (+ b) in fp32 and every operand-side sum its row check takes, as the engine makes them: A (n, R, K),
    B (K, g·width), references A (B_h w) (+ b_h·w) per group."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, rows, k, generator=gen) * scale
    b = torch.randn(k, groups * width, generator=gen) / k**0.5
    # A few outlier input channels and one large row, as real activations have.
    a[..., : max(1, k // 16)] *= 20.0
    a[:, 0] *= 100.0
    bias_v = torch.randn(groups * width, generator=gen) * scale if bias else None
    c = a @ b if bias_v is None else a @ b + bias_v
    w_n2 = checksum_weights(width, torch.device("cpu"), torch.float32)
    bw_Kg2 = b.view(k, groups, width) @ w_n2
    ref = (a @ bw_Kg2.flatten(-2)).view(n, rows * groups, 2)
    if bias_v is not None:
        ref = (ref.view(n, rows, groups, 2) + bias_v.view(groups, width) @ w_n2).flatten(1, 2)
    beta_Kg2 = b.square().view(k, groups, width) @ w_n2.square()
    moments = (a.square() @ torch.cat([beta_Kg2, bw_Kg2.square()], -1).flatten(-2)).view(n, rows * groups, 4)
    return {"a": a, "b": b, "c": c, "bias": bias_v, "ref": ref, "moments": moments, "bw": bw_Kg2, "groups": groups,
            "width": width, "k": k}


def c_side(c: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C's grouped row checksums (n, R·g, 2), their square sums (n, R·g))."""
    got = group_sums_rows(c, groups).flatten(-3, -2)
    sq = c.unflatten(-1, (groups, -1)).square().sum(-1).flatten(-2)
    return got, sq


def both_verdicts(p: dict[str, Any], c: torch.Tensor, tol: Tolerance, *, walk: bool, moments: bool
                  ) -> tuple[DirectionCheck, DirectionCheck]:
    """(the eager check, as checks.product._verify makes it by rows; the native one) of the same vectors."""
    g, k = p["groups"], p["k"]
    got, sq = c_side(c, g)
    a_norm = torch.linalg.vector_norm(p["a"], dim=-1)
    a_max = p["a"].abs().amax(-1)
    b_norm = torch.linalg.vector_norm(p["b"], dim=0)
    b_max = p["b"].abs().amax(0)
    bias_abs = None if p["bias"] is None else p["bias"].abs()
    ref_norm_g2 = torch.linalg.vector_norm(p["bw"], dim=0)
    ref_max_g2 = p["bw"].abs().amax(0)
    mom = p["moments"] if moments else None
    rule = functools.partial(direction_bounds, k=k, out_dtype=torch.float32, tol=tol, walk=(walk, False))
    grouped = g > 1
    eager_rule = _row_rule(rule, a_norm, b_norm, bias_abs, ref_norm_g2 if grouped else ref_norm_g2[0],
                           (a_max if walk else None, b_max if walk else None),
                           (ref_max_g2 if grouped else ref_max_g2[0]) if walk else None, mom if walk else None, g,
                           grouped=grouped)
    eager = verify_direction(p["ref"], got, eager_rule, None, sq, groups=g)
    native_rule = row_rule(b_norm.view(g, -1), k=k, tol=tol,
                           bias_abs_gn=None if bias_abs is None else bias_abs.view(g, -1),
                           ref_norm_g2=ref_norm_g2, b_max_gn=b_max.view(g, -1) if walk else None,
                           ref_max_g2=ref_max_g2 if walk else None, walk=walk)
    assert native_rule is not None
    native = row_verify.verify_rows(native_rule, p["ref"], got, sq, a_norm, a_max_NR=a_max if walk else None,
                                    moments_NV4=mom if walk else None)
    assert native is not None
    return eager, native


def assert_same(eager: DirectionCheck, native: DirectionCheck) -> None:
    assert native.bad.tolist() == eager.bad.tolist()
    torch.testing.assert_close(native.diff, eager.diff, rtol=0, atol=0, equal_nan=True)
    # The rigorous part is fp32 in both, its column sum made in double here, in fp32 there: a few ulps.
    torch.testing.assert_close(native.bound, eager.bound, rtol=2e-6, atol=0)
    assert eager.bound2 is not None
    torch.testing.assert_close(native.bound2, eager.bound2, rtol=2e-6, atol=0)
    torch.testing.assert_close(_worst_ratio({"row": native}), _worst_ratio({"row": eager}), rtol=1e-5, atol=1e-9,
                               equal_nan=True)
    # What the clean path reads of the native check (its worst ratio and flag, made in the kernel's loop) is what
    # the tensor ops make of its own fields, to the bit.
    assert native.worst is not None and native.flagged is not None
    assert bool(native.flagged) == bool(native.bad.any())
    torch.testing.assert_close(native.worst, torch.where(native.bad, 0.0, _ratio(native)).amax(), rtol=0, atol=0,
                               equal_nan=True)


fault_values = st.one_of(st.floats(1e-6, 1e21).flatmap(lambda m: st.sampled_from([m, -m])),
                         st.sampled_from([float("nan"), float("inf"), -float("inf")]))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), rows=st.integers(1, 40), k=st.integers(1, 300), groups=st.sampled_from([1, 2, 4]),
       width=st.integers(1, 90), bias=st.booleans(), walk=st.booleans(), moments=st.booleans(),
       tol=st.sampled_from(sorted(TOLERANCES)), scale=st.sampled_from([1e-36, 1e-20, 1e-3, 1.0, 50.0]),
       faults=st.lists(st.tuples(st.floats(0, 0.999), st.floats(0, 0.999), fault_values), max_size=3),
       seed=st.integers(0, 2**20))
def test_the_native_verdict_is_the_eager_rules(n, rows, k, groups, width, bias, walk, moments, tol, scale, faults,
                                               seed) -> None:
    p = product(n, rows, k, groups, width, bias=bias, seed=seed, scale=scale)
    c = p["c"].clone()
    for fi, fj, value in faults:
        c[n - 1, int(fi * rows), int(fj * groups * width)] += value
    eager, native = both_verdicts(p, c, TOLERANCES[tol], walk=walk, moments=moments)
    assert_same(eager, native)
    if not faults and tol != "tight":
        assert not bool(native.bad.any()), "a clean product flagged"


@pytest.mark.parametrize("walk", [True, False])
def test_a_few_rms_error_flags_its_row_alone_at_a_7b_like_width(walk: bool) -> None:
    """q/k/v-like rows at 7B widths (K = 4096, 4096 outputs in 16 groups): clean flags nothing, a 2× RMS error flags
    its own row vector and no other, under both models."""
    p = product(1, 64, 4096, 16, 256, bias=False, seed=3, scale=1.0)
    c = p["c"].clone()
    eager, native = both_verdicts(p, c, Tolerance(), walk=walk, moments=walk)
    assert_same(eager, native)
    assert not bool(native.bad.any())
    rms = float(c.square().mean().sqrt())
    c[0, 17, 1000] += 2 * rms
    eager, native = both_verdicts(p, c, Tolerance(), walk=walk, moments=walk)
    assert_same(eager, native)
    assert native.bad.nonzero().tolist() == [[0, 17 * 16 + 1000 // 256]]


def test_a_non_finite_reference_never_flags_and_a_nan_residual_always_does() -> None:
    p = product(1, 4, 32, 1, 16, bias=True, seed=1, scale=1.0)
    c = p["c"].clone()
    p["ref"][0, 1, 0] = float("inf")  # an upstream fault: its row's reference is not finite
    c[0, 2, 3] = float("nan")
    eager, native = both_verdicts(p, c, Tolerance(), walk=True, moments=True)
    assert_same(eager, native)
    assert native.bad[0].tolist() == [False, False, True, False]


def test_it_declines_what_it_does_not_take() -> None:
    """Half-precision vectors and mismatched shapes: None (the caller verifies eagerly); the paper's threshold has no
    factored rule."""
    p = product(1, 4, 32, 2, 16, bias=False, seed=1, scale=1.0)
    got, sq = c_side(p["c"], 2)
    a_norm = torch.linalg.vector_norm(p["a"], dim=-1)
    rule = row_rule(torch.linalg.vector_norm(p["b"], dim=0).view(2, -1), k=32, tol=Tolerance())
    assert rule is not None
    assert row_verify.verify_rows(rule, p["ref"].bfloat16(), got, sq, a_norm) is None
    assert row_verify.verify_rows(rule, p["ref"], got, sq, a_norm[..., :3]) is None
    assert row_rule(torch.ones(1, 4), k=4, tol=Tolerance(mode="extreme")) is None
    walk_rule = row_rule(torch.ones(2, 16), k=32, tol=Tolerance(), walk=True)
    assert walk_rule is not None
    assert row_verify.verify_rows(walk_rule, p["ref"], got, sq, a_norm) is None  # the walk needs ‖A_i‖∞


def test_repair_refuses_a_check_without_its_rule() -> None:
    from attnchecker.abft import repair

    p = product(1, 4, 32, 1, 16, bias=False, seed=1, scale=1.0)
    c = p["c"].clone()
    c[0, 1, 1] = 1e6
    _, native = both_verdicts(p, c, Tolerance(), walk=False, moments=False)
    assert bool(native.bad.any())
    with pytest.raises(ValueError, match="without its bound rule"):
        repair(c, {"row": native}, Tolerance(), correct=True)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 200), k=st.integers(1, 200), n=st.integers(1, 200), direction=st.sampled_from(["row", "col"]),
       bias=st.booleans(), tol=st.sampled_from(sorted(TOLERANCES)), scale=st.sampled_from([1e-30, 1.0, 1e3]),
       faults=st.lists(st.tuples(st.floats(0, 0.999), st.floats(0, 0.999), fault_values), max_size=2),
       seed=st.integers(0, 2**20))
def test_a_whole_step_gemm_check_gives_the_eager_verdict_in_either_direction(m, k, n, direction, bias, tol, scale,
                                                                             faults, seed) -> None:
    """verify_gemm with the native verifier, against itself without: a Linear forward or dX (rows, with a bias or
    not) and a Conv1D weight gradient (columns, no bias), clean and with faults."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=gen) * scale, torch.randn(k, n, generator=gen)
    bias_n = torch.randn(n, generator=gen) * scale if bias and direction == "row" else None
    c = a @ b if bias_n is None else torch.addmm(bias_n, a, b)
    for fi, fj, value in faults:
        c[int(fi * m), int(fj * n)] += value
    t = TOLERANCES[tol]
    eager = verify_gemm(c, a, b, t, bias_N=bias_n, directions=(direction,), one_pass=fused_pass)[direction]
    native = verify_gemm(c, a, b, t, bias_N=bias_n, directions=(direction,), one_pass=fused_pass,
                         row_verifier=row_verify.verify_rows)[direction]
    assert native.rule is None, "the native verifier did not take a product it covers"
    assert_same(eager, native)
    if not faults and tol != "tight":
        assert not bool(native.bad.any())


def test_through_the_engine_the_native_verdict_catches_a_few_rms_fault_that_is_then_repaired(
        monkeypatch: pytest.MonkeyPatch, kernel_everywhere: Any) -> None:
    """protect(scope="all") with Policy.full() on GPT-2 (Conv1D projections and MLP): every clean row check of a
    projection and of a Linear GEMM (forward, dX, and dW by columns) takes the native verdict; a 4× RMS error in
    every distinct Linear GEMM of the step in turn is flagged there (and only there), repaired by the slow path's
    check with rules, and the step's gradients are the fault-free one's."""
    from test_linear_abft import model_gemms, one_step

    from attnchecker.gemm import check as gemm_check
    from attnchecker.gemm import projection

    kernel_everywhere()
    taken = {"projection": 0, "gemm": 0, "flagged": 0}
    for module, site in ((projection, "projection"), (gemm_check, "gemm")):
        def spy(*args: Any, _site: str = site, **kwargs: Any) -> DirectionCheck | None:
            got = row_verify.verify_rows(*args, **kwargs)
            taken[_site] += got is not None
            taken["flagged"] += got is not None and bool(got.bad.any())
            return got
        monkeypatch.setattr(module, "verify_rows", spy)
    recorder = GemmInjector()
    clean, finite, detections = one_step("gpt2", "all", recorder)
    assert finite and not detections
    assert taken["projection"] > 0 and taken["gemm"] > 0 and taken["flagged"] == 0, taken
    # One call of every distinct Linear GEMM of the step: each projection's and MLP GEMM's forward, dX and dW (a
    # Conv1D dW checked by columns), and the LM head's.
    picked: dict[tuple[str, tuple[int, ...], int], GemmCall] = {}
    for call in model_gemms("gpt2", recorder.calls):
        if call.op in ("addmm", "mm"):
            picked.setdefault((call.phase, call.shape, call.k), call)
    assert {phase for phase, _, _ in picked} == {"forward", "backward"} and len(picked) >= 8, picked
    for n, call in enumerate(picked.values()):
        inj = GemmInjector(target=call.index, kind="rms", rms=4.0, element=11 + 29 * n)
        before = taken["flagged"]
        grads, finite, detections = one_step("gpt2", "all", inj)
        assert inj.hit == call
        assert taken["flagged"] == before + 1, f"{call}: not flagged by a native verdict alone"
        assert finite
        assert detections and {d.action for d in detections} <= {"corrected", "recomputed"}, (call, detections)
        assert worst_rel(grads, clean) <= 1e-5, call
