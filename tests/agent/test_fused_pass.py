"""attnchecker.kernels.fused_pass: the one-pass checksum kernel gives what the eager reductions give, on every layout the checks
pass it, keeps NaN and INF, declines what it does not take, and where it cannot be built the checks run eagerly."""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnchecker.abft import Tolerance, group_count
from attnchecker.abft.gemm import verify_gemm
from attnchecker.kernels import fused_pass as fp

pytestmark = pytest.mark.skipif(not fp.available(), reason="no C compiler: the kernel cannot be built here")


def randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def kernel_off() -> Iterator[None]:
    """The eager path, as without a kernel (bench/overhead.py's all_full_eager)."""
    fp.enabled = False
    try:
        yield
    finally:
        fp.enabled = True


def layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as a row-strided slice of a wider matrix (a head's columns of a fused projection)."""
    if kind == "slice":
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 5)
        wide[..., 2 : 2 + x.shape[-1]] = x
        return wide[..., 2 : 2 + x.shape[-1]]
    return x


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 70), seg=st.integers(1, 40), groups=st.sampled_from([1, 2, 3]),
       batch=st.sampled_from([(), (1,), (3,), (2, 2)]), nr=st.sampled_from([0, 1, 2, 3, 5]),
       nr2=st.sampled_from([0, 2, 4]), nl=st.sampled_from([0, 1, 2, 3, 5]), nl2=st.sampled_from([0, 2]),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()), shared=st.booleans(),
       kind=st.sampled_from(["contiguous", "slice"]), threads=st.sampled_from([1, 3]), seed=st.integers(0, 10_000))
def test_the_pass_matches_the_float64_products_and_sums(
    rows: int, seg: int, groups: int, batch: tuple[int, ...], nr: int, nr2: int, nl: int, nl2: int,
    flags: tuple[bool, bool, bool, bool], shared: bool, kind: str, threads: int, seed: int,
) -> None:
    """Every output against float64, at fp32 round-off for sums of this length; rows split into groups (grouped
    checksums); a factor shared by the batch (a weight's checksum vector) or one per matrix (attention's per-head
    references); on one thread, or on three blocks of rows (torch's intra-op threads), whatever the size."""
    assert_matches_float64(rows, seg, groups, batch, nr, nr2, nl, nl2, flags, shared, kind, threads, seed)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 23), cols=st.integers(1, 90), batch=st.sampled_from([(), (3,)]),
       nr=st.sampled_from([0, 2, 4]), nl=st.sampled_from([0, 2]), sq=st.tuples(st.booleans(), st.booleans()),
       shared=st.booleans(), kind=st.sampled_from(["contiguous", "slice"]), threads=st.sampled_from([1, 3]),
       seed=st.integers(0, 10_000))
def test_the_one_sweep_shapes_match_the_float64_products_and_sums(
    rows: int, cols: int, batch: tuple[int, ...], nr: int, nl: int, sq: tuple[bool, bool], shared: bool, kind: str,
    threads: int, seed: int,
) -> None:
    """The shapes the kernel takes in one sweep of 4 rows (the whole-step checks' x, W and dY: no groups, squared
    factors, maxima or copy), with row counts that leave 0 to 3 rows to the general path, and columns around the
    vector widths."""
    assert_matches_float64(rows, cols, 1, batch, nr, 0, nl, 0, (*sq, False, False), shared, kind, threads, seed)


def assert_matches_float64(
    rows: int, seg: int, groups: int, batch: tuple[int, ...], nr: int, nr2: int, nl: int, nl2: int,
    flags: tuple[bool, bool, bool, bool], shared: bool, kind: str, threads: int, seed: int,
) -> None:
    row_sq, col_sq, row_max, col_max = flags
    cols = seg * groups
    x = layout(randn((*batch, rows, cols), seed), kind)
    lead = () if shared else batch
    right = randn((*lead, seg, nr), seed + 1) if nr else None
    right_sq = randn((*lead, seg, nr2), seed + 2) if nr2 else None
    left = randn((*lead, rows, nl), seed + 3) if nl else None
    left_sq = randn((*lead, rows, nl2), seed + 4) if nl2 else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(fp, "_BLOCK_MIN", 1):
            got = fp.fused_pass(x, right=right, right_sq=right_sq, left=left, left_sq=left_sq, row_sq=row_sq,
                                col_sq=col_sq, row_max=row_max, col_max=col_max, groups=groups)
    finally:
        torch.set_num_threads(before)
    assert got is not None
    x64 = x.double()
    runs = x64.unflatten(-1, (groups, seg)).flatten(-3, -2)  # (..., R·g, S): the grouped vector layout
    u = torch.finfo(torch.float32).eps

    def near(out: torch.Tensor | None, want: torch.Tensor, scale: torch.Tensor, n: int) -> None:
        assert out is not None and out.shape == want.shape
        assert ((out.double() - want).abs() <= 2 * n * u * scale + 1e-30).all()

    for factor, out, data in ((right, got.right, runs), (right_sq, got.right_sq, runs.square())):
        if factor is None:
            assert out is None
        else:
            near(out, data @ factor.double(), data.abs() @ factor.double().abs(), seg)
    for factor, out, data in ((left, got.left, x64), (left_sq, got.left_sq, x64.square())):
        if factor is None:
            assert out is None
        else:
            near(out, data.mT @ factor.double(), data.abs().mT @ factor.double().abs(), rows)
    for flag, out, want, n in ((row_sq, got.row_sq, runs.square().sum(-1), seg),
                               (col_sq, got.col_sq, x64.square().sum(-2), rows)):
        if flag:
            near(out, want, want, n)
        else:
            assert out is None
    for flag, out, want in ((row_max, got.row_max, x.abs().amax(-1)), (col_max, got.col_max, x.abs().amax(-2))):
        if flag:
            assert out is not None and torch.equal(out, want)
        else:
            assert out is None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nan_and_inf_reach_every_output_of_their_row_and_column(bad: float, threads: int) -> None:
    """What a check must see: no finite-math shortcut drops them (rows of 37: the lanes and the remainder loop), and
    combining blocks of rows (three threads) keeps them too."""
    x = randn((5, 37), 0)
    x[3, 36] = bad
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(fp, "_BLOCK_MIN", 1):
            got = fp.fused_pass(x, right=randn((37, 2), 1), left=randn((5, 2), 2), row_sq=True, col_sq=True)
            maxima = fp.fused_pass(x, row_max=True, col_max=True)
    finally:
        torch.set_num_threads(before)
    assert maxima is not None and maxima.row_max is not None and maxima.col_max is not None
    assert not torch.isfinite(maxima.row_max[3]) and not torch.isfinite(maxima.col_max[36])
    assert got is not None and got.right is not None and got.left is not None
    assert got.row_sq is not None and got.col_sq is not None
    assert not torch.isfinite(got.right[3]).any() and torch.isfinite(got.right[[0, 1, 2, 4]]).all()
    assert not torch.isfinite(got.left[36]).any() and torch.isfinite(got.left[:36]).all()
    assert not torch.isfinite(got.row_sq[3]) and not torch.isfinite(got.col_sq[36])
    if math.isinf(bad):
        assert got.row_sq[3] == math.inf and got.col_sq[36] == math.inf


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), t=st.integers(1, 40), d=st.integers(1, 20), extra=st.integers(0, 9),
       source=st.sampled_from(["BHTD", "BTHD", "slice"]), dest=st.sampled_from(["BTHW", "BHTW"]),
       threads=st.sampled_from([1, 3]), seed=st.integers(0, 10_000))
def test_the_copy_is_each_row_then_zeros_in_the_buffers_layout(
    b: int, h: int, t: int, d: int, extra: int, source: str, dest: str, threads: int, seed: int,
) -> None:
    """copy_to (the encoded operands of the attention backward) holds X's rows followed by zeros, in whichever layout
    the buffer has ((B, T, H, W) read as (B, H, T, W): two batch strides), from X in any of the layouts attention
    hands it (heads split from a projection, a column slice of a fused one); the sums it makes in the same read are
    the ones it makes without the copy. Every element of the buffer is written: it starts as NaN."""
    x_BHTD = {"BHTD": lambda: randn((b, h, t, d), seed), "BTHD": lambda: randn((b, t, h, d), seed).transpose(1, 2),
              "slice": lambda: randn((b, t, 3 * h * d), seed)[..., h * d: 2 * h * d].unflatten(-1, (h, d))
              .transpose(1, 2)}[source]()
    w = d + extra
    buf = torch.full((b, t, h, w), math.nan).transpose(1, 2) if dest == "BTHW" else torch.full((b, h, t, w), math.nan)
    weights = randn((d, 2), seed + 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(fp, "_BLOCK_MIN", 1):
            # Read as encoded._rows_times reads it: heads split from a projection as its (B, T, H, D) rows.
            inside = x_BHTD.stride(1) < x_BHTD.stride(2)
            read, into = (x_BHTD.transpose(1, 2), buf.transpose(1, 2)) if inside else (x_BHTD, buf)
            plain = fp.fused_pass(read, right=weights, row_sq=True, row_max=True)
            got = fp.fused_pass(read, right=weights, row_sq=True, row_max=True, copy_to=into)
    finally:
        torch.set_num_threads(before)
    assert plain is not None and got is not None
    assert torch.equal(buf[..., :d], x_BHTD)
    assert torch.equal(buf[..., d:], torch.zeros(b, h, t, extra))
    for field in ("right", "row_sq", "row_max"):
        assert torch.equal(getattr(got, field), getattr(plain, field))


@pytest.mark.parametrize("case", ["narrow", "other_rows", "bf16", "batch_strides"])
def test_a_copy_it_cannot_write_declines_the_call_and_writes_nothing(case: str) -> None:
    """A buffer narrower than X, of another shape or dtype, or whose batch dims are not one or two strides: the
    call declines (the caller copies eagerly) and the buffer is untouched."""
    x = randn((2, 2, 3, 4, 8), 0)
    buf = {"narrow": lambda: torch.zeros(2, 2, 3, 4, 7), "other_rows": lambda: torch.zeros(2, 2, 3, 5, 8),
           "bf16": lambda: torch.zeros(2, 2, 3, 4, 8, dtype=torch.bfloat16),
           # batch dims (2, 2, 3) whose first two do not merge: three strides
           "batch_strides": lambda: torch.zeros(2, 3, 2, 4, 8).permute(0, 2, 1, 3, 4)}[case]()
    before = buf.clone()
    assert fp.fused_pass(x, row_sq=True, copy_to=buf) is None
    assert torch.equal(buf, before)


@pytest.mark.parametrize("case", ["bf16", "fp16", "fp64", "strided_rows", "wide_left", "groups", "needs_grad",
                                  "disabled"])
def test_it_declines_what_it_does_not_take(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = randn((8, 16), 0)
    right, left, groups = randn((16, 2), 1), None, 1
    if case in ("bf16", "fp16", "fp64"):
        x = x.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[case])
    elif case == "strided_rows":
        x = x.T.contiguous().T  # column-major: rows are not contiguous
    elif case == "wide_left":
        left = randn((8, 65), 1)
    elif case == "groups":
        right, groups = randn((5, 2), 1), 3  # 16 columns do not split into 3 runs
    elif case == "needs_grad":
        x.requires_grad_(True)
    else:
        monkeypatch.setattr(fp, "enabled", False)
    assert fp.fused_pass(x, right=right, left=left, row_sq=True, groups=groups) is None


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 60), k=st.integers(1, 80), n=st.integers(1, 60), a_t=st.booleans(), b_t=st.booleans(),
       with_bias=st.booleans(), batched=st.booleans(), fault=st.sampled_from([None, "inf", "nan", "add"]),
       seed=st.integers(0, 10_000))
def test_verify_gemm_with_the_kernel_flags_what_the_eager_path_flags(
    m: int, k: int, n: int, a_t: bool, b_t: bool, with_bias: bool, batched: bool, fault: str | None, seed: int
) -> None:
    """The fast path (row direction) on every operand layout the engine passes: a transposed A (dYᵀ, Xᵀ in a weight
    gradient), a transposed B (Wᵀ, Kᵀ), batches (attention's backward products). Same references and bound up to
    round-off, the same vectors flagged."""
    lead = (2, 3) if batched else ()
    a = randn((*lead, k, m), seed).mT if a_t else randn((*lead, m, k), seed)
    b = randn((*lead, n, k), seed + 1).mT if b_t else randn((*lead, k, n), seed + 1)
    bias = randn((n,), seed + 2) if with_bias and not batched else None
    c = a @ b if bias is None else torch.addmm(bias, a, b)
    if fault is not None:
        c.view(-1)[seed % c.numel()] = {"inf": math.inf, "nan": math.nan}.get(fault, 1000.0 * math.sqrt(k))
    eager = verify_gemm(c, a, b, Tolerance(), bias_N=bias, directions=("row",))["row"]
    fused = verify_gemm(c, a, b, Tolerance(), bias_N=bias, directions=("row",), one_pass=fp.fused_pass)["row"]
    assert torch.equal(eager.bad, fused.bad)
    assert int(fused.bad.sum()) == (0 if fault is None else 1)
    torch.testing.assert_close(fused.bound, eager.bound, rtol=1e-4, atol=0.0)
    # The two references differ by round-off only: far inside the tolerance either is checked against.
    assert eager.bound2 is not None
    bound_V2 = torch.stack([eager.bound, eager.bound2], -1)
    finite = torch.isfinite(eager.ref)
    assert ((fused.ref - eager.ref).abs()[finite] <= bound_V2[finite] / 2).all()


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The kernel loaded anew from an empty cache directory; the process's own kernel restored afterwards."""
    monkeypatch.setenv("ATTNCHECKER_CACHE_DIR", str(tmp_path))
    fp._kernel.cache_clear()
    yield tmp_path
    fp._kernel.cache_clear()


def test_the_library_is_built_once_into_the_cache_directory(fresh_kernel: Path) -> None:
    assert fp.available()
    (built,) = (fresh_kernel / "native").glob("fused_pass-*.so")
    stamp = built.stat().st_mtime_ns
    fp._kernel.cache_clear()
    assert fp.available()
    assert [p.name for p in (fresh_kernel / "native").iterdir()] == [built.name]  # no leftover temporary file
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_without_a_compiler_the_checks_run_eagerly(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A machine without a working C compiler: one warning, the kernel declines, verify_gemm computes the same
    check eagerly (nothing is left behind in the cache directory)."""
    monkeypatch.setenv("CC", "/bin/false")
    a, b = randn((6, 9), 0), randn((9, 7), 1)
    c = a @ b
    c[2, 3] = math.inf
    with caplog.at_level(logging.WARNING, logger="attnchecker"):
        assert fp.fused_pass(a, right=b) is None
        assert fp.fused_pass(a, right=b) is None
        checks = verify_gemm(c, a, b, Tolerance(), directions=("row",), one_pass=fp.fused_pass)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "eager path" in caplog.records[0].message
    assert checks["row"].bad.nonzero().tolist() == [[0, 2]]
    assert list((fresh_kernel / "native").iterdir()) == []


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_protected_step_checks_its_whole_step_gemms_through_the_kernel(arch: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's fast path reaches the kernel on the layouts a real step has (Conv1D and Linear weights, dYᵀ and
    Xᵀ views in the weight gradients; the encoded attention backward's strided q/k/v, its dO and its outputs in the
    kernel's (B, T, H, D) layout), instead of quietly declining them."""
    from model_zoo import batch, build, loss_of

    import attnchecker
    import attnchecker.attention.backward.encoded as encoded
    import attnchecker.gemm.check as gemm_check

    taken: list[bool] = []
    taken_encoded: list[bool] = []
    copies = 0

    def counting(into: list[bool]) -> object:
        def counted(x: torch.Tensor, **kwargs: object) -> object:
            nonlocal copies
            got = fp.fused_pass(x, **kwargs)  # type: ignore[arg-type]
            into.append(got is not None)
            copies += got is not None and kwargs.get("copy_to") is not None
            return got
        return counted

    monkeypatch.setattr(gemm_check, "fused_pass", counting(taken))
    monkeypatch.setattr(encoded, "fused_pass", counting(taken_encoded))
    # The zoo's models are small enough for the eager path (gemm.check.ONE_PASS_MIN); their layouts are the point.
    monkeypatch.setattr(gemm_check, "ONE_PASS_MIN", 0)
    model = build(arch)
    guard = attnchecker.protect(model, policy=attnchecker.Policy.full(), scope="all")
    loss_of(arch, model, batch(arch, 0)).backward()
    stats = guard.step_stats
    assert stats is not None
    gemm_checks = sum(stats.checks.get(op, 0) for op in ("linear", "linear_dx", "linear_dw"))
    layers = stats.checks["grad_q"]
    guard.close()
    assert gemm_checks > 0
    assert len(taken) >= gemm_checks  # C of every whole-step GEMM check at least (operand sums are shared)
    assert all(taken)
    # Per layer: q, k and dO (checksums and norms), v (norms) and O, each also written into its encoded buffer; and
    # the residuals of dQ', dK' and dV'.
    assert layers == 2 and len(taken_encoded) == 8 * layers and copies == 5 * layers
    assert all(taken_encoded)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_encoded_buffers_written_by_the_kernel_give_the_gradients_of_the_eager_buffers(arch: str) -> None:
    """The encoded attention backward's operands, written by the pass that reads them (copy_to) or concatenated
    eagerly where the kernel declines, are the same buffers: a protected step's gradients are bitwise equal."""
    from model_zoo import batch, build, loss_of

    import attnchecker

    torch.manual_seed(0)
    base = build(arch)
    grads = []
    for kernel in (True, False):
        model = build(arch)
        model.load_state_dict(base.state_dict())
        guard = attnchecker.protect(model, policy=attnchecker.Policy.full(), scope="all")
        with contextlib.nullcontext() if kernel else kernel_off():
            loss_of(arch, model, batch(arch, 0)).backward()
        stats = guard.step_stats
        assert stats is not None and stats.checks["grad_q"] > 0
        guard.close()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_checked_step_reads_each_weight_once_for_its_three_gemm_checks(arch: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward check of a Linear/Conv1D reads x and W once, and keeps what the backward's dX and dW checks need
    of them (gemm.check.linear_sums); the backward reads dy once for both. So a checked step's kernel reads each
    weight once (it read it twice: for y and for dX), whether the module's forward is the GEMM check's (the MLP) or
    the projection hook's (then the backward makes the sums). Faults are still corrected on this path:
    test_linear_abft's per-GEMM fault test runs it (its kernel variants)."""
    from model_zoo import batch, build, loss_of
    from transformers.pytorch_utils import Conv1D

    import attnchecker
    import attnchecker.gemm.check as gemm_check

    reads: list[int] = []

    def counted(x: torch.Tensor, **kwargs: object) -> object:
        reads.append(x.untyped_storage().data_ptr())
        return fp.fused_pass(x, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gemm_check, "fused_pass", counted)
    monkeypatch.setattr(gemm_check, "ONE_PASS_MIN", 0)
    model = build(arch)
    weights = {m.weight.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, (nn.Linear, Conv1D))}
    guard = attnchecker.protect(model, policy=attnchecker.Policy.full(), scope="all")
    loss_of(arch, model, batch(arch, 0)).backward()
    guard.close()
    assert weights
    assert {w: reads.count(w) for w in weights} == dict.fromkeys(weights, 1)


@settings(max_examples=30, deadline=None)
@given(tokens=st.sampled_from([7, 64, 300]), n_in=st.sampled_from([24, 96]), n_out=st.sampled_from([40, 512, 768]),
       layout=st.sampled_from(["out_in", "in_out", "in_out_slice"]), with_bias=st.booleans(),
       fault=st.sampled_from([None, "inf", "nan", "add"]), seed=st.integers(0, 10_000))
def test_a_projection_checked_by_rows_through_the_kernel_flags_what_the_eager_check_flags(
    tokens: int, n_in: int, n_out: int, layout: str, with_bias: bool, fault: str | None, seed: int,
) -> None:
    """The fp32 projection check (rows, random-walk model, grouped from 512 outputs on): W, X and Y each read once
    by the kernel, for an nn.Linear weight, a Conv1D one and a Conv1D column slice (GPT-2's q/k/v in c_attn). The
    same vectors flag as on the eager path, and the bounds agree to round-off."""
    from attnchecker.gemm.projection import _ProjectionInput

    x = randn((2, tokens, n_in), seed) * (1 + 10 * (torch.arange(n_in) == 3))  # an outlier channel
    if layout == "out_in":
        w_OI = randn((n_out, n_in), seed + 1) / math.sqrt(n_in)
    else:
        width = n_out * (3 if layout == "in_out_slice" else 1)
        w_IO = randn((n_in, width), seed + 1) / math.sqrt(n_in)
        w_OI = w_IO.T[n_out : 2 * n_out] if layout == "in_out_slice" else w_IO.T
    bias = randn((n_out,), seed + 2) if with_bias else None
    y = torch.nn.functional.linear(x, w_OI, bias)
    if fault is not None:
        y.view(-1)[seed % y.numel()] = {"inf": math.inf, "nan": math.nan}.get(fault, 1000.0 * math.sqrt(n_in))
    with torch.no_grad():
        fused = _ProjectionInput.of(x).checks(y, w_OI, bias, tol=Tolerance(), directions=("row",))["row"]
        groups = (group_count(n_out), group_count(tokens))
        # The kernel took every read (no quiet fallback to the eager path on these layouts).
        assert _ProjectionInput.of(x)._rows_in_one_pass(y, w_OI, bias, tol=Tolerance(), groups=groups) is not None
        with kernel_off():
            eager = _ProjectionInput.of(x).checks(y, w_OI, bias, tol=Tolerance(), directions=("row",))["row"]
    assert torch.equal(fused.bad, eager.bad)
    assert int(fused.bad.sum()) == (0 if fault is None else 1)
    torch.testing.assert_close(fused.bound, eager.bound, rtol=1e-4, atol=0.0)
    assert fused.groups == eager.groups


def test_the_kernel_keeps_nan_in_row_and_column_maxima() -> None:
    x = randn((4, 40), 0)
    x[1, 17] = math.nan
    got = fp.fused_pass(x, row_max=True, col_max=True)
    assert got is not None and got.row_max is not None and got.col_max is not None
    assert torch.isnan(got.row_max[1]) and torch.isnan(got.col_max[17])
    ok_rows, ok_cols = [0, 2, 3], [c for c in range(40) if c != 17]
    torch.testing.assert_close(got.row_max[ok_rows], x[ok_rows].abs().amax(-1))
    torch.testing.assert_close(got.col_max[ok_cols], x[:, ok_cols].abs().amax(0))


@settings(max_examples=40, deadline=None)
@given(batch=st.sampled_from([(), (2,), (2, 3)]), runs=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       sizes=st.tuples(st.integers(1, 30), st.integers(1, 30)), with_sq=st.booleans(),
       kind=st.sampled_from(["contiguous", "slice"]), seed=st.integers(0, 10_000))
def test_both_directions_in_one_pass_are_the_grouped_checksums(
    batch: tuple[int, ...], runs: tuple[int, int], sizes: tuple[int, int], with_sq: bool, kind: str, seed: int
) -> None:
    """Scores, context and the slow path's two-direction checks: the grouped row and column checksums and ΣC² per
    vector from one read of C (row groups runs of a row, column groups blocks of rows), laid out as checksums_of
    lays them out (abft/checksum.py), equal to its values at fp32 round-off."""
    from attnchecker.abft import checksums_of
    from attnchecker.checks import product as product_check

    (g_r, g_c), (run_c, run_r) = runs, sizes
    c = layout(randn((*batch, g_c * run_r, g_r * run_c), seed), kind)
    # Small C go to the eager path by default (checks.product._ONE_PASS_MIN): here the kernel's layout is the point.
    with mock.patch.object(product_check, "_ONE_PASS_MIN", 0), mock.patch.object(product_check, "_ONE_PASS_MIN_SQ", 0):
        got = product_check._both_in_one_pass(c, (g_r, g_c), with_sq=with_sq)
    assert got is not None
    want = checksums_of(c, with_sq=with_sq, groups=(g_r, g_c))
    u = torch.finfo(torch.float32).eps
    for mine, theirs, n in ((got[0], want[0], run_c), (got[1], want[1], run_r)):
        assert mine.shape == theirs.shape
        scale = n * n * c.abs().amax().item() + 1e-30  # weights up to n, n terms
        assert ((mine - theirs).abs() <= 4 * n * u * scale).all()
    if with_sq:
        assert got[2] is not None and want[2] is not None and got[2].sq_sum is not None and want[2].sq_sum is not None
        for mine, theirs in zip(got[2].sq_sum, want[2].sq_sum, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    else:
        assert got[2] is None


@pytest.mark.parametrize("fault", [None, "inf", "finite"])
def test_scores_and_context_checks_at_a_real_size_flag_as_the_eager_path(fault: str | None) -> None:
    """A 4-head 1024 × 1024 causal layer (grouped: 4 × 4 groups), over the kernel's size threshold: the same vectors
    flag through the kernel as eagerly, for a clean layer, an INF and an error of 3 × the RMS score."""
    from attnchecker.attention.pipeline import context_checks, scores_checks

    t, d, h = 1024, 64, 4
    q, k, v = randn((1, h, t, d), 0), randn((1, h, t, d), 1), randn((1, h, t, d), 2)
    scores = q @ k.mT
    probs = torch.softmax((scores / math.sqrt(d)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf),
                          -1)
    out = probs @ v
    if fault == "inf":
        scores[0, 1, 700, 3] = math.inf
        out[0, 2, 5, 60] = math.inf
    elif fault == "finite":
        scores[0, 1, 700, 3] += 3 * float(scores.square().mean().sqrt())
        out[0, 2, 5, 60] += 3 * float(out.square().mean().sqrt())
    tol = Tolerance()
    from attnchecker.checks.product import _both_in_one_pass

    assert _both_in_one_pass(scores, (4, 4), with_sq=True) is not None  # this size goes through the kernel
    fused = (scores_checks(q, k, scores, {}, h, tol), context_checks(probs, v, out, None, h, tol))
    with kernel_off():
        eager = (scores_checks(q, k, scores, {}, h, tol), context_checks(probs, v, out, None, h, tol))
    for got, want in zip(fused, eager, strict=True):
        for d_ in ("row", "col"):
            assert got[d_].groups == want[d_].groups
            assert torch.equal(got[d_].bad, want[d_].bad)
            assert int(got[d_].bad.sum()) == (0 if fault is None else 1)
