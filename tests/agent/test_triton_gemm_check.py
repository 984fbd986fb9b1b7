"""The Triton GEMM checks (issue 32: kernels/triton_gemm_check.py, gemm/device.py) under Triton's interpreter, on CPU
tensors: the pass gives verify_gemm's verdicts, corrects located errors in place and recomputes the rest on the device,
tells a product the dtype cannot hold from a fault, launches a fixed number of kernels per checked GEMM and never
waits for the device. The tests that compare with the CPU path run both (``impl``). conftest.py asks for the
interpreter where there is no CUDA device."""
from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from scoped_env import scoped_env
from sync_counter import SyncCounter
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.abft import Tolerance
from attnchecker.abft.gemm import verify_gemm
from attnchecker.checks.deferred import drain
from attnchecker.gemm import device
from attnchecker.gemm.check import check_gemms, trip_gemms
from attnchecker.gemm.linear import LinearSite, checked_linear
from attnchecker.inject import Fault
from attnchecker.kernels import triton_gemm_check as tg

pytestmark = pytest.mark.skipif(not (tg.available() and tg.interpreted()),
                                reason="runs the Triton kernels on CPU tensors under Triton's interpreter, which "
                                       "tests/agent/conftest.py turns on where there is no CUDA device; on a GPU, "
                                       "test_triton_gemm_gpu.py runs them compiled")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["cpu", "triton"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The CPU path (gemm/check.py as on a machine without a GPU) or the Triton path on CPU tensors; afterwards, that
    the path named is the one that ran (Triton kernels launched, or none)."""
    monkeypatch.setenv(device.GEMM_ENV, "auto" if request.param == "cpu" else "triton")
    tg.LAUNCHES.reset()
    yield request.param
    assert (tg.LAUNCHES.total > 0) == (request.param == "triton")


def detections(ctx, recorder) -> list:
    """What the checks reported by the step boundary (the Triton path's reports come at the drain)."""
    drain(ctx.runtime.deferred)
    return recorder.detections


def product(m: int, k: int, n: int, dtype: torch.dtype, *, seed: int = 0, bias: bool = False, cast: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(C, A, B, bias) with C as a GEMM computes it: fp32 accumulation, one rounding to C's dtype. cast: A and B
    stay fp32 (autocast's master weights), C is the half dtype."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    beta = torch.randn(n, generator=g) if bias else None
    exact = a @ b if beta is None else torch.addmm(beta, a, b)
    if not cast:
        a, b = a.to(dtype), b.to(dtype)
        beta = None if beta is None else beta.to(dtype)
        exact = a.float() @ b.float() if beta is None else torch.addmm(beta.float(), a.float(), b.float())
    return exact.to(dtype), a, b, beta


TOLERANCES = {"calibrated": Tolerance(), "rigorous": Tolerance(calibrated=False), "extreme": Tolerance(mode="extreme")}


@settings(max_examples=24)
@given(m=st.integers(1, 80), k=st.integers(1, 96), n=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       bias=st.booleans(), cast=st.booleans(), tol=st.sampled_from(sorted(TOLERANCES)),
       fault=st.sampled_from([None, 0.25, 4.0]), seed=st.integers(0, 2**31 - 1))
def test_the_pass_flags_the_rows_verify_gemm_flags(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, cast: bool,
                                                  tol: str, fault: float | None, seed: int) -> None:
    """The pass evaluates verify_gemm's row rule (abft/gemm_rule.py, every dtype, bias, operand cast and tolerance
    mode): on the same product its flagged rows are verify_gemm's, clean or with an error of 1/4 or 4 times the
    row's bound (n up to 300 crosses the kernel's 256-column tiles); a flagged row's bound is verify_gemm's."""
    cast = cast and dtype != torch.float32
    c, a, b, beta = product(m, k, n, dtype, seed=seed, bias=bias, cast=cast)
    tolerance = TOLERANCES[tol]
    i, j = seed % m, (seed // m) % n
    if fault is not None:
        chk = verify_gemm(c, a, b, tolerance, bias_N=beta, directions=("row",))["row"]
        assert chk.bound2 is not None
        e = fault * min(float(chk.bound[0, i]), float(chk.bound2[0, i]) / (j + 1))
        c[i, j] = (c[i, j].float() + e).to(dtype)
    want = verify_gemm(c, a, b, tolerance, bias_N=beta, directions=("row",))["row"]
    got = device.check_product(c, a, b, beta, tolerance, correct=False)
    flagged = got.code != 0
    assert torch.equal(flagged, want.bad[0]), (flagged.nonzero().tolist(), want.bad[0].nonzero().tolist())
    if fault == 4.0:
        assert bool(flagged[i])
    n_flagged = int(got.state[tg.STATE["flagged"]])
    for row, bound in zip(got.slot_i[:n_flagged, 1].tolist(), got.slot_f[:n_flagged, 2].tolist(), strict=True):
        assert bound == pytest.approx(float(want.bound[0, row]), rel=1e-4)


def test_verdicts_fail_without_the_rule() -> None:
    """The control: a rule whose calibrated part is off (the rigorous bound alone, ~100× looser at these sizes) lets
    the 4× error through that the real rule flags, so the comparison above can fail."""
    c, a, b, _ = product(64, 256, 256, torch.float32, seed=3)
    chk = verify_gemm(c, a, b, Tolerance(), directions=("row",))["row"]
    assert chk.bound2 is not None
    c[5, 9] += 4.0 * min(float(chk.bound[0, 5]), float(chk.bound2[0, 5]) / 10)
    assert bool(device.check_product(c.clone(), a, b, None, Tolerance(), correct=False).code[5] != 0)
    assert not bool(device.check_product(c, a, b, None, Tolerance(calibrated=False), correct=False).code[5] != 0)


def test_the_rule_takes_the_references_norm_not_the_triangle_bound() -> None:
    """The reference term of the bound is ‖B w‖'s, the norm of the vector the reference dotted A's rows with (the
    operand pass makes it beside the reference; verify_gemm likewise), not the triangle bound Σ_j w_j ‖B_j‖
    (verify_gemm(ref_norms=False)), √n looser on uncorrelated columns, where it is the largest term (fp32): at 512
    columns the pass's bound is verify_gemm's and under a fifth of the triangle's, and an error of twice it, which the
    triangle's bound lets through, is flagged by both paths."""
    dtype = torch.float32
    c, a, b, _ = product(64, 512, 512, dtype, seed=5)
    triangle = verify_gemm(c, a, b, Tolerance(), directions=("row",), ref_norms=False)["row"]
    norms = verify_gemm(c, a, b, Tolerance(), directions=("row",))["row"]
    i, j = 5, 9
    assert float(norms.bound[0, i]) < float(triangle.bound[0, i]) / 5
    c[i, j] = (c[i, j].float() + 2 * float(norms.bound[0, i])).to(dtype)
    assert not bool(verify_gemm(c, a, b, Tolerance(), directions=("row",), ref_norms=False)["row"].bad[0, i])
    assert verify_gemm(c, a, b, Tolerance(), directions=("row",))["row"].bad[0].nonzero().flatten().tolist() == [i]
    # One checksum pair per row, as these verify_gemm calls check it (512 columns would otherwise be 2 runs).
    got = device.check_product(c, a, b, None, Tolerance(grouped=False), correct=False)
    assert (got.code != 0).nonzero().flatten().tolist() == [i]
    assert float(got.slot_f[0, 2]) == pytest.approx(float(norms.bound[0, i]), rel=1e-4)


@settings(max_examples=16)
@given(m=st.integers(1, 40), k=st.integers(1, 96), n=st.sampled_from([512, 768, 1000, 1536, 2304]),
       dtype=st.sampled_from(DTYPES), bias=st.booleans(), cast=st.booleans(),
       fault=st.sampled_from([None, 0.25, 4.0]), seed=st.integers(0, 2**31 - 1))
def test_rows_in_runs_flag_what_verify_gemm_flags_by_runs(m: int, k: int, n: int, dtype: torch.dtype, bias: bool,
                                                          cast: bool, fault: float | None, seed: int) -> None:
    """Rows of 512 columns and more are checked in runs (device.runs: 2 to MAX_RUNS runs of at least 256 columns,
    each its own checksum pair), as verify_gemm(groups=runs) checks them: a row is flagged where one of its runs is,
    clean or with an error of 1/4 or 4 times its run's bound (1000 columns: runs of 500, across the kernel's tiles),
    and a flagged row's bound is its flagged run's."""
    cast = cast and dtype != torch.float32
    c, a, b, beta = product(m, k, n, dtype, seed=seed, bias=bias, cast=cast)
    r = device.runs(n, Tolerance())
    assert r == {512: 2, 768: 3, 1000: 2, 1536: 6, 2304: 8}[n]
    i, j = seed % m, (seed // m) % n
    if fault is not None:
        chk = verify_gemm(c, a, b, Tolerance(), bias_N=beta, directions=("row",), groups=r)["row"]
        assert chk.bound2 is not None
        v = i * r + j // (n // r)
        e = fault * min(float(chk.bound[0, v]), float(chk.bound2[0, v]) / (j % (n // r) + 1))
        c[i, j] = (c[i, j].float() + e).to(dtype)
    want = verify_gemm(c, a, b, Tolerance(), bias_N=beta, directions=("row",), groups=r)["row"]
    bad_MR = want.bad[0].view(m, r)
    got = device.check_product(c, a, b, beta, Tolerance(), correct=False)
    assert torch.equal(got.code != 0, bad_MR.any(1)), ((got.code != 0).nonzero().tolist(), bad_MR.nonzero().tolist())
    if fault == 4.0:
        assert bool(got.code[i] != 0)
    n_flagged = int(got.state[tg.STATE["flagged"]])
    for row, bound in zip(got.slot_i[:n_flagged, 1].tolist(), got.slot_f[:n_flagged, 2].tolist(), strict=True):
        run = int(bad_MR[row].nonzero()[0, 0])
        assert bound == pytest.approx(float(want.bound[0, row * r + run]), rel=1e-4)


def test_runs_catch_what_one_pair_per_row_misses() -> None:
    """The point of the runs: a bf16 product's clean bound is its output rounding over the checksum's elements, so
    a run of a third of the row has a bound about √3 smaller. An error of 1.2 times the run's bound is flagged in
    runs and passes one pair per row (Tolerance(grouped=False)), on both verify_gemm and the kernels."""
    dtype = torch.bfloat16
    c, a, b, _ = product(16, 256, 768, dtype, seed=11)
    by_runs = verify_gemm(c, a, b, Tolerance(), directions=("row",), groups=3)["row"]
    whole = verify_gemm(c, a, b, Tolerance(), directions=("row",))["row"]
    i, j = 4, 500
    assert float(by_runs.bound[0, i * 3 + 2]) < 0.7 * float(whole.bound[0, i])
    c[i, j] = (c[i, j].float() + 1.2 * float(by_runs.bound[0, i * 3 + 2])).to(dtype)
    assert device.check_product(c.clone(), a, b, None, Tolerance(), correct=False).code.nonzero().flatten().tolist() \
        == [i]
    assert not bool(device.check_product(c.clone(), a, b, None, Tolerance(grouped=False), correct=False).code.any())
    assert not bool(verify_gemm(c, a, b, Tolerance(), directions=("row",))["row"].bad.any())


KINDS = {"inf": float("inf"), "nan": float("nan"), "1e20": 1e20, "bitflip": None}


def corrupt(c: torch.Tensor, i: int, j: int, kind: str) -> None:
    if kind == "bitflip":
        from attnchecker.inject import bitflip

        c[i, j] = bitflip(c[i, j])
    else:
        c[i, j] = KINDS[kind]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.usefixtures("impl")
def test_a_located_fault_is_corrected_in_place(dtype: torch.dtype, kind: str, make_ctx) -> None:
    """INF, NaN, 1e20 and an exponent flip in one element of a bf16/fp16/fp32 product with a bias: corrected in place
    (located by value or by d2/d1, recomputed exactly from A's row and B's column), one "corrected" 0-D event at the
    element, on both paths."""
    c, a, b, beta = product(48, 64, 96, dtype, seed=1, bias=True)
    want = c.clone()
    corrupt(c, 5, 7, kind)
    ctx, rec = make_ctx()
    check_gemms(ctx, [("linear", c, a, b, beta)])
    (det,) = detections(ctx, rec)
    assert (det.op, det.action, det.pattern, det.row, det.col) == ("linear", "corrected", "0d", 5, 7)
    # To the dtype's tolerance: the exact element, summed in another order than the GEMM's, may round to the next
    # bf16 value at a tie.
    torch.testing.assert_close(c, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_slices_of_a_fused_projection_share_one_read_of_x(dtype: torch.dtype, make_ctx, monkeypatch) -> None:
    """GPT-2's c_attn: y (M, 3S) = x·W, its q/k/v slices checked as three GEMMs of the same x. In bf16 and fp16 one
    operand pass over x makes all three slices' references (3 runs each at S = 768: a factor 18 wide), beside the
    three passes over W's column blocks: 4 operand passes, not 6; fp32 x, whose pass multiplies on the FMA units,
    keeps one pass per slice. A fault in each slice (INF, NaN, 1e20) is corrected where it is; checked again, the
    slices flag nothing."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    g = torch.Generator().manual_seed(7)
    s = 768
    x, w = torch.randn(40, 64, generator=g).to(dtype), torch.randn(64, 3 * s, generator=g).to(dtype)
    y = (x.float() @ w.float()).to(dtype)
    want = y.clone()
    slices = [(op, y[:, i * s : (i + 1) * s], x, w[:, i * s : (i + 1) * s], None) for i, op in enumerate("qkv")]
    for i, kind in enumerate(("inf", "nan", "1e20")):
        corrupt(slices[i][1], 3 + i, 11 * i + 5, kind)
    ctx, rec = make_ctx()
    tg.LAUNCHES.reset()
    device.check_gemms(ctx, slices)
    found = sorted((d.op, d.action, d.row, d.col) for d in detections(ctx, rec))
    assert found == [("k", "corrected", 4, 16), ("q", "corrected", 3, 5), ("v", "corrected", 5, 27)]
    torch.testing.assert_close(y, want)
    shared = dtype != torch.float32
    assert tg.LAUNCHES.by_kernel == {"operand_pass": 4 if shared else 6, "check_pass": 3, "repair_rows": 3}
    ctx, rec = make_ctx()
    device.check_gemms(ctx, slices)  # the corrected slices, checked again
    assert detections(ctx, rec) == []


@pytest.mark.parametrize("pattern", ["row", "col", "block"])
def test_a_row_and_a_block_are_recomputed_and_a_column_corrected(pattern: str, make_ctx, monkeypatch) -> None:
    """The Triton path checks rows only: a corrupted column leaves one error in each row, each located and corrected;
    a corrupted row, or a 2-D block, holds several in a row, and those rows are recomputed on the device (a tl.dot over
    K, only in the programs that hold one) and verified again."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    c, a, b, _ = product(48, 64, 96, torch.bfloat16, seed=2)
    want = c.clone()
    region = {"row": (slice(3, 4), slice(None)), "col": (slice(None), slice(9, 10)), "block": (slice(4, 7),
                                                                                                slice(10, 13))}
    c[region[pattern]] = float("inf")
    ctx, rec = make_ctx()
    check_gemms(ctx, [("linear_dw", c, a, b, None)])
    (det,) = detections(ctx, rec)
    expect = {"row": ("recomputed", "1d", 3, None), "col": ("corrected", "1d", None, 9),
              "block": ("recomputed", "2d", 4, None)}[pattern]
    assert (det.action, det.pattern, det.row, det.col) == expect
    torch.testing.assert_close(c, want, rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("impl")
def test_a_batched_product_is_checked_per_matrix(make_ctx) -> None:
    """The attention backward's products (B, H, M, K)·(B, H, K, N), one operand a transposed view as k.mT is: two
    matrices with a fault each, both corrected, one report each at its (batch, head), the others untouched."""
    g = torch.Generator().manual_seed(6)
    a = torch.randn(2, 3, 24, 16, generator=g)
    b = torch.randn(2, 3, 40, 16, generator=g).mT
    c = a @ b
    want = c.clone()
    c[0, 2, 5, 7] = float("nan")
    c[1, 0, 11, 30] = 1e20
    ctx, rec = make_ctx()
    check_gemms(ctx, [("grad_q", c, a, b, None)])
    got = sorted((d.batch, d.head, d.row, d.col, d.action) for d in detections(ctx, rec))
    assert got == [(0, 2, 5, 7, "corrected"), (1, 0, 11, 30, "corrected")]
    torch.testing.assert_close(c, want)


def test_detect_mode_reports_and_changes_nothing(make_ctx, monkeypatch) -> None:
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    c, a, b, _ = product(32, 48, 64, torch.float32, seed=4)
    c[2, 3] = float("nan")
    seen = c.clone()
    ctx, rec = make_ctx(mode="detect")
    check_gemms(ctx, [("linear_dx", c, a, b, None)])
    (det,) = detections(ctx, rec)
    assert (det.action, det.kind, det.row, det.col) == ("detected", "nan", 2, 3)
    assert torch.equal(c.isnan(), seen.isnan()) and torch.equal(c.nan_to_num(), seen.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.usefixtures("impl")
def test_an_inf_the_dtype_cannot_avoid_is_no_fault_and_a_planted_one_is(dtype: torch.dtype, make_ctx) -> None:
    """gemm.check's _overflowed on both paths: an INF where the exact product is past the dtype's range (fp16 GradScaler
    steps; bf16 only in diverged training) is what the GEMM gives: no event, C unchanged. An INF planted over an
    ordinary value is corrected."""
    c, a, b, _ = product(16, 32, 24, dtype, seed=0)
    want = c.clone()
    c[3, 5] = float("inf")
    ctx, rec = make_ctx()
    check_gemms(ctx, [("linear_dw", c, a, b, None)])
    assert [(d.action, d.row, d.col) for d in detections(ctx, rec)] == [("corrected", 3, 5)]
    torch.testing.assert_close(c, want)
    big_a, big_b = (a * 4000, b * 4) if dtype == torch.float16 else (a * 1e20, b * 1e19)
    c_big = (big_a.double() @ big_b.double()).to(dtype)
    assert not bool(torch.isfinite(c_big).all())
    before = c_big.clone()
    ctx, rec = make_ctx()
    check_gemms(ctx, [("linear_dw", c_big, big_a, big_b, None)])
    assert detections(ctx, rec) == []
    assert torch.equal(c_big.isinf(), before.isinf()) and torch.equal(c_big.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.usefixtures("impl")
def test_rows_too_large_for_the_rules_own_sums_are_no_fault(dtype: torch.dtype, make_ctx) -> None:
    """Diverged training's values: a product of finite elements near 1e19 (A's rows near 1e19, B's of order 1), whose
    rows' squared norms leave fp32's range, so the row rule cannot be evaluated. The check flags those rows, the
    recomputation gives them again: no event, C the GEMM's (to its dtype's rounding, which the recomputation may
    redo). Elements past 1e10 on a tier-1 step too: its recompute judges them by what the operands allow."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(48, 64, generator=g) * 3e18).to(dtype), torch.randn(64, 96, generator=g).to(dtype)
    c = (a.float() @ b.float()).to(dtype)
    assert not bool(torch.isfinite(c.float().square().sum(-1)).all()) and bool(torch.isfinite(c).all())
    want = c.clone()
    for checked_ops in (None, frozenset()):
        ctx, rec = make_ctx() if checked_ops is None else make_ctx(checked_ops=checked_ops)
        (check_gemms if checked_ops is None else trip_gemms)(ctx, [("linear_dx", c, a, b, None)])
        assert detections(ctx, rec) == []
        if dtype == torch.bfloat16:
            torch.testing.assert_close(c, want, rtol=1e-2, atol=0.0)
        else:
            # A recompute may sum in another order: an element that cancels differs by more than 1e-5 of itself
            # (numpy 2.4's matmul under the interpreter: 1.6e-5), never by more than K·u of Σ_k |a_ik b_kj|.
            magnitude = a.abs() @ b.abs()
            assert bool(((c - want).abs() <= 64 * 2.0**-24 * magnitude).all())


@pytest.mark.parametrize("tier", ["abft", "tripwire"])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.usefixtures("impl")
def test_a_planned_fault_that_comes_back_in_the_recomputation_is_uncorrectable(persistent: bool, tier: str,
                                                                              make_ctx) -> None:
    """attnchecker.inject reaches the products the kernels compute themselves: a planned 2-D fault in a Linear's
    weight gradient (attempt 0, on the GEMM's output) is recomputed; persistent, it comes back in the recomputation
    (attempt 1: inside the repair kernel on the Triton path, on the recomputed tensor on the CPU path), which is then
    not verified: "uncorrectable". The same plan on both paths, on a checked step and on a tier-1 step (where the
    Triton path recomputes the rows the tier-1 pass marked, and finds the NaN again where finite operands cannot
    give it)."""
    fault = Fault(op="linear_dw", layer=0, step=0, kind="nan", pattern="2d", block=(2, 3), persistent=persistent,
                  seed=5)
    ctx, rec = make_ctx(faults=[fault])
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(48, 64, requires_grad=True)
    site = LinearSite(ctx=ctx, layout="out_in", check_forward=True)
    checked_linear(x, lin.weight, lin.bias, site, tier).square().sum().backward()
    (det,) = detections(ctx, rec)
    assert (det.op, det.pattern, det.tier) == ("linear_dw", "2d", tier)
    assert det.action == ("uncorrectable" if persistent else "recomputed")
    assert bool(lin.weight.grad.isnan().any()) == persistent


def test_tier1_on_the_device_recomputes_a_trip_and_reports_an_input_fault(make_ctx, monkeypatch) -> None:
    """trip_gemms on the Triton path: the tier-1 pass marks the rows holding an extreme value on the device, and the
    repair kernel recomputes them. Real values past 1e10 that the operands explain: no event, C unchanged. An INF
    that came in with an input: "detected", tier "tripwire". An INF written into C: recomputed, C exact again. An fp16
    product past 65504 (INF as the dtype holds it): no event."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 48, generator=gen) * 1e6, torch.randn(48, 40, generator=gen) * 1e6
    ctx, rec = make_ctx(checked_ops=frozenset())
    huge = a @ b
    want = huge.clone()
    trip_gemms(ctx, [("linear", huge, a, b, None)])
    assert detections(ctx, rec) == [] and torch.equal(huge, want)
    bad_a = a / 1e6
    bad_a[3, 5] = float("inf")
    c = bad_a @ (b / 1e6)
    trip_gemms(ctx, [("linear_dx", c, bad_a, b / 1e6, None)])
    a1, b1 = a / 1e6, b / 1e6
    c1 = a1 @ b1
    want1 = c1.clone()
    c1[7, 9] = float("inf")
    trip_gemms(ctx, [("linear_dw", c1, a1, b1, None)])
    got = [(d.op, d.tier, d.action) for d in detections(ctx, rec)]
    assert got == [("linear_dx", "tripwire", "detected"), ("linear_dw", "tripwire", "recomputed")]
    torch.testing.assert_close(c1, want1)
    assert ctx.runtime.stats.trip_checks["linear_dw"] == 1
    a16, b16 = (a1 * 300).half(), (b1 * 30).half()
    c16 = (a16.float() @ b16.float()).half()
    assert not bool(torch.isfinite(c16).all())
    before = c16.clone()
    ctx, rec = make_ctx(checked_ops=frozenset())
    trip_gemms(ctx, [("linear", c16, a16, b16, None)])
    assert detections(ctx, rec) == [] and torch.equal(c16.isinf(), before.isinf())


def _tripped(m: int, k: int, n: int, dtype: torch.dtype, *, seed: int, bias: bool, cast: bool, kind: str | None,
             transposed: bool) -> tg.TripGemm:
    """A GEMM for a tier-1 pass: C as the GEMM computes it, ``kind`` written into one element (None: clean; "input":
    an INF in A, which C inherits), C a transposed view where ``transposed`` (a Conv1D's dW as the check sees it)."""
    c, a, b, beta = product(m, k, n, dtype, seed=seed, bias=bias, cast=cast)
    i, j = seed % m, (seed // 7) % n
    if kind == "input":
        a = a.clone()
        a[i, seed % k] = float("inf")
        c = (a.float() @ b.float() + (0 if beta is None else beta.float())).to(dtype)
    elif kind is not None:  # past-range: 3e20, which fp16 holds as -INF
        c[i, j] = {"nan": float("nan"), "inf": float("inf"),
                   "near_inf": float("-inf") if dtype == torch.float16 else 3e20}[kind]
    if transposed:
        c = c.T.contiguous().T
    rule = device._rule(device.DeviceGemm("linear", c, a, b, beta), Tolerance(), 1)
    return tg.TripGemm(c, a, b, beta, rule)


@settings(max_examples=20, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 40), st.integers(1, 300)), min_size=2,
                       max_size=2),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=2, max_size=2), bias=st.lists(st.booleans(), min_size=2,
                                                                                      max_size=2),
       cast=st.booleans(), kinds=st.lists(st.sampled_from([None, None, "nan", "inf", "near_inf", "input"]),
                                          min_size=2, max_size=2),
       transposed=st.booleans(), correct=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_two_gemms_in_one_tier1_launch_come_out_as_two_launches_would(
        shapes: list[tuple[int, int, int]], dtypes: list[torch.dtype], bias: list[bool], cast: bool,
        kinds: list[str | None], transposed: bool, correct: bool, seed: int) -> None:
    """trip_pass_pair (a Linear's dX and dW in one launch) against trip_pass on each GEMM alone: across shapes (one
    row block or several, up to 300 columns), dtypes, bias, fp32 operands of a half output, a transposed C and a
    fault (NaN, INF, past-range, an INF that came in with A) in either, in detect and correct modes, each GEMM's
    counts, row codes and summaries, and C itself afterwards, bit for bit."""
    gemms = []
    for i, ((m, k, n), dtype, b, kind) in enumerate(zip(shapes, dtypes, bias, kinds, strict=True)):
        gemms.append(_tripped(m, k, n, dtype, seed=seed + i, bias=b, cast=cast and dtype != torch.float32,
                              kind=kind, transposed=transposed and i == 1))
    alone = [tg.TripGemm(g.c.clone(), g.a, g.b, g.bias, g.rule) for g in gemms]
    ws = tg.Workspace(torch.device("cpu"), 4 * tg.STATE_SIZE)
    want = [tg.trip_pass(g.c, g.a, g.b, g.bias, g.rule, ws, correct=correct) for g in alone]
    got = tg.trip_pass_pair(*gemms, ws, correct=correct)
    for g, w, chk, one in zip(gemms, want, got, alone, strict=True):
        assert torch.equal(chk.state, w.state) and torch.equal(chk.code, w.code)
        kept = min(int((w.code != 0).sum()), tg.SLOTS)  # the tripped rows' summaries; the rest never written
        assert torch.equal(chk.slot_i[:kept], w.slot_i[:kept])
        # value, d1, bound (the fourth field is never written)
        assert torch.equal(chk.slot_f[:kept, :3].view(torch.int32), w.slot_f[:kept, :3].view(torch.int32))
        assert torch.equal(g.c.contiguous().view(torch.uint8), one.c.contiguous().view(torch.uint8))
    assert any(int(w.state[tg.STATE["extreme"]]) > 0 for w in want) == any(k is not None for k in kinds)


VIEWS_AND_ALLOCATIONS = frozenset({"empty", "view", "slice", "select", "t", "permute", "expand", "detach", "transpose",
                                   "as_strided", "alias"})
"""Ops that launch nothing on a GPU. new_empty, set_ and copy_ are the interpreter's own host copies of the kernels'
arguments (GridExecutor._init_args_hst / _restore_args_dev): a compiled launch makes none."""
INTERPRETER = frozenset({"new_empty", "set_", "copy_"})


class DeviceOps(TorchDispatchMode):
    """The aten ops that do device work, by name, while ``on`` (set around the checks' entry points)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if self.on and name not in VIEWS_AND_ALLOCATIONS | INTERPRETER:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_device_work(monkeypatch: pytest.MonkeyPatch, mode: DeviceOps) -> None:
    """Switch ``mode`` on inside the Linear checks' entry points (both paths), not in the model's own ops."""
    from attnchecker.gemm import linear

    for owner, name in ((device, "linear_forward"), (device, "linear_backward"), (linear, "check_gemms"),
                        (linear, "trip_gemms"), (linear, "linear_sums"), (linear, "_backward_given")):
        fn = getattr(owner, name)

        def wrapped(*args, fn=fn, **kwargs):  # type: ignore[no-untyped-def]
            mode.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                mode.on = False

        monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("tier", ["abft", "tripwire"])
def test_a_checked_linear_launches_a_fixed_number_of_kernels_and_never_syncs(tier: str, impl: str,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            make_ctx) -> None:
    """One nn.Linear forward and backward, its three GEMMs checked (abft) or given tier 1: the histogram gets the same
    ratios on both paths; on the Triton path, 0 host syncs and a fixed set of launches: abft 3 operand passes (W, x,
    dY), 3 check passes and 3 repair kernels (9); tier 1, the tier-1 pass of y and one launch for dX's and dW's
    together, each recomputing a tripped row itself (2). Their atomics' zeroed memory comes from the guard's arena:
    one memset for the first call, none for the next. The CPU path syncs (its slow-path decision), so the count can
    fail."""
    ctx, rec = make_ctx()
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(48, 64, requires_grad=True)
    site = LinearSite(ctx=ctx, layout="out_in", check_forward=True)
    syncs, ops = SyncCounter(), DeviceOps()
    count_device_work(monkeypatch, ops)
    memsets = []
    for _ in range(2):
        ops.ops.clear()
        tg.LAUNCHES.reset()
        with syncs, ops:
            checked_linear(x, lin.weight, lin.bias, site, tier).square().sum().backward()
        memsets.append(ops.ops.pop("zeros", 0))
    assert detections(ctx, rec) == []
    # Each full check's worst clean ratio reaches the histogram (on the Triton path at the drain), tier 1's none.
    assert int(ctx.runtime.stats.residual_count or 0) == (6 if tier == "abft" else 0)
    if impl == "cpu":
        assert syncs.calls and not tg.LAUNCHES.total
        return
    assert syncs.calls == []
    launches = dict(tg.LAUNCHES.by_kernel)
    if tier == "abft":
        assert launches == {"operand_pass": 3, "check_pass": 3, "repair_rows": 3}
    else:
        assert launches == {"trip_pass": 1, "trip_pass_pair": 1}
    assert dict(ops.ops) == {}
    assert memsets == [1, 0] and ctx.runtime.zeroed.chunks_made == 1


def test_a_bad_setting_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, make_ctx) -> None:
    monkeypatch.setenv(device.GEMM_ENV, "cuda")
    c, a, b, _ = product(8, 8, 8, torch.float32)
    ctx, _ = make_ctx()
    with pytest.raises(ValueError, match="ATTNCHECKER_GEMM='cuda': use auto, triton"):
        check_gemms(ctx, [("linear", c, a, b, None)])


def test_triton_named_without_the_interpreter_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, make_ctx,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(device, "_warned", set())
    c, a, b, _ = product(8, 8, 8, torch.float32)
    c[1, 1] = float("inf")
    ctx, rec = make_ctx()
    with caplog.at_level("WARNING", logger="attnchecker"):
        assert check_gemms(ctx, [("linear", c, a, b, None)]) == 1  # the CPU path, reporting at once
    assert "TRITON_INTERPRET=1" in caplog.text and len(rec.detections) == 1


@pytest.mark.parametrize("tier", ["tripwire", "abft"])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("op", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_fused_projection_reports_a_fault_under_the_slice_it_is_in(impl: str, dtype: torch.dtype, op: str,
                                                                      persistent: bool, tier: str, make_ctx) -> None:
    """A fused projection (GPT-2's c_attn: y = x·W + b, its columns q, k, v) over two sequences of tokens, on a quiet
    step (tier 1: on the Triton path one tier-1 pass over all of y, one launch for the three slices; on the CPU path
    its one sum over y) and on a checked step (each slice's full check). An INF planned in one slice
    (attnchecker.inject, on the output below the check) is reported once, under that slice's op and the tier, at the
    sequence and token it was planned at, and y comes out as the clean product. A persistent 2-D block of them (which
    no checksum corrects: the rows are recomputed on both paths) comes back in the recomputation (on the Triton path
    the kernel's emulated fault, placed at the slice's columns and the tokens the host's recompute meets) and is
    "uncorrectable"."""
    from attnchecker.gemm.projection import protected_linear

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 24, 32, generator=g).to(dtype)
    w = (torch.randn(96, 32, generator=g) * 0.2).to(dtype)
    b = (torch.randn(96, generator=g) * 0.1).to(dtype)
    splits = (("q", 32), ("k", 32), ("v", 32))
    fault = Fault(op=op, layer=0, step=0, kind="inf", pattern="2d" if persistent else "0d", batch=1, row=5, col=11,
                  persistent=persistent)
    ctx, rec = make_ctx([fault], **({"checked_ops": frozenset()} if tier == "tripwire" else {}))
    tg.LAUNCHES.reset()
    with torch.no_grad():
        y = protected_linear(x, w, b, ctx=ctx, splits=splits)
    launches = dict(tg.LAUNCHES.by_kernel)
    got = [(d.op, d.tier, d.action, d.batch, d.row) for d in detections(ctx, rec)]
    if tier == "tripwire":
        assert launches == ({"trip_pass": 1} if impl == "triton" else {})
    else:
        assert launches.get("check_pass", 0) == (3 if impl == "triton" else 0)
    if persistent:
        assert got == [(op, tier, "uncorrectable", 1, 5)]
        return
    assert len(got) == 1 and got[0][:2] == (op, tier) and got[0][2] in ("corrected", "recomputed")
    assert got[0][3:] == (1, 5)
    clean = torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype)
    torch.testing.assert_close(y, clean, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)



def _linear_step(path: str, fault: Fault | None, tier: str, dtype: torch.dtype, make_ctx
                 ) -> tuple[list[torch.Tensor], list[tuple[str, str]]]:
    """A checked Linear's forward and backward (48 tokens, 64 → 96, bias) on ``path`` under one planned fault, read at
    the step boundary: (y, dW, db, dX in fp32; the reports' (op, action))."""
    ctx, rec = make_ctx([] if fault is None else [fault], **({} if tier == "abft" else {"checked_ops": frozenset()}))
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 96).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g) * 0.1)
        lin.bias.copy_(torch.randn(96, generator=g) * 0.1)
    x = torch.randn(48, 64, generator=g).to(dtype).requires_grad_()
    with scoped_env({device.GEMM_ENV: "auto" if path == "cpu" else "triton"}):
        y = checked_linear(x, lin.weight, lin.bias, LinearSite(ctx=ctx, layout="out_in", check_forward=True), tier)
        y.float().square().sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None and x.grad is not None
    reports = [(d.op, d.action) for d in detections(ctx, rec)]
    return [t.detach().float() for t in (y, lin.weight.grad, lin.bias.grad, x.grad)], reports


@settings(max_examples=20, deadline=None)
@example(op="linear", kind="inf", pattern="2d", persistent=True, tier="abft", dtype=torch.float32, seed=5)
@example(op="linear", kind="near_inf", pattern="2d", persistent=True, tier="abft", dtype=torch.bfloat16, seed=5)
@given(op=st.sampled_from(["linear", "linear_dx", "linear_dw"]),
       kind=st.sampled_from(["inf", "neg_inf", "nan", "near_inf", "bitflip"]),
       pattern=st.sampled_from(["0d", "1d", "2d"]), persistent=st.booleans(),
       tier=st.sampled_from(["abft", "tripwire"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**20))
def test_a_planned_fault_anywhere_in_a_linear_is_never_silent_on_either_path(
        op: str, kind: str, pattern: str, persistent: bool, tier: str, dtype: torch.dtype, seed: int, make_ctx
) -> None:
    """Both paths against the same planned fault (attnchecker.inject: any kind and pattern in any of a Linear's three
    GEMMs, on a checked or a tier-1 step, transient or persistent): the GEMM it struck is reported, and either it is
    reported uncorrectable (the step is not to be trusted: the policy skips it) or the output and every gradient are
    the fault-free step's. A persistent 2-D fault comes back in every recomputation: uncorrectable on both paths.
    Where they may differ: a persistent 0-D or 1-D fault on a tier-1 step, which the CPU path's full check corrects
    from the checksums and the Triton path's recomputation of the row meets again (uncorrectable there). Tier 1
    looks for extreme values only: an exponent flip, which can leave a finite value, is a checked step's."""
    assume(not (tier == "tripwire" and kind == "bitflip"))
    fault = Fault(op=op, layer=0, step=0, kind=kind, pattern=pattern, persistent=persistent, seed=seed)
    for path in ("cpu", "triton"):
        clean, _ = _linear_step(path, None, tier, dtype, make_ctx)
        got, reports = _linear_step(path, fault, tier, dtype, make_ctx)
        assert op in {o for o, _ in reports}, (path, reports)
        if (op, "uncorrectable") in reports:
            assert persistent, (path, reports)
            continue
        assert not (persistent and pattern == "2d"), f"{path}: a persistent 2-D fault passed: {reports}"
        scale = max(float(w.abs().max()) for w in clean)
        for t, want in zip(got, clean, strict=True):
            assert float((t - want).abs().max()) <= 2e-2 * scale, (path, reports)
