"""The projection checks: y = x Wᵀ + b (q/k/v/out, GPT-2's fused c_attn, any Linear/Conv1D) verified by checksums and
repaired in place, and in paper-faithful mode the input-derived checksums a q/k/v projection passes to the attention
of its layer (PassedProjection). Legend as in attention.py: N leading dims flattened, T tokens, I input features,
O output features, 2 a checksum pair."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..abft import (
    Tolerance,
    abs_max,
    acc_dtype,
    checksum_weights,
    direction_bounds,
    group_sums_cols,
    group_sums_rows,
    repair,
    square_times,
    times_skinny,
    weighted_cols,
)
from ..abft.tolerance import row_rule
from ..checks.context import LayerContext
from ..checks.passed import PassedProjection
from ..checks.product import Checks, _dot, _Exact, _exact_math, _groups, _tolerance, _verify, _walks
from ..checks.records import _any_bad, _count, _count_trips, _emit, _inject, _observe
from ..kernels.fused_pass import fused_pass
from ..kernels.row_verify import verify_rows
from ..matmul_precision import fp32_matmul_operand_roundoff
from ..tripwire import extreme, tripped
from . import device

__all__ = ["PassedProjection", "check_linear", "protected_linear"]


@dataclass(slots=True)
class _ProjectionInput:
    """What every column slice of one projection shares: X in the acc dtype, its token checksums and row norms.
    Token checksums are plain (one pair over all T tokens: the paper-faithful pass, whose reference the attention
    consumes ungrouped) and, made on first use, grouped (g_c runs of T/g_c tokens, abft/checksum.py) for the full
    check."""

    x_NTI: torch.Tensor
    x_acc_NTI: torch.Tensor
    xsum_made: torch.Tensor | None = None
    """(N, 2, I) wᵀX, made on first use (``xsum_N2I``): the token direction's, which an fp32 check by rows skips."""
    x_norm_made: torch.Tensor | None = None
    """(N, T) ‖X_t‖, made on first use (``x_norm_NT``), or by the first one-pass read of X."""
    xsum_grouped_N2gI: torch.Tensor | None = None
    """(N, 2·g_c, I): per token group h, rows 2h and 2h+1 are (1, 1..L)ᵀ X_h; None until a grouped check asks."""
    wsum_last: tuple[torch.Tensor, int, torch.Tensor] | None = None
    """(weight, g_r, Wᵀw per group (I, g_r, 2)) of the last slice asked: its row reference and its ref norm both
    need it, and it is a pass over W."""
    x_max_NT: torch.Tensor | None = None
    """max_i |X_ti| per token, for the calibrated bound's random-walk model; made on the first full check."""

    @classmethod
    def of(cls, x_NTI: torch.Tensor) -> _ProjectionInput:
        return cls(x_NTI, x_NTI.to(acc_dtype(x_NTI.dtype)))

    @property
    def xsum_N2I(self) -> torch.Tensor:  # noqa: N802  (the shape legend, as the field it replaced)
        """(N, 2, I): the plain token checksums wᵀX (one pass over X, the first time they are asked for)."""
        if self.xsum_made is None:
            self.xsum_made = weighted_cols(self.x_acc_NTI).mT
        return self.xsum_made

    @property
    def x_norm_NT(self) -> torch.Tensor:  # noqa: N802  (the shape legend, as the field it replaced)
        """(N, T): ‖X_t‖₂ per token."""
        if self.x_norm_made is None:
            self.x_norm_made = torch.linalg.vector_norm(self.x_acc_NTI, dim=-1)
        return self.x_norm_made

    def token_sums(self, groups: int) -> torch.Tensor:
        """(N, 2·g, I): the token checksums wᵀX per group of T/g tokens (g = 1: xsum_N2I). One pass over X, the first
        time a grouped check of this input asks (every slice of a projection has the same T, so the same g)."""
        if groups == 1:
            return self.xsum_N2I
        if self.xsum_grouped_N2gI is None or self.xsum_grouped_N2gI.shape[-2] != 2 * groups:
            self.xsum_grouped_N2gI = group_sums_cols(self.x_acc_NTI, groups).flatten(-2).mT
        return self.xsum_grouped_N2gI

    def token_ref(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None, groups: int = 1) -> torch.Tensor:
        """(N, O·g, 2): (wᵀX) Wᵀ + (Σw) b, the column-direction reference of Y = X Wᵀ + b, per group of g runs of
        tokens."""
        acc = self.x_acc_NTI.dtype
        ref_N2gO = self.token_sums(groups) @ weight_OI.to(acc).T
        if bias_O is not None:
            # Σw from the cached weights, on the device: a host-built tensor would be a host-to-device copy.
            wsum_21 = checksum_weights(self.x_NTI.shape[-2] // groups, ref_N2gO.device, acc).sum(0)[:, None]
            ref_N2gO = ref_N2gO + wsum_21.repeat(groups, 1) * bias_O.to(acc)
        # (N, g·2, O) -> (N, O, g, 2) -> (N, O·g, 2)
        return ref_N2gO.unflatten(-2, (groups, 2)).permute(0, 3, 1, 2).flatten(1, 2)

    def weight_sums(self, weight_OI: torch.Tensor, groups: int) -> torch.Tensor:
        """(I, g, 2): Wᵀw per group of O/g output features; made once for a slice's reference and ref norm."""
        last = self.wsum_last
        if last is None or last[0] is not weight_OI or last[1] != groups:
            last = self.wsum_last = (weight_OI, groups, group_sums_cols(weight_OI.to(self.x_acc_NTI.dtype), groups))
        return last[2]

    def feature_ref(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None, groups: int = 1) -> torch.Tensor:
        """(N, T·g, 2): X (Wᵀ w) + b·w, the row-direction reference, per group of g runs of output features."""
        acc = self.x_acc_NTI.dtype
        ww_Ig2 = self.weight_sums(weight_OI, groups)
        ref_NTg2 = times_skinny(self.x_acc_NTI, ww_Ig2.flatten(-2)).unflatten(-1, (groups, 2))
        if bias_O is not None:
            ref_NTg2 = ref_NTg2 + group_sums_rows(bias_O.to(acc)[None], groups)[0]
        return ref_NTg2.flatten(-3, -2)

    def ref_norms(
        self, weight_OI: torch.Tensor, groups: tuple[int, int] = (1, 1)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(‖Wᵀw‖ (2,), ‖wᵀX‖ (N, 2)): the vectors the row (column) references dot with, for the calibrated bound;
        per group ((g_r, 2), (N, g_c, 2)) for grouped checksums."""
        row = torch.linalg.vector_norm(self.weight_sums(weight_OI, groups[0]), dim=-3)
        col = torch.linalg.vector_norm(self.token_sums(groups[1]), dim=-1)
        if groups == (1, 1):
            return row[0], col
        return row, col.unflatten(-1, (-1, 2))

    def second_moments(self, weight_OI: torch.Tensor, groups: int) -> torch.Tensor:
        """(N, T·g, 4): per token and group of g runs of output features (w = 1 and 1..L, L = O/g), Σ_j w_j² Σ_i
        X_ti² W_ji² and Σ_i X_ti² (Wᵀw)_i², as (X∘X)·[β, (Wᵀw)∘(Wᵀw)] with β_i = Σ_j w_j² W_ji²: the random-walk
        model's product, reference and forming terms exactly (tolerance.bounds, moments_NR4), one skinny product of
        4g columns (the row reference's is 2g), squaring X a block of rows at a time (abft.square_times)."""
        acc = self.x_acc_NTI.dtype
        pos_L = torch.arange(1, weight_OI.shape[0] // groups + 1, device=weight_OI.device, dtype=acc)
        w2_2L = torch.stack([torch.ones_like(pos_L), pos_L.square()])
        # β per group, one L × I block of W at a time, squared into one reused buffer ((2, L) @ (L, I)): a 4096²
        # weight took 8 ms so, 60 ms squaring a fresh block each time (page faults) and 185 ms as an einsum over the
        # (g, L, I) view (one thread, measured).
        sq_LI = torch.empty(weight_OI.shape[0] // groups, weight_OI.shape[1], device=weight_OI.device, dtype=acc)
        beta_g2I = torch.empty(groups, 2, weight_OI.shape[1], device=weight_OI.device, dtype=acc)
        for h, blk in enumerate(weight_OI.chunk(groups)):
            sq_LI.copy_(blk).square_()  # in the acc dtype: a bf16 weight's squares are made in fp32
            torch.matmul(w2_2L, sq_LI, out=beta_g2I[h])
        cols_Ig4 = torch.cat([beta_g2I.permute(2, 0, 1), self.weight_sums(weight_OI, groups).square()], -1)
        return square_times(self.x_acc_NTI, cols_Ig4.flatten(-2)).unflatten(-1, (groups, 4)).flatten(-3, -2)

    def checks(
        self, y_NTO: torch.Tensor, weight_OI: torch.Tensor, bias_O: torch.Tensor | None, *, tol: Tolerance,
        cast_to: torch.dtype | None = None, directions: tuple[str, ...] = ("row", "col"),
    ) -> Checks:
        """The full check of one (slice of the) projection Y = X Wᵀ + b: both directions, or the rows alone
        (``directions``, ``fast_directions``), grouped where the tolerance groups (no sync)."""
        g_r, g_c = _groups(tol, weight_OI.shape[0]), _groups(tol, self.x_NTI.shape[-2])
        # The random-walk model for the rows (over the weight's output features) only: the columns run over tokens,
        # whose rows of X can be nearly collinear (outlier channels), so their errors need not be independent
        # (tolerance.bounds, `walk`).
        walk = _walks(tol)
        if walk and directions == ("row",) and cast_to is None:
            fused = self._rows_in_one_pass(y_NTO, weight_OI, bias_O, tol=tol, groups=(g_r, g_c))
            if fused is not None:
                return fused
        w_norm_O, bias_abs = self.weight_norms(weight_OI, bias_O)
        maxes: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        ref_maxes: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        moments = None
        if walk:
            if self.x_max_NT is None:
                self.x_max_NT = abs_max(self.x_acc_NTI, dim=-1)
            maxes = (self.x_max_NT, abs_max(weight_OI, dim=-1).to(self.x_acc_NTI.dtype))
            # ‖Wᵀw‖∞ over the input features, per group (g_r, 2); ungrouped (2,), as ref_norms.
            row_max = abs_max(self.weight_sums(weight_OI, g_r), dim=-3)
            ref_maxes = (row_max[0] if g_r == 1 else row_max, None)
            moments = self.second_moments(weight_OI, g_r)
        token_ref: torch.Tensor | None
        ref_norms: tuple[torch.Tensor | None, torch.Tensor | None]
        if directions == ("row",):
            # The token direction's reference and ref norm are what reads X by columns: not made.
            row_norm = torch.linalg.vector_norm(self.weight_sums(weight_OI, g_r), dim=-3)
            token_ref, ref_norms = None, (row_norm[0] if g_r == 1 else row_norm, None)
        else:
            token_ref, ref_norms = self.token_ref(weight_OI, bias_O, g_c), self.ref_norms(weight_OI, (g_r, g_c))
        return _verify(y_NTO, self.feature_ref(weight_OI, bias_O, g_r), token_ref,
                       self.x_norm_NT, w_norm_O, k=weight_OI.shape[1], tol=tol, bias_abs_C=bias_abs,
                       operands_cast_to=cast_to, ref_norms=ref_norms, groups=(g_r, g_c),
                       maxes=maxes, ref_maxes=ref_maxes, walk=(walk, False), moments_NR4=moments,
                       directions=directions)

    def _rows_in_one_pass(
        self, y_NTO: torch.Tensor, weight_OI: torch.Tensor, bias_O: torch.Tensor | None, *, tol: Tolerance,
        groups: tuple[int, int],
    ) -> Checks | None:
        """``checks`` by rows under the random-walk model, for fp32 on the CPU: every sum it takes from W, X and Y
        made in one read of each (fused_pass), or None where the kernel declines (the eager path then makes the
        same). W (O, I) per group of L = O/g output features: Wᵀw (I, g, 2), β = Σ_o w_o² W_oi² (I, g, 2), ‖W_o‖ and
        max_i |W_oi|; X: X·(Wᵀw), (X∘X)·[β, (Wᵀw)²], ‖X_t‖ and max_i |X_ti|; Y: the grouped row checksums and ΣY²."""
        g_r = groups[0]
        acc = torch.float32
        if not (self.x_acc_NTI.dtype == y_NTO.dtype == weight_OI.dtype == acc) or (
                bias_O is not None and bias_O.dtype != acc):
            return None
        n_out, n_in = weight_OI.shape
        run = n_out // g_r
        w_L2 = checksum_weights(run, weight_OI.device, acc)
        if weight_OI.mT.stride(-1) == 1:
            # A Conv1D weight (I, O), or a column slice of one: rows over the input features, runs of L outputs.
            w_sums = fused_pass(weight_OI.mT, right=w_L2, right_sq=w_L2.square(), col_sq=True, col_max=True,
                                groups=g_r)
            if w_sums is None or w_sums.right is None or w_sums.right_sq is None:
                return None
            ww_Ig2, beta_Ig2 = w_sums.right.view(n_in, g_r, 2), w_sums.right_sq.view(n_in, g_r, 2)
            w_sq_O, w_max_O = w_sums.col_sq, w_sums.col_max
        else:
            # An nn.Linear weight (O, I): each group of L rows a batch, summed from the left.
            try:
                w_gLI = weight_OI.view(g_r, run, n_in)
            except RuntimeError:
                return None
            w_sums = fused_pass(w_gLI, left=w_L2, left_sq=w_L2.square(), row_sq=True, row_max=True)
            if w_sums is None or w_sums.left is None or w_sums.left_sq is None or w_sums.row_sq is None:
                return None
            ww_Ig2, beta_Ig2 = w_sums.left.transpose(0, 1), w_sums.left_sq.transpose(0, 1)
            w_sq_O, w_max_O = w_sums.row_sq.flatten(), None if w_sums.row_max is None else w_sums.row_max.flatten()
        if w_sq_O is None or w_max_O is None:
            return None
        cols_Ig4 = torch.cat([beta_Ig2, ww_Ig2.square()], -1)
        if g_r <= _KERNEL_X_GROUPS:
            first = self.x_norm_made is None or self.x_max_NT is None
            x_sums = fused_pass(self.x_acc_NTI, right=ww_Ig2.flatten(-2), right_sq=cols_Ig4.flatten(-2),
                                row_sq=first, row_max=first)
            if x_sums is None or x_sums.right is None or x_sums.right_sq is None:
                return None
            if first:
                if x_sums.row_sq is None or x_sums.row_max is None:
                    return None
                self.x_norm_made, self.x_max_NT = x_sums.row_sq.sqrt(), x_sums.row_max
            xw_NTc, moments_NTc = x_sums.right, x_sums.right_sq
        else:
            # 6·g columns of products: BLAS (times_skinny, square_times) beats the kernel's dot per column.
            xw_NTc = times_skinny(self.x_acc_NTI, ww_Ig2.flatten(-2))
            moments_NTc = square_times(self.x_acc_NTI, cols_Ig4.flatten(-2))
            if self.x_max_NT is None:
                self.x_max_NT = abs_max(self.x_acc_NTI, dim=-1)
        y_sums = fused_pass(y_NTO, right=w_L2, row_sq=True, groups=g_r)
        if y_sums is None or y_sums.right is None:
            return None
        ref_NTg2 = xw_NTc.unflatten(-1, (g_r, 2))
        if bias_O is not None:
            ref_NTg2 = ref_NTg2 + group_sums_rows(bias_O[None], g_r)[0]
        ref_norm, ref_max = torch.linalg.vector_norm(ww_Ig2, dim=-3), abs_max(ww_Ig2, dim=-3)
        ref_NV2, moments_NV4 = ref_NTg2.flatten(-3, -2), moments_NTc.unflatten(-1, (g_r, 4)).flatten(-3, -2)
        if y_sums.row_sq is not None and fp32_matmul_operand_roundoff(y_NTO.device) is None:
            # The verdict in one native call (row_verify.py); the eager rule below where it declines.
            rule = row_rule(w_sq_O.sqrt().view(g_r, run), k=n_in, tol=tol,
                            bias_abs_gn=None if bias_O is None else bias_O.abs().view(g_r, run),
                            ref_norm_g2=ref_norm, b_max_gn=w_max_O.view(g_r, run), ref_max_g2=ref_max, walk=True)
            native = None if rule is None else verify_rows(rule, ref_NV2, y_sums.right, y_sums.row_sq,
                                                           self.x_norm_NT, a_max_NR=self.x_max_NT,
                                                           moments_NV4=moments_NV4)
            if native is not None:
                return {"row": native}
        return _verify(y_NTO, ref_NV2, None, self.x_norm_NT, w_sq_O.sqrt(), k=n_in, tol=tol,
                       bias_abs_C=None if bias_O is None else bias_O.abs(),
                       ref_norms=(ref_norm[0] if g_r == 1 else ref_norm, None), groups=groups,
                       maxes=(self.x_max_NT, w_max_O), ref_maxes=(ref_max[0] if g_r == 1 else ref_max, None),
                       walk=(True, False), moments_NR4=moments_NV4, directions=("row",),
                       row_sums=(y_sums.right, y_sums.row_sq))

    def weight_norms(
        self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(‖W_o‖₂ per output feature, |b|): the column norms of B = Wᵀ for the round-off bound."""
        acc = self.x_acc_NTI.dtype
        # Square-sum-root: for an HF Conv1D weight (in, out) each W_o is a strided column, and vector_norm along it is
        # ~10x slower (the bound has 1% slack; the two differ in the last bits).
        w_norm_O = weight_OI.to(acc).square().sum(-1).sqrt()
        return w_norm_O, None if bias_O is None else bias_O.to(acc).abs()


_KERNEL_X_GROUPS = 2
"""Most output groups for which the projection check reads X through the kernel: it takes 6·g columns of products
per row (2 for Xw, 4 for the moments), one dot product each, where BLAS runs them as one GEMM. At 7B shapes (g = 16,
96 columns) the check took 199 ms through the kernel against 154 ms eagerly; at GPT-2's (g ≤ 2) the kernel is
faster (one thread, measured)."""


def fast_directions(tol: Tolerance, out_dtype: torch.dtype) -> tuple[str, ...]:
    """What a clean projection check verifies: for an fp32 output under the calibrated bound, the rows alone. Their
    random-walk model (over the weight's output features, docs/abft.md) makes them the tighter threshold, and the
    columns (over tokens) add at most 0.2 points to the small bit-flip rates and nothing from 2 × RMS up (GPT-2
    shapes, fp32 and TF32), while costing a column pass over Y and X. Both directions for a bf16/fp16 output, where
    output rounding dominates both bounds and the columns do add detection (bf16 errors of 0.5 × RMS in q: 94 %
    caught with both, 77 % with the rows alone; docs/fault-coverage.md), and without the calibrated bound."""
    return ("row",) if _walks(tol) and out_dtype == torch.float32 else ("row", "col")


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


_Wired = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A slice of a projection's output given tier 1: (op, y slice (..., T, S), its weight rows (S, I), its bias (S,) or
None)."""


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
    found; not at all where the GEMM checks' Triton path runs (CUDA), which takes the full checks and tier 1
    (``_on_device``) and reports at the step boundary. In
    paper-faithful mode (config.source_repair False) q/k/v are not verified here: their input-derived checksums go to
    ``ctx.passed`` for protected_sdpa.
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
    # Detached once, then sliced: a slice of a parameter that requires grad is an autograd view (about 2 µs a slice
    # more from Python, three slices a fused projection, every call).
    weight_OI = weight.detach() if weight_layout == "out_in" else weight.detach().T
    bias_O = bias.detach() if bias is not None else None
    whole = len(splits) == 1
    tol = _tolerance(ctx)
    # Under autocast the module's fp32 input and weight were rounded to the output's dtype for the GEMM.
    cast_to = y.dtype if x.dtype != y.dtype or weight.dtype != y.dtype else None
    shared: _ProjectionInput | None = None
    # A clean check verifies the rows only where their threshold is the tight one (`fast_directions`); both
    # directions, which locate a column or a block, are made after a flag. Each pending check keeps a way to make them.
    pending: list[tuple[str, torch.Tensor, Checks, Callable[[], Checks], Callable[[], torch.Tensor], _Exact, float,
                        str]] = []
    # Tier 1: (name, y_s, w_s, b_s) of the slices only the tripwire looks at on this step.
    wired: list[_Wired] = []
    # The slices due a full check on this step, in the same form.
    due: list[_Wired] = []

    def full_checks(y_s: torch.Tensor, w_s: torch.Tensor, b_s: torch.Tensor | None,
                    directions: tuple[str, ...] = ("row", "col")) -> Checks:
        nonlocal shared
        shared = shared or _ProjectionInput.of(x_NTI.detach())
        return shared.checks(y_s.detach(), w_s, b_s, tol=tol, cast_to=cast_to, directions=directions)

    offset = 0
    for name, size in splits:
        y_s = y_NTO if whole else y_NTO[..., offset : offset + size]
        w_s = weight_OI if whole else weight_OI[offset : offset + size]
        b_s = bias_O if whole or bias_O is None else bias_O[offset : offset + size]
        offset += size
        _inject(ctx, name, y_s)
        if cfg.trips(name):
            wired.append((name, y_s, w_s, b_s))
        paper_pass = name in ("q", "k", "v") and not cfg.source_repair
        if cfg.mode == "off" or not (cfg.checks(name) or paper_pass):
            continue
        if paper_pass:
            with _exact_math(y):
                shared = shared or _ProjectionInput.of(x_NTI.detach())
                # Paper mode keeps the operand-only bound: the output it would be measured on is unverified.
                w_norm_O, bias_abs = shared.weight_norms(w_s, b_s)
                token_rule = direction_bounds(("col",), shared.x_norm_NT, w_norm_O, k=w_s.shape[1],
                                              out_dtype=y.dtype, tol=tol, bias_abs_C=bias_abs,
                                              operands_cast_to=cast_to)["col"]
                token_bound = token_rule.of(None).expand(y_s.shape[0], -1)
                ctx.passed.put(name, PassedProjection(token_ref_NO2=shared.token_ref(w_s, b_s),
                                                      token_bound_NO=token_bound,
                                                      x_NTI=x_NTI.detach(), weight_OI=w_s, bias_O=b_s,
                                                      x_norm_NT=shared.x_norm_NT, out_dtype=y.dtype, tol=tol))
                continue
        due.append((name, y_s, w_s, b_s))
    if due:
        due = _on_device(ctx, x_NTI, due, full=True)
    for name, y_s, w_s, b_s in due:
        t0 = time.perf_counter()
        with _exact_math(y):
            checks = full_checks(y_s, w_s, b_s, fast_directions(tol, y.dtype))
            _observe(ctx, checks, name)
        recompute = functools.partial(_recompute_linear, ctx, name, x_NTI.detach(), w_s, b_s)
        exact = functools.partial(_exact_linear, x_NTI.detach(), w_s, b_s)
        both = functools.partial(full_checks, y_s, w_s, b_s)
        pending.append((name, y_s, checks, both, recompute, exact, time.perf_counter() - t0, "abft"))
    if wired:
        # All slices given tier 1 (the usual tier-1 step): one pass over y, as the host's sum below.
        wired = _on_device(ctx, x_NTI, wired, full=False,
                           whole=(y_NTO, weight_OI, bias_O) if len(wired) == len(splits) > 1 else None)
    flags = [_any_bad(item[2]) for item in pending]
    if not flags and not wired:
        return y
    t0 = time.perf_counter()
    # All slices wired (the usual tier-1 step): one sum over y, not one per strided column slice.
    outputs = () if not wired else (y,) if len(wired) == len(splits) else tuple(item[1] for item in wired)
    # sync: the one per protected projection call (none on CPU); decides the slow path
    slow = tripped(flags, *outputs)
    trip_s = time.perf_counter() - t0 if wired else 0.0
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
            both = functools.partial(full_checks, y_s, w_s, b_s)
            pending.append((name, y_s, checks, both, recompute, exact, 0.0, "tripwire"))
        trip_s += time.perf_counter() - t0
    if wired:
        _count_trips(ctx, [item[0] for item in wired], trip_s)
    for name, y_s, checks, make_both, redo, refresh, seconds, tier in pending:
        t0 = time.perf_counter()
        if slow and (len(checks) == 2 or bool(_any_bad(checks))):  # sync: slow path only, whether this slice flagged
            with _exact_math(y):
                reports = repair(y_s, make_both() if len(checks) == 1 else checks, tol, correct=cfg.mode == "correct",
                                 recompute=redo, exact=refresh)
            _emit(ctx, name, reports, heads=False, tier=tier)
        if tier == "abft":
            _count(ctx, name, seconds + time.perf_counter() - t0)
        else:
            _count_trips(ctx, [], time.perf_counter() - t0)
    return y


def _on_device(ctx: LayerContext, x_NTI: torch.Tensor, slices: list[_Wired], *, full: bool,
               whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> list[_Wired]:
    """These slices' full check (``full``) or tier 1 on the GEMM checks' Triton path (gemm/device.py), where it runs
    (CUDA), as every other Linear's there. No sync, where the host's checks wait for the device once per call; what
    flagged or tripped is reported at the step boundary.

    Full: per slice one read of its weight rows and one of x for its row references and norms (in bf16 and fp16 one
    read of x for the slices of a fused projection together: device._row_sides), its check pass, and its repair
    kernel, which corrects a located element or recomputes a flagged row: a constant number of launches a slice,
    where the host's check is a few hundred PyTorch ops a slice (each a launch on CUDA). By rows (in runs past 512
    columns: device.runs) under verify_gemm's row rule, as the whole-step GEMMs there: the host's check adds the
    random-walk model (fp32) and the columns (bf16/fp16), and catches more small finite errors
    (docs/fault-coverage.md has both paths' rates; ATTNCHECKER_GEMM=torch keeps the host's check on a GPU). Tier 1:
    the tier-1 pass marks the rows holding an extreme element and recomputes them; ``whole`` (y (..., T, O), W (O, I),
    b (O,) or None), where ``slices`` are all of y's columns in order: one tier-1 pass over y (device.trip_columns),
    each tripped row reported under the slice of its first extreme element.

    Returns the slices left for the host: all of them where that path does not take them or a slice is not a (tokens,
    features) view of the output (the repair writes through it), none once done, and those it had not passed over
    where one of its kernels failed."""
    if whole is not None and not full:
        y_NTO, w_OI, b_O = whole
        gemms = _device_gemms(x_NTI, [(slices[0][0], y_NTO, w_OI, b_O)])
        if gemms is None:
            return slices
        (_, y_MO, x_MI, w_IO, b_O), = gemms
        try:
            device.trip_columns(ctx, tuple((name, y_s.shape[-1]) for name, y_s, _, _ in slices), y_MO, x_MI, w_IO,
                                b_O, tokens=y_NTO.shape[-2])
        except device.KernelFailed:
            return slices  # one launch: nothing of the call was checked
        return []
    gemms = _device_gemms(x_NTI, slices)
    if gemms is None:
        return slices
    try:
        if full:
            device.check_gemms(ctx, gemms, tokens=x_NTI.shape[-2])
        else:
            device.trip_gemms(ctx, gemms, tokens=x_NTI.shape[-2])
    except device.KernelFailed as exc:
        return slices[exc.done:]
    return []


def _device_gemms(x_NTI: torch.Tensor, slices: list[_Wired]
                  ) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] | None:
    """The slices as gemm/device.py's products (op, y (M, S), x (M, I), W_sᵀ (I, S), b_s), or None where that path
    does not take them (asked first: on the CPU path, every CPU call by default, nothing else here runs) or a slice is
    not a (tokens, features) view of the output, which its repair must write through."""
    if not device.takes(x_NTI, *(t for _, y_s, w_s, b_s in slices for t in (y_s, w_s, b_s) if t is not None)):
        return None
    x_MI = x_NTI.detach().reshape(-1, x_NTI.shape[-1])
    gemms = []
    for name, y_s, w_s, b_s in slices:
        try:
            y_MS = y_s.view(-1, y_s.shape[-1])
        except RuntimeError:
            return None
        gemms.append((name, y_MS, x_MI, w_s.T, b_s))
    return gemms


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
