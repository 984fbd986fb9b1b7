"""The Triton backend: the checked attention forward as one fused kernel per call and a repair kernel after it
(kernels/triton_attention.py), for CUDA. The tile contract is verified in the kernel with every tile in registers,
flags and the records of flagged blocks stay on the device, and a flagged block is recomputed, with located errors
corrected, by the repair kernel, on the device: the call makes no host-device sync. The host learns what happened at
the step boundary (checks/deferred.py), in one sync for the whole step, and only reads a call's records when its
status says something flagged.

On CPU tensors it runs under Triton's interpreter (TRITON_INTERPRET=1), only where ATTNCHECKER_ATTENTION=triton asks
for it (the interpreter runs a tile in tens of milliseconds): the tests run the engine's suites on it that way.

Faults: ``attnchecker.inject``'s plan is written into the kernel's tiles (its fault table), as are
kernels.triton_attention.emulated_faults; a dispatch-mode injector below autograd never sees the kernel's products,
so a call under a TorchDispatchMode is declined (ATTNCHECKER_ATTENTION=tiled runs them as torch ops).

Backward: the verified output and log-sum-exp feed, on the CPU without dropout, the fused CPU kernel's backward
(attention/backward/fused.py: under protect(scope="all") its checked encoded form), as the tiled backend's; on CUDA and
with attention dropout, the Triton backward (attention/backward/triton_backward.py), which regenerates the forward's
keep mask from its seed and checks its own products under protect(scope="all") (``_KernelBackward``).
"""
from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ...abft.repair import MatrixReport, pattern_of
from ...abft.tolerance import NEAR_INF
from ...checks.context import LayerContext
from ...checks.deferred import defer
from ...checks.device_time import Clock
from ...checks.product import _tolerance
from ...checks.records import _count, _count_trips
from ...inject import WindowHit, kernel_write, record_kernel_hits
from ...kernels import triton_attention as kernel
from ...matmul_precision import current_fp32_precision, fp32_matmul_operand_roundoff
from .. import vendor
from ..backward import fused, triton_backward
from ..backward.fused import (
    _additive_mask,
    _expand_heads,
    _Forward,
    _off_cpu_backward,
    _sdpa_backward,
    _VerifiedAttention,
    sdpa_tier1_on_device,
    sum_groups,
)
from ..backward.replay import Replay, replay_backward
from . import AttentionCall, BackendOutput
from .tiled_torch import mods_reasons

__all__ = ["FULL_ENV", "MAX_HEAD_DIM", "KernelFailed", "TritonBackend", "full_requested", "reports_of"]

log = logging.getLogger("attnchecker")

MAX_HEAD_DIM = 256
"""The largest head dim the kernel tiles (a whole head row is one tile row; beyond 256 its registers spill)."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTIONS = ("detected", "recomputed", "corrected", "uncorrectable")

_failed: list[str] = []
"""Why the kernel is off for the process, once it failed at run time: a configuration this Triton could not compile
(the interpreter the tests run under never compiles one: bench/triton_compile_matrix.py compiles them offline), or
a launch that raised. The backend then declines every call and the next backend in auto's order takes it, the one
that failed included (attention/pipeline.py): training goes on, checked, and ``Guard.coverage`` says why."""


class KernelFailed(RuntimeError):
    """The kernel failed on a call that nothing was written for yet: the pipeline runs that call on the next
    backend."""


class TritonBackend:
    name = "triton"

    def not_supported_reasons(self, call: AttentionCall, *, tier1: bool = False, trip: bool = True) -> list[str]:
        """Why the backend cannot run ``call`` ([] if it can); tier1: for ``tier1`` (with ``trip``), whose products
        are the vendor's aten op where it takes the call (a TorchDispatchMode sees them then)."""
        q, k, v, mask = call.q_BHTD, call.k_BHSD, call.v_BHSD, call.attn_mask
        why = kernel.not_available_reason(q.device)
        if why is not None:
            return [why]
        reasons = list(_failed)
        if q.device.type == "cpu" and call.requested != self.name:
            reasons.append("CPU tensors under Triton's interpreter: taken only when ATTNCHECKER_ATTENTION=triton asks "
                           "(the interpreter is for tests)")
        if _get_current_dispatch_mode() is not None and not (
                _tier1_on_vendor(call, trip=trip) if tier1 else _vendor_takes(call) and _full_over_vendor(
                    call, _tiers(call))):
            reasons.append("a TorchDispatchMode is active, and it expects to see the products as aten ops (the "
                           "kernel's are not)")
        if any(type(x) is not torch.Tensor for x in (q, k, v)):
            reasons.append("a tensor subclass (fake, meta or distributed) has no memory of its own to read")
        if any(x.dtype != q.dtype for x in (k, v)) or q.dtype not in _DTYPES:
            reasons.append(f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: the kernel takes float32, bfloat16 or float16, "
                           "the same for q, k and v")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            reasons.append("operands that are not (B, H, T, D)")
        elif v.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]:
            reasons.append("v's head dim differs from q's and k's")
        elif q.shape[-1] > MAX_HEAD_DIM:
            reasons.append(f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}, more than the kernel tiles")
        elif 0 in q.shape or 0 in k.shape:
            reasons.append("an empty operand")
        if call.return_probs:
            reasons.append("the caller asked for AP itself (return_probs), which the kernel never holds whole")
        reasons += mods_reasons(call, self.name)
        if call.paper:
            reasons.append("paper-faithful checksum passing: its references sum over all T tokens, not one tile's")
        if call.mask_grad:
            reasons.append("a mask that requires grad (a learned bias): only a graph through the mask gives its "
                           "gradient")
        if mask is not None and (mask.device != q.device or not (mask.dtype == torch.bool or mask.is_floating_point())
                                 or mask.dim() > 4):
            reasons.append("a mask that is not a bool or floating tensor of at most 4 dims on q's device")
        if q.dtype == torch.float32 and current_fp32_precision(q.device.type) == "bf16":
            reasons.append("fp32 matmuls in oneDNN's bf16 mode: the kernel's GEMMs are IEEE fp32 or TF32")
        if not math.isfinite(call.scale):
            reasons.append(f"scale {call.scale!r} is not finite")
        return reasons

    def run(self, call: AttentionCall) -> BackendOutput:
        """Every op the step verifies, traps (tier 1) or forces, verified in full in the kernel (as the tiled path
        does: per tile the checks cost about what the tripwire would), or, where an op is verified and the vendor's
        fused attention takes the call, over the vendor's forward (``_full_over_vendor``)."""
        tiers = _tiers(call)
        return _run(call, "full" if tiers else None, tiers)

    def tier1(self, call: AttentionCall, *, trip: bool = True) -> torch.Tensor:
        """Tier 1 (attention/pipeline.py, when neither op is due), a trip recovered by the repair kernel with full
        checks, on the device. The products: the vendor's fused attention (attention/vendor.py) where it
        takes the call and no fault is planned in the kernel's products, read by one Triton pass; else the kernel's
        tripwire variant. Where this step checks the backward in full (``_backward_takes_exact_lse``) the vendor's
        lse is not what our checked backward takes: the full checks over the vendor's forward make it so, their
        events under tier "tripwire", else the kernel's tripwire variant makes the call (``_tier1_on_vendor``).
        trip False (the policy's tripwire off, the backward checked in full): the kernel, unchecked, for its lse."""
        if not trip:
            return _run(call, None, {}, on_vendor=False).out_BHTD
        on_vendor = _tier1_on_vendor(call)
        mode = "full" if on_vendor and _backward_takes_exact_lse(call) else "tier1"
        return _run(call, mode, dict.fromkeys(kernel.OPS, "tripwire"), on_vendor=on_vendor).out_BHTD


FULL_ENV = "ATTNCHECKER_ATTENTION_FULL"
"""Where a full check of the attention forward runs. vendor (default): over the vendor's fused forward where it takes
the call (bf16 and fp16, no mask, dropout or window; abft/given_forward.py), whose products are aten ops that
profilers and fault injectors below autograd see; kernel: always in our checked kernel, which computes the products
itself and checks them tile by tile (and then the backward is ours too). The backward's: triton_backward.FULL_ENV."""
_FULL_CHOICES = ("vendor", "kernel")


def full_requested() -> str:
    """ATTNCHECKER_ATTENTION_FULL: vendor or kernel. Raises ValueError on anything else."""
    mode = os.environ.get(FULL_ENV, "vendor").strip().lower() or "vendor"
    if mode not in _FULL_CHOICES:
        raise ValueError(f"{FULL_ENV}={mode!r}: use one of {', '.join(_FULL_CHOICES)}")
    return mode


def _tiers(call: AttentionCall) -> dict[str, str]:
    """Each op the step verifies ("abft"), forces or traps ("tripwire")."""
    cfg = call.ctx.config
    return {op: "abft" if cfg.checks(op) and op not in call.force else "tripwire"
            for op in kernel.OPS if cfg.checks(op) or op in call.force or cfg.trips(op)}


def _full_over_vendor(call: AttentionCall, tiers: dict[str, str]) -> bool:
    """The full checks over the vendor's forward (kernels/triton_given_check.py) rather than in our kernel: an op
    verified and the other verified or trapped, inputs and tolerance the identities' bounds take
    (kernel.given_full_takes), ATTNCHECKER_ATTENTION_FULL not "kernel"; ``_vendor_takes`` besides. Where the
    backward is checked in full this step, the check normalises the vendor's lse for it (``_run``)."""
    checks = kernel.Checks(mode="full", tol=_tolerance(call.ctx))
    # One op verified and the other trapped is the default schedule's step after a fault (the faulty op's period
    # drops to min_period, the other's stays): our kernel checks both ops in full on such a step too and reports the
    # trapped one under tier "tripwire" (``_run``), so the identities, which test both, change nothing but the cost.
    return (set(tiers) == set(kernel.OPS) and "abft" in tiers.values()
            and kernel.given_full_takes(call.q_BHTD.dtype, checks)
            and full_requested() == "vendor")


def _backward_over_vendor(call: AttentionCall, made: vendor.Forward) -> bool:
    """Whether this call's backward, where the step checks it in full, is the vendor's backward checked by the
    identities over its gradients (kernels/triton_given_backward_check.py) rather than our checked backward: the
    vendor made the forward and has a backward at its results, the call takes the Triton backward's route
    (``_KernelBackward``: not the fused CPU kernel's), the identities take its dtype and tolerance, and
    ATTNCHECKER_ATTENTION_BACKWARD_FULL=vendor asks for it (triton_backward.FULL_ENV: opt-in until timed on a GPU)."""
    q = call.q_BHTD
    return (made.backward is not None and made.accumulation is not None and call.needs_grad
            and triton_backward.full_requested() == "vendor" and not _fused_cpu_backward(call)
            and triton_backward.given_full_takes(q.dtype, call.ctx)
            and not triton_backward.not_supported_reasons(q, call.k_BHSD, call.v_BHSD, call.attn_mask))


def _fused_cpu_backward(call: AttentionCall) -> bool:
    """The backward ``_with_grad`` gives a CPU call without dropout: the fused CPU kernel's (``_VerifiedAttention``)."""
    return call.dropout_p == 0.0 and call.q_BHTD.device.type == "cpu" and fused.cpu_kernel


def _vendor_takes(call: AttentionCall) -> bool:
    """Tier 1 on the vendor's forward: no fault planned in the kernel's products (attnchecker.inject's plan, which
    the kernel writes into its tiles) and an op of attention/vendor.py takes the call."""
    return not call.injected and not vendor.not_supported_reasons(
        call.q_BHTD, call.k_BHSD, call.v_BHSD, attn_mask=call.attn_mask, is_causal=call.is_causal,
        dropout_p=call.dropout_p) and call.mods is None and not call.return_lse


def _backward_takes_exact_lse(call: AttentionCall) -> bool:
    """Whether this call's backward is our checked Triton backward (not the fused CPU kernel's) checking in full on
    this step, whose identities take the forward's lse exact to fp32's rounding: the vendor's is not, unless the
    full checks over its forward normalise it. protect(scope="all") checks the backward on the ``out`` op's schedule
    (gemm/schedule.py), so a step of tier 1 for the attention ops can check their backward in full: the default
    schedule's steps after a fault in a Linear GEMM or the backward (``out``'s period drops to min_period, the
    attention ops' stays)."""
    return (call.needs_grad and not _fused_cpu_backward(call)
            and triton_backward.check_mode(call.ctx.runtime) == "abft")


def _tier1_on_vendor(call: AttentionCall, *, trip: bool = True) -> bool:
    """Whether tier 1's call runs over the vendor's forward: the vendor takes it and, where the backward takes an
    exact lse (``_backward_takes_exact_lse``), the full checks over its forward, which normalise its lse, take it too
    (the identities its dtype and tolerance, ATTNCHECKER_ATTENTION_FULL not "kernel"). trip False: never (the
    vendor's forward unchecked has no lse our backward takes)."""
    if not trip or not _vendor_takes(call):
        return False
    return not _backward_takes_exact_lse(call) or (kernel.given_full_takes(call.q_BHTD.dtype, kernel.Checks(
        mode="full", tol=_tolerance(call.ctx))) and full_requested() == "vendor")


def _run(call: AttentionCall, mode: str | None, tiers: dict[str, str], *, on_vendor: bool | None = None
         ) -> BackendOutput:
    """The call in our kernel, or over the vendor's forward: mode None (unchecked), "tier1" or "full"; tiers: the
    tier each op's events and counts take. on_vendor: whether the vendor's forward makes the products (None: tier 1's
    and ``_full_over_vendor``'s choice)."""
    ctx = call.ctx
    for name in ("q", "k", "v"):
        # The tiles take their references from the operands: a projection's passed checksums go unused.
        ctx.passed.take(name)
    q, k, v = call.q_BHTD, call.k_BHSD, call.v_BHSD
    u_in = fp32_matmul_operand_roundoff(q.device) if q.dtype == torch.float32 else None
    checks = kernel.Checks(mode=mode, scores="scores" in tiers, context="context" in tiers, tol=_tolerance(ctx),
                           operand_roundoff=u_in, repair=ctx.config.mode == "correct")
    seed = None
    if call.dropout_p > 0.0:
        # From the device's generator: torch.manual_seed reproduces it, and no value crosses to the host.
        seed = torch.randint(0, 2**31 - 1, (1,), device=q.device, dtype=torch.int64)
    hits, faults = _faults(ctx, q, v.shape[-1], k.shape[-2])
    with torch.no_grad():
        made = None
        over_vendor = on_vendor if on_vendor is not None else (
            mode == "tier1" or (mode == "full" and _full_over_vendor(call, tiers)))
        if over_vendor and not faults and _vendor_takes(call):
            made = vendor.forward(q.detach(), k.detach(), v.detach(), is_causal=call.is_causal, scale=call.scale)
        # A full check's device time (its checks are inside the attention it computes: both timed); tier 1's host
        # time, after the vendor's attention where it ran (what the unprotected model runs too).
        clock = Clock(q.device, full=mode == "full")
        try:
            got = kernel.forward(q.detach(), k.detach(), v.detach(), scale=call.scale, checks=checks,
                                 is_causal=call.is_causal, attn_mask=call.attn_mask, dropout_p=call.dropout_p,
                                 seed=seed, faults=faults, given=None if made is None else (made.out_BHTD,
                                                                                            made.lse_BHT),
                                 # Our checked backward's identities take the lse as exact to fp32's rounding
                                 # (its full check this step): the vendor's is made so (kernels/
                                 # triton_given_check.py). The check over the vendor's backward needs no such thing,
                                 # but our backward is its fallback (a kernel's emulated faults, a failure).
                                 normalise_lse=made is not None and mode == "full"
                                 and triton_backward.check_mode(ctx.runtime) == "abft",
                                 zeros=functools.partial(ctx.runtime.zeroed.take, q.device))
        except torch.OutOfMemoryError:
            raise  # the next backend needs more memory, not less
        except Exception as exc:
            # Nothing deferred or counted yet: the call can run again elsewhere.
            _failed.append(f"the Triton kernel failed here once ({type(exc).__name__}: {str(exc)[:200]})")
            log.error("attnchecker: the Triton checked attention failed and is off for this process; its calls run "
                      "on the next backend (Guard.coverage names it): %s", exc, exc_info=exc)
            raise KernelFailed(_failed[-1]) from exc
    if hits:
        _record_injected(hits, got)
    ops = list(tiers)
    # On CUDA the kernels' device time, added at the step boundary (checks/device_time.py), to the full checks' ops.
    seconds = clock.seconds(ctx, [op for op in ops if mode == "full" and tiers[op] == "abft"]) / max(1, len(ops))
    if got.records is not None:
        for op in ops:
            i = kernel.OPS.index(op)
            # The worst clean ratio rides to the step boundary too, where the step's histogram is one update.
            defer(ctx, op, got.status[i], reports_of(got.records, got.saved, i, q.shape[1]), tier=tiers[op],
                  ratio=got.status[2 + i] if mode == "full" else None)
    out = got.out_BHTD
    if call.needs_grad:
        out = _with_grad(call, got, seed, made, check_vendor=made is not None and _backward_over_vendor(call, made))
    for op in ops:
        if mode == "tier1":
            continue
        if tiers[op] == "abft":
            _count(ctx, op, seconds)
        else:
            _count_trips(ctx, [op], seconds)
    if mode == "tier1":
        _count_trips(ctx, ops, seconds * len(ops))
    return BackendOutput(out, got.lse_BHT)


def _with_grad(call: AttentionCall, got: kernel.Result, seed: torch.Tensor | None,
               made: vendor.Forward | None = None, *, check_vendor: bool = False) -> torch.Tensor:
    """The kernel's output with autograd attached. On the CPU without dropout, the fused CPU kernel's backward at
    the verified output and lse (under protect(scope="all") its checked encoded form), as the tiled backend's.
    Elsewhere (and on the CPU with fused.cpu_kernel off, as tests take the other devices' branch)
    ``_KernelBackward``; made: the vendor's forward, where it made the results (attention/vendor.py), whose backward
    is then the one at them; check_vendor (``_backward_over_vendor``): a full check of the backward tests the
    vendor's gradients, not our kernel's."""
    q, k, v = call.q_BHTD, call.k_BHSD, call.v_BHSD
    if _fused_cpu_backward(call):
        h = q.shape[1]
        out: torch.Tensor = _VerifiedAttention.apply(q, _expand_heads(k, h), _expand_heads(v, h), _Forward(
            out_BHTD=got.out_BHTD, lse_BHT=got.lse_BHT, mask_add=_additive_mask(call.attn_mask, q.dtype),
            scale=call.scale, is_causal=call.is_causal, attn_mask=call.attn_mask, layer=call.ctx,
            block_q=got.block_m))
        return out
    how = Replay(out_BHTD=got.out_BHTD, lse_BHT=got.lse_BHT, attn_mask=call.attn_mask, is_causal=call.is_causal,
                 scale=call.scale, dropout_p=call.dropout_p, seed=seed,
                 vendor_backward=None if made is None else made.backward,
                 vendor_accumulation=made.accumulation if made is not None and check_vendor else None)
    grad: torch.Tensor = _KernelBackward.apply(q, k, v, how, call.ctx)
    return grad


class _KernelBackward(torch.autograd.Function):
    """The backward of a Triton forward off the fused CPU kernel's reach (CUDA, or attention dropout): the Triton
    backward (attention/backward/triton_backward.py) with the step's check (protect(scope="all")) and the forward's
    dropout seed, its scores in fp32 as this kernel kept them. Where the vendor made the forward, the step checks
    the backward in full and ATTNCHECKER_ATTENTION_BACKWARD_FULL=vendor (``Replay.vendor_accumulation``): the
    vendor's backward, tested by the identities over its gradients, a flagged block recomputed by our kernels (unless
    emulated faults wait for our kernels). Tier 1
    without dropout: SDPA's gradient read by the kernels' tier-1 pass (fused.sdpa_tier1_on_device); unchecked without
    dropout, the vendor's backward at its own forward's results where the vendor's forward made them (tier-1 steps:
    attention/vendor.py), else SDPA's recomputed gradient (flash). Where the Triton backward declines
    (ATTNCHECKER_ATTENTION_BACKWARD=torch) or failed in this process: the checked PyTorch products, or with dropout
    the PyTorch replay of the kernel's keep mask (attention/backward/replay.py, unchecked)."""

    @staticmethod
    def forward(ctx, q, k, v, how, layer):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(q, k, v, how.out_BHTD, how.lse_BHT)
        ctx.how, ctx.layer = how, layer
        return how.out_BHTD

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def]
        q, k, v, out, lse = ctx.saved_tensors
        how: Replay = ctx.how
        layer: LayerContext = ctx.layer
        mode = triton_backward.check_mode(layer.runtime)
        # A fault planned in this backward's products (attnchecker.inject) needs them made where it can reach them,
        # in our kernels (or the checked products): not in the vendor's backward, nor in SDPA's under tier 1 or
        # unchecked. (Emulated faults of the tests go to our kernels on a full check, and to the repair elsewhere.)
        ours = triton_backward.planned(layer)
        if not triton_backward.not_supported_reasons(q, k, v, how.attn_mask):
            if (mode == "abft" and how.vendor_backward is not None and how.vendor_accumulation is not None
                    and not ours and not triton_backward.faults_pending()):
                # The vendor's backward, what an unprotected step runs, tested by the identities over its gradients;
                # a block that flags is recomputed into them by our checked backward, on the device.
                given = how.vendor_backward(dout, q, k, v)
                dq, dk, dv = triton_backward.backward(q, k, v, out, lse, dout, scale=how.scale,
                                                      is_causal=how.is_causal, check="abft", ctx=layer, given=given,
                                                      accumulation=how.vendor_accumulation)
                return dq, dk, dv, None, None
            if mode == "tripwire" and how.dropout_p == 0.0 and not ours:
                dq, dk, dv = sdpa_tier1_on_device(layer, dout, q, k, v, out, lse, how.attn_mask, scale=how.scale,
                                                  is_causal=how.is_causal, vendor_backward=how.vendor_backward)
                return dq, dk, dv, None, None
            if mode != "off" or how.dropout_p > 0.0 or ours:
                try:
                    dq, dk, dv = triton_backward.backward(
                        q, k, v, out, lse, dout, scale=how.scale, is_causal=how.is_causal, attn_mask=how.attn_mask,
                        dropout_p=how.dropout_p, seed=0 if how.seed is None else how.seed, check=mode, ctx=layer)
                    return dq, dk, dv, None, None
                except triton_backward.KernelFailed:
                    pass  # logged, and off from now on: the PyTorch branches below
        if how.dropout_p > 0.0:
            return (*replay_backward(q, k, v, out, lse, dout, how), None, None)
        h = q.shape[1]
        if mode == "off" and how.vendor_backward is not None and not ours:
            # The vendor's backward at its own forward's (repaired) results, dK and dV on k's heads: no forward again.
            return (*how.vendor_backward(dout, q, k, v), None, None)
        k_rep, v_rep = _expand_heads(k, h), _expand_heads(v, h)
        if mode == "off" and not ours:
            grads = _sdpa_backward(dout, q, k_rep, v_rep, how.attn_mask, scale=how.scale, is_causal=how.is_causal)
        else:
            grads = _off_cpu_backward(layer, dout, q, k_rep, v_rep, out, lse, how.attn_mask, None, scale=how.scale,
                                      is_causal=how.is_causal, block_q=None)
        dq, dk, dv = grads
        return dq, sum_groups(dk, k.shape[1]), sum_groups(dv, v.shape[1]), None, None


def reports_of(records: torch.Tensor, saved: torch.Tensor | None, op: int, heads: int
               ) -> Callable[[], list[MatrixReport]]:
    """The reports of one op of a call, made from the kernels' records (kernels/triton_attention.FIELDS, the fast
    pass's kept rows located on the host) once the step's drain found the call's status flagged: one per flagged
    (matrix, query block)."""

    def build() -> list[MatrixReport]:
        got = kernel.located(records, saved)[:, :, op, : len(kernel.FIELDS)]
        flagged = (got[..., 0] != 0).nonzero().tolist()  # sync: slow path only, at the step boundary
        picked = got[[n for n, _ in flagged], [i for _, i in flagged]].tolist() if flagged else []  # sync: as above
        reports = []
        for (n, _), fields in zip(flagged, picked, strict=True):
            rep = _report(divmod(n, heads), dict(zip(kernel.FIELDS, fields, strict=True)))
            if rep is not None:
                reports.append(rep)
        return reports

    return build


def _report(index: tuple[int, int], rec: dict[str, float]) -> MatrixReport | None:
    """One block's record as a report: the pattern from its flagged rows and columns, the place of its first flagged
    element (a block's top-left, a line's row or column alone, as abft.repair reports them), the action its outcome
    says; None for a dismissed tier-1 trip."""
    outcome = kernel.OUTCOMES[int(rec["outcome"])]
    if outcome == "dismissed":
        return None
    action = "detected" if outcome == "none" else outcome
    n_rows, n_cols = int(rec["n_rows"]), int(rec["n_cols"])
    row = int(rec["row"]) if rec["row"] >= 0 else None
    col = int(rec["col"]) if rec["col"] >= 0 else None
    pattern = pattern_of(n_rows, n_cols)
    if pattern == "1d":
        row, col = (row, None) if n_rows <= 1 else (None, col)
    residual = rec["residual"] if math.isfinite(rec["residual"]) else None
    bound = rec["bound"] if rec["flag"] != 2 else NEAR_INF
    return MatrixReport(index=index, pattern=pattern, row=row, col=col, value=rec["value"], residual=residual,
                        bound=bound, action=action)


def _faults(ctx: LayerContext, q: torch.Tensor, d: int, s: int
            ) -> tuple[list[tuple[str, WindowHit]], list[kernel.Fault]]:
    """The call's faults as the kernel's table: attnchecker.inject's plan, located on the whole (B, H, T, S) scores
    and (B, H, T, D) context (Injector.resolve), one entry per element; then any emulated ones (tests)."""
    b, h, t, _ = q.shape
    injector = ctx.runtime.injector
    hits: list[tuple[str, WindowHit]] = []
    table: list[kernel.Fault] = []
    if injector is not None:
        for op, shape in (("scores", (b, h, t, s)), ("context", (b, h, t, d))):
            for hit in injector.resolve(op=op, layer=ctx.layer, step=ctx.step, shape=shape):
                hits.append((op, hit))
                kind, value = kernel_write(hit.fault)
                kind = "set" if kind == "value" else kind
                n = hit.lead[0] * h + hit.lead[1]
                table += [(op, n, r, c, kind, value, hit.fault.persistent) for r in hit.rows for c in hit.cols]
    return hits, table + kernel.take_faults()


def _record_injected(hits: list[tuple[str, WindowHit]], got: kernel.Result) -> None:
    """The injector's ground truth of the kernel's faults (attnchecker.inject.record_kernel_hits): a causal tile the
    kernel skipped holds none."""
    assert got.faults_seen is not None
    seen = got.faults_seen.tolist()  # sync: injection only, never on a call without a planned fault
    record_kernel_hits([hit for _, hit in hits], seen)
