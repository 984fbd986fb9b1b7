"""The attention GEMMs' operand-rounding moments (abft/operand_moments.py): an fp32 context CL = AP·V or scores AS = QKᵀ
under TF32 (emulated on the CPU by rounding or truncating the operands to 10 mantissa bits) is checked against the error
its operands' roundings can make, shared elements included, not against u_in·‖A_i‖‖B_j‖ per element."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import NanoGPT
from quiet_period import step_until_due_after_quiet
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import attnchecker
from attnchecker.abft import Tolerance, group_sums_cols
from attnchecker.abft.operand_moments import context_moments, scores_moments
from attnchecker.attention.backends.tiled_torch import context_tile_checks, scores_tile_checks
from attnchecker.attention.pipeline import context_checks, scores_checks
from attnchecker.emulate import emulate_fp32_matmul


def _probs(scores_TS: torch.Tensor, causal: bool) -> torch.Tensor:
    t, s = scores_TS.shape
    if causal:
        scores_TS = scores_TS.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores_TS, -1)


def _structured(kind: str, t: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(AP (T, T), V (T, D)) of attention patterns whose operand roundings are correlated."""
    v = torch.randn(t, d, generator=gen)
    if kind == "spread":
        return _probs(torch.randn(t, t, generator=gen) * 2, True), v
    if kind == "uniform_constant_channels":
        # every AP value equal in a row (one rounding for the row) and value channels equal on every token
        v[:, 1], v[:, 2] = 200.0, -150.0
        return _probs(torch.zeros(t, t), True), v
    if kind == "repeated_tokens":
        # a RoPE model's first layer: equal tokens have equal V rows, and a key-only score gives equal AP per token
        ids = torch.randint(0, 4, (t,), generator=gen)
        protos = torch.randn(4, d, generator=gen) * 3
        return _probs(torch.randn(t, 4, generator=gen)[:, ids], False), protos[ids]
    if kind == "identical_rows":
        # every query the same AP row (non-power-of-two keys, so AP itself rounds), one constant value channel: the
        # vector's elements round alike, the independence the model's M assumes at its weakest
        v[:, 3] = 3.7
        return torch.full((t, t), 1.0 / t).mul_(t / (t + 0.37)).add_(0.37 / (t * (t + 0.37))), v
    if kind == "sink":
        # most of every row on token 0, whose value row is 50× the others: V_0j's one rounding is in every element
        # of a column
        s = torch.randn(t, t, generator=gen)
        s[:, 0] += 8.0
        v[0] *= 50.0
        return _probs(s, True), v
    raise ValueError(kind)


KINDS = ["spread", "uniform_constant_channels", "repeated_tokens", "identical_rows", "sink"]


def _ratio(checks) -> float:
    worst = 0.0
    for d in ("row", "col"):
        c = checks[d]
        d1, d2 = (c.diff[..., 0].abs() / c.bound).max(), (c.diff[..., 1].abs() / c.bound2).max()
        worst = max(worst, float(d1), float(d2))
    return worst


def _context(p_TS: torch.Tensor, v_SD: torch.Tensor, *, truncate: bool, err: tuple[int, int, float] | None = None):
    with emulate_fp32_matmul("tf32", truncate=truncate), torch.no_grad():
        c = p_TS @ v_SD
        if err is not None:
            c[err[0], err[1]] += err[2]
        return context_checks(p_TS[None, None], v_SD[None, None], c[None, None], None, 1, Tolerance())


@pytest.mark.parametrize("truncate", [False, True], ids=["round", "truncate"])
@pytest.mark.parametrize("kind", KINDS)
def test_clean_tf32_context_is_not_flagged_with_correlated_roundings(kind, truncate) -> None:
    # T = 1024: four query groups per column. The sink under truncation read 2.0× the Cauchy-Schwarz threshold
    # (a false positive): that model took V_0j's shared rounding as independent across the column.
    p, v = _structured(kind, 1024, 64, torch.Generator().manual_seed(3))
    ratio = _ratio(_context(p, v, truncate=truncate))
    assert ratio < 0.6, f"{kind}: clean residual at {ratio:.3f} of the threshold"


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    t=st.sampled_from([16, 96, 512, 768]),
    d=st.sampled_from([8, 64, 128]),
    truncate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_clean_tf32_context_never_flags(kind, t, d, truncate, seed) -> None:
    p, v = _structured(kind, t, d, torch.Generator().manual_seed(seed))
    checks = _context(p, v, truncate=truncate)
    assert not checks["row"].bad.any() and not checks["col"].bad.any()


def test_a_two_rms_error_in_a_tf32_context_is_flagged_at_a_long_sequence() -> None:
    # Before the moments the threshold sat at ~5.5× the RMS element at T = 4096 (bench/coverage.py, 7B TF32
    # context): a 2× RMS error passed. Peaked attention over 2048 keys, as in that campaign.
    gen = torch.Generator().manual_seed(0)
    t, d = 2048, 128
    q, k = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen) + 2.0
    p = _probs(q @ k.T / math.sqrt(d) * 4, True)
    v = torch.randn(t, d, generator=gen)
    rms = float((p @ v).square().mean().sqrt())
    positions = torch.randint(0, t, (8,), generator=gen).tolist()
    for row, col in zip(positions, torch.randint(0, d, (8,), generator=gen).tolist(), strict=True):
        checks = _context(p, v, truncate=True, err=(row, col, 2.0 * rms))
        assert checks["row"].bad.any() or checks["col"].bad.any(), (row, col)


def test_the_moments_are_per_group() -> None:
    # Query group h of the column moments is the moments of the sub-product AP[h]·V; the row moments of row t do not
    # depend on the other rows.
    gen = torch.Generator().manual_seed(1)
    p, v = _structured("spread", 1024, 16, gen)
    p_l1 = p.sum(-1)
    vw = torch.stack([v.sum(-1), v @ torch.arange(1.0, 17.0)], -1)
    row, col = context_moments(p, v, p_l1, (1, 4), vw_NS2g=vw)
    for h in range(4):
        rows = slice(256 * h, 256 * (h + 1))
        row_h, col_h = context_moments(p[rows], v, p_l1[rows], (1, 1), vw_NS2g=vw)
        torch.testing.assert_close(row[rows], row_h)
        torch.testing.assert_close(col.view(16, 4, 4)[:, h], col_h, rtol=1e-5, atol=0)


def test_the_moments_are_the_weighted_cauchy_schwarz_sums() -> None:
    # Against their definitions in float64, one row and one column at a time (row groups of features: D = 1024).
    gen = torch.Generator().manual_seed(4)
    t, s, d = 512, 300, 1024
    p = torch.softmax(torch.randn(t, s, generator=gen, dtype=torch.float64) * 3, -1)
    v = torch.randn(s, d, generator=gen, dtype=torch.float64)
    g_r, g_c = 4, 2
    l1 = p.sum(-1)
    runs = v.view(s, g_r, d // g_r)
    w_r = torch.arange(1.0, d // g_r + 1, dtype=torch.float64)
    vw = torch.stack([runs.sum(-1), runs @ w_r], -1).flatten(-2)
    row, col = context_moments(p.float(), v.float(), l1.float(), (g_r, g_c), vw_NS2g=vw.float())
    for ti, h in [(0, 0), (17, 3), (511, 2)]:
        for wi, w in enumerate([torch.ones_like(w_r), w_r]):
            vh = runs[:, h]  # (S, L)
            m = l1[ti] * (p[ti] @ (vh.square() @ w.square()))
            r = l1[ti] * (p[ti] @ (vh @ w).square())
            got = row[ti * g_r + h]
            torch.testing.assert_close(got[wi].double(), m, rtol=2e-2, atol=0)
            torch.testing.assert_close(got[2 + wi].double(), r, rtol=2e-2, atol=0)
    w_c = torch.arange(1.0, t // g_c + 1, dtype=torch.float64)
    for j, h in [(0, 0), (999, 1)]:
        rows = slice(h * t // g_c, (h + 1) * t // g_c)
        for wi, w in enumerate([torch.ones_like(w_c), w_c]):
            m = ((w.square() * l1[rows]) @ p[rows]) @ v[:, j].square()
            wp = w @ p[rows]
            r = wp.sum() * (wp @ v[:, j].square())
            got = col[j * g_c + h]
            torch.testing.assert_close(got[wi].double(), m, rtol=2e-2, atol=0)
            torch.testing.assert_close(got[2 + wi].double(), r, rtol=2e-2, atol=0)


def test_the_tiled_path_takes_the_same_moments() -> None:
    # The tiled path's unnormalised P̃ (max 1 per row) and ΣP̃: an error of 2× RMS flagged, the clean tile not.
    gen = torch.Generator().manual_seed(2)
    p, v = _structured("sink", 512, 64, gen)
    p_tilde = p / p.amax(-1, keepdim=True)
    vw = torch.stack([v.sum(-1), v @ torch.arange(1.0, 65.0)], -1)
    with emulate_fp32_matmul("tf32", truncate=True), torch.no_grad():
        c = p_tilde @ v
        rms = float(c.square().mean().sqrt())

        def check(cl: torch.Tensor):
            return context_tile_checks(cl[None], p_tilde[None], v[None], vw[None], p_tilde.sum(-1)[None], None,
                                       tol=Tolerance(), g_v=1)

        assert _ratio(check(c)) < 0.6
        bad = c.clone()
        bad[300, 7] += 2.0 * rms
        checks = check(bad)
        assert checks["row"].bad.any() or checks["col"].bad.any()


def _scores(q_TD: torch.Tensor, k_SD: torch.Tensor, *, truncate: bool):
    with emulate_fp32_matmul("tf32", truncate=truncate), torch.no_grad():
        return scores_checks(q_TD[None, None], k_SD[None, None], (q_TD @ k_SD.T)[None, None], {}, 1, Tolerance())


@pytest.mark.parametrize("truncate", [False, True], ids=["round", "truncate"])
@pytest.mark.parametrize("noise", [0.01, 0.3, None], ids=["collinear", "shared-direction", "random"])
def test_clean_tf32_scores_are_not_flagged_with_collinear_queries_and_keys(noise, truncate) -> None:
    # Queries and keys along one shared direction (massive activations give one): Q_td's rounding is in every score
    # of row t alike. The Cauchy-Schwarz operand term read 1.56× (truncating) at T = 1024 with both collinear.
    gen = torch.Generator().manual_seed(7)
    t, d = 1024, 128
    direction = torch.randn(d, generator=gen)
    if noise is None:
        q, k = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    else:
        q = direction + noise * torch.randn(t, d, generator=gen)
        k = direction + noise * torch.randn(t, d, generator=gen)
    assert _ratio(_scores(q, k, truncate=truncate)) < 0.6


def test_the_scores_moments_are_their_definitions() -> None:
    gen = torch.Generator().manual_seed(8)
    t, s, d, g_r, g_c = 1024, 512, 64, 2, 4
    q, k = torch.randn(t, d, generator=gen, dtype=torch.float64), torch.randn(s, d, generator=gen, dtype=torch.float64)
    qbar = group_sums_cols(q, g_c).flatten(-2)
    kbar = group_sums_cols(k, g_r).flatten(-2)
    row, col = scores_moments(q.float(), k.float(), qbar.float(), kbar.float(), (g_r, g_c))
    for (mine, other, ti, h, g, moments) in [(q, k, 5, 1, g_r, row), (k, q, 300, 3, g_c, col)]:
        length = other.shape[0] // g
        block = other[h * length : (h + 1) * length]
        weights = [torch.ones(length, dtype=torch.float64), torch.arange(1.0, length + 1, dtype=torch.float64)]
        for wi, w in enumerate(weights):
            m = mine[ti].square() @ (w.square() @ block.square())
            r = mine[ti].square() @ (w @ block).square()
            got = moments[ti * g + h]
            torch.testing.assert_close(got[wi].double(), m, rtol=2e-2, atol=0)
            torch.testing.assert_close(got[2 + wi].double(), r, rtol=2e-2, atol=0)


def test_a_two_rms_error_in_tf32_scores_is_flagged() -> None:
    gen = torch.Generator().manual_seed(9)
    t, d = 2048, 128
    q, k = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen) + 2.0
    with emulate_fp32_matmul("tf32", truncate=True), torch.no_grad():
        s = q @ k.T
        rms = float(s.square().mean().sqrt())
        for row, col in zip(torch.randint(0, t, (8,), generator=gen).tolist(),
                            torch.randint(0, t, (8,), generator=gen).tolist(), strict=True):
            bad = s.clone()
            bad[row, col] += 2.0 * rms
            checks = scores_checks(q[None, None], k[None, None], bad[None, None], {}, 1, Tolerance())
            assert checks["row"].bad.any() or checks["col"].bad.any(), (row, col)


def test_the_tiled_path_takes_the_scores_moments() -> None:
    gen = torch.Generator().manual_seed(10)
    direction = torch.randn(64, generator=gen)
    q = (direction + 0.3 * torch.randn(512, 64, generator=gen))[None]
    k = (direction + 0.3 * torch.randn(256, 64, generator=gen))[None]
    norms = (torch.linalg.vector_norm(q, dim=-1), torch.linalg.vector_norm(k, dim=-1))
    with emulate_fp32_matmul("tf32", truncate=True), torch.no_grad():
        s = q @ k.mT
        rms = float(s.square().mean().sqrt())

        def check(tile: torch.Tensor):
            return scores_tile_checks(tile, q, k, *norms, tol=Tolerance())

        assert _ratio(check(s)) < 0.6
        bad = s.clone()
        bad[0, 100, 30] += 2.0 * rms
        checks = check(bad)
        assert checks["row"].bad.any() or checks["col"].bad.any()


class _ContextRmsFault(TorchDispatchMode):
    """Adds ``times`` × RMS to one element of the first bmm output shaped like an attention context (..., T, D) with a
    reduction over T keys: chosen by shape alone, knowing nothing of attnchecker."""

    def __init__(self, t: int, d: int, times: float) -> None:
        super().__init__()
        self.t, self.d, self.times = t, d, times
        self.hit = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (not self.hit and func is torch.ops.aten.bmm.default and out.shape[-2:] == (self.t, self.d)
                and args[0].shape[-1] == self.t):
            with torch.no_grad():
                flat = out.view(-1)
                flat[flat.numel() // 2 + 5] += self.times * float(flat.double().square().mean().sqrt())
            self.hit = True
        return out


def test_default_policy_under_truncating_tf32_catches_a_two_rms_context_error_after_a_quiet_period() -> None:
    # protect(model, optimizer=opt) with nothing else set, every fp32 GEMM under (emulated) truncating TF32, head dim
    # 128 at T = 256 (the unfused path there): clean steps until the context's first full check after the schedule
    # went quiet, then a 2x RMS error in the context product. Detected and corrected: the loss is the clean step's.
    t, n_embd, vocab = 256, 256, 128
    torch.manual_seed(0)
    model = NanoGPT(vocab=vocab, n_embd=n_embd, n_head=2, n_layer=2, block=t).train()
    ids = torch.randint(0, vocab, (1, t + 1), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights unchanged: every step has the same clean result

    def loss_of(fault: TorchDispatchMode | None = None) -> torch.Tensor:
        with emulate_fp32_matmul("tf32", truncate=True), fault or contextlib.nullcontext():
            logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))

    guard = attnchecker.protect(model, optimizer=opt)
    try:
        clean: list[float] = []

        def clean_step(_due: bool) -> None:
            opt.zero_grad(set_to_none=True)
            loss = loss_of()
            with emulate_fp32_matmul("tf32", truncate=True):
                loss.backward()
            opt.step()
            clean.append(float(loss.detach()))

        step_until_due_after_quiet(guard, clean_step, op="context")
        assert guard.detections == []
        fault = _ContextRmsFault(t, n_embd // 2, 2.0)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(fault)
        opt.step()
        detections = list(guard.detections)
    finally:
        guard.close()
    assert fault.hit, "no context-shaped product was seen"
    assert [d.op for d in detections] == ["context"], detections
    assert detections[0].action in ("corrected", "recomputed")
    assert abs(float(loss.detach()) - clean[-1]) <= 1e-5 * abs(clean[-1])


class _ProductPrecisions(TorchDispatchMode):
    """Records, per fp32 matrix product, its output's last two dims and the fp32 precision in force when it ran
    (entered inside emulate_fp32_matmul, it sees each product before the emulation rounds its operands)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, int], str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) and out.dtype == torch.float32:
            from attnchecker.matmul_precision import current_fp32_precision

            self.seen.append((tuple(out.shape[-2:]), current_fp32_precision("cpu")))
        return out


@pytest.mark.parametrize("truncate", [False, True])
def test_the_tiled_path_runs_its_tile_gemms_in_tf32_and_checks_them_with_the_matching_bound(monkeypatch,
                                                                                             truncate) -> None:
    """Under TF32 the tiled attention's own tile GEMMs run in TF32, as the model's would (IEEE fp32 ran them ~7x below
    a tensor core's rate, while the bound already charged TF32's rounding), and the checksum products in IEEE fp32.
    The bound is TF32's (operand moments): clean LLM-like attention raises nothing, a 2x RMS error in either product is
    caught."""
    from test_tolerance_calibrated import activations

    from attnchecker.attention.backends import BACKEND_ENV
    from attnchecker.attention.pipeline import protected_sdpa
    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime
    from attnchecker.inject import Fault, Injector

    monkeypatch.setenv(BACKEND_ENV, "tiled")
    t, h, d = 512, 2, 64
    x = activations((1, t, 128), 3, outliers=30.0)
    w = torch.randn(3 * h * d, 128, generator=torch.Generator().manual_seed(4)) / math.sqrt(128)
    q, k, v = ((x @ wp.T).view(1, t, h, d).transpose(1, 2).contiguous() for wp in w.split(h * d))

    def run(faults: list[Fault]) -> tuple[list[Any], list[tuple[tuple[int, int], str]]]:
        found: list[Any] = []
        ctx = LayerContext(layer=0, runtime=Runtime(config=CheckConfig(), stats=OpStats(),
                                                    injector=Injector(faults) if faults else None,
                                                    on_detection=found.append))
        with emulate_fp32_matmul("tf32", truncate=truncate), _ProductPrecisions() as seen, torch.no_grad():
            protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
        return found, seen.seen

    found, seen = run([])
    assert found == []
    tiles = {prec for shape, prec in seen if shape[0] == 256 and shape[1] in (256, 512, d)}
    assert tiles == {"tf32"}, seen  # the (Tq, Tk) scores and (Tq, D) context tiles
    assert any(prec == "ieee" for _, prec in seen)  # the checksum references
    rms = {"scores": float((q[0, 1] @ k[0, 1].T).square().mean().sqrt()), "context": float(v.square().mean().sqrt())}
    for op in ("scores", "context"):
        found, _ = run([Fault(op=op, layer=0, step=0, kind="add", value=2.0 * rms[op], batch=0, head=1, row=300,
                              col=40)])
        # A transient fault: the recompute of its block is clean ("recomputed", located by its row).
        assert [(det.op, det.row, det.action) for det in found] == [(op, 300, "recomputed")], found
