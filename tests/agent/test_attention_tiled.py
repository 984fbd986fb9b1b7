"""The tiled protected attention (issue 12): the engine's guarantees re-run on the tiled path, plus what only tiles have.

The engine suites (test_attention_layer.py, test_attention_fused_backward.py) are imported here and run again with the
tiled path forced and tiles of 4 queries × 3 keys, so their small shapes cross many tiles: equivalence with SDPA
over shapes, dtypes, masks and GQA; every extreme fault corrected; loss and gradients equal to the fault-free step's;
zero false positives; at most one host sync per protected call.
"""
from __future__ import annotations

import math
import os

import pytest
import test_attention_fused_backward as fused_suite
import test_attention_layer as layer_suite
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from scoped_env import scoped_env
from test_attention_layer import TOL, layer_params, run_layer, seeded
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.abft.tiled import TilePlan, finish, fold_scores, square_sums
from attnchecker.attention.backends.tiled_torch import PATH_ENV, TILE_ENV
from attnchecker.attention.backward import fused as fused_backward
from attnchecker.attention.pipeline import protected_sdpa
from attnchecker.inject import Fault

SMALL_TILES = "4,3"


@pytest.fixture(autouse=True, scope="module")
def force_tiled():
    """Module scope (hypothesis refuses function-scoped fixtures): set for this module's tests, restored after."""
    with scoped_env({PATH_ENV: "tiled", TILE_ENV: SMALL_TILES}):
        yield


# The engine's suites, collected again in this module (so under force_tiled). Tests that never reach attention's
# scores/context (projections only, paper mode, dropout) are left to their own module.
_SKIP = {"test_fused_conv1d_projection_checks_each_slice_as_its_own_op",
         "test_check_linear_on_a_hooked_output_keeps_autograd_fault_free", "test_off_mode_injects_and_checks_nothing",
         "test_paper_mode_corrects_the_output_but_not_the_gradients", "test_paper_mode_corrects_qkv_faults_downstream",
         "test_dropout_recompute_reuses_the_mask", "test_dropout_keeps_the_unfused_graph"}
for _suite in (layer_suite, fused_suite):
    for _name in dir(_suite):
        if _name.startswith("test_") and _name not in _SKIP:
            globals()[_name] = getattr(_suite, _name)


# ------------------------------------------------------------------------------------------------- tiles only


class LargestTensor(TorchDispatchMode):
    """The largest number of elements any op produced: the memory claim as a test (no T×S tensor is ever made)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("tiles", ["16,16", "32,8"])
def test_no_tensor_of_the_attention_matrix_size_is_made_forward_or_backward(make_ctx, tiles: str) -> None:
    b, h, t, d = 1, 2, 128, 8
    q, k, v = (seeded((b, h, t, d), i, torch.float32).requires_grad_() for i in range(3))
    os.environ[TILE_ENV] = tiles
    try:
        ctx, rec = make_ctx()
        with LargestTensor() as big:
            out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
            out.pow(2).sum().backward()
    finally:
        os.environ[TILE_ENV] = SMALL_TILES
    bq, bk = (int(x) for x in tiles.split(","))
    # O(T·D): the output, and V beside its two checksum columns ([V | V w], one GEMM for CL and its references).
    assert big.numel <= max(b * h * bq * bk, b * h * t * (d + 2)) < b * h * t * t
    assert rec.detections == [] and ctx.runtime.stats.checks["scores"] == 1


def test_the_checked_backward_keeps_to_blocks_of_rows_and_gives_the_sdpa_gradient(make_ctx, monkeypatch) -> None:
    """Under protect(scope="all") the backward's products are checked (attention.backward.checked), on this path a block of
    query rows at a time: no T×S tensor in backward either, one check per block and product, SDPA's gradient. They
    are the encoded kernel's recovery and the full check off the CPU: the encoded kernel is switched off to reach
    them (the next test is the encoded path's)."""
    from attnchecker.attention.backward import encoded
    from attnchecker.gemm.schedule import _WHOLE_STEP

    monkeypatch.setattr(encoded, "enabled", False)

    b, h, t, d, rows = 1, 2, 128, 8, 16
    q, k, v = (seeded((b, h, t, d), i, torch.float32).requires_grad_() for i in range(3))
    os.environ[TILE_ENV] = f"{rows},{rows}"
    ctx, rec = make_ctx()
    _WHOLE_STEP.add(id(ctx.runtime))
    try:
        with LargestTensor() as big:
            out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
            out.pow(2).sum().backward()
    finally:
        _WHOLE_STEP.discard(id(ctx.runtime))
        os.environ[TILE_ENV] = SMALL_TILES
    assert big.numel <= max(b * h * rows * t, b * h * t * (d + 2)) < b * h * t * t
    stats = ctx.runtime.stats
    assert rec.detections == []
    assert all(stats.checks[op] == t // rows for op in ("scores_bwd", "grad_probs", "grad_v", "grad_q", "grad_k"))
    grads = [x.grad.clone() for x in (q, k, v)]
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).pow(2).sum().backward()
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-4, atol=1e-5)


def _whole_step_backward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Causal protected_sdpa with ctx's runtime taken for a scope="all" guard's (its whole-step checks due), then its
    backward: the largest tensor that backward made."""
    from attnchecker.gemm.schedule import _WHOLE_STEP

    _WHOLE_STEP.add(id(ctx.runtime))
    try:
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
        with LargestTensor() as big:
            out.pow(2).sum().backward()
    finally:
        _WHOLE_STEP.discard(id(ctx.runtime))
    return big.numel


def test_the_encoded_backward_keeps_the_kernels_memory_and_gives_the_sdpa_gradient(make_ctx, monkeypatch) -> None:
    """The full check of the backward as it runs on the CPU: the fused kernel on checksum-encoded operands
    (attention.backward.encoded), one check of each of its ops per layer, no T×S tensor (its buffers are
    (B, H, T, D + 5) padded to a multiple of 8), SDPA's gradient."""
    from attnchecker.attention.backward.encoded import ENCODED_OPS, encoded_width

    b, h, t, d = 1, 2, 128, 8
    q, k, v = (seeded((b, h, t, d), 20 + i, torch.float32).requires_grad_() for i in range(3))
    monkeypatch.setenv(TILE_ENV, "16,16")
    ctx, rec = make_ctx()
    assert _whole_step_backward(ctx, q, k, v) <= b * h * t * encoded_width(d) < b * h * t * t
    stats = ctx.runtime.stats
    assert rec.detections == []
    assert all(stats.checks[op] == 1 for op in ENCODED_OPS) and stats.checks.get("scores_bwd", 0) == 0
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).pow(2).sum().backward()
    for got, want in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_the_checked_backward_holds_to_the_tile_budget_on_any_path(make_ctx, monkeypatch) -> None:
    """Every caller of the checked backward gets blocks within the tile budget: here the unfused path (T·S below the
    tiled threshold, but B·H·T·S past a budget made small), which the fused tier-1 kernel's recovery from a trip at
    long context shares (it passes no block size either). Before, those callers materialised all of (B, H, T, S)."""
    import attnchecker.attention.backward.checked as attention_backward
    from attnchecker.attention.backward import encoded

    monkeypatch.setattr(encoded, "enabled", False)  # its products, as above
    b, h, t, d = 1, 2, 64, 8
    q, k, v = (seeded((b, h, t, d), 10 + i, torch.float32).requires_grad_() for i in range(3))
    monkeypatch.setattr(attention_backward, "TILE_BUDGET", b * h * 16 * t)  # 16 rows over all keys
    monkeypatch.setenv(PATH_ENV, "unfused")
    ctx, rec = make_ctx()
    assert _whole_step_backward(ctx, q, k, v) <= max(b * h * 16 * t, b * h * t * (d + 2)) < b * h * t * t
    stats = ctx.runtime.stats
    assert rec.detections == [] and stats.checks["grad_q"] == t // 16
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).pow(2).sum().backward()
    for got, want in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_faults_in_many_tiles_at_once_are_all_found_and_leave_clean_gradients(make_ctx) -> None:
    x = seeded((2, 14, 16), 70, torch.float32)
    p = layer_params(16, 71, torch.float32)
    _, loss0, grads0, _, _ = run_layer(make_ctx, x, p, 2, is_causal=True)
    places = [("scores", 0, 1, 2, 1), ("scores", 1, 0, 9, 7), ("scores", 1, 1, 13, 12), ("context", 0, 0, 5, 3),
              ("context", 1, 1, 12, 6)]
    faults = [Fault(op=op, layer=0, step=0, kind=kind, batch=b, head=h, row=r, col=c)
              for (op, b, h, r, c), kind in zip(places, ["inf", "nan", "near_inf", "neg_inf", "bitflip"])]
    _, loss1, grads1, rec, ctx = run_layer(make_ctx, x, p, 2, faults=faults, is_causal=True)
    found = sorted((d.op, d.batch, d.head, d.row, d.col) for d in rec.detections)
    assert found == sorted(places)
    assert {d.action for d in rec.detections} == {"recomputed"}
    assert len(ctx.runtime.injector.injected) == len(places)
    torch.testing.assert_close(loss1, loss0)
    for g1, g0 in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(g1, g0)


@pytest.mark.parametrize("op", ["scores", "context"])
def test_a_persistent_single_fault_is_corrected_in_its_tile(make_ctx, op: str) -> None:
    """The recompute of the query block sees the fault again: located and corrected in the tile, as the unfused path
    corrects it in AS / CL."""
    x = seeded((1, 11, 16), 72, torch.float32)
    p = layer_params(16, 73, torch.float32)
    clean = run_layer(make_ctx, x, p, 2, is_causal=True)[0]
    fault = Fault(op=op, layer=0, step=0, kind="near_inf", row=6, col=2, persistent=True, seed=3)
    out, _, _, rec, ctx = run_layer(make_ctx, x, p, 2, faults=[fault], is_causal=True)
    assert [(d.op, d.pattern, d.action, d.row, d.col) for d in rec.detections] == [(op, "0d", "corrected", 6, 2)]
    assert [i.attempt for i in ctx.runtime.injector.injected] == [0, 1]
    torch.testing.assert_close(out, clean)


def test_detect_mode_reports_every_flagged_tile_and_keeps_the_fault(make_ctx) -> None:
    q, k, v = (seeded((1, 2, 10, 8), 74 + i, torch.float32) for i in range(3))
    faults = [Fault(op="scores", layer=0, step=0, kind="nan", batch=0, head=1, row=2, col=7),
              Fault(op="context", layer=0, step=0, kind="inf", batch=0, head=0, row=9, col=4)]
    ctx, rec = make_ctx(faults=faults, mode="detect")
    out = protected_sdpa(q, k, v, ctx=ctx)
    assert sorted((d.op, d.head, d.row, d.col, d.kind, d.action) for d in rec.detections) == [
        ("context", 0, 9, 4, "inf", "detected"), ("scores", 1, 2, 7, "nan", "detected")]
    assert not torch.isfinite(out).all()


@settings(max_examples=25)
@given(
    t=st.integers(1, 23),
    s=st.integers(1, 23),
    bq=st.integers(1, 9),
    bk=st.integers(1, 9),
    causal=st.booleans(),
    dead=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**20),
)
def test_the_tile_contract_computes_softmax_attention_and_its_log_sum_exp(t, s, bq, bk, causal, dead, dtype,
                                                                          seed) -> None:
    """abft.tiled alone (the contract a kernel implements): any tile sizes, masks with dead rows, half precision."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, 5, generator=g).to(dtype) for n in (t, s, s))
    mask = torch.rand(2, t, s, generator=g) > 0.3
    if dead:
        mask[:, 0] = False
    plan = TilePlan(t, s, bq, bk, causal)
    out = torch.empty(2, t, 5, dtype=dtype)
    lse = torch.empty(2, t)
    for i in range(plan.n_q):
        r0, r1 = plan.rows(i)
        m, l_ = torch.full((2, r1 - r0), -math.inf), torch.zeros(2, r1 - r0)
        o = torch.zeros(2, r1 - r0, 5)
        for _, c0, c1 in plan.keys(i):
            blocked = ~mask[:, r0:r1, c0:c1]
            if causal:
                blocked = blocked | (torch.arange(c0, c1)[None, :] > torch.arange(r0, r1)[:, None])
            p, alpha, m, l_, _ = fold_scores(q[:, r0:r1] @ k[:, c0:c1].mT, m, l_, scale=0.5, blocked=blocked,
                                          additive=None)
            o = o * alpha[..., None] + p @ v[:, c0:c1].float()
        out[:, r0:r1], lse[:, r0:r1] = finish(o, m, l_, dtype)
    full = mask & ~torch.ones(t, s, dtype=torch.bool).triu(1) if causal else mask
    z = (q.float() @ k.float().mT * 0.5).masked_fill(~full, -math.inf)
    want_lse = torch.logsumexp(z, -1)
    want = torch.nan_to_num(torch.softmax(z, -1)) @ v.float()
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    live = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[live], want_lse[live], **TOL[dtype])
    assert torch.isposinf(lse[~live]).all()


@settings(max_examples=30)
@given(tq=st.integers(1, 40), tk=st.integers(1, 40), d=st.integers(1, 16), scale=st.floats(1e-3, 1e3),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**20))
def test_square_sums_from_the_operands_equal_the_tile_s(tq, tk, d, scale, dtype, seed) -> None:
    """The calibrated bound's ΣAS² per row and column, from D × D Grams, is the squaring pass's (to round-off)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, n, d, generator=g, dtype=torch.float64) * scale for n in (tq, tk))
    rows, cols = square_sums(q.to(dtype), k.to(dtype))
    s = q @ k.mT
    tol = {"rtol": 1e-4, "atol": 1e-5 * scale**4 * d} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 0.0}
    torch.testing.assert_close(rows.double(), s.square().sum(-1), **tol)
    torch.testing.assert_close(cols.double(), s.square().sum(-2), **tol)
    assert (rows >= 0).all() and (cols >= 0).all()


def test_layer_with_grouped_query_heads_and_a_sliding_window_matches_sdpa(make_ctx) -> None:
    """GQA and a GPT-Neo-style local window (a bool mask), handled per tile."""
    q = seeded((2, 4, 17, 8), 80, torch.float32)
    k, v = seeded((2, 2, 17, 8), 81, torch.float32), seeded((2, 2, 17, 8), 82, torch.float32)
    i = torch.arange(17)
    window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 5)
    ctx, rec = make_ctx()
    out = protected_sdpa(q, k, v, ctx=ctx, attn_mask=window, enable_gqa=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=window, enable_gqa=True))
    assert rec.detections == []


def _off_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, mask: torch.Tensor | None,
             monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """The gradient of a verified output as the backward off the CPU makes it outside protect(scope="all") (SDPA's,
    recomputed; a GPU has no _scaled_dot_product_flash_attention_for_cpu_backward): the CPU call sent down that
    branch."""
    monkeypatch.setattr(fused_backward, "cpu_kernel", False)
    lse = torch.zeros(out.shape[:-1])  # not read on this branch outside scope="all"
    got = fused_backward._VerifiedAttention.apply(q, k, v, fused_backward._Forward(
        out_BHTD=out, lse_BHT=lse, mask_add=None, scale=0.5, is_causal=True, attn_mask=mask))
    return torch.autograd.grad(got.sum(), (q, k, v))


def test_the_off_cpu_backward_gives_the_fused_sdpa_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = (seeded((1, 2, 9, 4), 90 + i, torch.float32).requires_grad_() for i in range(3))
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    got = _off_cpu(q, k, v, out, None, monkeypatch)
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_off_cpu_backward_folds_a_causal_flag_into_an_explicit_mask(kind: str, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    """SDPA takes is_causal or attn_mask, not both; the off-CPU backward folds the two into one mask."""
    q, k, v = (seeded((1, 2, 9, 4), 95 + i, torch.float32).requires_grad_() for i in range(3))
    g = torch.Generator().manual_seed(4)
    mask = (torch.rand(9, 9, generator=g) > 0.3).fill_diagonal_(True)
    if kind == "additive":
        mask = torch.randn(9, 9, generator=g)
    with torch.no_grad():
        out = causal_and_masked(q, k, v, mask)
    got = _off_cpu(q, k, v, out, mask, monkeypatch)
    want = torch.autograd.grad(causal_and_masked(q, k, v, mask).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def causal_and_masked(q, k, v, mask):
    """softmax(0.5·QKᵀ + mask, causal) V through the unfused ops the engine checks."""
    return fused_suite.reference(q, k, v, attn_mask=mask, is_causal=True, scale=0.5)


def test_causal_tiles_stop_at_the_diagonal() -> None:
    """A key block reaching past a causal query block's last row is cut there; blocks wholly above it are skipped."""
    plan = TilePlan(t=10, s=10, block_q=4, block_k=100, is_causal=True)
    assert [list(plan.keys(i)) for i in range(plan.n_q)] == [[(0, 0, 4)], [(0, 0, 8)], [(0, 0, 10)]]
    plan = TilePlan(t=8, s=8, block_q=4, block_k=3, is_causal=True)
    assert list(plan.keys(0)) == [(0, 0, 3), (1, 3, 4)]
    assert list(TilePlan(t=8, s=8, block_q=4, block_k=3, is_causal=False).keys(0))[-1] == (2, 6, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tiled_path_matches_sdpa_corrects_faults_and_keeps_gradients(make_ctx) -> None:
    """First thing to run on a CUDA machine (bench/gpu_overhead.py then measures the overhead)."""
    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        x = seeded((2, 64, 64), 100, dtype).to(dev)
        p = {n: None if t is None else t.detach().to(dev).requires_grad_() for n, t in
             layer_params(64, 101, dtype).items()}
        _, loss0, grads0, rec0, _ = run_layer(make_ctx, x, p, 4, is_causal=True)
        faults = [Fault(op="scores", layer=0, step=0, kind="inf", seed=1),
                  Fault(op="context", layer=0, step=0, kind="nan", seed=2)]
        out, loss1, grads1, rec, _ = run_layer(make_ctx, x, p, 4, faults=faults, is_causal=True)
        assert rec0.detections == []
        assert sorted(d.op for d in rec.detections) == ["context", "scores"]
        assert torch.isfinite(out).all()
        torch.testing.assert_close(loss1, loss0, **TOL[dtype])
        for g1, g0 in zip(grads1, grads0, strict=True):
            torch.testing.assert_close(g1, g0, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_overhead_bench_runs(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu_overhead.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "gpu_overhead.py"), "--tiny", "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {v for e in doc["time"] for v in e["variants"]} == {"baseline", "tiled", "unfused"}
    assert all("peak_mb" in v for e in doc["memory"] for v in e["variants"].values())


# ---------------------------------------------------------------------------------------- tier 1 on the tiled path


class _CorruptFusedOnce(TorchDispatchMode):
    """Below autograd: one INF in the first output of the first fused CPU attention kernel call (a fault tier 1 sees
    in the fused output; the recovery then runs the tiled path)."""

    def __init__(self) -> None:
        super().__init__()
        self.hit = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.hit and func.overloadpacket.__name__ == "_scaled_dot_product_flash_attention_for_cpu":
            out[0].view(-1)[7] = math.inf
            self.hit = True
        return out


def _unchecked_layer(make_ctx, faults=None, mode=None):
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 2, 10, 8, generator=g).requires_grad_() for _ in range(3))
    ctx, rec = make_ctx(faults, checked_ops=frozenset())  # tier 2 not due: only the tripwire stands
    if mode is None:
        out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    else:
        with mode:
            out = protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)], rec, ctx.runtime.stats


@pytest.mark.parametrize("op", ["scores", "context"])
def test_an_unchecked_step_keeps_tier1_on_the_tiled_path(make_ctx, op: str) -> None:
    """A step where tier 2 is not due still catches an extreme fault on the tiled path (there tier 1 verifies each
    tile), under tier "tripwire", with the fault-free output and gradients."""
    clean_out, clean_grads, _, _ = _unchecked_layer(make_ctx)
    out, grads, rec, stats = _unchecked_layer(make_ctx, [Fault(op=op, layer=0, step=0, kind="inf", seed=4)])
    assert rec.detections and {d.tier for d in rec.detections} == {"tripwire"}
    assert {d.op for d in rec.detections} == {op}
    assert sum(stats.checks.values()) == 0 and stats.trip_checks[op] == 1
    torch.testing.assert_close(out, clean_out, rtol=1e-5, atol=1e-6)
    for g, cg in zip(grads, clean_grads, strict=True):
        torch.testing.assert_close(g, cg, rtol=1e-5, atol=1e-6)


def test_a_trip_in_the_fused_kernel_recovers_through_the_tiled_path(make_ctx) -> None:
    clean_out, clean_grads, _, _ = _unchecked_layer(make_ctx)
    mode = _CorruptFusedOnce()
    out, grads, rec, _ = _unchecked_layer(make_ctx, mode=mode)
    assert mode.hit
    assert [(d.op, d.tier, d.action) for d in rec.detections] == [("context", "tripwire", "recomputed")]
    torch.testing.assert_close(out, clean_out, rtol=1e-5, atol=1e-6)
    for g, cg in zip(grads, clean_grads, strict=True):
        torch.testing.assert_close(g, cg, rtol=1e-5, atol=1e-6)
