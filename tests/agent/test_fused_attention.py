"""The native checked attention forward (fused_attention.c, issue 12): what the tiled path runs where it applies.

- The kernel alone: output and lse equal to the float64 reference over shapes, causal or not, block sizes and
  checksum groups; clean calls flag nothing; a fault inside the kernel (emulated: written into its scores or context
  right after the GEMM that computed them) is flagged at its row, whatever its size down to a fraction of the RMS;
  the same at a 7B-like head (T = 4096, D = 128).
- Masks: key padding, bool and additive, broadcast or full, rows with every key masked: the masked softmax's output
  and lse, faults flagged at their row, SDPA's gradients.
- Through the engine (protected_sdpa, and a GPT-2 step as ``protect(model, optimizer=opt)`` runs it, on its first
  step, on the first full check after a quiet period, and on a padded batch): the output is
  SDPA's, a fault inside the kernel is recomputed and reported with its place, detect mode reports and keeps it,
  and the checks are counted; calls it does not take (half precision, a dispatch mode, a set tile size, the
  kernel switched off) run the PyTorch tile loop and give the same answer.
- The engine's no-fault suites re-run with the kernel taking every call it can.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import test_attention_fused_backward as fused_suite
import test_attention_layer as layer_suite
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quiet_period import step_until_due_after_quiet
from scoped_env import scoped_env
from test_attention_layer import seeded
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.abft import Tolerance
from attnchecker.abft.tiled import augment_v, v_row_checksums
from attnchecker.attention.backends.native_rules import kernel_checks, kernel_rules
from attnchecker.attention.backends.tiled_torch import KERNEL_BLOCK_Q, PATH_ENV, TILE_ENV
from attnchecker.attention.backward.fused import _additive_mask
from attnchecker.attention.pipeline import protected_sdpa
from attnchecker.checks.product import _groups
from attnchecker.checks.records import _worst_ratio
from attnchecker.emulate import emulate_fp32_matmul
from attnchecker.kernels import fused_attention

pytestmark = pytest.mark.skipif(not fused_attention.available(), reason="no C compiler or no BLAS sgemm_ here")


@pytest.fixture(autouse=True, scope="module")
def kernel_path() -> Iterator[None]:
    """The tiled path at every size, its own tile sizes (so the kernel may take the call): module scope, for
    hypothesis."""
    with scoped_env({PATH_ENV: "native", TILE_ENV: None}):
        yield


class Calls:
    """Counts the kernel's calls (fused_attention.run) that it took, while active."""

    def __init__(self) -> None:
        self.n = 0

    @contextlib.contextmanager
    def watch(self) -> Iterator[Calls]:
        original = fused_attention.run

        def counted(*args: Any, **kwargs: Any) -> Any:
            got = original(*args, **kwargs)
            self.n += got is not None  # a call it declined inside (None) ran the PyTorch loop
            return got

        fused_attention.run = counted  # type: ignore[assignment]
        try:
            yield self
        finally:
            fused_attention.run = original  # type: ignore[assignment]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, is_causal: bool,
              attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64; a row with every key masked: out 0, lse +INF (SDPA's safe softmax, abft.tiled.finish)."""
    z = scale * q.double() @ k.double().mT
    if is_causal:
        z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if attn_mask is not None:
        z = z + (attn_mask.double() if attn_mask.dtype != torch.bool
                 else torch.zeros(attn_mask.shape, dtype=torch.float64).masked_fill(~attn_mask, -math.inf))
    dead = torch.isneginf(z).all(-1, keepdim=True)
    out = torch.softmax(z.masked_fill(dead, 0.0), -1) @ v.double()
    return out.masked_fill(dead, 0.0), torch.logsumexp(z, -1).masked_fill(dead[..., 0], math.inf)


def kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, is_causal: bool,
                block_q: int = KERNEL_BLOCK_Q, faults: list[fused_attention.Fault] | None = None,
                tol: Tolerance | None = None, mask_add: torch.Tensor | None = None, heads: int = 1
                ) -> tuple[fused_attention.KernelOutput, dict[str, Any]]:
    s = k.shape[1]
    tol = tol or Tolerance()
    vw = v_row_checksums(v)
    rules = kernel_rules(q, k, v, vw, tol=tol, groups=_groups(tol, s))
    got = fused_attention.run(q, k, augment_v(v, vw), rules, scale=scale, is_causal=is_causal, block_q=block_q,
                              faults=faults, mask_add=mask_add, heads=heads)
    assert got is not None
    checks = kernel_checks(k, v, vw, got, rules, tol=tol)
    assert_same_verdict(got, checks)
    return got, checks


def assert_same_verdict(got: fused_attention.KernelOutput, checks: dict[str, Any]) -> None:
    """The kernel's own verdict, the one the engine acts on (rows flagged per matrix, worst ratio per op), is what
    the Python checks make of the same sums (kernel_checks, the report of a flagged call)."""
    n = got.flagged_N2.shape[0]
    for i, op in enumerate(fused_attention.OPS):
        row = checks[op]["row"]
        assert got.flagged_N2[:, i].tolist() == row.bad.view(n, -1).sum(-1).tolist(), op
        torch.testing.assert_close(got.worst_2[i], _worst_ratio({"row": row}), rtol=1e-4, atol=1e-7, equal_nan=True,
                                   msg=lambda m, op=op: f"{op}: {m}")


# ------------------------------------------------------------------------------------------------ the kernel


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), t=st.integers(1, 300), s=st.integers(1, 300), d=st.integers(1, 72),
       causal=st.booleans(), block_q=st.sampled_from([1, 5, 64, 256]), scale=st.floats(0.01, 2.0),
       magnitude=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**20))
def test_the_kernel_gives_the_reference_output_and_lse_and_flags_nothing_clean(n, t, s, d, causal, block_q, scale,
                                                                               magnitude, seed) -> None:
    s = t if causal else s
    q, k, v = (seeded((n, x, d), seed + i, torch.float32, magnitude) for i, x in enumerate((t, s, s)))
    got, checks = kernel_call(q, k, v, scale=scale, is_causal=causal, block_q=block_q)
    out, lse = reference(q, k, v, scale=scale, is_causal=causal)
    # As close to the float64 softmax as fp32 SDPA is: large scores make the output as sensitive as their rounding.
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    allowed = 4 * float((sdpa.double() - out).abs().max()) + 1e-5 * float(v.abs().max())
    assert float((got.out_NTD.double() - out).abs().max()) <= allowed
    # The scores' own fp32 rounding (u·|z|, z up to ~10^4 at magnitude 30) is what lse inherits.
    z_max = float((scale * q.double() @ k.double().mT).abs().max())
    torch.testing.assert_close(got.lse_NT.double(), lse, rtol=1e-5, atol=1e-6 * (1.0 + z_max))
    for op, chk in checks.items():
        row = chk["row"]
        assert not bool(row.bad.any()), op
        assert float((row.diff[..., 0].abs() / row.bound).max()) < 0.5, op


TOLERANCES = {
    "calibrated": Tolerance(),
    "rigorous": Tolerance(calibrated=False),
    "extreme": Tolerance(mode="extreme"),
    "tight": Tolerance(factor=0.02, sigmas=2.0),
    "ungrouped": Tolerance(grouped=False),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 3), t=st.integers(1, 600), s=st.integers(1, 600), d=st.integers(1, 40),
       causal=st.booleans(), tol=st.sampled_from(sorted(TOLERANCES)), magnitude=st.sampled_from([1e-3, 1.0, 30.0]),
       faults=st.lists(st.tuples(st.sampled_from(fused_attention.OPS), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
                                 st.floats(0.0, 1.0), st.floats(-6.0, 21.0)), max_size=3),
       seed=st.integers(0, 2**20))
def test_the_kernel_verifies_each_row_as_the_python_checks_do(n, t, s, d, causal, tol, magnitude, faults,
                                                             seed) -> None:
    """The rows the kernel flags, and its worst ratio, under every tolerance mode, on clean calls and with faults
    from far below the threshold to 1e21 and non-finite (kernel_call asserts the verdicts agree)."""
    s = t if causal else s
    q, k, v = (seeded((n, x, d), seed + i, torch.float32, magnitude) for i, x in enumerate((t, s, s)))
    # Each fault: op, matrix, row and column as fractions, and the value 10^e written there (e > 20: NaN).
    where = [(op, round(fi * (n - 1)), round(fr * (t - 1)), round(fc * ((s if op == "scores" else d) - 1)),
              math.nan if e > 20 else 10.0 ** e)
             for op, fi, fr, fc, e in faults]
    kernel_call(q, k, v, scale=d ** -0.5, is_causal=causal, faults=where or None, tol=TOLERANCES[tol])


@pytest.mark.parametrize("causal", [True, False])
def test_with_several_torch_threads_the_matrices_are_split_between_them_with_the_one_thread_answer(
        causal: bool) -> None:
    """torch.set_num_threads(3): the B·H matrices run in parts at once, each part's GEMMs on its own thread (MKL's
    per-thread setting), where one thread would leave the other cores idle beside SDPA's threaded kernel; no part
    smaller than PART_MIN_MACS (this call's 10.8M multiply-adds make 2 parts, a demo-size call one). Every output is
    bitwise the one-thread call's, and a fault in a matrix of the last part is flagged at its matrix."""
    if fused_attention._mkl_local_threads() is None:
        pytest.skip("the BLAS is not MKL: the kernel runs in one part")
    q, k, v = (seeded((5, 300, 24), 40 + i, torch.float32) for i in range(3))
    macs = 5 * 300 * 300 * 24
    fault = [("scores", 4, 100, 7, 1e6)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert fused_attention._parts(5, macs) == [(0, 5)]
        one, _ = kernel_call(q, k, v, scale=0.2, is_causal=causal, faults=fault)
        torch.set_num_threads(3)
        assert fused_attention._parts(5, macs) == [(0, 2), (2, 5)]
        assert fused_attention._parts(32, 32 * 64 * 64 * 32) == [(0, 32)]
        three, _ = kernel_call(q, k, v, scale=0.2, is_causal=causal, faults=fault)
    finally:
        torch.set_num_threads(before)
    for name in ("out_NTD", "lse_NT", "p_sum_NT", "scores_sums_NTg3", "scores_refs_NTg2", "context_sums_NT5",
                 "flagged_N2", "worst_2"):
        assert torch.equal(getattr(one, name), getattr(three, name)), name
    assert three.flagged_N2[:, 0].nonzero().flatten().tolist() == [4]


@pytest.mark.parametrize("causal", [True, False])
def test_grouped_score_rows_cover_exactly_the_keys_each_block_computed(causal: bool) -> None:
    """S = 1024: 4 checksum groups of 256 keys; a causal block computes only the groups up to its last key, and the
    ones it skips are zero on both sides (no flag from a reference the kernel never matched)."""
    q, k, v = (seeded((2, 1024, 16), i, torch.float32) for i in range(3))
    got, checks = kernel_call(q, k, v, scale=0.25, is_causal=causal)
    assert got.scores_sums_NTg3.shape == (2, 1024, 4, 3)
    if causal:
        assert bool((got.scores_sums_NTg3[:, :64, 1:] == 0).all())  # the first block: keys 0..63, group 0 only
        assert bool((got.scores_sums_NTg3[:, -64:] != 0).all())
    assert not any(bool(c["row"].bad.any()) for c in checks.values())
    torch.testing.assert_close(got.out_NTD.double(), reference(q, k, v, scale=0.25, is_causal=causal)[0],
                               rtol=1e-5, atol=1e-5)


FAULT_VALUES = {"inf": math.inf, "neg_inf": -math.inf, "nan": math.nan, "near_inf": 1e20}


@pytest.mark.parametrize("kind", [*FAULT_VALUES, "2x_rms", "half_rms"])
@pytest.mark.parametrize("op", fused_attention.OPS)
@pytest.mark.parametrize("causal", [True, False])
def test_a_fault_inside_the_kernel_is_flagged_at_its_row(op: str, kind: str, causal: bool) -> None:
    n, t, d = 3, 700, 32
    q, k, v = (seeded((n, t, d), 10 + i, torch.float32) for i in range(3))
    clean, _ = kernel_call(q, k, v, scale=d ** -0.5, is_causal=causal)
    where = (1, 555, 500 if op == "scores" else 17)
    if kind in FAULT_VALUES:
        value = FAULT_VALUES[kind]
    else:
        # The element's clean value plus m x RMS of the matrix it lands in (a finite silent error).
        if op == "scores":
            rms = float((q[1] @ k[1].T).square().mean().sqrt())
            base = float(q[1, where[1]] @ k[1, where[2]])
        else:
            p = torch.softmax(d ** -0.5 * q[1] @ k[1].T + (torch.ones(t, t).triu(1) * -1e30 if causal else 0), -1)
            cl = p @ v[1] * clean.p_sum_NT[1][:, None]  # the kernel checks CL before it is normalised
            rms, base = float(cl.square().mean().sqrt()), float(cl[where[1], where[2]])
        value = base + (2.0 if kind == "2x_rms" else 0.5) * rms
    _, checks = kernel_call(q, k, v, scale=d ** -0.5, is_causal=causal, faults=[(op, *where, value)])
    bad = checks[op]["row"].bad
    rows = bad.view(n, t, -1).any(-1).nonzero().tolist()
    assert rows == [[where[0], where[1]]], (op, kind)
    other = "context" if op == "scores" else "scores"
    if op == "context":
        assert not bool(checks[other]["row"].bad.any())  # a context fault leaves the scores' sums alone


@pytest.mark.parametrize("op", fused_attention.OPS)
def test_at_a_7b_like_head_clean_rows_pass_and_a_2x_rms_fault_is_flagged(op: str) -> None:
    """A Llama-7B-like head (T = S = 4096, D = 128, causal; 16 checksum groups of 256 keys a scores row), where a
    bound tight at small shapes could be loose: no clean row flags, with room, and an error of 2 x the RMS of the
    matrix it lands in is flagged at its row."""
    t, d = 4096, 128
    q, k, v = (seeded((1, t, d), 30 + i, torch.float32) for i in range(3))
    clean, checks = kernel_call(q, k, v, scale=d ** -0.5, is_causal=True)
    assert clean.scores_sums_NTg3.shape[2] == 16
    for name, chk in checks.items():
        row = chk["row"]
        assert not bool(row.bad.any()), name
        assert float((row.diff[..., 0].abs() / row.bound).max()) < 0.5, name
    row, col = 3000, (2000 if op == "scores" else 64)
    if op == "scores":
        scores = q[0] @ k[0].T
        rms, base = float(scores.square().mean().sqrt()), float(scores[row, col])
    else:
        z = (d ** -0.5 * q[0] @ k[0].T).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        cl = torch.softmax(z, -1) @ v[0] * clean.p_sum_NT[0][:, None]  # the kernel checks CL before normalising
        rms, base = float(cl.square().mean().sqrt()), float(cl[row, col])
    _, checks = kernel_call(q, k, v, scale=d ** -0.5, is_causal=True, faults=[(op, 0, row, col, base + 2 * rms)])
    assert checks[op]["row"].bad.view(1, t, -1).any(-1).nonzero().tolist() == [[0, row]]


# ------------------------------------------------------------------------------------------------ the engine


def _qkv(b: int, h: int, t: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return tuple(seeded((b, h, t, d), seed + i, torch.float32) for i in range(3))


def test_protected_sdpa_runs_on_the_kernel_and_gives_sdpa(make_ctx) -> None:
    q, k, v = _qkv(2, 3, 96, 16)
    ctx, rec = make_ctx()
    with Calls().watch() as calls:
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert calls.n == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)
    assert rec.detections == []
    stats = ctx.runtime.stats
    assert stats.checks["scores"] == stats.checks["context"] == 1
    assert stats.check_seconds["scores"] > 0 and stats.check_seconds["context"] > 0
    assert int(stats.residual_count) == 2


@pytest.mark.parametrize("op", fused_attention.OPS)
@pytest.mark.parametrize("value", [math.inf, math.nan, 1e20, 0.75])
def test_a_fault_inside_the_kernel_is_recomputed_and_reported_at_its_place(make_ctx, op: str, value: float) -> None:
    q, k, v = _qkv(2, 3, 96, 16, seed=5)
    clean = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ctx, rec = make_ctx()
    # Matrix n = batch·H + head = 1·3 + 2; row 70; a key at or before the row, or a feature.
    with Calls().watch() as calls, fused_attention.emulated_faults([(op, 5, 70, 40 if op == "scores" else 3, value)]):
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert calls.n == 1  # the recompute runs the PyTorch tile loop, which the emulated fault does not reach
    torch.testing.assert_close(out, clean, rtol=1e-5, atol=1e-6)
    assert [(d.op, d.action, d.batch, d.head, d.row) for d in rec.detections] == [(op, "recomputed", 1, 2, 70)]


def test_detect_mode_reports_the_kernels_fault_and_keeps_its_output(make_ctx) -> None:
    q, k, v = _qkv(1, 2, 80, 8, seed=9)
    ctx, rec = make_ctx(mode="detect")
    with fused_attention.emulated_faults([("context", 1, 33, 2, math.nan)]):
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert [(d.op, d.action, d.head, d.row, d.kind) for d in rec.detections] == [("context", "detected", 1, 33, "nan")]
    assert bool(out[0, 1, 33].isnan().any()) and not bool(out[0, 0].isnan().any())


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _declined(case: str) -> contextlib.AbstractContextManager[Any]:
    if case == "dispatch_mode":
        return _Passthrough()
    if case == "tf32":
        return emulate_fp32_matmul("tf32")
    if case == "tile_size":
        os.environ[TILE_ENV] = "32,32"
        return contextlib.nullcontext()
    if case == "disabled":
        fused_attention.enabled = False
    return contextlib.nullcontext()


@pytest.mark.parametrize("case", ["bf16", "dispatch_mode", "tf32", "tile_size", "disabled"])
def test_calls_the_kernel_does_not_take_run_the_pytorch_tile_loop(make_ctx, case: str) -> None:
    q, k, v = _qkv(1, 2, 64, 8, seed=3)
    kwargs: dict[str, Any] = {"is_causal": True}
    if case == "bf16":
        q, k, v = (x.bfloat16() for x in (q, k, v))
    ctx, rec = make_ctx()
    try:
        with Calls().watch() as calls, _declined(case):
            out = protected_sdpa(q, k, v, ctx=ctx, **kwargs)
    finally:
        os.environ.pop(TILE_ENV, None)
        fused_attention.enabled = True
    assert calls.n == 0
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs).to(q.dtype)
    tol = {"rtol": 2e-2, "atol": 2e-2} if q.dtype == torch.bfloat16 else {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(out, expected, **tol)
    assert rec.detections == []
    assert ctx.runtime.stats.checks["scores"] == 1


MASKS = ("key_padding", "causal_padding", "bool", "additive", "dead_rows", "heads_only")


def make_mask(kind: str, b: int, h: int, t: int, s: int, seed: int) -> torch.Tensor:
    """A mask of the kinds models pass: key padding (B, 1, 1, S) as a bool, the same folded into a causal one
    (B, 1, T, S) as transformers hands SDPA for a padded batch, a bool (T, S), an additive (B, H, T, S) of finite
    values (ALiBi-like biases), an additive (1, 1, T, S) of 0 / -INF with whole rows masked, and a per-head (H, T, S)
    bool. The two padding kinds mask every key past some point for whole query blocks (the kernel skips them)."""
    gen = torch.Generator().manual_seed(seed)
    if kind in ("key_padding", "causal_padding"):
        lengths = torch.randint(1, s + 1, (b,), generator=gen)
        pad = (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
        return pad if kind == "key_padding" else pad & torch.ones(t, s, dtype=torch.bool).tril()
    if kind == "bool":
        return torch.rand(t, s, generator=gen) > 0.3
    if kind == "additive":
        return torch.randn(b, h, t, s, generator=gen) * 3.0
    if kind == "dead_rows":
        m = torch.where(torch.rand(1, 1, t, s, generator=gen) > 0.4, 0.0, -math.inf)
        m[..., :: max(1, t // 3), :] = -math.inf
        return m
    return torch.rand(h, t, s, generator=gen) > 0.5


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(MASKS), b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 150),
       s=st.integers(1, 150), d=st.integers(1, 40), seed=st.integers(0, 2**20))
def test_a_masked_call_runs_on_the_kernel_and_gives_the_masked_softmax(make_ctx, kind: str, b: int, h: int, t: int,
                                                                      s: int, d: int, seed: int) -> None:
    """Key padding, bool and additive masks, broadcast or full, rows with every key masked: the kernel takes the
    call (read in place where the mask broadcasts), the output is the masked softmax's (0 on dead rows, SDPA's safe
    softmax), the lse the float64 one (+INF on dead rows), and a clean call flags nothing."""
    q = seeded((b, h, t, d), seed, torch.float32)
    k, v = (seeded((b, h, s, d), seed + i, torch.float32) for i in (1, 2))
    mask = make_mask(kind, b, h, t, s, seed)
    ctx, rec = make_ctx()
    with Calls().watch() as calls:
        out = protected_sdpa(q, k, v, ctx=ctx, attn_mask=mask)
    assert calls.n == 1
    want, want_lse = reference(q, k, v, scale=d ** -0.5, is_causal=False, attn_mask=mask)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    assert rec.detections == []
    mask_add = _additive_mask(mask, torch.float32)
    got, _ = kernel_call(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), scale=d ** -0.5, is_causal=False,
                         mask_add=mask_add, heads=h)
    assert int(got.flagged_N2.sum()) == 0
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got.lse_NT.view(b, h, t)), finite)
    torch.testing.assert_close(got.lse_NT.view(b, h, t)[finite].double(), want_lse[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["causal_padding", "key_padding"])
def test_a_padding_mask_skips_the_keys_no_row_of_a_block_keeps(kind: str) -> None:
    """T = S = 1024 in 4 checksum groups of 256 keys: where the mask masks every key past some point for a whole
    query block (the causal part, or a sequence's padding), the kernel computes only the groups up to the block's last
    kept key, as a causal call does (their sums and references are zero), with the output and lse of the full masked
    softmax; a fault in the last group computed is flagged."""
    b, h, t, d = 2, 2, 1024, 32
    q, k, v = _qkv(b, h, t, d, seed=13)
    mask = make_mask(kind, b, h, t, t, 3)
    lengths = mask[:, 0, -1].sum(-1).tolist()  # keys each sequence keeps (its last row keeps them all)
    mask_add = _additive_mask(mask, torch.float32)
    got, _ = kernel_call(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), scale=d ** -0.5, is_causal=False,
                         mask_add=mask_add, heads=h)
    assert int(got.flagged_N2.sum()) == 0
    want, want_lse = reference(q, k, v, scale=d ** -0.5, is_causal=False, attn_mask=mask)
    torch.testing.assert_close(got.out_NTD.view(b, h, t, d).double(), want, rtol=1e-4, atol=1e-5)
    live = torch.isfinite(want_lse)
    torch.testing.assert_close(got.lse_NT.view(b, h, t)[live].double(), want_lse[live], rtol=1e-5, atol=1e-4)
    sums = got.scores_sums_NTg3.view(b, h, t, 4, 3)
    for i, keep in enumerate(lengths):
        for r0 in range(0, t, KERNEL_BLOCK_Q):
            last = min(keep, r0 + KERNEL_BLOCK_Q if kind == "causal_padding" else t) - 1
            done = last // 256 + 1
            assert bool((sums[i, :, r0:r0 + KERNEL_BLOCK_Q, done:] == 0).all()), (i, r0)
            assert bool((sums[i, :, r0:r0 + KERNEL_BLOCK_Q, done - 1, 2] > 0).all()), (i, r0)
    # A fault in the last group row 700 of batch 1 computes, at a key it keeps.
    keep = min(lengths[1], 701 if kind == "causal_padding" else t) - 1
    fault = ("scores", h + 1, 700, keep, 1e4)
    got, checks = kernel_call(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), scale=d ** -0.5, is_causal=False,
                              mask_add=mask_add, heads=h, faults=[fault])
    assert checks["scores"]["row"].bad.view(b * h, t, -1).any(-1).nonzero().tolist() == [[h + 1, 700]]


@pytest.mark.parametrize("op", fused_attention.OPS)
def test_a_fault_in_a_masked_call_is_flagged_at_its_row_and_recomputed_through_the_engine(make_ctx, op: str) -> None:
    """Under a key-padding mask: an error inside the kernel, 4× RMS in the scores (at a key the mask keeps) or 1e3 in
    the unnormalised context, is flagged at its row; through the engine the call is recomputed on the PyTorch loop,
    with the mask, and the output is SDPA's."""
    b, h, t, d = 2, 4, 128, 32
    q, k, v = _qkv(b, h, t, d, seed=11)
    mask = make_mask("key_padding", b, h, t, t, 5)
    keep = int(mask[1, 0, 0].sum()) - 1  # the last key batch 1 keeps
    scores = q[1, 2] @ k[1, 2].mT
    value = float(scores[70, keep] + 4.0 * scores.square().mean().sqrt()) if op == "scores" else 1e3
    col = keep if op == "scores" else 3
    fault = (op, h + 2, 70, col, value)
    got, checks = kernel_call(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), scale=d ** -0.5, is_causal=False,
                              mask_add=_additive_mask(mask, torch.float32), heads=h, faults=[fault])
    assert got.flagged_N2[:, fused_attention.OPS.index(op)].tolist() == [int(i == h + 2) for i in range(b * h)]
    assert checks[op]["row"].bad.view(b * h, t, -1).any(-1).nonzero().tolist() == [[h + 2, 70]]
    ctx, rec = make_ctx()
    with fused_attention.emulated_faults([fault]):
        out = protected_sdpa(q, k, v, ctx=ctx, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-6)
    assert [(x.op, x.batch, x.head) for x in rec.detections] == [(op, 1, 2)]


def test_gradients_through_a_masked_kernel_call_are_sdpas(make_ctx) -> None:
    """The fused backward fed the kernel's output and lse, under a key-padding mask: SDPA's gradients."""
    b, h, t, d = 2, 3, 96, 16
    q, k, v = (x.requires_grad_() for x in _qkv(b, h, t, d, seed=21))
    mask = make_mask("key_padding", b, h, t, t, 9)
    ctx, _ = make_ctx()
    with Calls().watch() as calls:
        out = protected_sdpa(q, k, v, ctx=ctx, attn_mask=mask)
    assert calls.n == 1
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask).square().sum(), (q2, k2, v2))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t", [16, 256])
def test_auto_runs_calls_below_the_tiled_size_on_the_kernel_unless_an_injection_targets_them(make_ctx, t: int) -> None:
    """The native pass beats the unfused path at every size: auto takes it below ATTNCHECKER_TILED_MIN_TS too. A call
    attnchecker.inject targets keeps the path the size picks (there, the unfused one, which corrects in place)."""
    from attnchecker.inject import Fault

    q, k, v = _qkv(1, 2, t, 8, seed=4)
    os.environ.pop(PATH_ENV)
    try:
        ctx, rec = make_ctx()
        with Calls().watch() as calls:
            out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
        assert calls.n == 1 and rec.detections == []
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5,
                                   atol=1e-6)
        ctx, rec = make_ctx(faults=[Fault(op="scores", layer=0, step=0, kind="inf", row=t - 1, col=0)])
        with Calls().watch() as calls:
            out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
        assert calls.n == 0
        assert [(d.op, d.action) for d in rec.detections] == [("scores", "corrected")]
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5,
                                   atol=1e-6)
    finally:
        os.environ[PATH_ENV] = "native"


def _gpt2_at_512() -> tuple[torch.nn.Module, torch.Tensor]:
    """A 2-layer GPT-2 (transformers, random weights) at T = 512, the size from which auto tiles, and its batch."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=512, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).train()
    model.set_attn_implementation("sdpa")
    return model, torch.randint(0, 128, (2, 512), generator=torch.Generator().manual_seed(1))


def _four_rms_scores_fault(model: torch.nn.Module, ids: torch.Tensor) -> fused_attention.Fault:
    """Layer 0's scores element (batch 1, head 2, row 300, key 200) plus 4 x the RMS of its scores, as the kernel's
    fault list writes it: the first kernel call of a step holding matrix n = 1·4 + 2 is layer 0's."""
    with torch.no_grad():
        h = model.transformer.h[0]
        x = h.ln_1(model.transformer.wte(ids) + model.transformer.wpe(torch.arange(512)))
        q, k, _ = h.attn.c_attn(x).split(64, dim=-1)
        q, k = (z.view(2, 512, 4, 16).transpose(1, 2) for z in (q, k))
        scores = q @ k.mT
        rms, base = float(scores.square().mean().sqrt()), float(scores[1, 2, 300, 200])
    return ("scores", 1 * 4 + 2, 300, 200, base + 4 * rms)


def _step(model: torch.nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer,
          faults: list[fused_attention.Fault] | None = None, attention_mask: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One training step (loss, gradients, kernel calls); lr 0, so every step has the same fault-free result.
    attention_mask: a padded batch (HF's 0 = padding; its labels there are -100)."""
    opt.zero_grad(set_to_none=True)
    labels = ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -100)
    with Calls().watch() as calls, fused_attention.emulated_faults(faults or []):
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads, calls.n


@pytest.fixture
def auto_path() -> Iterator[None]:
    """The path choice as a user gets it (auto), inside this module's forced tiled path."""
    with scoped_env({PATH_ENV: None}):
        yield


def _assert_recovered(seen: list, loss: torch.Tensor, grads: dict, want_loss: torch.Tensor, want: dict) -> None:
    assert [(d.op, d.action, d.layer, d.batch, d.head, d.row, d.kind) for d in seen] == [
        ("scores", "recomputed", 0, 1, 2, 300, "silent")]
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's threads for the test (2: the kernel's calls split between threads where MKL allows), restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_the_default_policy_on_a_gpt2_step_recovers_a_fault_inside_the_kernel(auto_path: None,
                                                                              torch_threads: int) -> None:
    """The path users take: protect(model, optimizer=opt), default policy, T = 512 (the tiled path's size, so the
    kernel's), the first step (scores and context checked in full), on one thread and on two (a CPU job's default is
    more than one: each call's 8 matrices then run in two parts, the fault's in the second). A finite error of 4 x RMS
    in layer 0's scores inside the kernel: recomputed, one event, and the loss and every gradient equal the
    fault-free step's."""
    import attnchecker

    if torch_threads > 1 and fused_attention._mkl_local_threads() is not None:
        assert fused_attention._parts(8, 8 * 512 * 512 * 16) == [(0, 4), (4, 8)]
    model, ids = _gpt2_at_512()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    with attnchecker.protect(twin, optimizer=opt) as guard:
        want_loss, want, n_clean = _step(twin, ids, opt)
        assert guard.detections == [] and n_clean == 2  # both layers on the kernel
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with attnchecker.protect(model, optimizer=opt) as guard:
        loss, grads, _ = _step(model, ids, opt, [_four_rms_scores_fault(model, ids)])
        seen = list(guard.detections)
    _assert_recovered(seen, loss, grads, want_loss, want)


def test_after_a_quiet_period_the_next_scheduled_check_catches_a_fault_inside_the_kernel(auto_path: None,
                                                                                        torch_threads: int) -> None:
    """The same fault on the default policy's first full scores check after the run has gone quiet (its period grown
    to the maximum, 7 steps or more without a full scores check, each on SDPA and its tripwire): the path a long
    clean run takes, not only its first step; on one torch thread and on two (the call then in two parts)."""
    import attnchecker

    model, ids = _gpt2_at_512()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with attnchecker.protect(model, optimizer=opt) as guard:
        want_loss, want, _ = _step(model, ids, opt)
        def clean_step(due: bool) -> None:
            _, _, calls = _step(model, ids, opt)
            assert calls == (2 if due else 0)  # the kernel runs on the checked steps only

        step_until_due_after_quiet(guard, clean_step)
        assert guard.detections == []
        loss, grads, calls = _step(model, ids, opt, [_four_rms_scores_fault(model, ids)])
        seen = list(guard.detections)
    assert calls == 2
    _assert_recovered(seen, loss, grads, want_loss, want)


def test_a_padded_batch_runs_on_the_kernel_and_a_fault_inside_it_is_recovered(auto_path: None) -> None:
    """A padded batch, as fine-tuning feeds one: GPT-2 given an attention_mask (batch 0's last 112 tokens padding)
    hands SDPA one 4-D mask, causal and padding together, not is_causal. Under protect(model, optimizer=opt) with the
    default policy both layers' calls run on the kernel, and the 4× RMS fault in layer 0's scores (batch 1) is
    recomputed with the mask: one event, the loss and every gradient the fault-free step's."""
    import attnchecker

    model, ids = _gpt2_at_512()
    pad = torch.ones_like(ids)
    pad[0, 400:] = 0
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    with attnchecker.protect(twin, optimizer=opt) as guard:
        want_loss, want, n_clean = _step(twin, ids, opt, attention_mask=pad)
        assert guard.detections == [] and n_clean == 2
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with attnchecker.protect(model, optimizer=opt) as guard:
        loss, grads, _ = _step(model, ids, opt, [_four_rms_scores_fault(model, ids)], attention_mask=pad)
        seen = list(guard.detections)
    _assert_recovered(seen, loss, grads, want_loss, want)
    plain = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    plain_loss = plain(input_ids=ids, attention_mask=pad, labels=ids.masked_fill(pad == 0, -100)).loss
    torch.testing.assert_close(loss, plain_loss.detach(), rtol=1e-5, atol=1e-6)


def test_after_a_quiet_period_a_padded_batch_s_fault_inside_the_kernel_is_caught(auto_path: None) -> None:
    """The padded batch on the default policy's first full scores check after the run has gone quiet (7+ steps on
    SDPA and its tripwire): the masked call runs on the kernel, and the 4× RMS fault is recomputed with the mask."""
    import attnchecker

    model, ids = _gpt2_at_512()
    pad = torch.ones_like(ids)
    pad[0, 400:] = 0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with attnchecker.protect(model, optimizer=opt) as guard:
        want_loss, want, _ = _step(model, ids, opt, attention_mask=pad)

        def clean_step(due: bool) -> None:
            _, _, calls = _step(model, ids, opt, attention_mask=pad)
            assert calls == (2 if due else 0)

        step_until_due_after_quiet(guard, clean_step)
        assert guard.detections == []
        loss, grads, calls = _step(model, ids, opt, [_four_rms_scores_fault(model, ids)], attention_mask=pad)
        seen = list(guard.detections)
    assert calls == 2
    _assert_recovered(seen, loss, grads, want_loss, want)


# ------------------------------------------------------------------------------ the engine's no-fault suites

# Re-collected here, under kernel_path: the tests whose calls the kernel takes (fp32; causal, a mask that does not
# require grad, or neither) run on it; the others (a learned mask, half precision) check that everything else is
# unchanged beside it.
for _suite, _names in ((layer_suite, ("test_protected_sdpa_matches_sdpa_without_faults",
                                      "test_protected_layer_matches_the_unprotected_layer",
                                      "test_stats_count_checks_and_bucketize_residuals_on_device")),
                       (fused_suite, ("test_fused_backward_matches_the_unfused_graph",
                                      "test_fused_backward_with_grouped_query_heads",
                                      "test_fp64_inputs_with_grad_give_the_unprotected_loss_and_gradients"))):
    for _name in _names:
        globals()[_name] = getattr(_suite, _name)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**20))
def test_the_layer_suites_take_the_kernel(make_ctx, seed: int) -> None:
    """The re-collected suites above are not vacuous: a call of theirs goes through the kernel."""
    q, k, v = _qkv(2, 2, 9, 16, seed)
    ctx, _ = make_ctx()
    with Calls().watch() as calls:
        protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    assert calls.n == 1
