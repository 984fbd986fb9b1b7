"""The checked attention backward on the GPU: the Triton kernels of kernels/triton_attention_bwd.py under the engine's
policy, with no host-device sync. What the kernels find stays on the device until the step boundary
(checks/deferred.py), where one sync per step emits the detections: "recomputed" for a flagged block whose repair
came back clean, "uncorrectable" for one that flagged again (a fault that repeats), "detected" in detect mode (no
repair is launched there, and the gradients keep the fault, as every backend's do in that mode).

``backward`` is what an autograd Function calls with the forward's verified output and row log-sum-exp: the Triton
forward's (attention/backends), and the PyTorch tile loop's off the CPU (attention/backward/fused.py).

Legend: B batch, H query heads, HK key/value heads, T queries, S keys, D head dim, O the kernels' ops, P programs.
"""
from __future__ import annotations

import functools
import logging
import math
import os

import torch

from ...abft.given_backward import GradientAccumulation, given_backward_rule
from ...abft.repair import MatrixReport
from ...abft.tolerance import NEAR_INF, TF32_OPERAND_ROUNDOFF, Tolerance
from ...abft.vector_rules import product_rule, softmax_grad_rule
from ...checks.context import LayerContext, Runtime
from ...checks.deferred import defer
from ...checks.device_time import Clock
from ...checks.product import _tolerance
from ...checks.records import _count, _count_trips
from ...gemm.schedule import whole_step, whole_step_due, whole_step_trips
from ...inject import WindowHit, kernel_write, record_kernel_hits
from ...kernels import triton_attention_bwd as kernels
from ...matmul_precision import current_fp32_precision, fp32_matmul_operand_roundoff

__all__ = ["BACKWARD_ENV", "FULL_ENV", "KernelFailed", "KernelFault", "backward", "check_mode", "emulated_faults",
           "faults_pending", "full_requested", "given_full_takes", "not_supported_reasons", "planned", "requested",
           "take_faults"]

log = logging.getLogger("attnchecker")

KernelFault = kernels.KernelFault

BACKWARD_ENV = "ATTNCHECKER_ATTENTION_BACKWARD"
"""auto (default): the Triton kernels where they run (CUDA), else the checked PyTorch products; triton: the kernels
(a call they cannot take gets the products, with a warning); torch: always the products, whose GEMMs are aten ops
that profilers and fault injectors below autograd see (attention/backward/checked.py)."""
_CHOICES = ("auto", "triton", "torch")

FULL_ENV = "ATTNCHECKER_ATTENTION_BACKWARD_FULL"
"""Where a step that checks the attention backward in full checks it, when the vendor made the forward. kernel
(default): our checked backward, which computes and checks every product itself. vendor: the vendor's backward,
what an unprotected step runs, tested by the identities over its gradients (kernels/triton_given_backward_check.py),
a flagged block recomputed by our kernels. Compiled for sm_90 the identities' loop issues more instructions per tile
than our checked passes' two loops together (docs/performance.md §12), so the vendor's stays opt-in until a GPU run
(bench/gpu_suite.py's "abft_given" against "abft") says which is faster."""
_FULL_CHOICES = ("kernel", "vendor")

_pending: list[KernelFault] = []

_failed: list[str] = []
"""Why the kernels are off for the process, once they failed at run time (a configuration this Triton could not
compile, a launch that raised): every later call gets the PyTorch products, and the call that failed too."""


class KernelFailed(RuntimeError):
    """The kernels failed before writing anything: the caller computes the gradients another way."""


def requested() -> str:
    """ATTNCHECKER_ATTENTION_BACKWARD: auto, triton or torch. Raises ValueError on anything else."""
    mode = os.environ.get(BACKWARD_ENV, "auto").strip().lower() or "auto"
    if mode not in _CHOICES:
        raise ValueError(f"{BACKWARD_ENV}={mode!r}: use one of {', '.join(_CHOICES)}")
    return mode


def full_requested() -> str:
    """ATTNCHECKER_ATTENTION_BACKWARD_FULL: kernel or vendor. Raises ValueError on anything else."""
    mode = os.environ.get(FULL_ENV, "kernel").strip().lower() or "kernel"
    if mode not in _FULL_CHOICES:
        raise ValueError(f"{FULL_ENV}={mode!r}: use one of {', '.join(_FULL_CHOICES)}")
    return mode


def not_supported_reasons(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                          attn_mask: torch.Tensor | None) -> list[str]:
    """Why ``backward`` cannot take this call ([] = it can), ATTNCHECKER_ATTENTION_BACKWARD=torch included."""
    reasons = ["ATTNCHECKER_ATTENTION_BACKWARD=torch"] if requested() == "torch" else list(_failed)
    if attn_mask is not None and attn_mask.requires_grad:
        reasons.append("a mask that requires grad (the kernels give no gradient for it)")
    return reasons + kernels.not_supported_reasons(q_BHTD, k_BHSD, v_BHSD, attn_mask)


def check_mode(runtime: Runtime) -> str:
    """What a backward of this step checks under the runtime's policy: "abft" where the whole-step checks are due
    (protect(scope="all")), "tripwire" where they get tier 1, else "off"."""
    if whole_step_due(runtime):
        return "abft"
    return "tripwire" if whole_step_trips(runtime) else "off"


def emulated_faults(faults: list[KernelFault]) -> _Pending:
    """Tests: the next backward through ``backward`` (with faults=None) inside the block writes these faults in its
    kernels, as a fault of their own arithmetic would; persistent ones again in the repair's recompute."""
    return _Pending(faults)


class _Pending:
    def __init__(self, faults: list[KernelFault]) -> None:
        self.faults = list(faults)

    def __enter__(self) -> None:
        _pending[:] = self.faults

    def __exit__(self, *exc: object) -> None:
        _pending.clear()


def faults_pending() -> bool:
    """Whether emulated faults wait for the next backward (tests): only our kernels can write them, so that backward
    runs in them, not the vendor's checked over."""
    return bool(_pending)


def take_faults() -> list[KernelFault] | None:
    """The pending emulated faults, now consumed (None: none)."""
    if not _pending:
        return None
    got = list(_pending)
    _pending.clear()
    return got


def backward(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,
    lse_BHT: torch.Tensor,
    dout_BHTD: torch.Tensor,
    *,
    scale: float,
    is_causal: bool,
    window: int | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor = 0,
    check: str,
    faults: list[KernelFault] | None = None,
    ctx: LayerContext | None,
    scores_dtype: torch.dtype | None = None,
    given: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    accumulation: GradientAccumulation | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (B, H, T, D), dk, dv (B, HK, S, D), dk and dv summed over each KV head's query heads) of
    softmax(scale·QKᵀ + mask)·V with dropout (kernels/triton_dropout.py's mask for ``seed``, an int or the forward's
    (1,) int64 device tensor), at the forward's
    verified out and lse (fp32, +INF on rows with every key masked). check: "abft", "tripwire" or "off"
    (``check_mode`` picks it from the step's policy); the policy's mode "off" turns it off, "detect" launches no
    repair. faults: emulated faults (tests; None: those of ``emulated_faults``). ctx: where the records go (None:
    check "off" only). scores_dtype: the dtype the forward rounded its scores to (the PyTorch tile loop's
    half-precision products), None where it kept them in fp32 (a fused kernel): the row-sum identities' bounds
    (abft.vector_rules.softmax_grad_rule). given: (dq, dk, dv) an unchecked backward made: for check "tripwire"
    tier 1 reads them, for check "abft" (``given_full_takes``) the identities of abft/given_backward.py test them,
    with ``accumulation``, how that backward rounds its sums; the blocks that flag are recomputed by the kernels into
    them, checked in full (``kernels.run``); returned. Window, mask and causal: kernels.run. No host-device sync."""
    if check not in kernels.CHECKS:
        raise ValueError(f"check must be one of {kernels.CHECKS}, got {check!r}")
    if ctx is None or ctx.config.mode == "off":
        check = "off"
        if given is not None:
            return given
    clock = Clock(q_BHTD.device, full=check == "abft")
    faults = take_faults() if faults is None else faults
    hits, rows = _planned(ctx, q_BHTD.shape, k_BHSD.shape)
    table = kernels.fault_table(rows + (faults or []), q_BHTD.device) if rows else faults
    tf32 = q_BHTD.dtype == torch.float32 and current_fp32_precision(q_BHTD.device.type) == "tf32"
    rules = None
    identities = None
    tile = kernels.tiles(q_BHTD.shape[-1], q_BHTD.device, q_BHTD.dtype)
    if check == "abft":
        assert ctx is not None
        _, h, t, d = q_BHTD.shape
        # The forward's fp32 products rounded their operands too, under the same flags (its scores and output).
        u_fwd = fp32_matmul_operand_roundoff(q_BHTD.device) if q_BHTD.dtype == torch.float32 else None
        rules = _rules(tile.block, t, k_BHSD.shape[-2], d, h // k_BHSD.shape[1], q_BHTD.dtype,
                       _tolerance(ctx), tf32, u_fwd or 0.0, scores_dtype)
        if given is not None:
            if accumulation is None:
                raise ValueError("a full check of given gradients needs how their backward rounds its sums "
                                 "(accumulation: abft.given_backward.CPU_FLASH(t) or FP32_ACCUMULATION)")
            identities = _identities(q_BHTD.dtype, _tolerance(ctx), accumulation)
    repair = ctx is not None and ctx.config.mode == "correct"
    try:
        dq, dk, dv, launch = kernels.run(
            q_BHTD, k_BHSD, v_BHSD, out_BHTD, lse_BHT, dout_BHTD, scale=scale, is_causal=is_causal, window=window,
            attn_mask=attn_mask, dropout_p=dropout_p, seed=seed, check=check, rules=rules, faults=table,
            repair=repair, tf32=tf32, tile=tile, given=given, identities=identities)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        # Nothing deferred or counted yet. Tier 1's gradients were made already: they go on unread this once.
        _failed.append(f"the Triton backward failed here once ({type(exc).__name__}: {str(exc)[:200]})")
        log.error("attnchecker: the Triton attention backward failed and is off for this process; its calls run "
                  "the PyTorch products: %s", exc, exc_info=exc)
        if given is not None:
            return given
        raise KernelFailed(_failed[-1]) from exc
    if hits:
        assert isinstance(table, torch.Tensor)
        record_kernel_hits(hits, kernels.faults_seen(table))
    if launch is not None:
        assert ctx is not None
        ops = kernels.GIVEN_OPS if identities is not None else kernels.OPS
        _defer(ctx, launch, check, ops)
        # On CUDA the kernels' time, on the device, is added at the step boundary (checks/device_time.py).
        if check == "abft":
            seconds = clock.seconds(ctx, ops) / len(ops)
            for op in ops:
                _count(ctx, op, seconds)
        else:
            _count_trips(ctx, TRIP_OPS, clock.seconds(ctx))
    return dq, dk, dv


TRIP_OPS: tuple[str, ...] = ("grad_v", "grad_k", "grad_q")
"""What tier 1 looks at: the three outputs."""


def planned(ctx: LayerContext | None) -> bool:
    """Whether attnchecker.inject's plan has a fault due in this layer's attention backward on this step, under
    protect(scope="all"), the scope that protects that backward (checked in full on this step or by tier 1; the
    policy's mode "detect" shows what the fault does to the gradients unrepaired; under mode "off" the model runs
    unprotected, its backward in the vendor's kernels, and the plan does not reach it). Such a backward runs in
    products a fault can reach, these kernels or the checked PyTorch products (attention/backward/checked.py), not in
    a fused kernel that keeps them to itself (the CPU's, SDPA's, a vendor's). Host-only dict lookups."""
    injector = None if ctx is None else ctx.runtime.injector
    if injector is None or not whole_step(ctx.runtime) or ctx.config.mode == "off":  # type: ignore[union-attr]
        return False
    return any(injector.fires(op=op, layer=ctx.layer, step=ctx.step) for op in kernels.OPS)  # type: ignore[union-attr]


def _planned(ctx: LayerContext | None, q_shape: torch.Size, k_shape: torch.Size
             ) -> tuple[list[WindowHit], list[KernelFault]]:
    """attnchecker.inject's faults for this backward, located on each product's whole shape (Injector.resolve) and
    written as the kernels' table, one row per element: S and dP (B, H, T, S) in the key pass (whose dK and dV use
    them), dQ (B, H, T, D), dV and dK (B, HK, S, D) in their first tile's share of the sum."""
    injector = None if ctx is None else ctx.runtime.injector
    if injector is None or not planned(ctx):
        return [], []
    assert ctx is not None
    b, h, t, d = q_shape
    hk, s = k_shape[1], k_shape[2]
    shapes = {"scores_bwd": (b, h, t, s), "grad_probs": (b, h, t, s), "grad_q": (b, h, t, d), "grad_v": (b, hk, s, d),
              "grad_k": (b, hk, s, d)}
    hits: list[WindowHit] = []
    table: list[KernelFault] = []
    for op in kernels.OPS:
        heads = shapes[op][1]
        for hit in injector.resolve(op=op, layer=ctx.layer, step=ctx.step, shape=shapes[op]):
            hits.append(hit)
            kind, value = kernel_write(hit.fault)
            n = hit.lead[0] * heads + hit.lead[1]
            side = "queries" if op == "grad_q" else "keys"
            table += [KernelFault(op=op, n=n, row=r, col=c, kind=kind, value=value, side=side,
                                  persistent=hit.fault.persistent) for r in hit.rows for c in hit.cols]
    return hits, table



@functools.lru_cache(maxsize=64)
def _rules(block: int, t: int, s: int, d: int, group: int, dtype: torch.dtype, tol: Tolerance, tf32: bool,
           u_fwd: float, scores_dtype: torch.dtype | None) -> kernels.Rules:
    """The bounds' scalars of one call shape (abft.vector_rules): the tiles' S and dP (vectors ``block`` long over D
    products), dV and dK (D long over the group's G·T rows), dQ (D long over S keys), Σ_j dS_ij."""
    r = TF32_OPERAND_ROUNDOFF if tf32 else None
    return kernels.Rules(
        tile=product_rule(block, d, tol, operand_roundoff=r).scalars(),
        keys=product_rule(d, t * group, tol, operand_roundoff=r).scalars(),
        queries=product_rule(d, s, tol, operand_roundoff=r).scalars(),
        softmax=softmax_grad_rule(t=t, s=s, d=d, dtype=dtype, tol=tol, u_fwd=u_fwd, u_kernel=r or 0.0,
                                  scores_dtype=scores_dtype).scalars())


def given_full_takes(dtype: torch.dtype, ctx: LayerContext) -> bool:
    """Whether the identities over given gradients can check this call in full: half-precision inputs and a
    round-off tolerance (abft.given_backward.given_backward_rule)."""
    try:
        given_backward_rule(dtype, _tolerance(ctx))
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=16)
def _identities(dtype: torch.dtype, tol: Tolerance, acc: GradientAccumulation) -> kernels.GivenIdentities:
    """The identities' scalars for the kernel (abft.given_backward), one per call shape's dtype and tolerance."""
    return kernels.GivenIdentities.of(dtype, tol, acc)


def _defer(ctx: LayerContext, launch: kernels.Launch, check: str, ops: tuple[str, ...]) -> None:
    """One deferred record per op of ``ops``, all with one flag: whether any program's status word has a bit set
    (one device op; an op's reports look for its own bit, after the step boundary's read), and for check "abft" the
    worst ratio of the vectors that passed (a flagged one is reported, not a margin), which the step boundary adds to
    the histogram."""
    any_flagged = launch.status_P.amax()  # the words are ≥ 0: nonzero where some program flagged some op
    worst_O = None
    if check == "abft":
        ratio_PO = launch.summary_PO6[..., 0]
        worst_O = torch.where(ratio_PO <= 1.0, ratio_PO, 0.0).amax(0)
    tier = "abft" if check == "abft" else "tripwire"
    for o, op in enumerate(kernels.OPS):
        if op not in ops or (check == "tripwire" and op not in TRIP_OPS):
            continue
        defer(ctx, op, any_flagged, functools.partial(_reports, launch, o, check), tier=tier,
              ratio=None if worst_O is None else worst_O[o])


def _reports(launch: kernels.Launch, o: int, check: str) -> list[MatrixReport]:
    """At the step boundary, after the drain's sync: one report per program that flagged op ``o``."""
    status = launch.status_P.tolist()  # sync: slow path only (a flagged step)
    repaired = None if launch.repaired_P is None else launch.repaired_P.tolist()  # sync: slow path only
    reports = []
    for p, word in enumerate(status):
        if not word >> o & 1:
            continue
        _, head, index, error, bound, column = launch.summary_PO6[p, o].tolist()  # sync: slow path only
        _, batch, _ = launch.program(p)
        outcome = None if repaired is None else repaired[p]
        if check == "tripwire":
            # Tier 1: a block that trips again after its recompute, within what its inputs can give, holds what
            # they give: an event only when that is not finite; values past NEAR_INF from finite inputs are diverged
            # training. Outcome 4: past what they can give, a fault that came back in the recompute. Outcome 3: an
            # INF the half-precision range gives from finite values (GradScaler's overflow steps).
            if (outcome == 2 and math.isfinite(error)) or outcome == 3:
                continue
            action = "recomputed" if outcome == 1 else "uncorrectable" if outcome == 4 else "detected"
            reports.append(MatrixReport(index=(batch, int(head)), pattern="1d", row=int(index), col=None, value=error,
                                        residual=None, bound=NEAR_INF, action=action))
            continue
        action = {None: "detected", 1: "recomputed", 2: "uncorrectable"}[outcome]
        at = int(index)
        reports.append(MatrixReport(index=(batch, int(head)), pattern="1d", row=None if column else at,
                                    col=at if column else None, value=error,
                                    residual=abs(error) if math.isfinite(error) else None, bound=bound, action=action))
    return reports

