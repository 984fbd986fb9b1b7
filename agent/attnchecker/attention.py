"""The protected attention pipeline over ``abft``: Q/K/V projections, AS = Q·Kᵀ, scale + mask + softmax + dropout,
CL = AP·V and the output projection, each verified by checksums and repaired in place (ATTNChecker, DESIGN.md).

Legend: B batch, H query heads, Hk key/value heads, T query tokens, S key tokens, D head dim, I input features,
O output features, N a projection's leading dims flattened, 2 a checksum pair (weights ones and 1..n).
Fast path: batched tensor work over (batch, heads) and exactly one host-device sync per protected call, to decide
whether the slow path (locate / correct / recompute, ``abft.repair``) runs. Corrections happen under no_grad on
tensors autograd never saved, so backward sees the fault-free values.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .abft import (
    DirectionCheck,
    MatrixReport,
    Tolerance,
    acc_dtype,
    bounds,
    checksum_weights,
    checksums_of,
    col_norms,
    repair,
    times_skinny,
    verify_direction,
    weighted_cols,
    weighted_rows,
)
from .context import RESIDUAL_RATIO_BUCKETS, LayerContext
from .events import Detection, kind_of, value_to_wire
from .matmul_precision import fp32_matmul_operand_roundoff, ieee_fp32_matmul
from .tiled_attention import choose_tiles, tiled_sdpa
from .tripwire import NEAR_INF, extreme, extreme_value, lse_over_bound

__all__ = [
    "PassedProjection",
    "check_linear",
    "protected_linear",
    "protected_sdpa",
    "protected_self_attention",
]

Checks = dict[str, DirectionCheck]
_Exact = Callable[[tuple[int, ...], torch.Tensor, torch.Tensor], torch.Tensor]


def _dot(a_PK: torch.Tensor, b_PK: torch.Tensor, bias_P: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise dot products in the accumulation dtype: single elements of a product, recomputed exactly."""
    acc = acc_dtype(a_PK.dtype)
    out_P = (a_PK.to(acc) * b_PK.to(acc)).sum(-1)
    return out_P if bias_P is None else out_P + bias_P.to(acc)


@dataclass(slots=True, kw_only=True)
class PassedProjection:
    """Checksum passing (paper-faithful mode): what a q/k/v projection hands to the attention of its layer.

    Stored in ``ctx.passed[op]`` by check_linear; protected_sdpa pops it. All derived from the projection's input X
    and weights, never from its (unverified) output.
    """

    token_ref_NO2: torch.Tensor
    """Token-direction checksums (wᵀX)Wᵀ + (Σw)b of the projection output, acc dtype."""
    token_bound_NO: torch.Tensor
    """Round-off bound on their d1, to tell whether the actual output agrees (slow path only)."""
    x_NTI: torch.Tensor
    weight_OI: torch.Tensor
    bias_O: torch.Tensor | None
    x_norm_NT: torch.Tensor
    out_dtype: torch.dtype
    tol: Tolerance

    @property
    def tokens(self) -> int:
        return self.x_NTI.shape[-2]

    def token_bound_norm(self, heads: int) -> torch.Tensor:
        """(N, heads, 1): ‖per-feature bound‖₂ over each head's features. The passed q̄ (k̄) differs from wᵀQ (wᵀK)
        as computed by up to the projection's bound per feature, so a reference q̄ Kᵀ is off by up to this × ‖K_s‖."""
        n = self.token_bound_NO.shape[0]
        norm_NH1: torch.Tensor = torch.linalg.vector_norm(self.token_bound_NO.view(n, heads, -1), dim=-1, keepdim=True)
        return norm_NH1

    def feature_bound(self, heads: int) -> torch.Tensor:
        """(N, heads, T): bound on |v̂ - V w| per token and head (the projection's round-off, per head)."""
        in_features = self.weight_OI.shape[1]
        acc = self.token_ref_NO2.dtype
        w_norm_HD = torch.linalg.vector_norm(self.weight_OI.to(acc), dim=-1).view(heads, -1)
        bias_abs_HD = None if self.bias_O is None else self.bias_O.to(acc).abs().view(heads, -1)
        row_rule, _ = bounds(self.x_norm_NT[:, None, :], w_norm_HD[None], k=in_features, out_dtype=self.out_dtype,
                             tol=self.tol, bias_abs_C=bias_abs_HD)
        return row_rule.of(None)

    def feature_ref(self, heads: int) -> torch.Tensor:
        """(N, heads, T, 2): per-token, per-head feature-direction checksums X (W_hᵀ w) + b_h·w (V's v̂)."""
        acc = self.token_ref_NO2.dtype
        out_features, in_features = self.weight_OI.shape
        d = out_features // heads
        w_D2 = checksum_weights(d, self.x_NTI.device, acc)
        w_HDI = self.weight_OI.to(acc).view(heads, d, in_features)
        ww_IH2 = torch.einsum("hdi,dc->ihc", w_HDI, w_D2).reshape(in_features, heads * 2)
        ref_NTH2 = times_skinny(self.x_NTI.to(acc), ww_IH2).view(*self.x_NTI.shape[:-1], heads, 2)
        if self.bias_O is not None:
            ref_NTH2 = ref_NTH2 + self.bias_O.to(acc).view(heads, d) @ w_D2
        return ref_NTH2.transpose(-3, -2)


# --------------------------------------------------------------------------------------------------- shared helpers


def _exact_math(like: torch.Tensor) -> contextlib.ExitStack:
    """no_grad, autocast off and IEEE fp32 matmuls: checksums must run in the dtypes we chose (under autocast a fp32
    checksum matmul would silently run in bf16, under TF32 with 10-bit operands, and flag clean data); autograd must
    not see them."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(torch.autocast(device_type=like.device.type, enabled=False))
    stack.enter_context(ieee_fp32_matmul(like.device))
    return stack


def _tolerance(ctx: LayerContext) -> Tolerance:
    cfg = ctx.config
    return Tolerance(mode=cfg.tolerance, factor=cfg.tolerance_factor)


def _inject(ctx: LayerContext, op: str, out: torch.Tensor, attempt: int = 0) -> None:
    injector = ctx.runtime.injector
    if injector is not None:
        with torch.no_grad():
            injector.apply(out, op=op, layer=ctx.layer, step=ctx.step, attempt=attempt)


@functools.lru_cache(maxsize=16)
def _bucket_edges(device: torch.device) -> torch.Tensor:
    return torch.tensor(RESIDUAL_RATIO_BUCKETS, device=device, dtype=torch.float32)


def _any_bad(checks: Checks) -> torch.Tensor:
    flags = [chk.bad.any() for chk in checks.values()]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)


def _observe(ctx: LayerContext, checks: Checks) -> None:
    """Histogram of the worst residual/bound ratio (d1 and d2, both flag) among the unflagged vectors of one check,
    kept on the device: the dashboard's margin is its inverse."""
    stats = ctx.runtime.stats
    if stats is None or not checks:
        return
    worst = torch.stack([
        torch.where(chk.bad, 0.0, _ratio(chk)).amax().float()
        for chk in checks.values()
    ]).amax()
    _record_ratio(ctx, worst)


def _record_ratio(ctx: LayerContext, worst: torch.Tensor) -> None:
    """Add one check's worst residual/bound ratio (a device scalar) to the histogram (also the tiled path's)."""
    stats = ctx.runtime.stats
    if stats is None:
        return
    device = worst.device
    if stats.residual_counts is None or stats.residual_counts.device != device:
        stats.residual_counts = torch.zeros(len(RESIDUAL_RATIO_BUCKETS) + 1, device=device, dtype=torch.int64)
        stats.residual_sum = torch.zeros((), device=device, dtype=torch.float64)
        stats.residual_count = torch.zeros((), device=device, dtype=torch.int64)
    # A non-finite ratio is a check that could not be evaluated (its inputs already carried a fault that another op
    # reports, e.g. context computed from scores before their repair): it is left out, so one such check does not
    # turn the interval's sum into NaN (JSON cannot carry it, and the whole histogram would be lost).
    valid = torch.isfinite(worst)
    bucket = torch.bucketize(torch.where(valid, worst, 0.0), _bucket_edges(device))
    assert stats.residual_sum is not None and stats.residual_count is not None
    stats.residual_counts.index_add_(0, bucket.view(1), valid.view(1).to(torch.int64))
    stats.residual_sum += torch.where(valid, worst, 0.0).double()
    stats.residual_count += valid.to(torch.int64)


def _ratio(chk: DirectionCheck) -> torch.Tensor:
    """(..., V) the larger of |d1|/bound and |d2|/bound2."""
    ratio = chk.diff[..., 0].abs() / chk.bound.clamp_min(1e-30)
    if chk.bound2 is None:
        return ratio
    return torch.maximum(ratio, chk.diff[..., 1].abs() / chk.bound2.clamp_min(1e-30))


def _emit(ctx: LayerContext, op: str, reports: list[MatrixReport], *, heads: bool, tier: str = "abft") -> None:
    """One Detection per flagged matrix: to the runtime's callback and its counters. tier: who caught it."""
    rt = ctx.runtime
    for rep in reports:
        kind = kind_of(rep.value)
        det = Detection(
            op=op,
            layer=ctx.layer,
            step=ctx.step,
            pattern=rep.pattern,
            kind=kind,
            action=rep.action,
            batch=rep.index[0] if rep.index else None,
            head=rep.index[1] if heads and len(rep.index) > 1 else None,
            row=rep.row,
            col=rep.col,
            value=value_to_wire(rep.value),
            residual=rep.residual,
            bound=rep.bound,
            tier=tier,
        )
        if rt.stats is not None:
            rt.stats.add_fault(op, kind, rep.action, tier)
        if rt.on_detection is not None:
            rt.on_detection(det)


def _count(ctx: LayerContext, op: str, seconds: float) -> None:
    stats = ctx.runtime.stats
    if stats is not None:
        stats.checks[op] = stats.checks.get(op, 0) + 1
        stats.check_seconds[op] = stats.check_seconds.get(op, 0.0) + seconds


def _count_trips(ctx: LayerContext, ops: Sequence[str], seconds: float) -> None:
    """Tier-1 checks of ``ops`` (one each) and their time (recovery after a trip too: ``ops`` empty). Kept apart from
    check_seconds: the scheduler's overhead rule relaxes tier 2, which cannot make tier 1 cheaper."""
    stats = ctx.runtime.stats
    if stats is None:
        return
    for name in ops:
        stats.trip_checks[name] = stats.trip_checks.get(name, 0) + 1
    stats.trip_seconds += seconds


def _gemm_accumulation(c: torch.Tensor) -> torch.dtype | None:
    """The precision a half-precision product may have been reduced in: its own dtype when cuBLAS is allowed
    reduced-precision reductions (PyTorch's default), else fp32 (None)."""
    if not c.is_cuda:
        return None
    flags = torch.backends.cuda.matmul
    if c.dtype == torch.float16 and flags.allow_fp16_reduced_precision_reduction:
        return torch.float16
    if c.dtype == torch.bfloat16 and flags.allow_bf16_reduced_precision_reduction:
        return torch.bfloat16
    return None


def _verify(
    c_NRC: torch.Tensor,
    row_ref_NR2: torch.Tensor,
    col_ref_NC2: torch.Tensor,
    a_norm_NR: torch.Tensor,
    b_norm_NC: torch.Tensor,
    *,
    k: int,
    tol: Tolerance,
    bias_abs_C: torch.Tensor | None = None,
    extra_row_NR: torch.Tensor | None = None,
    extra_col_NC: torch.Tensor | None = None,
    operands_cast_to: torch.dtype | None = None,
    ref_norms: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> Checks:
    """Both directions of C = A·B against references derived from the inputs (no sync). extra_*: error already in
    a passed reference (paper-faithful mode), added to the bound. operands_cast_to: autocast ran the product on
    operands rounded to this dtype. ref_norms: (‖B w‖, ‖wᵀA‖) per batch (..., 2), for the calibrated bound."""
    roundoff = tol.mode == "roundoff"
    use_abs = c_NRC.dtype != acc_dtype(c_NRC.dtype) and roundoff
    got_rows, got_cols, sums = checksums_of(c_NRC, with_abs=use_abs, with_sq=roundoff and tol.calibrated)
    # An fp32 product under TF32 (or oneDNN bf16) rounded its operands; autocast already says so for half products.
    operand_u = fp32_matmul_operand_roundoff(c_NRC.device) if c_NRC.dtype == torch.float32 else None
    row_rule, col_rule = bounds(
        a_norm_NR, b_norm_NC, k=k, out_dtype=c_NRC.dtype, tol=tol, bias_abs_C=bias_abs_C, use_abs=use_abs,
        gemm_accumulates_in=_gemm_accumulation(c_NRC), operands_cast_to=operands_cast_to,
        operand_roundoff=operand_u, ref_norms=ref_norms,
    )
    if extra_row_NR is not None and roundoff:
        row_rule = row_rule.plus(extra_row_NR)
    if extra_col_NC is not None and roundoff:
        col_rule = col_rule.plus(extra_col_NC)
    row_sums, col_sums = (sums.of("row"), sums.of("col")) if sums is not None else ((None, None), (None, None))
    return {
        "row": verify_direction(row_ref_NR2, got_rows, row_rule, *row_sums),
        "col": verify_direction(col_ref_NC2, got_cols, col_rule, *col_sums),
    }


# ------------------------------------------------------------------------------------------------------ projections


@dataclass(slots=True)
class _ProjectionInput:
    """What every column slice of one projection shares: X in the acc dtype, its token checksums and row norms."""

    x_NTI: torch.Tensor
    x_acc_NTI: torch.Tensor
    xsum_N2I: torch.Tensor
    x_norm_NT: torch.Tensor

    @classmethod
    def of(cls, x_NTI: torch.Tensor) -> _ProjectionInput:
        x_acc = x_NTI.to(acc_dtype(x_NTI.dtype))
        return cls(x_NTI, x_acc, weighted_cols(x_acc).mT, torch.linalg.vector_norm(x_acc, dim=-1))

    def token_ref(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
        """(N, O, 2): (wᵀX) Wᵀ + (Σw) b, the column-direction reference of Y = X Wᵀ + b."""
        acc = self.x_acc_NTI.dtype
        ref_N2O = self.xsum_N2I @ weight_OI.to(acc).T
        if bias_O is not None:
            # Σw from the cached weights, on the device: a host-built tensor would be a host-to-device copy.
            wsum_21 = checksum_weights(self.x_NTI.shape[-2], ref_N2O.device, acc).sum(0)[:, None]
            ref_N2O = ref_N2O + wsum_21 * bias_O.to(acc)
        return ref_N2O.transpose(-2, -1)

    def feature_ref(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
        """(N, T, 2): X (Wᵀ w) + b·w, the row-direction reference."""
        acc = self.x_acc_NTI.dtype
        ww_I2 = weighted_cols(weight_OI.to(acc))
        ref_NT2 = times_skinny(self.x_acc_NTI, ww_I2)
        if bias_O is not None:
            ref_NT2 = ref_NT2 + weighted_rows(bias_O.to(acc)[None])[0]
        return ref_NT2

    def ref_norms(self, weight_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(‖Wᵀw‖ (2,), ‖wᵀX‖ (N, 2)): the vectors the row (column) references dot with, for the calibrated bound."""
        ww_I2 = weighted_cols(weight_OI.to(self.x_acc_NTI.dtype))
        return torch.linalg.vector_norm(ww_I2, dim=-2), torch.linalg.vector_norm(self.xsum_N2I, dim=-1)

    def weight_norms(
        self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(‖W_o‖₂ per output feature, |b|): the column norms of B = Wᵀ for the round-off bound."""
        acc = self.x_acc_NTI.dtype
        # Square-sum-root: for an HF Conv1D weight (in, out) each W_o is a strided column, and vector_norm along it is
        # ~10x slower (the bound has 1% slack; the two differ in the last bits).
        w_norm_O = weight_OI.to(acc).square().sum(-1).sqrt()
        return w_norm_O, None if bias_O is None else bias_O.to(acc).abs()


def _recompute_linear(
    ctx: LayerContext, name: str, x_NTI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None
) -> torch.Tensor:
    fresh_NTO = F.linear(x_NTI, w_OI, b_O)
    _inject(ctx, name, fresh_NTO, attempt=1)
    return fresh_NTO


def _exact_linear(
    x_NTI: torch.Tensor,
    w_OI: torch.Tensor,
    b_O: torch.Tensor | None,
    key: tuple[int, ...],
    rows: torch.Tensor,
    cols: torch.Tensor,
) -> torch.Tensor:
    return _dot(x_NTI[key][rows], w_OI[cols], None if b_O is None else b_O[cols])


def check_linear(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    ctx: LayerContext,
    op: str | None = None,
    splits: Sequence[tuple[str, int]] | None = None,
    weight_layout: str = "out_in",
) -> torch.Tensor:
    """Inject planned faults into y = x Wᵀ + b (``out_in``, nn.Linear) or x W + b (``in_out``, HF Conv1D), then verify
    and repair it in place. x: (..., T, I), y: (..., T, O). ``splits`` names column slices of a fused projection
    (GPT-2 c_attn), each its own op. Returns y. Syncs with the device once (clean input), more only when a fault is
    found. In paper-faithful mode (config.source_repair False) q/k/v are not verified here: their input-derived
    checksums go to ``ctx.passed`` for protected_sdpa.
    """
    if weight_layout not in ("out_in", "in_out"):
        raise ValueError(f"weight_layout must be 'out_in' or 'in_out', got {weight_layout!r}")
    if splits is None:
        if op is None:
            raise ValueError("check_linear needs op= or splits=")
        splits = ((op, y.shape[-1]),)
    if sum(size for _, size in splits) != y.shape[-1]:
        raise ValueError(f"splits {list(splits)} do not add up to the {y.shape[-1]} output features")
    cfg = ctx.config
    x_NTI = x.reshape(-1, *x.shape[-2:]) if x.dim() != 2 else x[None]
    y_NTO = y.view(-1, *y.shape[-2:]) if y.dim() != 2 else y[None]
    weight_OI = weight if weight_layout == "out_in" else weight.T
    tol = _tolerance(ctx)
    # Under autocast the module's fp32 input and weight were rounded to the output's dtype for the GEMM.
    cast_to = y.dtype if x.dtype != y.dtype or weight.dtype != y.dtype else None
    shared: _ProjectionInput | None = None
    pending: list[tuple[str, torch.Tensor, Checks, Callable[[], torch.Tensor], _Exact, float, str]] = []
    # Tier 1: (name, y_s, w_s, b_s) of the slices only the tripwire looks at on this step.
    wired: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def full_checks(y_s: torch.Tensor, w_s: torch.Tensor, b_s: torch.Tensor | None) -> Checks:
        nonlocal shared
        shared = shared or _ProjectionInput.of(x_NTI.detach())
        w_norm_O, bias_abs = shared.weight_norms(w_s, b_s)
        return _verify(y_s.detach(), shared.feature_ref(w_s, b_s), shared.token_ref(w_s, b_s), shared.x_norm_NT,
                       w_norm_O, k=w_s.shape[1], tol=tol, bias_abs_C=bias_abs, operands_cast_to=cast_to,
                       ref_norms=shared.ref_norms(w_s))

    offset = 0
    for name, size in splits:
        y_s = y_NTO[..., offset : offset + size]
        w_s = weight_OI[offset : offset + size].detach()
        b_s = bias[offset : offset + size].detach() if bias is not None else None
        offset += size
        _inject(ctx, name, y_s)
        if cfg.trips(name):
            wired.append((name, y_s, w_s, b_s))
        paper_pass = name in ("q", "k", "v") and not cfg.source_repair
        if cfg.mode == "off" or not (cfg.checks(name) or paper_pass):
            continue
        t0 = time.perf_counter()
        with _exact_math(y):
            shared = shared or _ProjectionInput.of(x_NTI.detach())
            if paper_pass:
                # Paper mode keeps the operand-only bound: the output it would be measured on is unverified.
                w_norm_O, bias_abs = shared.weight_norms(w_s, b_s)
                token_rule = bounds(shared.x_norm_NT, w_norm_O, k=w_s.shape[1], out_dtype=y.dtype, tol=tol,
                                    bias_abs_C=bias_abs, operands_cast_to=cast_to)[1]
                token_bound = token_rule.of(None).expand(y_s.shape[0], -1)
                ctx.passed[name] = PassedProjection(token_ref_NO2=shared.token_ref(w_s, b_s),
                                                    token_bound_NO=token_bound,
                                                    x_NTI=x_NTI.detach(), weight_OI=w_s, bias_O=b_s,
                                                    x_norm_NT=shared.x_norm_NT, out_dtype=y.dtype, tol=tol)
                continue
            checks = full_checks(y_s, w_s, b_s)
            _observe(ctx, checks)

        recompute = functools.partial(_recompute_linear, ctx, name, x_NTI.detach(), w_s, b_s)
        exact = functools.partial(_exact_linear, x_NTI.detach(), w_s, b_s)
        pending.append((name, y_s, checks, recompute, exact, time.perf_counter() - t0, "abft"))
    flags = [_any_bad(item[2]) for item in pending]
    trip_s = 0.0
    if wired:
        t0 = time.perf_counter()
        # All slices wired (the usual tier-1 step): one sum over y, not one per strided column slice.
        flags.append(extreme(y) if len(wired) == len(splits) else extreme(*(item[1] for item in wired)))
        trip_s = time.perf_counter() - t0
    if not flags:
        return y
    slow = bool(torch.stack(flags).any())  # sync: the one per protected projection call; decides the slow path
    if slow and wired:
        t0 = time.perf_counter()
        for name, y_s, w_s, b_s in wired:
            if not bool(extreme(y_s)):  # sync: slow path only, which slice tripped
                continue
            # A trip: this slice gets the full check now, which locates and corrects (or recomputes) the fault.
            with _exact_math(y):
                checks = full_checks(y_s, w_s, b_s)
            recompute = functools.partial(_recompute_linear, ctx, name, x_NTI.detach(), w_s, b_s)
            exact = functools.partial(_exact_linear, x_NTI.detach(), w_s, b_s)
            pending.append((name, y_s, checks, recompute, exact, 0.0, "tripwire"))
        trip_s += time.perf_counter() - t0
    if wired:
        _count_trips(ctx, [item[0] for item in wired], trip_s)
    for name, y_s, checks, redo, refresh, seconds, tier in pending:
        t0 = time.perf_counter()
        if slow:
            with _exact_math(y):
                reports = repair(y_s, checks, tol, correct=cfg.mode == "correct", recompute=redo, exact=refresh)
            _emit(ctx, name, reports, heads=False, tier=tier)
        if tier == "abft":
            _count(ctx, name, seconds + time.perf_counter() - t0)
        else:
            _count_trips(ctx, [], time.perf_counter() - t0)
    return y


def protected_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    ctx: LayerContext,
    op: str | None = None,
    splits: Sequence[tuple[str, int]] | None = None,
    weight_layout: str = "out_in",
) -> torch.Tensor:
    """Compute x Wᵀ + b (or x W + b for ``in_out``) and check it (check_linear)."""
    if weight_layout == "out_in":
        y = F.linear(x, weight, bias)
    else:
        y = x @ weight if bias is None else torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(
            *x.shape[:-1], weight.shape[-1])
    return check_linear(x, y, weight, bias, ctx=ctx, op=op, splits=splits, weight_layout=weight_layout)


# -------------------------------------------------------------------------------------------------------- attention


def _dead_rows(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(..., T, 1) bool: query rows with every key masked. SDPA returns 0 there (safe softmax), not NaN."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return ~attn_mask.any(-1, keepdim=True)
    return torch.isneginf(attn_mask).all(-1, keepdim=True)


def _probs(
    scores_BHTS: torch.Tensor,
    *,
    scale: float,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
    keep_BHTS: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AP = dropout(softmax(scale·AS + mask)); the dropout keep-mask is returned so a recompute reuses it."""
    probs, keep, _ = _probs_lse(scores_BHTS, scale=scale, attn_mask=attn_mask, is_causal=is_causal,
                                dropout_p=dropout_p, keep_BHTS=keep_BHTS)
    return probs, keep


def _probs_lse(
    scores_BHTS: torch.Tensor,
    *,
    scale: float,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
    keep_BHTS: torch.Tensor | None,
    with_lse: bool = False,
    probs_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """_probs, and with_lse also the row log-sum-exp of scale·AS + mask (B, H, T) in fp32, +INF on rows with every
    key masked (so that exp(s - lse) = 0 there, as AP), for the fused backward (_VerifiedAttention). probs_dtype: AP's
    dtype (V's) when AS was formed wider than the operands (fp16, _scores_product); default AS's."""
    # One new tensor, then in place: out-of-place masking copied the (B, H, T, S) scores once per mask.
    s = scores_BHTS * scale
    t, n_keys = s.shape[-2:]
    if is_causal:
        s.masked_fill_(_future_mask(t, n_keys, s.device), -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s.masked_fill_(~attn_mask, -math.inf)
        else:
            s.add_(attn_mask)
    # Softmax in fp32 for half inputs, like SDPA's kernels: the row sums feed the checksum bound.
    probs32 = torch.softmax(s, dim=-1, dtype=torch.float32)
    lse_BHT = None
    if with_lse:
        # From what softmax already computed: softmax is monotone, so the largest p sits at the largest s = m, where
        # p = exp(m - lse): lse = m - log max(p), with max(p) >= 1/S (no cancellation). Two max passes (values only:
        # max with indices is ~15x slower on CPU) instead of torch.logsumexp's three.
        lse_BHT = s.amax(-1).float() - probs32.amax(-1).log()
    probs = probs32.to(probs_dtype or s.dtype)
    dead = _dead_rows(attn_mask)
    if dead is not None:
        probs = probs.masked_fill(dead, 0.0)
        if lse_BHT is not None:
            lse_BHT = lse_BHT.masked_fill(dead[..., 0], math.inf)
    if dropout_p > 0.0:
        if keep_BHTS is None:
            keep_BHTS = torch.empty_like(probs).bernoulli_(1.0 - dropout_p)
        probs = probs * keep_BHTS / (1.0 - dropout_p)
    return probs, keep_BHTS, lse_BHT


@functools.lru_cache(maxsize=32)
def _future_mask(t: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(T, S) bool, True above the diagonal (top-left aligned, as SDPA's is_causal). Cached: callers must not
    write it."""
    return torch.ones(t, n_keys, dtype=torch.bool, device=device).triu(1)


def _fused_backward_ok(
    q_BHTD: torch.Tensor, dropout_p: float, return_probs: bool, attn_mask: torch.Tensor | None = None
) -> bool:
    """Whether the CPU flash-attention backward can stand in for autograd through the unfused forward: it recomputes
    AP from Q, K and the row log-sum-exp, so it cannot reproduce our dropout mask, and return_probs hands AP itself
    to the caller's graph. Nor does it return a gradient for the mask: a mask that requires grad (a learned relative
    bias, T5/Swin/ALiBi style) is differentiated through the unfused graph instead, as PyTorch's own SDPA then runs
    its math backend."""
    mask_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
    return q_BHTD.device.type == "cpu" and dropout_p == 0.0 and not return_probs and not mask_grad


def _scores_product(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor) -> torch.Tensor:
    """AS = Q Kᵀ (B, H, T, S). fp16 operands are multiplied into fp32: the unscaled logits pass fp16's 65504 well
    before the scaled ones do, and PyTorch's attention (flash/efficient kernels, the CPU kernel) accumulates them in
    fp32, so an fp16 AS would turn a finite attention into INF/NaN and a false "uncorrectable". fp16 values are exact
    in fp32 (and in TF32), so the checksums of this product are those of an fp32 GEMM. bf16 has fp32's range."""
    if q_BHTD.dtype == torch.float16:
        return q_BHTD.float() @ k_BHSD.float().transpose(-2, -1)
    return q_BHTD @ k_BHSD.transpose(-2, -1)


@dataclass(slots=True)
class _Forward:
    """What _VerifiedAttention's backward needs besides q, k, v: the verified output and how AP was formed."""

    out_BHTD: torch.Tensor
    lse_BHT: torch.Tensor
    mask_add: torch.Tensor | None
    scale: float
    is_causal: bool
    layer: LayerContext | None = None
    """Set: under protect(scope="all") backward may run the checked products (attention_backward) instead."""


class _VerifiedAttention(torch.autograd.Function):
    """Autograd for an attention output computed, verified and repaired outside autograd (under no_grad).

    The gradient is the fused CPU kernel's backward (aten._scaled_dot_product_flash_attention_for_cpu_backward) at
    q, k, v, the verified output and the row log-sum-exp: the gradient of softmax(scale·QKᵀ + mask)·V, the same
    function the unfused graph would differentiate, without keeping AS and AP alive for backward or running softmax
    backward over them. Backward is unprotected either way (DESIGN.md); what it reads (q, k, v, out) is what the
    checks verified. docs/abft.md (performance) has the reasoning.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd: _Forward) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, fwd.out_BHTD, fwd.lse_BHT, fwd.mask_add)
        ctx.scale, ctx.is_causal, ctx.layer = fwd.scale, fwd.is_causal, fwd.layer
        return fwd.out_BHTD

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse, mask_add = ctx.saved_tensors
        if ctx.layer is not None:
            from .attention_backward import checked_backward
            from .linear_abft import whole_step_due

            if whole_step_due(ctx.layer.runtime):
                dq, dk, dv = checked_backward(ctx.layer, grad_out, q, k, v, out, lse, mask_add, scale=ctx.scale,
                                              is_causal=ctx.is_causal)
                return dq, dk, dv, None
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask_add, scale=ctx.scale)
        return dq, dk, dv, None


def _additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as the fused backward takes it: additive, 4-D. A 3-D (H, T, S) mask, valid for SDPA (it broadcasts
    from the right), is misread by the CPU kernel's backward, which then fails on its size."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(~attn_mask, -math.inf)
    else:
        mask = attn_mask.to(dtype)
    return mask.view(*(1,) * (4 - mask.dim()), *mask.shape) if mask.dim() < 4 else mask


def _suspect_heads(passed: PassedProjection | None, x_BHSD: torch.Tensor, heads: int) -> torch.Tensor | None:
    """(B, H) bool, slow path only: this head's q/k/v disagrees with the checksums passed from its projection, so a
    reference built from it is not clean."""
    if passed is None:
        return None
    with _exact_math(x_BHSD):
        return _disagrees(passed, x_BHSD, heads)


def _disagrees(passed: PassedProjection, x_BHSD: torch.Tensor, heads: int) -> torch.Tensor:
    got_BHD2 = weighted_cols(x_BHSD.to(passed.token_ref_NO2.dtype))
    b, hk = passed.token_ref_NO2.shape[0], heads
    ref_BHD2 = passed.token_ref_NO2.view(b, hk, -1, 2)
    bound_BHD = passed.token_bound_NO.view(b, hk, -1)
    ok_BHD = ~torch.isfinite(ref_BHD2[..., 0]) | ((ref_BHD2[..., 0] - got_BHD2[..., 0]).abs() <= bound_BHD)
    return ~ok_BHD.all(-1)


def _take_passed(ctx: LayerContext, name: str, n: int, tokens: int, heads: int, d: int) -> PassedProjection | None:
    passed = ctx.passed.pop(name, None)
    if not isinstance(passed, PassedProjection):
        return None
    if passed.token_ref_NO2.shape != (n, heads * d, 2) or passed.tokens != tokens:
        return None
    return passed


def _expand_heads(x_BHSD: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each key/value head for its query-head group (SDPA's enable_gqa). expand + reshape rather than
    repeat_interleave, which syncs on CUDA to size its output."""
    hk = x_BHSD.shape[-3]
    if hk == heads:
        return x_BHSD
    lead, tail = x_BHSD.shape[:-3], x_BHSD.shape[-2:]
    grouped = x_BHSD.unsqueeze(-3).expand(*lead, hk, heads // hk, *tail)
    return grouped.reshape(*lead, heads, *tail)


def protected_sdpa(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_probs: bool = False,
    use_passed: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.scaled_dot_product_attention`` with AS = QKᵀ (op "scores") and CL = AP·V (op "context") verified in both
    directions and repaired in place. q: (B, H, T, D), k/v: (B, Hk, S, D) (Hk divides H with enable_gqa).
    attn_mask: bool (True = attend) or additive float, broadcastable to (B, H, T, S).
    use_passed: take q/k/v checksums from ``ctx.passed`` (paper-faithful mode); pass False when q/k were transformed
    after their projection (RoPE). Returns out (B, H, T, Dv), or (out, AP) with return_probs.
    One host-device sync on clean input (after both products: optimistic), more only on the slow path.
    """
    if q_BHTD.dim() != 4:
        raise ValueError(f"protected_sdpa expects (B, H, T, D) tensors, got q of shape {tuple(q_BHTD.shape)}")
    h, d = q_BHTD.shape[1], q_BHTD.shape[3]
    hk = k_BHSD.shape[-3]
    if hk != h and not (enable_gqa and h % hk == 0):
        raise ValueError(f"q has {h} heads and k/v {hk}: pass enable_gqa=True with a divisor head count")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cfg = ctx.config
    if (not (cfg.checks("scores") or cfg.checks("context")) and ctx.runtime.injector is None and not return_probs
            and not (is_causal and attn_mask is not None)):
        # Nothing to verify or inject in this call (an adaptive step that skips both ops, or mode off): the fused
        # kernel, exactly what the unprotected model runs. Passed checksums of this layer are dropped unused.
        for name in ("q", "k", "v"):
            ctx.passed.pop(name, None)
        if not (cfg.trips("scores") or cfg.trips("context")):
            return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        fused, trip = _tripwire_sdpa(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal,
                                     scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa)
        if trip is None or cfg.mode != "correct":
            if trip is not None:
                _emit_trip(ctx, trip, action="detected")
            return fused
        # Tier 1 tripped: drop the fused result and run the layer's attention again through the checked path, both
        # ops verified (a transient fault does not repeat; one that does is located and corrected there).
        force = frozenset(("scores", "context"))
    else:
        trip, force = None, frozenset()
    caught: list[int] = [0]
    tiles = choose_tiles(q_BHTD.shape[-2], k_BHSD.shape[-2], device=q_BHTD.device, dropout_p=dropout_p,
                         return_probs=return_probs, paper=not cfg.source_repair and use_passed)
    # The tiled path's CPU backward is the fused kernel, which has no gradient for the mask: a learned bias stays
    # on the unfused path (its graph differentiates through the mask).
    if tiles is not None and not (attn_mask is not None and attn_mask.requires_grad):
        # O(T) extra memory instead of the T×S scores and probabilities (issue 12, tiled_attention.py).
        for name in ("q", "k", "v"):
            ctx.passed.pop(name, None)
        out = tiled_sdpa(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                         tiles=tiles, force=force, caught=caught)
        if trip is not None and not caught[0]:
            _emit_trip(ctx, trip, action="recomputed")
        return out
    fused_grad = _fused_backward_ok(q_BHTD, dropout_p, return_probs, attn_mask)
    with torch.no_grad() if fused_grad else contextlib.nullcontext():
        out, probs, lse = _checked_attention(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, attn_mask=attn_mask,
                                             is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                             use_passed=use_passed and not force, with_lse=fused_grad, force=force,
                                             caught=caught)
    if trip is not None and not caught[0]:
        _emit_trip(ctx, trip, action="recomputed")
    if fused_grad and torch.is_grad_enabled() and (q_BHTD.requires_grad or k_BHSD.requires_grad
                                                   or v_BHSD.requires_grad):
        assert lse is not None
        k_rep, v_rep = _expand_heads(k_BHSD, h), _expand_heads(v_BHSD, h)
        out = _VerifiedAttention.apply(q_BHTD, k_rep, v_rep, _Forward(
            out_BHTD=out, lse_BHT=lse, mask_add=_additive_mask(attn_mask, q_BHTD.dtype), scale=scale,
            is_causal=is_causal, layer=ctx))
    return (out, probs) if return_probs else out


def _checked_attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    use_passed: bool,
    with_lse: bool,
    force: frozenset[str] = frozenset(),
    caught: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """protected_sdpa's unfused forward with its checks and repairs: (out, AP, row log-sum-exp if with_lse).
    force: ops verified whatever the step's config says (a tier-1 recovery; their events say tier "tripwire").
    caught: [n], incremented by the number of detections emitted."""
    b, h, t, _ = q_BHTD.shape
    hk, s = k_BHSD.shape[-3], k_BHSD.shape[-2]
    cfg = ctx.config
    tol = _tolerance(ctx)
    paper = not cfg.source_repair and use_passed
    passed = {
        name: _take_passed(ctx, name, b, t if name == "q" else s, h if name == "q" else hk, x.shape[-1])
        if paper else None
        for name, x in (("q", q_BHTD), ("k", k_BHSD), ("v", v_BHSD))
    }
    k_rep, v_rep = _expand_heads(k_BHSD, h), _expand_heads(v_BHSD, h)
    scores = _scores_product(q_BHTD, k_rep)
    _inject(ctx, "scores", scores)
    checks: dict[str, Checks] = {}
    seconds = dict.fromkeys(("scores", "context"), 0.0)
    tier = {op: "tripwire" if op in force else "abft" for op in ("scores", "context")}
    wired: dict[str, torch.Tensor] = {}
    """Tier 1: op -> its trip flag, for the ops only the tripwire looks at on this step."""
    trip_s = 0.0
    if cfg.checks("scores") or "scores" in force:
        t0 = time.perf_counter()
        checks["scores"] = _scores_checks(q_BHTD, k_rep, scores.detach(), passed, h, tol)
        _observe(ctx, checks["scores"])
        seconds["scores"] += time.perf_counter() - t0
    elif cfg.trips("scores"):
        t0 = time.perf_counter()
        wired["scores"] = extreme(scores)
        trip_s += time.perf_counter() - t0
    probs, keep, lse = _probs_lse(scores, scale=scale, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                  keep_BHTS=None, with_lse=with_lse, probs_dtype=v_rep.dtype)
    out = probs @ v_rep
    _inject(ctx, "context", out)
    if cfg.checks("context") or "context" in force:
        t0 = time.perf_counter()
        checks["context"] = _context_checks(probs.detach(), v_rep, out.detach(), passed.get("v"), h, tol, dropout_p)
        _observe(ctx, checks["context"])
        seconds["context"] += time.perf_counter() - t0
    elif cfg.trips("context"):
        t0 = time.perf_counter()
        wired["context"] = extreme(out)
        trip_s += time.perf_counter() - t0
    if checks or wired:
        any_bad = torch.stack([_any_bad(c) for c in checks.values()] + list(wired.values())).any()
        if bool(any_bad):  # sync: the one per protected attention call; decides whether the slow path runs
            t0 = time.perf_counter()
            for op, flag in wired.items():
                if not bool(flag):  # sync: slow path only, which op tripped
                    continue
                # A trip: the op gets its full check now, which locates and corrects (or recomputes) the fault.
                tier[op] = "tripwire"
                if op == "scores":
                    checks[op] = _scores_checks(q_BHTD, k_rep, scores.detach(), passed, h, tol)
                else:
                    checks[op] = _context_checks(probs.detach(), v_rep, out.detach(), passed.get("v"), h, tol,
                                                 dropout_p)
            correct = cfg.mode == "correct"
            if "scores" in checks:
                trusted = _trusted(passed.get("q"), passed.get("k"), q_BHTD, k_BHSD, h, hk)

                def recompute_scores() -> torch.Tensor:
                    fresh = _scores_product(q_BHTD.detach(), k_rep.detach())
                    _inject(ctx, "scores", fresh, attempt=1)
                    return fresh

                def exact_scores(key: tuple[int, ...], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
                    return _dot(q_BHTD.detach()[key][rows], k_rep.detach()[key][cols])

                with _exact_math(scores):
                    reports = repair(scores, checks["scores"], tol, correct=correct, recompute=recompute_scores,
                                     trusted=trusted, exact=None if paper else exact_scores)
                _emit(ctx, "scores", reports, heads=True, tier=tier["scores"])
                if caught is not None:
                    caught[0] += len(reports)
                if correct and any(r.action in ("corrected", "recomputed") for r in reports):
                    # AS was repaired in place: rebuild AP and CL from it, reusing the dropout mask.
                    probs, _, lse = _probs_lse(scores, scale=scale, attn_mask=attn_mask, is_causal=is_causal,
                                               dropout_p=dropout_p, keep_BHTS=keep, with_lse=with_lse,
                                               probs_dtype=v_rep.dtype)
                    out = probs @ v_rep
                    _inject(ctx, "context", out, attempt=1)
                    if "context" in checks:
                        checks["context"] = _context_checks(probs.detach(), v_rep, out.detach(), passed.get("v"), h,
                                                            tol, dropout_p)
            seconds["scores"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if "context" in checks:
                # CL's column references (wᵀAP)V are built from V, unverified in paper-faithful mode.
                v_bad = _suspect_heads(passed.get("v"), v_BHSD, hk)
                trusted = None if v_bad is None else {"col": _expand_heads(~v_bad[..., None, None], h)[..., 0, 0]}

                def recompute_context() -> torch.Tensor:
                    fresh = probs.detach() @ v_rep.detach()
                    _inject(ctx, "context", fresh, attempt=1)
                    return fresh

                def exact_context(key: tuple[int, ...], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
                    return _dot(probs.detach()[key][rows], v_rep.detach()[key].T[cols])

                with _exact_math(out):
                    reports = repair(out, checks["context"], tol, correct=correct, recompute=recompute_context,
                                     trusted=trusted, exact=None if paper else exact_context)
                _emit(ctx, "context", reports, heads=True, tier=tier["context"])
                if caught is not None:
                    caught[0] += len(reports)
            seconds["context"] += time.perf_counter() - t0
    if wired:
        _count_trips(ctx, list(wired), trip_s)
    for op in checks:
        if tier[op] == "abft":
            _count(ctx, op, seconds[op])
        else:
            _count_trips(ctx, [], seconds[op])
    return out, probs, lse


@dataclass(frozen=True, slots=True)
class _Trip:
    """What tier 1 saw in a fused attention call: which op, the extreme value and where (batch, head, row[, col])."""

    op: str
    value: float
    index: tuple[int, ...]


def _tripwire_sdpa(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    enable_gqa: bool,
) -> tuple[torch.Tensor, _Trip | None]:
    """Tier 1 on the fused kernel: (out, None), or (out, what tripped). On CPU without dropout the kernel is called
    directly for its row log-sum-exp, checked against the q/k norm bound (tripwire.lse_over_bound); elsewhere the
    output alone is checked (INF/NaN in AS reach it; a finite near-INF score that does not is left to tier 2)."""
    h = q_BHTD.shape[1]
    lse_BHT: torch.Tensor | None = None
    mask_add: torch.Tensor | None = None
    # The CPU flash kernel takes 2-D or 4-D masks and one head size for q, k and v, and has no gradient for the mask;
    # F.sdpa falls back to its math path otherwise (a learned bias: a mask that requires grad), and so does tier 1
    # (output test only).
    flash = (q_BHTD.device.type == "cpu" and dropout_p == 0.0 and q_BHTD.dim() == 4
             and (attn_mask is None or (attn_mask.dim() in (2, 4) and not attn_mask.requires_grad))
             and v_BHSD.shape[-1] == q_BHTD.shape[-1])
    if flash:
        k_rep, v_rep = _expand_heads(k_BHSD, h), _expand_heads(v_BHSD, h)
        mask_add = _additive_mask(attn_mask, q_BHTD.dtype)
        # What F.scaled_dot_product_attention runs on CPU for these inputs, with its log-sum-exp kept.
        out, lse_BHT = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_BHTD, k_rep, v_rep, 0.0, is_causal, attn_mask=mask_add, scale=scale)
        t0 = time.perf_counter()  # tier-1 time is the tests, not the attention the unprotected model runs too
        # The mask's largest value joins the bound only after a trip (masks are <= 0 but for ALiBi-style biases):
        # reading it on every call would cost as much as the rest of the tripwire.
        flags = [extreme(out), lse_over_bound(q_BHTD, k_rep, lse_BHT, scale=scale)]
    else:
        k_rep = k_BHSD
        out = F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        t0 = time.perf_counter()
        flags = [extreme(out)]
    trip: _Trip | None = None
    if bool(torch.stack(flags).any()):  # sync: the one per attention call on a tier-1 step
        if bool(extreme(out)):  # sync: slow path only
            value, index = extreme_value(out)
            trip = _Trip("context", value, index[:3])
        elif lse_BHT is not None:
            mask_max = 0.0 if mask_add is None else float(mask_add.amax())  # sync: slow path only
            if bool(lse_over_bound(q_BHTD, k_rep, lse_BHT, scale=scale, mask_max=mask_max)):  # sync: slow path
                value, index = extreme_value(lse_BHT)
                trip = _Trip("scores", value, index)
    _count_trips(ctx, ["scores", "context"], time.perf_counter() - t0)
    return out, trip


def _emit_trip(ctx: LayerContext, trip: _Trip, *, action: str) -> None:
    """The event of a tier-1 trip that the full check run after it had nothing left to locate (the fault was in a
    result that was thrown away and computed again)."""
    rt = ctx.runtime
    kind = kind_of(trip.value)
    if trip.op == "scores" and kind == "silent":
        kind = "near_inf"  # a log-sum-exp over its bound: a score near INF, scaled and logged down
    idx = trip.index
    det = Detection(op=trip.op, layer=ctx.layer, step=ctx.step, pattern="0d", kind=kind, action=action,
                    batch=idx[0] if idx else None, head=idx[1] if len(idx) > 1 else None,
                    row=idx[2] if len(idx) > 2 else None, value=value_to_wire(trip.value), residual=None,
                    bound=NEAR_INF, tier="tripwire")
    if rt.stats is not None:
        rt.stats.add_fault(trip.op, kind, action, "tripwire")
    if rt.on_detection is not None:
        rt.on_detection(det)


def _trusted(
    passed_q: PassedProjection | None,
    passed_k: PassedProjection | None,
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    h: int,
    hk: int,
) -> dict[str, torch.Tensor] | None:
    """Paper-faithful mode: AS's row references are built from Q and its column references from K, both unverified.
    A head whose Q (K) disagrees with the passed checksums has untrusted row (column) references."""
    q_bad = _suspect_heads(passed_q, q_BHTD, h)
    k_bad = _suspect_heads(passed_k, k_BHSD, hk)
    trusted = {}
    if q_bad is not None:
        trusted["row"] = ~q_bad
    if k_bad is not None:
        trusted["col"] = _expand_heads(~k_bad[..., None, None], h)[..., 0, 0]
    return trusted or None


def _scores_checks(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    scores_BHTS: torch.Tensor,
    passed: dict[str, PassedProjection | None],
    h: int,
    tol: Tolerance,
) -> Checks:
    """AS = Q Kᵀ: per query row Q k̄ᵀ, per key column K q̄ᵀ; q̄, k̄ passed from X when available (paper mode)."""
    with _exact_math(scores_BHTS):
        acc = acc_dtype(q_BHTD.dtype)
        # Heads split out of a projection are strided views: one copy each makes every later reduction fast.
        q_acc, k_acc = q_BHTD.detach().to(acc).contiguous(), k_BHSD.detach().to(acc).contiguous()
        b = q_acc.shape[0]
        pq, pk = passed.get("q"), passed.get("k")
        qbar_BHD2 = pq.token_ref_NO2.view(b, h, -1, 2) if pq is not None else weighted_cols(q_acc)
        if pk is not None:
            kbar_BHD2 = _expand_heads(pk.token_ref_NO2.view(b, -1, q_acc.shape[-1], 2), h)
        else:
            kbar_BHD2 = weighted_cols(k_acc)
        q_norm_BHT = torch.linalg.vector_norm(q_acc, dim=-1)
        k_norm_BHS = torch.linalg.vector_norm(k_acc, dim=-1)
        # Row references Q k̄ᵀ use a passed k̄: off by ‖k̄ error‖·‖Q_t‖; column references K q̄ᵀ likewise.
        extra_row = None
        if pk is not None:
            kv_heads = pk.token_bound_NO.shape[1] // q_acc.shape[-1]
            extra_row = q_norm_BHT * _expand_heads(pk.token_bound_norm(kv_heads)[..., None], h)[..., 0]
        extra_col = None if pq is None else k_norm_BHS * pq.token_bound_norm(h)
        return _verify(
            scores_BHTS,
            times_skinny(q_acc, kbar_BHD2),
            times_skinny(k_acc, qbar_BHD2),
            q_norm_BHT,
            k_norm_BHS,
            k=q_acc.shape[-1],
            tol=tol,
            extra_row_NR=extra_row,
            extra_col_NC=extra_col,
            ref_norms=(torch.linalg.vector_norm(kbar_BHD2, dim=-2), torch.linalg.vector_norm(qbar_BHD2, dim=-2)),
        )


def _context_checks(
    probs_BHTS: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,
    passed_v: PassedProjection | None,
    h: int,
    tol: Tolerance,
    dropout_p: float = 0.0,
) -> Checks:
    """CL = AP V: per query row AP (V w) (V w passed from X when available), per feature column (wᵀAP) V.
    AP ≥ 0 with rows summing to 1 (0 when fully masked, 1/(1-p) at most after dropout), so ‖AP_t‖₂ ≤ ‖AP_t‖₁ needs
    no pass over AP; 1.01 covers the rounding of half-precision probabilities."""
    with _exact_math(out_BHTD):
        acc = acc_dtype(v_BHSD.dtype)
        v_acc, p_acc = v_BHSD.detach().to(acc).contiguous(), probs_BHTS.to(acc)
        s = p_acc.shape[-1]
        if passed_v is not None:
            # v̂ passed from X carries the projection's round-off per token: AP times it bounds the row references'.
            kv_heads = passed_v.weight_OI.shape[0] // v_acc.shape[-1]
            vw_BHS2 = _expand_heads(passed_v.feature_ref(kv_heads), h)
            vbound_BHS1 = _expand_heads(passed_v.feature_bound(kv_heads)[..., None], h)
            row_BHTc = times_skinny(p_acc, torch.cat([vw_BHS2, vbound_BHS1], dim=-1))
        else:
            vw_BHS2 = weighted_rows(v_acc)
            row_BHTc = times_skinny(p_acc, vw_BHS2)
        pw_BHS2 = weighted_cols(p_acc)
        col_ref_BHD2 = (pw_BHS2.mT @ v_acc).mT
        p_norm_BHT = torch.full(row_BHTc.shape[:-1], 1.01 / (1.0 - dropout_p), device=p_acc.device, dtype=acc)
        return _verify(
            out_BHTD,
            row_BHTc[..., :2],
            col_ref_BHD2,
            p_norm_BHT,
            col_norms(v_acc),
            k=s,
            tol=tol,
            extra_row_NR=row_BHTc[..., 2] if passed_v is not None else None,
            ref_norms=(torch.linalg.vector_norm(vw_BHS2, dim=-2), torch.linalg.vector_norm(pw_BHS2, dim=-2)),
        )


# ------------------------------------------------------------------------------------------------------ whole layer


def protected_self_attention(
    x_BTC: torch.Tensor,
    *,
    ctx: LayerContext,
    num_heads: int,
    w_o: torch.Tensor,
    b_o: torch.Tensor | None = None,
    w_q: torch.Tensor | None = None,
    b_q: torch.Tensor | None = None,
    w_k: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    w_v: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    w_qkv: torch.Tensor | None = None,
    b_qkv: torch.Tensor | None = None,
    num_kv_heads: int | None = None,
    weight_layout: str = "out_in",
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """One protected self-attention layer: separate (w_q, w_k, w_v) or fused (w_qkv, GPT-2 c_attn) projections, with
    or without bias; all six ops verified per ctx.config. x: (B, T, C) -> (B, T, C_out)."""
    b, t, _ = x_BTC.shape
    kv_heads = num_kv_heads or num_heads
    if w_qkv is not None:
        out_features = w_qkv.shape[0] if weight_layout == "out_in" else w_qkv.shape[1]
        d = out_features // (num_heads + 2 * kv_heads)
        splits = (("q", num_heads * d), ("k", kv_heads * d), ("v", kv_heads * d))
        qkv = protected_linear(x_BTC, w_qkv, b_qkv, ctx=ctx, splits=splits, weight_layout=weight_layout)
        q, k, v = torch.split(qkv, [size for _, size in splits], dim=-1)
    else:
        if w_q is None or w_k is None or w_v is None:
            raise ValueError("protected_self_attention needs w_qkv or all of w_q, w_k, w_v")
        q = protected_linear(x_BTC, w_q, b_q, ctx=ctx, op="q", weight_layout=weight_layout)
        k = protected_linear(x_BTC, w_k, b_k, ctx=ctx, op="k", weight_layout=weight_layout)
        v = protected_linear(x_BTC, w_v, b_v, ctx=ctx, op="v", weight_layout=weight_layout)
    q_BHTD = q.view(b, t, num_heads, -1).transpose(1, 2)
    k_BHTD = k.view(b, t, kv_heads, -1).transpose(1, 2)
    v_BHTD = v.view(b, t, kv_heads, -1).transpose(1, 2)
    out_BHTD = protected_sdpa(q_BHTD, k_BHTD, v_BHTD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              dropout_p=dropout_p, enable_gqa=kv_heads != num_heads)
    assert isinstance(out_BHTD, torch.Tensor)
    merged_BTC = out_BHTD.transpose(1, 2).reshape(b, t, -1)
    return protected_linear(merged_BTC, w_o, b_o, ctx=ctx, op="out", weight_layout=weight_layout)
