"""A one-pass reduction kernel for the checksum fast path on CPU (issue 17): what an eager check reads twice, read once.

A row-direction check of C = A·B needs, from each of its three matrices, a skinny product and a sum of squares: C w
and Σ_j C_ij², A (B w) and ‖A_i‖², B w and ‖B_:,j‖²; a projection's calibrated check also needs the operands'
∞-norms and products of their squares (projection._ProjectionInput). Eagerly each is a pass over memory of its own,
and the checks are memory-bound (docs/performance.md): a check of GPT-2's MLP GEMMs read about 2× the bytes one pass
needs. ``fused_pass`` computes them together in one read of the matrix (``fused_pass.c``), on either layout: a
transposed view (dYᵀ, Xᵀ) is read as its contiguous base, its products taken from the other side; grouped
checksums are runs of a row, each with its own sums.

The C source is built and loaded by ``native`` (on first use, with the system C compiler). Where there is no compiler,
the build fails, the tensors are not fp32 on the CPU, or ``ATTNCHECKER_NATIVE=0``, ``fused_pass`` returns None and
the caller takes its eager path (the same quantities, the same bounds). A GPU would need the same contract in its own
kernel (not written).

Legend: R rows, C columns of X; nr, nl the skinny factors' widths; ... leading batch dims.
abft/ stays pure: ``abft.gemm.verify_gemm`` takes this function as its ``one_pass`` argument (gemm.check passes it).
No host-device sync (CPU tensors only).
"""
from __future__ import annotations

import ctypes
import functools
import itertools
from concurrent.futures import ThreadPoolExecutor

import torch

from ..abft.gemm import FusedSums
from . import build

__all__ = ["available", "fused_pass"]

enabled = True
"""False: ``fused_pass`` declines every call, as without a kernel (bench/overhead.py's ``all_full_eager`` toggles it
around its steps, to price the kernel side by side in one run)."""
_SOURCE = build.source("fused_pass.c")
_WIDEST_LEFT = 64
"""Widest left factor: the kernel keeps a row's left coefficients on its stack."""


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if it is not yet)."""
    return _kernel() is not None


def fused_pass(
    x: torch.Tensor,
    *,
    right: torch.Tensor | None = None,
    right_sq: torch.Tensor | None = None,
    left: torch.Tensor | None = None,
    left_sq: torch.Tensor | None = None,
    row_sq: bool = False,
    col_sq: bool = False,
    row_max: bool = False,
    col_max: bool = False,
    groups: int = 1,
    copy_to: torch.Tensor | None = None,
) -> FusedSums | None:
    """In one read of X (..., R, C), whose rows are split into ``groups`` runs of S = C/g consecutive elements:
    each run times right (..., S, nr) and, squared, times right_sq (..., S, nr2); Xᵀ·left (left (..., R, nl)) and
    (X∘X)ᵀ·left_sq; the squared sum of each run and of each column; the largest |X| of each row and column. The
    factors' batch dims are X's or absent (shared). Outputs in the grouped vector layout (abft/checksum.py: run h of
    row i is vector i·g + h): ``FusedSums``. None when the kernel cannot take these tensors (the caller computes the
    same eagerly): not all fp32 on the CPU, rows that are not contiguous, batch dims that do not flatten, C not a
    multiple of ``groups``, a left factor wider than 64, or no kernel.

    copy_to (..., R, W), W ≥ C, fp32 with contiguous rows: also written in the same read, each row X's row followed
    by W − C zeros (the encoded operands of the attention backward). Its batch dims, flattened, must be one stride
    or two (a (B, T, H, W) buffer read as (B, H, T, W)); where they are not, the call declines and writes nothing."""
    if not enabled or x.dim() < 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
        return None
    if x.stride(-1) != 1 or (x.requires_grad and torch.is_grad_enabled()):
        return None
    rows, cols = x.shape[-2:]
    if groups < 1 or cols % groups:
        return None
    lead = x.shape[:-2]
    try:
        x3 = x.view(-1, rows, cols)
    except RuntimeError:
        return None
    # Each factor as (nb or 1, n, length): each of its n columns a contiguous run, as the kernel reads it.
    factors: list[torch.Tensor | None] = []
    for factor, length, widest in ((right, cols // groups, None), (right_sq, cols // groups, None),
                                   (left, rows, _WIDEST_LEFT), (left_sq, rows, _WIDEST_LEFT)):
        if factor is None:
            factors.append(None)
            continue
        if (factor.dtype != torch.float32 or factor.device.type != "cpu" or factor.shape[-2] != length
                or (widest is not None and factor.shape[-1] > widest)
                or factor.shape[:-2] not in (lead, torch.Size(), (1,) * len(lead))):
            return None
        factors.append(factor.detach().mT.reshape(-1, factor.shape[-1], length).contiguous())
    dest = None
    if copy_to is not None:
        dest = _copy_view(copy_to, lead, rows, cols)
        if dest is None:
            return None
    kernel = _kernel()
    if kernel is None:
        return None
    spans = _row_spans(rows, x3.numel())
    if len(spans) == 1:
        outs = _call(kernel, x3, groups, factors, (row_sq, col_sq, row_max, col_max), dest)
    else:
        # Row blocks on torch's intra-op threads (ctypes lets go of the GIL): rows are independent, the column sums
        # of the blocks add up, their maxima combine by max.
        def block(span: tuple[int, int]) -> list[torch.Tensor | None]:
            r0, r1 = span
            # The left factors run along the rows: each block takes its own rows of them.
            part = [t if i < 2 or t is None else t[..., r0:r1].contiguous() for i, t in enumerate(factors)]
            return _call(kernel, x3[:, r0:r1], groups, part, (row_sq, col_sq, row_max, col_max),
                         None if dest is None else dest[..., r0:r1, :])

        blocks = list(_pool(len(spans)).map(block, spans))
        outs = []
        for i, pieces in enumerate(zip(*blocks, strict=True)):
            if pieces[0] is None:
                outs.append(None)
            elif i in _PER_ROW:
                outs.append(torch.cat(pieces, dim=1))  # type: ignore[arg-type]
            elif i == _COL_MAX:
                outs.append(functools.reduce(torch.maximum, pieces))
            else:
                outs.append(functools.reduce(torch.add, pieces))
    xr, xr2, lx, lx2, rsq, csq, rmax, cmax = outs
    nr, nr2, nl, nl2 = (_width(t) for t in factors)
    return FusedSums(
        right=None if xr is None else xr.view(*lead, rows * groups, nr),
        right_sq=None if xr2 is None else xr2.view(*lead, rows * groups, nr2),
        left=None if lx is None else lx.view(*lead, nl, cols).mT,
        left_sq=None if lx2 is None else lx2.view(*lead, nl2, cols).mT,
        row_sq=None if rsq is None else rsq.view(*lead, rows * groups),
        col_sq=None if csq is None else csq.view(*lead, cols),
        row_max=None if rmax is None else rmax.view(*lead, rows),
        col_max=None if cmax is None else cmax.view(*lead, cols),
    )


_PER_ROW = (0, 1, 4, 6)
"""Positions in `_call`'s outputs of the per-row ones (xr, xr2, rsq, rmax): row blocks concatenate."""
_COL_MAX = 7
_BLOCK_MIN = 1 << 20
"""Fewest elements of X per thread's block of rows: below, one call on one thread. Each block costs a dispatch to
the pool and its share of the combine; at 2^18 the checks of a GPT-2 MLP GEMM on 2 threads ran slower than the eager
reductions, at 2^20 within noise of them (2-core machine, three repeats)."""


def _row_spans(rows: int, numel: int) -> list[tuple[int, int]]:
    """Row ranges for torch's intra-op threads: as many as the threads, each at least _BLOCK_MIN elements."""
    blocks = max(1, min(torch.get_num_threads(), numel // _BLOCK_MIN, rows))
    edges = [rows * i // blocks for i in range(blocks + 1)]
    return list(itertools.pairwise(edges))


@functools.lru_cache(maxsize=4)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnchecker-fused-pass")


def _width(factor: torch.Tensor | None) -> int:
    return 0 if factor is None else factor.shape[1]


def _batch_stride(factor: torch.Tensor | None) -> int:
    """0 for a factor the batch shares."""
    return 0 if factor is None or factor.shape[0] == 1 else factor.stride(0)


def _copy_view(copy_to: torch.Tensor, lead: torch.Size, rows: int, cols: int) -> torch.Tensor | None:
    """copy_to as (L0, L1, R, W), its batch dims (X's) split as the kernel walks them (matrix b at (b / L1, b % L1)),
    or None where it is not a buffer the kernel can write (dtype, device, shape, strides)."""
    if (copy_to.dtype != torch.float32 or copy_to.device.type != "cpu" or copy_to.shape[:-1] != (*lead, rows)
            or copy_to.shape[-1] < cols or copy_to.stride(-1) != 1 or copy_to.requires_grad):
        return None
    inner = lead[-1] if lead else 1
    try:
        return copy_to.view(-1, inner, rows, copy_to.shape[-1])
    except RuntimeError:
        return None


def _call(kernel: ctypes._CFuncPtr, x3: torch.Tensor, groups: int,  # type: ignore[name-defined]
          factors: list[torch.Tensor | None], wants: tuple[bool, bool, bool, bool],
          dest: torch.Tensor | None = None) -> list[torch.Tensor | None]:
    """One call of the kernel on X (nb, R, C) (rows contiguous), factors as `fused_pass` lays them out:
    [xr, xr2, lx, lx2, rsq, csq, rmax, cmax]; dest (L0, L1, R, W) the copy's buffer (``_copy_view``)."""
    nb, rows, cols = x3.shape
    r_t, r2_t, l_t, l2_t = factors
    (nr, sr), (nr2, sr2), (nl, sl), (nl2, sl2) = ((_width(t), _batch_stride(t)) for t in factors)
    row_sq, col_sq, row_max, col_max = wants
    new = functools.partial(torch.empty, dtype=torch.float32)
    xr = new((nb, rows * groups, nr)) if r_t is not None else None
    xr2 = new((nb, rows * groups, nr2)) if r2_t is not None else None
    lx = new((nb, nl, cols)) if l_t is not None else None
    lx2 = new((nb, nl2, cols)) if l2_t is not None else None
    rsq = new((nb, rows * groups)) if row_sq else None
    csq = new((nb, cols)) if col_sq else None
    rmax = new((nb, rows)) if row_max else None
    cmax = new((nb, cols)) if col_max else None
    p = build.ptr
    copy = (1, 0, 0, 0, 0) if dest is None else (dest.shape[1], dest.stride(0), dest.stride(1), dest.stride(2),
                                                   dest.shape[3])
    kernel(nb, rows, cols, p(x3), x3.stride(1), x3.stride(0), groups, p(r_t), nr, sr, p(r2_t), nr2, sr2,
           p(l_t), nl, sl, p(l2_t), nl2, sl2, p(xr), p(xr2), p(lx), p(lx2), p(rsq), p(csq),
           p(rmax), p(cmax), p(dest), *copy)
    return [xr, xr2, lx, lx2, rsq, csq, rmax, cmax]


@functools.lru_cache(maxsize=1)
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernel's entry point, built and loaded once per process; None (logged once) where it cannot be."""
    fn = build.load(_SOURCE, "attnchecker_fused_pass", "checks take their eager path, which reads each matrix "
                     "about twice")
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = None
    fn.argtypes = [i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64,
                   ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    return fn
