"""Fault coverage of the checksum tolerance: detection rate of single finite errors vs magnitude (in RMS elements of
the product) and of single bit flips vs bit, per op, shape and dtype; clean residuals as a fraction of the threshold;
false positives over many clean checks. docs/fault-coverage.md shows the figures.

How it stays cheap (a 4096³ fp32 GEMM takes seconds here): every clean product is computed once; each trial pass
copies the output, injects one error into each of P distinct rows and columns (so every row and column vector holds
at most one error: P independent single-error trials) and runs the engine's own verification (attention._verify via
its projection/scores/context entry points) on the copy, an O(n²) pass. A trial is detected when its row or its
column is flagged, as the engine's slow path would be entered.

Products: fp32 and tf32 (operands rounded to 10 mantissa bits, attnchecker.emulate, the engine told TF32 is in
force) run as fp32 GEMMs; bf16 and fp16 operands are multiplied in fp32 and rounded to the dtype, as a GPU GEMM with
fp32 accumulation does (CPU half GEMMs are slow).

    python bench/coverage.py [--tiny] [--shapes tiny,gpt2,7b] [--dtypes fp32,tf32,bf16,fp16] [--trials 1024]
                             [--clean-checks 100000] [--path unfused|tiled|kernel|triton]
                             [--out bench/results/coverage.json]

--path tiled checks scores and context as the tiled attention path does (TiledOp): tile by tile, through the
engine's per-tile checks. --path kernel (fp32) runs them through the native attention pass (KernelOp): the errors are
written inside the kernel, and its rows' verdict is read. --path triton checks the projections q and out as a GPU
does, through the GEMM checks' Triton path (TritonOp), its kernels run by Triton's interpreter (TRITON_INTERPRET=1
in the command's environment).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()
import torch
import torch.nn.functional as F

from attnchecker.abft import Tolerance, vector_of
from attnchecker.abft.tiled import augment_v, causal_offset, fold_scores, v_row_checksums
from attnchecker.attention.backends.native_rules import kernel_checks, kernel_rules
from attnchecker.attention.backends.tiled_torch import (
    KERNEL_BLOCK_Q,
    context_tile_checks,
    default_tiles,
    scores_tile_checks,
)
from attnchecker.attention.pipeline import (
    _ProjectionInput,
    context_checks,
    scores_checks,
)
from attnchecker.checks.product import _groups
from attnchecker.emulate import emulate_fp32_matmul, round_mantissa
from attnchecker.gemm.projection import fast_directions
from attnchecker.kernels import fused_attention

# name -> (tokens T, model width, heads checked in scores/context, head dim D, heads in the clean-check batches)
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"t": 16, "d_model": 32, "heads": 4, "d_head": 8},
    "gpt2": {"t": 1024, "d_model": 768, "heads": 2, "d_head": 64},
    "7b": {"t": 4096, "d_model": 4096, "heads": 1, "d_head": 128},
}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROJECTION_DIRECTIONS = "engine"
"""What a projection's check verifies: "engine" (projection.fast_directions), "both" or "rows"
(--projection-directions)."""
MAGNITUDES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 100.0, 1000.0)
BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}
# (exponent bits, mantissa bits) per dtype: bit i < mantissa is mantissa, then exponent, then the sign.
LAYOUT = {torch.float32: (8, 23), torch.bfloat16: (8, 7), torch.float16: (5, 10)}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def activations(shape: tuple[int, ...], gen: torch.Generator, *, outliers: float = 30.0) -> torch.Tensor:
    """LLM-like hidden states: a few feature channels `outliers` × larger, a shared offset, token scales over a
    decade (the same recipe as tests/agent/test_tolerance_calibrated.py)."""
    x = torch.randn(shape, generator=gen)
    channels = torch.randperm(shape[-1], generator=gen)[: max(1, shape[-1] // 64)]
    x[..., channels] *= outliers
    x = x + 0.5 * torch.randn(shape[-1], generator=gen)
    return x * 10 ** (torch.rand(*shape[:-1], 1, generator=gen) - 0.5)


def product(a: torch.Tensor, b: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """a @ b as the dtype's GEMM computes it (see module docstring)."""
    if dtype_name == "tf32":
        return round_mantissa(a, 10) @ round_mantissa(b, 10)
    if a.dtype == torch.float32:
        return a @ b
    return (a.float() @ b.float()).to(a.dtype)


class Op:
    """One op's clean operands and product, and how the engine verifies a (corrupted) copy of the product."""

    def __init__(self, name: str, shape: dict[str, int], dtype_name: str, seed: int) -> None:
        dtype = DTYPES[dtype_name]
        gen = torch.Generator().manual_seed(seed)
        t, dm, h, d = shape["t"], shape["d_model"], shape["heads"], shape["d_head"]
        self.name, self.dtype_name = name, dtype_name
        if name in ("q", "out"):
            # q: the residual stream with outlier features; out: the merged attention context (no outliers).
            x = activations((1, t, dm), gen, outliers=30.0 if name == "q" else 1.0).to(dtype)
            w = (torch.randn(dm, dm, generator=gen) / math.sqrt(dm)).to(dtype)
            self.x, self.w = x, w
            self.c = product(x, w.T, dtype_name)
        else:
            x = activations((1, t, dm), gen).to(torch.float32)
            wq = torch.randn(h * d, dm, generator=gen) / math.sqrt(dm)
            wk = torch.randn(h * d, dm, generator=gen) / math.sqrt(dm)
            q = (x @ wq.T).view(1, t, h, d).transpose(1, 2).contiguous().to(dtype)
            k = ((x @ wk.T).view(1, t, h, d).transpose(1, 2) + 2.0).contiguous().to(dtype)  # a shared key direction
            scores = product(q, k.mT, dtype_name)
            self.q, self.k, self.h, self.scores = q, k, h, scores
            if name == "scores":
                self.c = scores
            else:
                causal = torch.ones(t, t, dtype=torch.bool).triu(1)
                probs = torch.softmax((scores.float() / math.sqrt(d)).masked_fill(causal, -math.inf), -1).to(dtype)
                v = activations((1, h, t, d), gen, outliers=1.0).to(dtype)
                self.probs, self.v = probs, v
                self.c = product(probs, v, dtype_name)
        self.rms = float(self.c.float().square().mean().sqrt())
        self.row_scale: torch.Tensor | None = None
        """(R,) per row of the first matrix: an error of m·RMS at row r is m·RMS·row_scale[r] in c (None: 1)."""

    def checks(self, c: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
        """The engine's verification of (a corrupted copy of) the product: {"row", "col"} DirectionChecks."""
        with emulate_fp32_matmul("tf32") if self.dtype_name == "tf32" else contextlib.nullcontext(), torch.no_grad():
            if self.name in ("q", "out"):
                # What the engine verifies on a clean step (projection.fast_directions: an fp32 output's rows alone
                # under the calibrated bound), or both directions (--projection-directions both).
                directions = {"engine": fast_directions(tol, c.dtype), "rows": ("row",)}.get(PROJECTION_DIRECTIONS,
                                                                                               ("row", "col"))
                return _ProjectionInput.of(self.x).checks(c, self.w, None, tol=tol, directions=directions)
            if self.name == "scores":
                return scores_checks(self.q, self.k, c, {}, self.h, tol)
            return context_checks(self.probs, self.v, c, None, self.h, tol)

    def check_seconds(self, tols: dict[str, Tolerance], reps: int = 3) -> dict[str, float]:
        """Median seconds of one verification of the clean product per tolerance, interleaved (a loaded machine
        slows every variant alike)."""
        times: dict[str, list[float]] = {name: [] for name in tols}
        for _ in range(reps):
            for name, tol in tols.items():
                t0 = time.perf_counter()
                self.checks(self.c, tol)
                times[name].append(time.perf_counter() - t0)
        return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}

    def verify(self, c: torch.Tensor, tol: Tolerance, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(P,) whether the row or the column vector holding element (rows[p], cols[p]) of the first matrix of c is
        flagged (with grouped checksums: the row's and the column's group)."""
        checks = self.checks(c, tol)
        first = (0,) * (c.dim() - 2)
        r, n = c.shape[-2:]
        row = checks["row"]
        flagged = row.bad[first][vector_of("row", row.groups, n, rows, cols)]
        if "col" in checks:
            col = checks["col"]
            flagged = flagged | col.bad[first][vector_of("col", col.groups, r, rows, cols)]
        return flagged

    def clean_ratios(self, tol: Tolerance) -> dict[str, float]:
        """Worst clean |d1|/bound and |d2|/bound2 over both directions of the clean product."""
        checks = self.checks(self.c, tol)
        d1 = max(float((chk.diff[..., 0].abs() / chk.bound).max()) for chk in checks.values())
        d2 = max(float((chk.diff[..., 1].abs() / chk.bound2).max()) for chk in checks.values())
        bound = min(float(chk.bound.median()) for chk in checks.values())
        return {"worst_d1_over_bound": d1, "worst_d2_over_bound": d2, "median_bound_over_rms": bound / self.rms,
                "flagged_vectors": int(sum(int(chk.bad.sum()) for chk in checks.values()))}


class TiledOp(Op):
    """scores or context checked as the tiled attention path checks them (--path tiled): one tile per default query
    block (256 rows) over all its keys, each tile through attention.backends.tiled_torch.scores_tile_checks /
    context_tile_checks, the engine's own per-tile checks. Scores: no mask, so every 256 × S tile spans whole rows (as
    the unfused campaign's scores). Context: causal, so block i's tile is P̃_i (256 × its key prefix, unnormalised: the
    online softmax's exp(z - max)) times V; c is those tiles' P̃V, and an error of m·RMS of the normalised CL in row t
    is m·RMS·ΣP̃_t in the tile (the same error in the layer's output once the tiled path divides by ΣP̃). The per-tile
    checks are stitched into one (R·g, 2) / (C·n_blocks, 2) layout, so a 256-row tile column is column group i."""

    def __init__(self, name: str, shape: dict[str, int], dtype_name: str, seed: int) -> None:
        if name not in ("scores", "context"):
            raise ValueError(f"--path tiled covers scores and context, not {name!r}")
        super().__init__(name, shape, dtype_name, seed)
        t = self.c.shape[-2]
        self.block_q = min(t, default_tiles(t, self.h).block_q)
        if t % self.block_q:
            raise ValueError(f"T = {t} is not a multiple of the {self.block_q}-row query block")
        self.q_acc, self.k_acc = self.q.float(), self.k.float()
        if name == "context":
            d = self.q.shape[-1]
            self.v_acc = self.v.float()
            tiles, sums, pvs = [], [], []
            for r0 in range(0, t, self.block_q):
                r1 = r0 + self.block_q
                m0 = torch.full((*self.scores.shape[:-2], self.block_q), -math.inf)
                p, _, _, l_, _ = fold_scores(self.scores[..., r0:r1, :r1].clone(), m0, torch.zeros_like(m0),
                                             scale=1 / math.sqrt(d), blocked=None, additive=None,
                                             causal_offset=causal_offset(r0, 0, r1, is_causal=True))
                p_c = p.to(self.v.dtype)
                tiles.append(p_c)
                sums.append(l_)
                pvs.append(product(p_c, self.v[..., :r1, :], dtype_name))
            self.p_tiles, self.p_sums = tiles, sums
            self.c = torch.cat(pvs, -2)
            self.row_scale = torch.cat(sums, -1)[(0,) * (self.c.dim() - 2)]

    def checks(self, c: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
        with emulate_fp32_matmul("tf32") if self.dtype_name == "tf32" else contextlib.nullcontext(), torch.no_grad():
            per_tile = []
            t = c.shape[-2]
            if self.name == "context":
                g_v = _groups(tol, c.shape[-1])
                vw = v_row_checksums(self.v_acc, g_v)
            for i, r0 in enumerate(range(0, t, self.block_q)):
                r1 = r0 + self.block_q
                if self.name == "scores":
                    q_i = self.q_acc[..., r0:r1, :]
                    per_tile.append(scores_tile_checks(c[..., r0:r1, :], q_i, self.k_acc, q_i.norm(dim=-1),
                                                       self.k_acc.norm(dim=-1), tol=tol))
                else:
                    per_tile.append(context_tile_checks(c[..., r0:r1, :], self.p_tiles[i], self.v_acc[..., :r1, :],
                                                        vw[..., :r1, :], self.p_sums[i], None, tol=tol, g_v=g_v))
        return {"row": _stitch(per_tile, "row"), "col": _stitch(per_tile, "col")}


class KernelOp(Op):
    """scores or context through the native attention pass (--path kernel; fp32, the kernel's only dtype). The
    product is the kernel's own; a corrupted copy c is handed to it as emulated faults (every element where c differs
    from the clean product, written into the kernel's scores or context right after the GEMM that made them:
    fused_attention.emulated_faults), and the verdict is the kernel's rows, read through kernel_checks (its sums and
    references; the kernel's own count of flagged rows is asserted equal on every call). Scores: no mask, whole rows,
    as the unfused campaign's. Context: causal; c is the kernel's unnormalised P̃V (its output times ΣP̃, a value an ulp
    or so from the kernel's own: flips of the lowest mantissa bits are within that), so an error of m·RMS of the
    normalised output in row t is m·RMS·ΣP̃_t there, as in TiledOp. The rows alone: the kernel verifies no columns."""

    def __init__(self, name: str, shape: dict[str, int], dtype_name: str, seed: int) -> None:
        if name not in ("scores", "context") or dtype_name != "fp32":
            raise ValueError(f"--path kernel covers fp32 scores and context, not {dtype_name} {name}")
        if not fused_attention.available():
            raise ValueError("--path kernel: the native attention pass is not available here (no C compiler or no "
                             "BLAS sgemm_)")
        super().__init__(name, shape, dtype_name, seed)
        self.causal = name == "context"
        self.q3, self.k3 = self.q[0].contiguous(), self.k[0].contiguous()
        if name == "scores":
            gen = torch.Generator().manual_seed(seed + 7)
            self.v3 = activations(self.k3.shape, gen, outliers=1.0)
        else:
            self.v3 = self.v[0].contiguous()
            got = self._run([], Tolerance())[0]
            self.c = (got.out_NTD * got.p_sum_NT[..., None])[None]
            self.rms = float((got.out_NTD.square().mean()).sqrt())
            self.row_scale = got.p_sum_NT[0]

    def _run(self, faults: list[fused_attention.Fault], tol: Tolerance) -> tuple[Any, dict[str, Any]]:
        groups = _groups(tol, self.k3.shape[-2])
        vw = v_row_checksums(self.v3)
        rules = kernel_rules(self.q3, self.k3, self.v3, vw, tol=tol, groups=groups)
        with fused_attention.emulated_faults(faults):
            got = fused_attention.run(self.q3, self.k3, augment_v(self.v3, vw), rules,
                                      scale=1 / math.sqrt(self.q3.shape[-1]), is_causal=self.causal,
                                      block_q=KERNEL_BLOCK_Q, faults=fused_attention.take_faults())
        if got is None:
            raise RuntimeError("the native attention pass declined the call")
        return got, kernel_checks(self.k3, self.v3, vw, got, rules, tol=tol)

    def checks(self, c: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
        where = (c != self.c).nonzero().tolist()
        faults = [(self.name, h, r, col, float(c[0, h, r, col])) for _, h, r, col in where]
        got, checks = self._run(faults, tol)
        row = checks[self.name]["row"]
        n = self.q3.shape[0]
        flagged = got.flagged_N2[:, fused_attention.OPS.index(self.name)]
        if flagged.tolist() != row.bad.view(n, -1).sum(-1).tolist():
            raise RuntimeError("the kernel's verdict and kernel_checks' differ")
        return {"row": _Stitched(row.bad[None], row.diff[None], row.bound[None], row.bound2[None], row.groups)}


class TritonOp(Op):
    """q or out checked as the GEMM checks' Triton path checks a projection on a GPU (--path triton; the kernels
    under Triton's interpreter here, TRITON_INTERPRET=1): gemm/device.py's operand passes and check pass, by rows, with
    verify_gemm's row rule (abft/gemm_rule.py), the repair kernel told not to correct. A fault's verdict is its row's
    outcome code; the clean ratio is the check's worst (both weightings: the kernel keeps one worst)."""

    def __init__(self, name: str, shape: dict[str, int], dtype_name: str, seed: int) -> None:
        from attnchecker.kernels import triton_gemm_check as tg

        if name not in ("q", "out"):
            raise ValueError(f"--path triton covers the projections q and out, not {name!r}")
        if dtype_name == "tf32":
            raise ValueError("--path triton: TF32 is not emulated under Triton's interpreter")
        if not (tg.available() and tg.interpreted()):
            raise ValueError("--path triton needs triton installed and TRITON_INTERPRET=1 before it is imported")
        super().__init__(name, shape, dtype_name, seed)

    def _check(self, c: torch.Tensor, tol: Tolerance) -> Any:
        from attnchecker.gemm import device

        with torch.no_grad():
            return device.check_product(c[0].clone(), self.x[0], self.w.T, None, tol, correct=False)

    def checks(self, c: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
        return {"row": self._check(c, tol)}

    def verify(self, c: torch.Tensor, tol: Tolerance, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self._check(c, tol).code.reshape(-1)[rows] != 0

    def clean_ratios(self, tol: Tolerance) -> dict[str, float]:
        from attnchecker.kernels import triton_gemm_check as tg

        chk = self._check(self.c, tol)
        worst = tg.STATE["worst"]
        ratio = float(chk.state[worst : worst + 1].view(torch.float32))
        return {"worst_d1_over_bound": ratio, "worst_d2_over_bound": ratio, "median_bound_over_rms": float("nan"),
                "flagged_vectors": int((chk.code != 0).sum())}


@dataclasses.dataclass
class _Stitched:
    """The fields of a DirectionCheck the campaign reads, over all tiles of a matrix."""

    bad: torch.Tensor
    diff: torch.Tensor
    bound: torch.Tensor
    bound2: torch.Tensor
    groups: int


def _stitch(per_tile: list[dict[str, Any]], direction: str) -> _Stitched:
    """Rows: the tiles' row vectors in order (each tile spans whole rows, same groups). Columns: tile i's column j
    becomes vector j·n + i, the grouped layout with n groups of one tile height each."""
    chks = [tile[direction] for tile in per_tile]
    if direction == "row":
        assert len({c.groups for c in chks}) == 1
        return _Stitched(torch.cat([c.bad for c in chks], -1), torch.cat([c.diff for c in chks], -2),
                         torch.cat([c.bound for c in chks], -1), torch.cat([c.bound2 for c in chks], -1),
                         chks[0].groups)
    assert all(c.groups == 1 for c in chks), "a tile column of >= 512 rows is grouped itself: not stitched here"
    return _Stitched(torch.stack([c.bad for c in chks], -1).flatten(-2),
                     torch.stack([c.diff for c in chks], -2).flatten(-3, -2),
                     torch.stack([c.bound for c in chks], -1).flatten(-2),
                     torch.stack([c.bound2 for c in chks], -1).flatten(-2), len(chks))


def positions(op: Op, trials: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = op.c.shape[-2:]
    gen = torch.Generator().manual_seed(seed)
    n = min(trials, r, c)
    return torch.randperm(r, generator=gen)[:n], torch.randperm(c, generator=gen)[:n]


def detected(op: Op, bad: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    return op.verify(bad, tol, rows, cols)


def magnitude_sweep(op: Op, trials: int, seed: int, tol: Tolerance) -> dict[str, float]:
    out = {}
    for m in MAGNITUDES:
        rows, cols = positions(op, trials, seed)
        sign = torch.randint(0, 2, rows.shape, generator=torch.Generator().manual_seed(seed + 1)) * 2 - 1
        bad = op.c.clone()
        first = (0,) * (bad.dim() - 2)
        orig = bad[first][rows, cols].float()
        size = m * op.rms if op.row_scale is None else m * op.rms * op.row_scale[rows]
        bad[(*first, rows, cols)] = (orig + sign * size).to(bad.dtype)
        changed = bad[first][rows, cols] != op.c[first][rows, cols]  # a half-precision value may round back
        hit = detected(op, bad, rows, cols, tol)
        out[str(m)] = float(hit[changed].float().mean()) if bool(changed.any()) else float("nan")
    return out


def bit_sweep(op: Op, trials: int, seed: int, tol: Tolerance) -> dict[str, dict[str, float]]:
    """Per bit: detection rate over all flips, and over flips that moved the value by >= 2x RMS (or to INF/NaN)."""
    dtype = op.c.dtype
    out = {}
    for bit in range(BITS[dtype]):
        rows, cols = positions(op, trials, seed + bit)
        bad = op.c.clone()
        first = (0,) * (bad.dim() - 2)
        ints = bad.view(INT_VIEW[dtype])
        mask = torch.tensor(1 << bit if bit < BITS[dtype] - 1 else -(1 << bit), dtype=INT_VIEW[dtype])
        ints[(*first, rows, cols)] ^= mask
        new = bad[first][rows, cols].float()
        old = op.c[first][rows, cols].float()
        delta = (new - old).abs()
        big = ~torch.isfinite(new) | (delta >= 2 * op.rms * (1.0 if op.row_scale is None else op.row_scale[rows]))
        hit = detected(op, bad, rows, cols, tol)
        out[str(bit)] = {"rate": float(hit.float().mean()),
                         "rate_if_ge_2rms": float(hit[big].float().mean()) if bool(big.any()) else float("nan"),
                         "share_ge_2rms": float(big.float().mean())}
    return out


RESIDUAL_DATA = ("llm", "drift", "sorted", "positional")
"""Operands of the residual-model sweep. llm: `activations` against outlier-weighted columns. drift: both operands
non-negative-mean (post-GELU-like A, positive-offset B): every product's partial sums drift with a common sign.
sorted: A ≥ 0 and B's rows of one sign for k < K/2 and the other after, so every partial sum climbs to ~K/2 terms and
falls back (C small): the ordering the random-walk model does not assume, its worst case. positional: `llm` with a
strong sinusoid over the rows of A (one period per 256 tokens, 3x the per-feature scale, along one random direction),
so every column of C has a smooth sign-changing profile over the tokens its checksums sum over."""


def residual_operands(data: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """((1, n, K) A, (1, K, n) B) fp32 for one RESIDUAL_DATA kind."""
    a = activations((1, n, k), gen)
    b = (activations((1, n, k), gen, outliers=1.0) / math.sqrt(k)).mT.contiguous()
    if data == "drift":
        a, b = F.gelu(a), b.abs() * 0.5 + b
    elif data == "positional":
        wave_N1 = torch.sin(torch.arange(n) * (2 * math.pi / 256))[:, None]
        a = a + 3.0 * wave_N1 * torch.randn(k, generator=gen)
    elif data == "sorted":
        sign_K1 = torch.where(torch.arange(k)[:, None] < k // 2, 1.0, -1.0)
        a, b = a.abs(), b.abs() * sign_K1
    return a, b


def residual_model(dtype_name: str, ks: tuple[int, ...], n: int, seed: int, data: str = "llm",
                   walk: bool = True) -> list[dict[str, Any]]:
    """Clean residuals against the model: z = |d| / modelled std per row and column vector of an (n, K) @ (K, n)
    product (operands: RESIDUAL_DATA), for each K. The threshold is `sigmas` z; the model is validated when the worst
    z stays well below it. walk: the random-walk model in both directions (operand ∞-norms passed to `bounds`, and the
    rows' exact second moments as the engine's projection rows make them; the engine takes the model only for
    projection rows, the columns here show the Hölder form), else Cauchy-Schwarz. These operands' rows are
    independent draws, so the sweep tests the per-element model; the correlation of near-collinear rows is the clean
    campaign's part."""
    from attnchecker.abft import (
        abs_max,
        bounds,
        checksum_weights,
        checksums_of,
        verify_direction,
    )

    dtype = DTYPES[dtype_name]
    out = []
    for k in ks:
        gen = torch.Generator().manual_seed(seed + k)
        a, b = residual_operands(data, n, k, gen)
        a, b = a.to(dtype), b.to(dtype)
        with emulate_fp32_matmul("tf32") if dtype_name == "tf32" else contextlib.nullcontext(), torch.no_grad():
            c = product(a, b, dtype_name)
            a32, b32 = a.float(), b.float()
            from attnchecker.matmul_precision import (
                fp32_matmul_operand_roundoff,
                ieee_fp32_matmul,
            )

            with ieee_fp32_matmul("cpu"):
                w_c, w_r = checksum_weights(n, a.device, torch.float32), checksum_weights(n, a.device, torch.float32)
                bw, wa = b32 @ w_c, w_r.T @ a32
                refs = {"row": a32 @ bw, "col": (wa @ b32).mT}
                rows, cols, sums = checksums_of(c, with_abs=dtype != torch.float32, with_sq=True)
                u_op = fp32_matmul_operand_roundoff("cpu") if dtype == torch.float32 else None
                maxes: dict[str, Any] = {}
                if walk:
                    w2 = torch.stack([w_c[:, 0], w_c[:, 1].square()], -1)  # (1, j²): the d1/d2 weights squared
                    maxes = {"a_max_NR": abs_max(a32, dim=-1), "b_max_NC": abs_max(b32, dim=-2),
                             "ref_maxes": (abs_max(bw, dim=-2), abs_max(wa, dim=-1)), "walk": (True, True),
                             "moments_NR4": a32.square() @ torch.cat([b32.square() @ w2, bw.square()], -1)}
                rules = dict(zip(("row", "col"), bounds(
                    torch.linalg.vector_norm(a32, dim=-1), torch.linalg.vector_norm(b32, dim=-2), k=k,
                    out_dtype=c.dtype, tol=Tolerance(), use_abs=dtype != torch.float32, operand_roundoff=u_op,
                    ref_norms=(torch.linalg.vector_norm(bw, dim=-2), torch.linalg.vector_norm(wa, dim=-1)),
                    **maxes), strict=True))
            got = {"row": rows, "col": cols}
            z1, z2, flagged = [], [], 0
            for d in ("row", "col"):
                chk = verify_direction(refs[d], got[d], rules[d], *sums.of(d))
                s1, s2 = rules[d].sigma(sums.of(d)[1], refs[d])
                z1.append((chk.diff[..., 0].abs() / s1).flatten())
                z2.append((chk.diff[..., 1].abs() / s2).flatten())
                flagged += int(chk.bad.sum())
            z1_all, z2_all = torch.cat(z1).double(), torch.cat(z2).double()
        out.append({"k": k, "n": n, "data": data, "model": "random_walk" if walk else "cauchy_schwarz",
                    "vectors": int(z1_all.numel()), "flagged": flagged,
                    "z_d1": {"max": float(z1_all.max()), "p99": float(z1_all.quantile(0.99)),
                             "rms": float(z1_all.square().mean().sqrt())},
                    "z_d2": {"max": float(z2_all.max()), "p99": float(z2_all.quantile(0.99)),
                             "rms": float(z2_all.square().mean().sqrt())}})
    return out


def clean_campaign(dtype_name: str, checks: int, seed: int, tol: Tolerance | None = None) -> dict[str, Any]:
    """Many clean small checks on realistic data (outlier features, causal and padding masks, fully masked rows):
    flagged matrices per op. A check = one verified matrix: a batch element's projection, a (batch, head)'s scores
    or context."""
    from attnchecker.attention.pipeline import check_linear, protected_sdpa
    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime

    dtype = DTYPES[dtype_name]
    flagged: list[Any] = []
    runtime = Runtime(step=0, config=CheckConfig(), injector=None, on_detection=flagged.append, stats=OpStats())
    ctx = LayerContext(layer=0, runtime=runtime)
    if tol is not None and tol.sigmas != Tolerance().sigmas:
        # The policy has no `sigmas` (it is not a user setting): for a what-if run at another quantile the
        # engine's tolerance builder is replaced for this process only.
        import attnchecker.attention.backends.tiled_torch
        import attnchecker.attention.pipeline
        import attnchecker.gemm.projection

        def what_if(c: Any) -> Tolerance:
            return Tolerance(mode=c.config.tolerance, factor=c.config.tolerance_factor, sigmas=tol.sigmas)

        # Every engine module that builds a tolerance holds its own reference to checks.product._tolerance.
        for engine in (attnchecker.attention.pipeline, attnchecker.gemm.projection,
                       attnchecker.attention.backends.tiled_torch):
            engine._tolerance = what_if  # type: ignore[attr-defined]
    counts = {"projection": 0, "scores": 0, "context": 0}
    gen = torch.Generator().manual_seed(seed)
    i = 0
    with emulate_fp32_matmul("tf32") if dtype_name == "tf32" else contextlib.nullcontext(), torch.no_grad():
        while sum(counts.values()) < checks:
            b, t, dm, heads = 64, (16, 48, 96)[i % 3], (64, 128, 256)[i % 3], 4
            x = activations((b, t, dm), gen, outliers=(1.0, 30.0, 100.0)[i % 3] if dtype != torch.float16 else 30.0)
            w = torch.randn(3 * dm, dm, generator=gen) / math.sqrt(dm)
            bias = torch.randn(3 * dm, generator=gen) * 0.1
            x, w, bias = x.to(dtype), w.to(dtype), bias.to(dtype)
            qkv = F.linear(x, w, bias) if dtype_name in ("fp32", "tf32") else F.linear(x.float(), w.float(),
                                                                                        bias.float()).to(dtype)
            check_linear(x, qkv, w, bias, ctx=ctx, splits=(("q", dm), ("k", dm), ("v", dm)))
            q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in qkv.split(dm, -1))
            mask = None
            if i % 2:
                lengths = torch.randint(0, t + 1, (b,), generator=gen)
                mask = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :].expand(b, 1, t, t)
            protected_sdpa(q, k, v, ctx=ctx, attn_mask=mask, is_causal=i % 2 == 0)
            counts["projection"] += 3 * b
            counts["scores"] += b * heads
            counts["context"] += b * heads
            i += 1
    return {"checks": counts, "total_checks": sum(counts.values()), "false_positives": len(flagged),
            "false_positive_ops": sorted({d.op for d in flagged})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes and few trials (the smoke test)")
    p.add_argument("--shapes", default="tiny,gpt2,7b")
    p.add_argument("--dtypes", default="fp32,tf32,bf16,fp16")
    p.add_argument("--ops", default="q,out,scores,context")
    p.add_argument("--trials", type=int, default=1024, help="single-error trials per magnitude / bit and op")
    p.add_argument("--clean-checks", type=int, default=100_000, help="clean checks per dtype (0: skip)")
    p.add_argument("--parts", default="faults,model,clean",
                   help="faults: injection sweeps; model: clean residuals vs the model (K up to 8192); clean: "
                        "false positives over --clean-checks")
    p.add_argument("--residual-data", default="llm",
                   help=f"comma list of {RESIDUAL_DATA}: the operands of the --parts model sweep")
    p.add_argument("--ks", default=None, help="comma list of K for the --parts model sweep (default 64..8192)")
    p.add_argument("--sigmas", type=float, default=None,
                   help="the calibrated threshold in modelled standard deviations (default: the library's)")
    p.add_argument("--path", default="unfused", choices=("unfused", "tiled", "kernel", "triton"),
                   help="which path's checks the ops go through: scores and context on the unfused, tiled (tile by "
                        "tile, the engine's tiled_attention checks) or kernel (the native pass, fp32) path, where "
                        "projections are the same on every path; triton: q and out as the GEMM checks' Triton path "
                        "checks them on a GPU (by rows; under TRITON_INTERPRET=1)")
    p.add_argument("--projection-directions", default="engine", choices=("engine", "both", "rows"),
                   help="q/out: the directions the engine's clean check verifies (fp32: the rows alone), both, or "
                        "the rows alone in every dtype (what the rows alone give up, side by side)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    global PROJECTION_DIRECTIONS
    PROJECTION_DIRECTIONS = args.projection_directions
    torch.set_num_threads(args.threads)
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    dtypes = args.dtypes.split(",")
    for name in shapes:
        if name not in SHAPES:
            p.error(f"unknown shape {name!r}: choose from {sorted(SHAPES)}")
    for name in dtypes:
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}: choose from {sorted(DTYPES)}")
    if args.path == "kernel" and ("faults" in args.parts.split(",")
                                  and (set(dtypes) - {"fp32"} or set(args.ops.split(",")) - {"scores", "context"})):
        p.error(f"--path kernel covers fp32 scores and context (the native pass's only dtype and ops), not "
                f"--dtypes {args.dtypes} --ops {args.ops}: pass --dtypes fp32 --ops scores,context")
    clean_checks = min(args.clean_checks, 2000) if args.tiny else args.clean_checks
    trials = min(args.trials, 64) if args.tiny else args.trials
    cal = Tolerance() if args.sigmas is None else Tolerance(sigmas=args.sigmas)
    plain = dataclasses.replace(cal, grouped=False)
    rig = Tolerance(calibrated=False)
    parts = set(args.parts.split(","))
    results: list[dict[str, Any]] = []
    rows: list[list[Any]] = []
    for shape_name in shapes if "faults" in parts else []:
        for dtype_name in dtypes:
            for op_name in args.ops.split(","):
                t0 = time.perf_counter()
                op = {"tiled": TiledOp, "kernel": KernelOp, "triton": TritonOp}.get(args.path, Op)(
                    op_name, SHAPES[shape_name], dtype_name, args.seed)
                entry = {
                    "shape": shape_name, "dtype": dtype_name, "op": op_name, "path": args.path,
                    "product_shape": list(op.c.shape),
                    "rms": op.rms,
                    "clean": op.clean_ratios(cal),
                    "clean_rigorous": op.clean_ratios(rig),
                    "clean_ungrouped": op.clean_ratios(plain),
                    "magnitude": {"calibrated": magnitude_sweep(op, trials, args.seed, cal),
                                  "calibrated_ungrouped": magnitude_sweep(op, trials, args.seed, plain),
                                  "rigorous": magnitude_sweep(op, trials, args.seed, rig)},
                    "bits": bit_sweep(op, trials, args.seed, cal),
                    "bits_ungrouped": bit_sweep(op, trials, args.seed, plain),
                    "check_seconds": op.check_seconds({"grouped": cal, "ungrouped": plain}),
                    "layout": dict(zip(("exponent_bits", "mantissa_bits"), LAYOUT[op.c.dtype], strict=True)),
                }
                entry["summary"] = summarize(entry)
                entry["summary_ungrouped"] = summarize({**entry, "bits": entry["bits_ungrouped"]})
                entry["seconds"] = time.perf_counter() - t0
                results.append(entry)
                s = entry["summary"]
                cs = entry["check_seconds"]
                rows.append([shape_name, dtype_name, op_name, entry["clean"]["worst_d1_over_bound"],
                             entry["clean"]["median_bound_over_rms"], entry["magnitude"]["calibrated"]["2.0"],
                             entry["magnitude"]["calibrated_ungrouped"]["2.0"], entry["magnitude"]["rigorous"]["2.0"],
                             s["exponent_bits"], s["top8_mantissa_bits"], s["flips_ge_2rms"],
                             cs["grouped"] / cs["ungrouped"]])
                print(f"  {shape_name}/{dtype_name}/{op_name}: {entry['seconds']:.1f}s", flush=True)
    if rows:
        print(_common.table(rows, ["shape", "dtype", "op", "clean |d1|/bound", "bound/RMS", "2xRMS det",
                                   "2xRMS ungrouped", "2xRMS rigorous", "exp-bit flips", "top-8 mantissa",
                                   "flips >=2RMS", "check time grouped/ungrouped"]))
    ks = (16, 64) if args.tiny else (64, 512, 2048, 4096, 8192)
    if args.ks:
        ks = tuple(int(x) for x in args.ks.split(","))
    model: dict[str, list[dict[str, Any]]] = {}
    for d in dtypes if "model" in parts else []:
        model[d] = [r for data in args.residual_data.split(",") for walk in (True, False)
                    for r in residual_model(d, ks, 64 if args.tiny else 1024, args.seed, data, walk)]
    if model:
        print(_common.table([[d, r["data"], r["model"], r["k"], r["vectors"], r["z_d1"]["rms"], r["z_d1"]["max"],
                              r["z_d2"]["rms"], r["z_d2"]["max"], r["flagged"]] for d, rs in model.items() for r in rs],
                            ["dtype", "data", "model", "K", "vectors", "rms z(d1)", "max z(d1)", "rms z(d2)",
                             "max z(d2)", "flagged"]))
    clean = {}
    if clean_checks and "clean" in parts:
        for dtype_name in dtypes:
            clean[dtype_name] = clean_campaign(dtype_name, clean_checks, args.seed, cal)
        print(_common.table([[k, v["total_checks"], v["false_positives"]] for k, v in clean.items()],
                            ["dtype", "clean checks", "false positives"]))
    payload = {"magnitudes": list(MAGNITUDES), "trials": trials, "sigmas": cal.sigmas, "path": args.path,
               "projection_directions": args.projection_directions,
               "threads": args.threads, "results": results,
               "residual_model": model, "clean": clean}
    path = _common.write_result("coverage", _no_nan(payload), args.out)
    print(f"wrote {path}")
    return 0


def _no_nan(x: Any) -> Any:
    """NaN (no trial of that kind, e.g. no flip moved a value by 2x RMS) as null: JSON has no NaN."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def summarize(entry: dict[str, Any]) -> dict[str, float]:
    """Detection over the exponent bits, the top 8 mantissa bits (all of bf16's 7), and over flips of any bit that
    moved the value by >= 2x RMS."""
    exp_bits, man_bits = entry["layout"]["exponent_bits"], entry["layout"]["mantissa_bits"]
    bits = entry["bits"]
    exp = [bits[str(b)]["rate"] for b in range(man_bits, man_bits + exp_bits)]
    top = [bits[str(b)]["rate"] for b in range(max(0, man_bits - 8), man_bits)]
    big = [(v["rate_if_ge_2rms"], v["share_ge_2rms"]) for v in bits.values() if v["share_ge_2rms"] > 0]
    weight = sum(s for _, s in big)
    return {"exponent_bits": sum(exp) / len(exp), "top8_mantissa_bits": sum(top) / len(top),
            "flips_ge_2rms": sum(r * s for r, s in big) / weight if weight else float("nan")}


if __name__ == "__main__":
    sys.exit(main())
