"""The checked attention forward in one native pass per query block (issue 12): ``fused_attention.c``.

The tiled path (attention/backends/tiled_torch.py) runs the tile contract of ``abft.tiled`` as PyTorch ops: per tile a
dozen passes over the scores through memory (GEMM, scale, mask, max, shift, exp, sum, the checksum reductions) and a few
hundred small ops for the checks. This kernel runs the same contract with each query block's scores in cache: the two
GEMMs by the BLAS PyTorch itself links (MKL's ``sgemm_``, called from C), and between them one pass for the scores' row
checksums (plain, weighted, Σ AS²) per checksum group, and the softmax; after the second GEMM one for the context's row
checksums, whose references come out of that GEMM itself ([V | V w], abft.tiled.augment_v). Each row is verified
where its sums are made, against the row rule of abft/tolerance.py factored per checksum group (``row_terms``: the
per-call terms, O(S·D), are made in Python by attention.backends.native_rules.kernel_rules); the call returns the rows
flagged per matrix and the worst ratio per op. Only a flag goes back to Python's checks of the same sums
(attention.backends.native_rules.kernel_checks, for the report) and the recovery
(attention.backends.tiled_torch._kernel_forward).

Scope: plain fp32 tensors on the CPU; causal with T = S, or an explicit mask (bool or additive, made an fp32
additive mask and read in place where it broadcasts: key padding (B, 1, 1, S) costs S floats a batch), or neither; a
positive scale; IEEE fp32 matmuls (TF32 or oneDNN bf16 modes keep the PyTorch path, whose products honour them);
no TorchDispatchMode active (a mode expects to see the products, which here are no aten ops: a fault injector below
autograd, a tracer); and a BLAS that exports ``sgemm_``. A mask that requires grad (a learned bias) keeps the
unfused path (attention.py), whose graph differentiates through it. Anything else, or ``enabled = False``, or
``ATTNCHECKER_NATIVE=0``: ``applies`` says no and the engine keeps its PyTorch paths. Faults inside the kernel are
emulated for tests by ``emulated_faults``.

Legend: N batch x heads, T queries, S keys, D head dim, g checksum groups per scores row (G = S/g keys each).
No host-device sync (CPU tensors only).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..abft.tolerance import RowTerms
from ..matmul_precision import fp32_matmul_operand_roundoff
from . import build

__all__ = ["OPS", "KernelOutput", "KernelRules", "applies", "available", "emulated_faults", "not_supported_reasons",
           "run", "take_faults"]

enabled = True
"""False: ``run`` declines every call (bench/ and tests price or exercise the PyTorch tiled loop side by side)."""
_SOURCE = build.source("fused_attention.c")
OPS = ("scores", "context")
"""The kernel's two checked products, in the order of its per-op outputs (KernelOutput) and of a fault's op."""


Fault = tuple[str, int, int, int, float]
"""(op, n, row, col, value): one element of the scores (col a key) or of the unnormalised context (col a feature) of
matrix n = batch·H + head, overwritten inside the kernel right after the GEMM that computed it."""
_pending: list[Fault] = []


@contextlib.contextmanager
def emulated_faults(faults: list[Fault]) -> Iterator[None]:
    """Tests: the next kernel call inside the block writes these faults, as a fault of its own arithmetic would (a
    transient fault: that call only; the recovery's recompute does not see it). The PyTorch paths never see them."""
    _pending[:] = list(faults)
    try:
        yield
    finally:
        _pending.clear()


def take_faults() -> list[Fault] | None:
    """The pending emulated faults, now consumed (None: none)."""
    if not _pending:
        return None
    got = list(_pending)
    _pending.clear()
    return got


@dataclass(frozen=True, slots=True)
class KernelRules:
    """What the kernel verifies each row against (attention.backends.native_rules.kernel_rules makes it)."""

    kbar_ND2g: torch.Tensor
    """[K_h^T e | K_h^T w] per checksum group h (column 2h + w): the scores' row references are Q_i times it."""
    q_norm_NT: torch.Tensor
    """‖Q_i‖₂, the scores rows' operand norm."""
    scores: RowTerms
    """The scores' row rule per checksum group ((N, g) terms)."""
    context: RowTerms
    """The context's ((N, 1) terms; its rows' operand norm is sqrt(Σ_j P̃_ij)·1.01, made in the kernel)."""

    @property
    def groups(self) -> int:
        """Checksum groups per scores row."""
        return self.scores.rigorous_Ng.shape[-1]


@dataclass(frozen=True, slots=True)
class KernelOutput:
    out_NTD: torch.Tensor
    """softmax(scale·QKᵀ) V, normalised."""
    lse_NT: torch.Tensor
    """Row log-sum-exp of scale·QKᵀ (what the fused backward takes)."""
    p_sum_NT: torch.Tensor
    """Σ_j P̃_ij, P̃ = exp(scale·AS - row max) (the context's ‖P̃_i‖₂ <= sqrt of it)."""
    scores_sums_NTg3: torch.Tensor
    """Per row and checksum group of the scores: (Σ AS, Σ j·AS (j = 1..G within the group), Σ AS²); zeros for a
    group a causal (or masked) block did not compute."""
    scores_refs_NTg2: torch.Tensor
    """Their references Q_i (K_hᵀ [e, w]) as the kernel made them; zeros for a group a causal block did not compute."""
    context_sums_NT5: torch.Tensor
    """Per row of the unnormalised context CL = P̃ V: (Σ_d CL, Σ_d d·CL, Σ_d CL², P̃ (V e), P̃ (V w))."""
    flagged_N2: torch.Tensor
    """int64: rows flagged per matrix, (scores, context)."""
    worst_2: torch.Tensor
    """fp32: per op (scores, context) the worst |d|/bound among the rows not flagged, NaN if one is NaN
    (records._worst_ratio)."""
    seconds: tuple[float, float]
    """Time the kernel spent in the scores' and the context's checks: sums and verification (the checks' share of
    its pass)."""


def available() -> bool:
    """Whether the kernel is built and loaded and a BLAS sgemm_ was found (building it now if it is not yet)."""
    return _kernel() is not None and _sgemm() is not None


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float,
            attn_mask: torch.Tensor | None = None) -> bool:
    """Whether ``run`` would take a call of these operands ((..., T, D), (..., S, D), (..., S, D)) and mask (bool or
    floating, broadcastable to (..., T, S); module doc: scope), without touching their memory: what the engine asks
    before it picks a path (attention/backends/native_cpu.py)."""
    return not not_supported_reasons(q, k, v, is_causal=is_causal, scale=scale, attn_mask=attn_mask)


def not_supported_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float,
                          attn_mask: torch.Tensor | None = None) -> list[str]:
    """Why ``run`` would not take this call ([] = it would), first reason first; no pass over the tensors."""
    if not enabled:
        return ["turned off (attnchecker.kernels.fused_attention.enabled = False)"]
    if not (math.isfinite(scale) and scale > 0.0):
        return [f"scale {scale!r} is not a positive finite number"]
    if attn_mask is not None:
        if is_causal:
            return ["is_causal together with an explicit mask"]
        if (type(attn_mask) is not torch.Tensor or attn_mask.device.type != "cpu"
                or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point())
                or attn_mask.dim() > 4 or q.dim() != 4):
            return ["a mask that is not a bool or floating CPU tensor of at most 4 dims"]
    # The kernel reads raw memory and its GEMMs are no aten ops: a tensor subclass (fake, meta, distributed) has no
    # such memory, and a TorchDispatchMode (a tracer, a FLOP counter, a fault injector) expects to see the products.
    if _get_current_dispatch_mode() is not None:
        return ["a TorchDispatchMode is active, and it expects to see the products as aten ops"]
    if any(type(x) is not torch.Tensor for x in (q, k, v)):
        return ["a tensor subclass (fake, meta or distributed) has no memory of its own to read"]
    if any(x.device.type != "cpu" for x in (q, k, v)):
        return [f"tensors on {q.device.type}, not the CPU"]
    if any(x.dtype != torch.float32 for x in (q, k, v)):
        return [f"{q.dtype} tensors: the native pass takes float32"]
    if any(x.dim() < 3 for x in (q, k, v)):
        return ["operands of fewer than 3 dims"]
    (t, d), (s, dk), (sv, dv) = q.shape[-2:], k.shape[-2:], v.shape[-2:]
    if (dk, sv, dv) != (d, s, d):
        return ["v's head dim differs from q's and k's"]
    if 0 in (t, s, d):
        return ["an empty operand"]
    if is_causal and t != s:
        return [f"causal with T = {t} != S = {s}"]
    rounding = fp32_matmul_operand_roundoff(q.device)
    if rounding is not None:
        return [f"fp32 matmuls round their operands here (TF32 or bf16 mode, relative {rounding:.1e}): the PyTorch "
                "paths' products honour that mode"]
    if not available():
        return ["not built: no C compiler, ATTNCHECKER_NATIVE=0, or no BLAS sgemm_ (see the warning logged once)"]
    return []


def run(q_NTD: torch.Tensor, k_NSD: torch.Tensor, va_NSA: torch.Tensor, rules: KernelRules, *, scale: float,
        is_causal: bool, block_q: int, faults: list[Fault] | None = None, mask_add: torch.Tensor | None = None,
        heads: int = 1) -> KernelOutput | None:
    """One call of the kernel on (N, T, D) / (N, S, D) operands (``applies`` said yes). va: [V | V e | V w]
    (N, S, D + 2), abft.tiled.augment_v. rules: what each row is verified against; its scores terms give the
    checksum groups per scores row (S % g == 0). mask_add: an additive fp32 mask (B|1, H|1, T|1, S) of a call that is
    not causal, matrix n being (batch, head) = divmod(n, heads) (attention.backward.fused._additive_mask makes it).
    faults: (op, n, row, col, value) written into the scores (col a key) or the unnormalised context (col a feature)
    right after the GEMM that computes them, before their checksums: a fault of the kernel's own arithmetic, emulated
    (tests). None where the kernel declines."""
    kernel, sgemm = _kernel(), _sgemm()
    if kernel is None or sgemm is None:
        return None
    q, k, va = q_NTD.contiguous(), k_NSD.contiguous(), va_NSA.contiguous()
    (n, t, d), s = q.shape, k.shape[1]
    groups = rules.groups
    if (va.shape != (n, s, d + 2) or groups < 1 or s % groups or block_q < 1
            or rules.kbar_ND2g.shape != (n, d, 2 * groups) or rules.q_norm_NT.shape != (n, t)):
        return None
    new = functools.partial(torch.empty, dtype=torch.float32)
    out, lse, p_sum = new((n, t, d)), new((n, t)), new((n, t))
    s_sums, s_refs, c_sums = new((n, t, groups, 3)), new((n, t, groups, 2)), new((n, t, 5))
    flagged = torch.empty((n, 2), dtype=torch.int64)
    mask, strides = _mask_layout(mask_add, n, heads, t, s)
    if mask_add is not None and (mask is None or is_causal):
        return None
    kbar, q_norm = rules.kbar_ND2g.contiguous(), rules.q_norm_NT.contiguous()
    terms = [(x.rigorous_Ng.to(torch.float32).contiguous(),
              None if x.var_Ng2 is None else x.var_Ng2.to(torch.float64).contiguous(), x)
             for x in (rules.scores, rules.context)]
    parts = _parts(n, n * t * s * d)
    split = len(parts) > 1

    def call(n0: int, n1: int) -> tuple[int, torch.Tensor, tuple[float, float]]:
        """The kernel over matrices [n0, n1): its own work buffers, every other pointer offset to n0."""
        work, oa, worst = new((min(block_q, t), s)), new((min(block_q, t), d + 2)), new(2)
        seconds = (ctypes.c_double * 2)(0.0, 0.0)
        mine = [(op, i - n0, r, c, v) for op, i, r, c, v in faults or () if n0 <= i < n1]
        where = values = None
        if mine:
            where = torch.tensor([[OPS.index(op), i, r, c] for op, i, r, c, _ in mine], dtype=torch.int64)
            values = torch.tensor([v for *_, v in mine], dtype=torch.float32)
        structs = (_RowRule * 2)(*(_row_rule(rig[n0:n1], None if var is None else var[n0:n1], x)
                                   for rig, var, x in terms))
        p = build.ptr
        with _blas_single_threaded(split):
            status = kernel(sgemm, n1 - n0, t, s, d, p(q[n0:n1]), p(k[n0:n1]), p(va[n0:n1]), scale, int(is_causal),
                            block_q, s // groups, p(work), p(oa), p(out[n0:n1]), p(lse[n0:n1]), p(p_sum[n0:n1]),
                            p(s_sums[n0:n1]), p(c_sums[n0:n1]), p(where), p(values), len(mine), seconds,
                            p(kbar[n0:n1]), p(q_norm[n0:n1]), structs, p(s_refs[n0:n1]), p(flagged[n0:n1]), p(worst),
                            p(mask), heads, *strides, n0)
        return status, worst, (seconds[0], seconds[1])

    # The first part on this thread, the others on the pool: ctypes lets go of the GIL for the call.
    pending = [_pool(len(parts) - 1).submit(call, *part) for part in parts[1:]] if split else []
    done = [call(*parts[0])] + [f.result() for f in pending]
    if any(status != 0 for status, _, _ in done):
        return None
    worsts = torch.stack([w for _, w, _ in done])
    # NaN-sticky, as the kernel's own per-op maximum (records._worst_ratio's amax).
    worst_2 = worsts.amax(0) if len(done) > 1 else worsts[0]
    return KernelOutput(out_NTD=out, lse_NT=lse, p_sum_NT=p_sum, scores_sums_NTg3=s_sums, scores_refs_NTg2=s_refs,
                        context_sums_NT5=c_sums, flagged_N2=flagged, worst_2=worst_2,
                        seconds=(sum(x[0] for _, _, x in done), sum(x[1] for _, _, x in done)))


def _mask_layout(mask_add: torch.Tensor | None, n: int, heads: int, t: int, s: int
                 ) -> tuple[torch.Tensor | None, tuple[int, int, int]]:
    """(the mask as the kernel reads it, its (batch, head, query) strides in elements, 0 where it broadcasts); None
    where it cannot: not fp32 4-D broadcastable to (n/heads, heads, t, s), or heads not dividing n."""
    if mask_add is None:
        return None, (0, 0, 0)
    if (heads < 1 or n % heads or mask_add.dtype != torch.float32 or mask_add.dim() != 4
            or any(m not in (1, want) for m, want in zip(mask_add.shape, (n // heads, heads, t), strict=False))
            or mask_add.shape[-1] != s):
        return None, (0, 0, 0)
    mask = mask_add if mask_add.stride(-1) == 1 else mask_add.contiguous()
    sb, sh, st = (0 if mask.shape[i] == 1 else mask.stride(i) for i in range(3))
    return mask, (sb, sh, st)


PART_MIN_MACS = 1 << 22
"""Least work per part (multiply-adds of Q Kᵀ, n·T·S·D): a demo-size call (32 matrices, T = S = 64, D = 32: 4.2M) took
0.66–0.92 ms in one part and 0.80–0.96 ms in two, the thread hand-off about what it saves; from 16.8M on two parts
were 1.3–1.9× faster (2 threads, wall time)."""


def _parts(n: int, macs: int) -> list[tuple[int, int]]:
    """[0, n) split between up to torch.get_num_threads() threads, as even as whole matrices allow, each part with at
    least PART_MIN_MACS of the call's `macs`. One part where the BLAS cannot be told to keep each part's GEMMs on its
    own thread (``_blas_single_threaded``): parts whose GEMMs each spread over every core would fight for them."""
    threads = min(n, torch.get_num_threads(), max(1, macs // PART_MIN_MACS))
    if _mkl_local_threads() is None:
        threads = 1
    bounds = [n * i // threads for i in range(threads + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(threads)]


_POOL: tuple[int, ThreadPoolExecutor] | None = None
"""(its threads, the pool) that runs the parts after the first."""


def _pool(workers: int) -> ThreadPoolExecutor:
    """The threads that run the parts after the first (kept between calls; made again for more threads)."""
    global _POOL
    if _POOL is None or _POOL[0] < workers:
        if _POOL is not None:
            _POOL[1].shutdown(wait=False)
        _POOL = (workers, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnchecker-attention"))
    return _POOL[1]


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: make a new one there on first use."""
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


@contextlib.contextmanager
def _blas_single_threaded(on: bool) -> Iterator[None]:
    """MKL's GEMMs on the calling thread alone while the kernel runs (MKL_Set_Num_Threads_Local, a per-thread
    setting), when the call is one of several parts running at once; off: MKL's own threading, as for a torch
    matmul."""
    setter = _mkl_local_threads() if on else None
    if setter is None:
        yield
        return
    before = setter(1)
    try:
        yield
    finally:
        setter(before)


class _RowRule(ctypes.Structure):
    """fused_attention.c's row_rule."""

    _fields_ = [("rigorous", ctypes.c_void_p), ("var", ctypes.c_void_p)] + [
        (name, ctypes.c_double)
        for name in ("a_floor", "rig_coef", "under", "sq_coef1", "sq_coef2", "sq_pad", "sigmas", "off2", "n")]


def _row_rule(rigorous: torch.Tensor, var: torch.Tensor | None, terms: RowTerms) -> _RowRule:
    """The struct of ``terms`` with its per-matrix arrays given (fp32 and float64, contiguous: the caller holds them
    for the call)."""
    return _RowRule(rigorous.data_ptr(), None if var is None else var.data_ptr(), terms.a_floor, terms.rig_coef,
                    terms.under, terms.sq_coef[0], terms.sq_coef[1], terms.sq_pad, terms.sigmas, terms.off2,
                    float(terms.n))


@functools.lru_cache(maxsize=1)
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    fn = build.load(_SOURCE, "attnchecker_fused_attention", "checked attention takes the PyTorch tiled loop")
    if fn is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.restype = i64
    fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, f32, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                   ptr, ptr, i64, ctypes.POINTER(ctypes.c_double), ptr, ptr, ctypes.POINTER(_RowRule), ptr, ptr, ptr,
                   ptr, i64, i64, i64, i64, i64]
    return fn


@functools.lru_cache(maxsize=1)
def _torch_cpu() -> ctypes.CDLL | None:
    """The library PyTorch's CPU kernels live in, as already loaded (MKL is linked into it in the x86 wheels)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if path.exists():
            try:
                return ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                return None
    return None


@functools.lru_cache(maxsize=1)
def _sgemm() -> int | None:
    """The address of sgemm_ (Fortran BLAS) in the library PyTorch's CPU kernels link (MKL in the x86 wheels), so
    that the kernel's GEMMs run on the BLAS, and under the thread settings, PyTorch's own matmuls do."""
    lib = _torch_cpu()
    try:
        return None if lib is None else ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except AttributeError:
        return None


@functools.lru_cache(maxsize=1)
def _mkl_local_threads() -> Callable[[int], int] | None:
    """MKL's per-thread thread count setter (returns the previous setting), or None where the BLAS is not MKL."""
    lib = _torch_cpu()
    try:
        fn = None if lib is None else lib.MKL_Set_Num_Threads_Local
    except AttributeError:
        return None
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn
