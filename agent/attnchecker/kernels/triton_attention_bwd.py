"""The checked attention backward as Triton kernels (FlashAttention-2 style): dQ, dK, dV of
softmax(scale·QKᵀ + mask)·V at the forward's verified output and row log-sum-exp, with checksums on the backward's
own products in the kernel, flags and a small summary on the device, and a repair launch that recomputes what was
flagged. No host-device sync anywhere here.

Launches (each a constant, whatever T and S):
  1. ``_delta``: δ_i = rowsum(dO_i ∘ O_i) in fp32; with check "abft", also what the key pass's checks take from each
     query block alone (norms, checksums and column sums of q and dO), and ``_key_terms`` those of K, with the values'
     norms, for the query pass: made once per call, not in every program's loop over the other side's blocks.
  2. ``_query_pass`` over (query block, batch·head): recomputes S = Q_i K_jᵀ and AP from the lse, dP = dO_i V_jᵀ,
     dS = AP ∘ (dP ∘ Z - δ) key block by key block, and accumulates dQ_i = scale·Σ_j dS_ij K_j.
  3. ``_key_pass`` over (key block, batch·KV head): the same S, AP, dP, dS for its keys against every query block
     (and every query head of its GQA group), accumulating dV_j = Σ_i (AP ∘ Z)ᵀ dO_i and dK_j = scale·Σ_i dSᵀ Q_i.
  4., 5. the same two kernels with REPAIR: a program whose first run flagged nothing returns at once; a flagged one
     recomputes its block (a transient fault does not repeat), checks it again and says on the device whether it
     came back clean. Each program owns its outputs (dQ rows, or dK and dV rows), so a recompute touches nothing else.
Dropout: Z = keep/(1-p) regenerated from the forward's counter-based mask (kernels/triton_dropout.py).
Tier 1 over given gradients (``run(given=...)``: SDPA's, on a tier-1 step without dropout): ``_delta``, then
``_trip_given`` in place of launches 2 and 3 (one read of dQ, dK, dV), then 4 and 5 as above. The full check over
given gradients (``run(check="abft", given=...)``: the vendor's, on a full step whose forward it made): ``_delta``
(with ‖O_i‖) and ``_key_terms``, then the identities (kernels/triton_given_backward_check.py) in place of launches 2
and 3, then 4 and 5 with their full checks, recomputing only what the identities flagged.

Checks (``check="abft"``), every product, one direction each (a repair recomputes, so a flag need not locate):
  scores_bwd  S = Q Kᵀ per tile: by rows (over the tile's keys) in the key pass, by columns (over its queries) in
              the query pass; references Q_i·(K_jᵀ w) and (wᵀQ_i)·K_j from the block the program keeps. And
              Σ_j AP_ij = 1 per query row: the recomputed AP against the forward's lse (a wrong lse scales a row of
              AP, which every checksum downstream is consistent with).
  grad_probs  dP = dO Vᵀ per tile, the same way; and Σ_j dS_ij = 0 per query row (an identity of any consistent AP,
              dP and δ, attention/backward/encoded.py): it sees what feeds dS elementwise, one recomputed score or
              probability off, and δ.
  grad_v      dV_j = Σ_i (AP ∘ Z)ᵀ dO_i, by rows once accumulated: the reference Σ_i (AP ∘ Z)_ijᵀ (dO_i w) is
              accumulated beside it, so a fault in a tile's product or in the accumulation shows.
  grad_k      dK_j = Σ_i dS_ijᵀ Q_i, likewise.   grad_q  dQ_i = Σ_j dS_ij K_j, likewise.
The bounds are abft's calibrated rules (abft/vector_rules.py: direction_bounds factored into scalars), evaluated per
vector from norms the programs make of the blocks they load. ``check="tripwire"``: INF, NaN or |x| > NEAR_INF in
dQ, dK, dV only; ``check="off"``: the plain kernels (to time what the checks cost).

Faults (``KernelFault``: attnchecker.inject's plan, tests): the kernels' products never reach a TorchDispatchMode, so
an emulated fault table overwrites elements right after the product that made them (inf, nan, 1e20, an exponent bit
flip, a finite error), and says in the table which it wrote (``fault_table``, ``faults_seen``).

Legend: B batch, H query heads, HK key/value heads (G = H/HK per group), T queries, S keys, D head dim; N = B·H a
matrix; P programs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..abft.given_backward import GradientAccumulation, given_backward_rule
from ..abft.given_forward import U32
from ..abft.tolerance import Tolerance
from . import triton_checks as tc
from . import triton_dropout
from . import triton_given_backward_check as given_check
from .triton_common import cdiv, device_function, host_table, interpreting, next_power_of_2, shared_per_block, triton

if triton is not None:
    import triton.language as tl

    from .triton_attention_bwd_parts import (
        _beyond,
        _clear_summary,
        _dot,
        _keep_worst,
        _key_block,
        _keys_nonfinite,
        _keys_top,
        _nonfinite,
        _queries_nonfinite,
        _queries_top,
        _query_block,
        _row_norms,
        _rows_nonfinite,
        _store_status,
    )

__all__ = ["CHECKS", "FAULT_ROW", "FIELDS", "GIVEN_OPS", "OPS", "GivenIdentities", "KernelFault", "Launch", "Rules",
           "Tiles", "available", "bench_checks", "by_dot", "fault_table", "faults_seen", "gpu_tiles", "interpreting",
           "not_supported_reasons", "pass_warps", "run", "tiles", "warps_for"]

OPS: tuple[str, ...] = ("scores_bwd", "grad_probs", "grad_v", "grad_k", "grad_q")
"""The checked products, in the order of an Outcome's per-op fields and of a status word's bits."""
GIVEN_OPS: tuple[str, ...] = ("grad_v", "grad_k", "grad_q")
"""What the check over given gradients verifies (``GivenIdentities``): the three outputs. A fault inside the other
backward's S or dP shows in the gradients made from it."""
FIELDS: tuple[str, ...] = ("ratio", "head", "index", "error", "bound", "column")
"""Per program and op, the worst vector of its first run: |d|/bound (INF for NaN), its head, its row (or its column
when ``column`` is 1), d1 = checksum - reference (abft: the error as the checksum sees it), the bound."""
CHECKS: tuple[str, ...] = ("off", "tripwire", "abft")
FAULT_KINDS: tuple[str, ...] = ("value", "add", "bitflip")
_SIDES = ("keys", "queries")
FAULT_ROW = 14
"""Floats per row of the fault table: the fault (``KernelFault.row_values``, 8), then what the kernels saw of it,
(applied, value before, value after) in the first run and in the repair's recompute (``faults_seen``)."""
BLOCK = 32
"""Rows and keys per tile, under the interpreter and on a GPU where it fits (``gpu_tiles``). Chosen from the compiler,
not from timing: ptxas for sm_90 (bench/triton_kernels.py, docs/perf/triton_backward_kernels.json; bf16, causal) had
the checked kernels spilling 36-344 bytes per thread at 32×32 tiles and 8 warps, D = 64 and 128, against 1.3-4.7 KB
at 64×64 (8 warps) and up to 17.7 KB at 64×64 (4 warps); the unchecked ones 0-32 bytes at 32 and 0-72 at 64."""
NUM_WARPS = 8
"""Warps per program where fewer would spill kilobytes: 32×32 tiles at head dim 256, and fp32 inputs (``warps_for``)."""
FEW_WARPS = 4
"""Warps per program, bf16 and fp16, on 32×32 tiles up to head dim 128 and on 16×16 tiles (``warps_for``)."""
TRIP_WARPS = 8
"""Warps of ``_trip_given``, one read of a block's gradients: on Triton's default 4 it needs 255 registers and spills
56 bytes at head dim 128, on 8 it takes 159 and none (sm_90, bench/triton_kernels.py)."""
GIVEN_WARPS = 8
"""Warps of the full check over given gradients (triton_given_backward_check._check_given_bwd): on 8 it takes 255
registers and spills 40 bytes at head dim 64 and 52 at 128, on 4 it spills 140 at 64, though its loop then issues
6,312 instructions a tile against 9,728 (sm_90, bench/triton_kernels.py --given --mix): a GPU run should time both."""
MAX_HEAD_DIM = 256


def available() -> bool:
    """Whether the kernels can run here: triton imports, and there is a CUDA device or the interpreter is on."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


@dataclass(frozen=True, slots=True)
class Tiles:
    block: int
    """Rows and keys per tile (the rules' tile vectors are this long)."""
    stages: int
    """Software-pipeline stages of the passes' loops (Triton's num_stages; its default is 3)."""
    warps: int = NUM_WARPS
    """Warps per program (Triton's num_warps; ``warps_for``)."""
    checked_key_warps: int | None = None
    """Warps of the key pass's programs under check "abft" with every reference on the tensor cores (BY_DOT 3) and its
    repair, where not ``warps`` (``pass_warps``)."""


KEY_PASS_CHECKED_WARPS = 2
"""Warps of the key pass's checked programs on 32 × 32 tiles up to head dim 64 in bf16 and fp16 (``gpu_tiles``). Its
products share one tensor-core layout that splits a tile's 32 rows across the warps, 16 rows an instruction: on 4
warps two of them hold and check the same rows again. On 2 the checked loop issues about half the instructions a
tile, at the same 8 warps resident per SM (four programs of 2 at up to 255 registers) and a spill stack as small
(sm_90, bf16, as launched, bench/triton_kernels.py --mix: 5,032 → 2,576 a tile at D 64, spilling 32 and 56 bytes;
its repair 5,164 → 2,636). With its references as fp32 sums (refs_by_dot off) it would spill 932 bytes, and at D 128
1.6 KB: those keep 4. So do the unchecked and tier-1 passes: they shorten too (784 → 606), but at fewer registers a
program 4 warps keep 12 warps resident against 8. Not timed on a GPU."""


def pass_warps(tile: Tiles, kernel: str, check: str, by_dot: int) -> int:
    """The warps a pass's programs launch on: ``tile.warps``, or ``tile.checked_key_warps`` for the key pass under check
    "abft" with both its BY_DOT bits (by_dot: the BY_DOT it launches with)."""
    if kernel == "_key_pass" and check == "abft" and by_dot == 3 and tile.checked_key_warps is not None:
        return tile.checked_key_warps
    return tile.warps


def warps_for(block: int, block_d: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Warps per program for block × block tiles at padded head dim block_d and inputs of dtype: FEW_WARPS, except
    NUM_WARPS for fp32 inputs and on 32×32 tiles at 256. A 32×32 tile is smaller than 8 warps' tensor-core layout,
    so 8 warps hold and check much of it several times over: the work of one tile, summed over the program's warps,
    is 54 to 58 % of it with 4 (bf16, full checks, sm_90 offline: key pass 12,304 → 6,932 instructions per tile at
    D = 64, 17,096 → 9,968 at 128; query pass 12,312 → 6,916 and 15,488 → 8,312; unchecked 2,976 → 2,196 and
    3,088 → 2,348 at 64), with the same 8 warps resident per SM (two programs of 4 at up to 255 registers). At 32×32
    and D = 256, 4 warps spill 1.1 to 2.7 KB, and with fp32 inputs (fp32 products, TF32 or not, and the references'
    fp32 sums) 0.8 to 11 KB where 8 spill 0.1 to 5.3 KB (the checked configurations the backward's tests launch,
    compiled for sm_89: docs/perf/triton_compile_matrix_sm89_bwd_abft_warps.json). Not timed on a GPU:
    bench/gpu_suite.py's tiles section times both counts."""
    if dtype == torch.float32 or (block == BLOCK and block_d > 128):
        return NUM_WARPS
    return FEW_WARPS


SHARED_NEEDED: dict[tuple[int, int, int], int] = {
    (64, BLOCK, 3): 57888,
    (128, BLOCK, 3): 107040, (128, BLOCK, 2): 74016,
    (256, BLOCK, 3): 205344, (256, BLOCK, 2): 139552, (256, 16, 2): 67744}
"""(padded head dim, block, stages) -> the most shared memory a key or query pass needed at those tiles, bytes, over
the configurations bench/triton_compile_matrix.py compiled with Triton 3.9 (sm_80 and sm_89: the same bytes for each
arch; docs/performance.md §7). (256, BLOCK, 3): the configuration heaviest at 128 (causal, full checks), compiled
alone for sm_90."""


def by_dot(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """(query pass, key pass): which of a checked call's references each makes on the tensor cores, BY_DOT's bits.
    Bit 1: the S and dP checks' references, from the block the program keeps (``triton_checks.parts_of``); bit 2 (key
    pass): dV's and dK's, from _delta's parts of each query block. bf16 and fp16 only (their products with the parts
    are exact in fp32). Chosen from ptxas for sm_90 (bench/triton_kernels.py --mix, bf16, the launched 32 × 32 tiles
    on 4 warps), not from timing: where a form shortened the tile loop without much more spill (the key pass's dV and
    dK form at D = 128: 2,305 instructions against 2,492, but 220 spill loads and stores per tile against 135). Under
    the interpreter every form runs (bits 1 and 3), so that the tests run each."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0, 0
    if interpreting():
        return 1, 3
    return (1, 3) if block_d <= 64 else (1, 1)


def tiles(d: int, device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16) -> Tiles:
    """The tiles ``run`` takes for head dim d and inputs of dtype on ``device``: BLOCK on Triton's 3 stages under the
    interpreter (and where the device's limit is unknown), else ``gpu_tiles`` for its shared memory per block."""
    return gpu_tiles(d, None if device is None else shared_per_block(device), dtype)


def gpu_tiles(d: int, shared_per_block: int | None = None, dtype: torch.dtype = torch.bfloat16) -> Tiles:
    """The first of 32 × 32 on 3 stages, on 2, and 16 × 16 on 2 whose shared memory (SHARED_NEEDED) fits
    ``shared_per_block``. What it gives: BLOCK on 3 stages up to D = 64 everywhere, and past it on H100 and H200
    (227 KB); 2 stages at D = 128 on sm_86 and sm_89 (99 KB: 3 stages needed 104 KB) and at D = 256 on A100
    (163 KB); 16 × 16 at D = 256 on a 99 KB GPU; each with ``warps_for``'s warps, and up to D = 64 the key pass's
    checked programs on KEY_PASS_CHECKED_WARPS where those are 4."""
    block_d = max(16, next_power_of_2(d)) if triton is not None else d
    if shared_per_block is None or block_d <= 64:
        warps = warps_for(BLOCK, block_d, dtype)
        return Tiles(BLOCK, 3, warps, KEY_PASS_CHECKED_WARPS if block_d <= 64 and warps == FEW_WARPS else None)
    for block, stages in ((BLOCK, 3), (BLOCK, 2), (16, 2)):
        need = SHARED_NEEDED.get((block_d, block, stages))
        if need is not None and need <= shared_per_block:
            return Tiles(block, stages, warps_for(block, block_d, dtype))
    return Tiles(16, 2, warps_for(16, block_d, dtype))


def not_supported_reasons(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                          attn_mask: torch.Tensor | None) -> list[str]:
    """Why ``run`` cannot take these operands ([] = it can). No sync, no pass over the tensors."""
    reasons = []
    if triton is None:
        reasons.append("triton is not installed")
    elif q_BHTD.device.type == "cuda" and interpreting():
        reasons.append("TRITON_INTERPRET=1 runs kernels on CPU tensors only")
    elif q_BHTD.device.type != "cuda" and not interpreting():
        reasons.append(f"the Triton kernels run on CUDA (this call is on {q_BHTD.device.type}; TRITON_INTERPRET=1 "
                       "runs them on the CPU for tests)")
    if q_BHTD.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reasons.append(f"dtype {q_BHTD.dtype} (the kernels take float32, bfloat16, float16)")
    if k_BHSD.dtype != q_BHTD.dtype or v_BHSD.dtype != q_BHTD.dtype:
        reasons.append("q, k and v in different dtypes")
    if q_BHTD.shape[-1] > MAX_HEAD_DIM or v_BHSD.shape[-1] != q_BHTD.shape[-1]:
        reasons.append(f"head dims q {q_BHTD.shape[-1]}, v {v_BHSD.shape[-1]} (one head dim up to {MAX_HEAD_DIM})")
    if attn_mask is not None and not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        reasons.append(f"a {attn_mask.dtype} mask (bool or additive float)")
    return reasons


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelFault:
    """One emulated fault: element (row, col) of matrix n of product ``op``, overwritten right after the product
    that made it. op: one of OPS. n: b·H + query head for scores_bwd, grad_probs and grad_q; b·HK + KV head for
    grad_v and grad_k. (row, col): (query, key) in S and dP; (key, feature) in dV and dK; (query, feature) in dQ; a
    fault in dV, dK or dQ lands in the first tile's share of the sum. side: which pass computes S or dP with the
    fault ("keys": the key pass, whose dK and dV use them; "queries": the query pass, for dQ). kind: "value" (the
    element becomes ``value``: inf, nan, 1e20), "add" (``value`` is added: a finite error), "bitflip" (an exponent
    bit, as attnchecker.inject.bitflip). persistent: it fires in the repair's recompute too."""

    op: str
    n: int
    row: int
    col: int
    kind: str = "value"
    value: float = math.inf
    side: str = "keys"
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"KernelFault.op must be one of {OPS}, got {self.op!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"KernelFault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.side not in _SIDES:
            raise ValueError(f"KernelFault.side must be one of {_SIDES}, got {self.side!r}")
        if (self.op, self.side) in (("grad_q", "keys"), ("grad_v", "queries"), ("grad_k", "queries")):
            raise ValueError(f"{self.op} is made by the {'query' if self.op == 'grad_q' else 'key'} pass only")

    def row_values(self) -> list[float]:
        return [float(OPS.index(self.op)), float(_SIDES.index(self.side)), float(self.n), float(self.row),
                float(self.col), float(FAULT_KINDS.index(self.kind)), self.value, float(self.persistent)]


def fault_table(faults: list[KernelFault], device: torch.device) -> torch.Tensor:
    """(F, FAULT_ROW) fp32 on ``device``: the faults for ``run``, their seen slots zero. Copied without a sync
    (host_table)."""
    return host_table([f.row_values() + [0.0] * (FAULT_ROW - 8) for f in faults], torch.float32, device)


def faults_seen(table: torch.Tensor) -> list[tuple[tuple[bool, float, float], tuple[bool, float, float]]]:
    """Per fault of a table ``run`` took: (applied, value before, value after) in the first run and in the repair's
    recompute. Before: the product's element, or for dV, dK and dQ the first tile's share of its sum. A fault the
    kernels never wrote (its tile masked out, its program not repaired) is not applied. Syncs: injection only."""
    seen = table[:, 8:].tolist()  # sync: injection only, never on a call without a planned fault
    return [((row[0] != 0.0, row[1], row[2]), (row[3] != 0.0, row[4], row[5])) for row in seen]


@dataclass(frozen=True, slots=True)
class Rules:
    """The scalars of each check's bound (abft.vector_rules): ``ProductRule.scalars()`` of the tile products S and dP
    (vectors BLOCK long over D products), of dV and dK (D long over the G·T rows of a group), of dQ (D long over S
    keys), and ``SoftmaxGradRule.scalars()``."""

    tile: tuple[float, ...]
    keys: tuple[float, ...]
    queries: tuple[float, ...]
    softmax: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class GivenIdentities:
    """The scalars of the full check over gradients another backward made (``run(check="abft", given=...)``;
    abft/given_backward.py): its rule's tau·u, kappa·u32 and tau·tiny, and how that backward rounds its running sums
    into its outputs (GradientAccumulation's query and key blocks; 0: fp32 to the end, one rounding)."""

    tau_u: float
    kappa_u32: float
    tau_tiny: float
    query_block: int
    key_block: int

    @classmethod
    def of(cls, dtype: torch.dtype, tol: Tolerance, acc: GradientAccumulation) -> GivenIdentities:
        """The scalars for half-precision gradients under a round-off tolerance (given_backward_rule raises for
        others), from a backward that rounds its sums as ``acc`` says."""
        rule = given_backward_rule(dtype, tol)
        return cls(tau_u=rule.tau * rule.u, kappa_u32=rule.kappa * U32, tau_tiny=rule.tau * rule.tiny,
                   query_block=acc.query_block or 0, key_block=acc.key_block or 0)


@dataclass(frozen=True, slots=True)
class Launch:
    """One call's geometry and what its first run found, on the device."""

    b: int
    h: int
    hk: int
    key_blocks: int
    query_blocks: int
    status_P: torch.Tensor
    """int32 per program (key pass first, then query pass): bit o set = op OPS[o] flagged in its first run."""
    summary_PO6: torch.Tensor
    """fp32 (P, len(OPS), len(FIELDS)): the worst vector per op of each program's first run."""
    repaired_P: torch.Tensor | None
    """int32 per program after the repair launch: 0 not flagged, 1 clean after its recompute, 2 flagged again, 3 (tier
    1) what the dtype's range gives: a half-precision operand of the products (dS, AP∘Z) or, for given gradients, an
    output rounded to INF from finite values, not a fault; None when no repair ran (detect mode)."""

    @property
    def key_programs(self) -> int:
        return self.b * self.hk * self.key_blocks

    def program(self, p: int) -> tuple[str, int, int]:
        """(pass, batch, head of the program's block: the KV head in the key pass)."""
        if p < self.key_programs:
            n = p // self.key_blocks
            return "keys", n // self.hk, n % self.hk
        n = (p - self.key_programs) // self.query_blocks
        return "queries", n // self.h, n % self.h



def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


def _writable(x: torch.Tensor) -> torch.Tensor:
    """x itself where the kernels can write its rows in place through its strides: its elements distinct and each
    row's features adjacent (a vendor's gradient in its inputs' layout, a slice of a larger buffer); else a contiguous
    copy (an expanded, stride-0 view: a write through it would land in several elements)."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return x.contiguous()
    dims = sorted((st, n) for st, n in zip(x.stride(), x.shape, strict=True) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return x.contiguous()
        span = st * n
    return x


def _mask_4d(attn_mask: torch.Tensor | None, shape: tuple[int, int, int, int]) -> tuple[Any, tuple[int, ...], int]:
    """(the mask as the kernels read it, its (B, H, T, S) strides (0 where it broadcasts), kind: 0 none, 1 additive,
    2 bool)."""
    if attn_mask is None:
        return None, (0, 0, 0, 0), 0
    m = attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).expand(shape)
    return m, _strides(m), 2 if attn_mask.dtype == torch.bool else 1


def run(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,
    lse_BHT: torch.Tensor,
    dout_BHTD: torch.Tensor,
    *,
    scale: float,
    is_causal: bool,
    window: int | None,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    seed: int | torch.Tensor,
    check: str,
    rules: Rules | None,
    faults: list[KernelFault] | torch.Tensor | None = None,
    repair: bool = True,
    tf32: bool = False,
    tile: Tiles | None = None,
    given: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    refs_by_dot: bool = True,
    identities: GivenIdentities | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Launch | None]:
    """(dq (B, H, T, D), dk, dv (B, HK, S, D) summed over each KV head's query heads, and what the checks found, None
    for check "off"). window: keys more than window - 1 before a query are masked (GPT-Neo's local attention: key j
    is seen by query i when 0 <= i - j < window with is_causal); None for none. attn_mask: bool (True = attend) or
    additive, broadcastable to (B, H, T, S); causal is top-left aligned, as SDPA's. seed: dropout's, an int or a (1,)
    int64 tensor on the device (the forward's, read in the kernels: no copy to the host). rules: for check "abft" (and
    "tripwire", which ignores them). repair: launch the recompute of flagged programs. tf32: fp32 products with TF32
    operands (the rules must say so). tile: tile size and stages (default ``tiles`` for the head dim and device: the
    rules' tile vectors must be as long). given: (dq, dk, dv) an unchecked backward
    made (SDPA's, the vendor's), for check "tripwire": the first pass only reads them (``_trip_given``), and for
    check "abft" (no mask, dropout or window) it tests them against ``identities`` (kernels/
    triton_given_backward_check.py); the repair recomputes the flagged blocks into them, with the check's own full
    checks; returned, written in place in their own layout (``_writable``: a copy only of one whose rows overlap or
    whose features are not adjacent). refs_by_dot: False makes every reference an fp32 sum whatever the dtype
    (``by_dot`` (0, 0): bench_checks' A/B on a GPU).
    Launches 3 kernels, 5 with repair, one more each for check "abft" (``_key_terms``); no host-device sync."""
    if triton is None:
        raise RuntimeError("the Triton attention backward needs triton (pip install triton)")
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    b, h, t, d = q_BHTD.shape
    hk, s = k_BHSD.shape[1], k_BHSD.shape[2]
    if h % hk:
        raise ValueError(f"q has {h} heads and k/v {hk}: the KV heads must divide the query heads")
    device = q_BHTD.device
    interp = interpreting()
    tile = tile or tiles(d, device, q_BHTD.dtype)
    blk = tile.block
    block_d = max(16, next_power_of_2(d))
    n_kb, n_qb = cdiv(s, blk), cdiv(t, blk)
    p_keys, p_queries = b * hk * n_kb, b * h * n_qb
    mode = CHECKS.index(check)
    if given is not None and check == "off":
        raise ValueError("given gradients take check 'tripwire' (tier 1) or 'abft' (the identities), not 'off'")
    given_full = given is not None and check == "abft"
    if given_full and identities is None:
        raise ValueError("a full check of given gradients needs their identities' scalars (GivenIdentities)")
    if given_full and (attn_mask is not None or dropout_p > 0.0 or window is not None):
        raise ValueError("a full check of given gradients takes no mask, dropout or window (the vendors' backwards "
                         "that make them take none either)")

    delta_BHT = torch.empty((b, h, t), dtype=torch.float32, device=device)
    # check "abft": what each pass's checks take from the other pass's blocks alone, made once per call (_delta,
    # _key_terms) rather than in every program's loop.
    terms = mode == CHECKS.index("abft")
    q_rows = torch.empty((b * h, 6, t), dtype=torch.float32, device=device) if terms else delta_BHT
    q_tile = torch.empty((b * h, n_qb, 2 * block_d + 8), dtype=torch.float32, device=device) if terms else delta_BHT
    dot_q, dot_k = by_dot(q_BHTD.dtype, block_d) if terms and refs_by_dot else (0, 0)
    q_parts = (torch.empty((b * h, n_qb, 2, blk, tc.SPLIT_COLUMNS), dtype=q_BHTD.dtype, device=device) if dot_k >= 2
               else q_BHTD)
    o_norm = torch.empty((b * h, t), dtype=torch.float32, device=device) if given_full else delta_BHT
    if given is None or given_full:
        # (Tier 1 over given gradients: _trip_given makes δ, one launch fewer.)
        _delta[(n_qb, b * h)](out_BHTD, dout_BHTD, delta_BHT, q_BHTD, q_rows, q_tile, q_parts, o_norm,
                              *_strides(out_BHTD), *_strides(dout_BHTD), *_strides(q_BHTD), h, t, d, BLOCK_M=blk,
                              BLOCK_D=block_d, TERMS=terms, BY_DOT=dot_k, O_NORM=given_full)
    k_rows, k_tile = delta_BHT, delta_BHT
    if terms:
        k_rows = torch.empty((b * hk, 4, s), dtype=torch.float32, device=device)
        k_tile = torch.empty((b * hk, n_kb, block_d + 2), dtype=torch.float32, device=device)
        _key_terms[(n_kb, b * hk)](k_BHSD, v_BHSD, k_rows, k_tile, *_strides(k_BHSD), *_strides(v_BHSD), hk, s, d,
                                   BLOCK_N=blk, BLOCK_D=block_d)
    if given is None:
        dq = torch.empty((b, h, t, d), dtype=q_BHTD.dtype, device=device)
        dk = torch.empty((b, hk, s, d), dtype=k_BHSD.dtype, device=device)
        dv = torch.empty((b, hk, s, d), dtype=v_BHSD.dtype, device=device)
    else:
        # The repair writes the flagged blocks' rows into these, through their strides: no copy of FlashAttention's
        # gradients, which come in the (B, T, H, D) layout of its inputs.
        dq, dk, dv = (_writable(x) for x in given)
        if dq.shape != (b, h, t, d) or dk.shape != (b, hk, s, d) or dv.shape != (b, hk, s, d):
            raise ValueError(f"given gradients of shapes {tuple(dq.shape)}, {tuple(dk.shape)}, {tuple(dv.shape)}: "
                             f"want q's {(b, h, t, d)} and k's {(b, hk, s, d)}")
    status = torch.empty((p_keys + p_queries,), dtype=torch.int32, device=device) if mode else dq
    summary = torch.empty((p_keys + p_queries, len(OPS), len(FIELDS)), dtype=torch.float32,
                          device=device) if mode else dq
    mask, mask_strides, mask_kind = _mask_4d(attn_mask, (b, h, t, s))
    # Planned or emulated faults only: a table copied without a sync (fault_table), or one the caller made to read
    # back what the kernels wrote (faults_seen).
    if isinstance(faults, list):
        faults = fault_table(faults, device) if faults else None
    n_faults = 0 if faults is None else faults.shape[0]
    table = faults if faults is not None and n_faults else dq
    r = rules if rules is not None else Rules((0.0,) * 12, (0.0,) * 12, (0.0,) * 12, (0.0,) * 8)
    common: dict[str, Any] = {
        "BLOCK_M": blk, "BLOCK_N": blk, "BLOCK_D": block_d, "CAUSAL": is_causal, "WINDOW": window is not None,
        "MASK_KIND": mask_kind, "DROPOUT": dropout_p > 0.0, "CHECK": mode, "FAULTS_ON": n_faults > 0,
        "INTERPRET": interp, "PRECISION": "tf32" if tf32 and q_BHTD.dtype == torch.float32 else "ieee"}
    inputs = (q_BHTD, k_BHSD, v_BHSD, dout_BHTD, lse_BHT, delta_BHT, mask if mask is not None else dq)
    on_device = isinstance(seed, torch.Tensor)
    common["SEED_ON_DEVICE"] = on_device
    sizes = (*_strides(q_BHTD), *_strides(k_BHSD), *_strides(v_BHSD), *_strides(dout_BHTD), *_strides(lse_BHT),
             *mask_strides, h, hk, t, s, d, scale, window or 0, dropout_p, 0 if on_device else seed, n_faults)
    grad_strides = (*_strides(dq), *_strides(dk), *_strides(dv))
    repaired = None
    for attempt in (0, 1) if mode and repair else (0,):
        if given_full and not attempt:
            assert identities is not None
            given_check._check_given_bwd[(p_keys + p_queries,)](
                *inputs[:6], o_norm, q_rows, k_rows, dq, dk, dv, status, summary, *grad_strides, *_strides(q_BHTD),
                *_strides(k_BHSD), *_strides(v_BHSD), *_strides(dout_BHTD), *_strides(lse_BHT), h, hk, t, s, d, scale,
                n_kb, n_qb, p_keys, identities.tau_u, identities.kappa_u32, identities.tau_tiny,
                identities.query_block, identities.key_block, BLOCK_M=blk, BLOCK_N=blk, BLOCK_D=block_d,
                CAUSAL=is_causal, INTERPRET=interp, num_warps=GIVEN_WARPS)
            continue
        if given is not None and not attempt:
            _trip_given[(p_keys + p_queries,)](
                *inputs[:6], out_BHTD, dq, dk, dv, status, summary, *grad_strides, *_strides(q_BHTD),
                *_strides(k_BHSD), *_strides(v_BHSD),
                *_strides(dout_BHTD), *_strides(lse_BHT), *_strides(out_BHTD), h, hk, t, s, d, window or 0, n_kb,
                n_qb, p_keys, BLOCK_M=blk, BLOCK_N=blk, BLOCK_D=block_d, CAUSAL=is_causal, WINDOW=window is not None,
                num_warps=TRIP_WARPS)
            continue
        # The repair: the same launches, whose programs read their first run's status and return when it is 0.
        if attempt:
            repaired = torch.empty_like(status)
        written = repaired if attempt else status
        _query_pass[(n_qb, b * h)](*inputs, dq, written, summary, table, seed if on_device else dq, k_rows, k_tile,
                                   *grad_strides[:4], *sizes, p_keys,
                                   r.tile, r.queries,
                                   r.softmax, FIRST=status, REPAIR=bool(attempt), GIVEN=given is not None,
                                   num_warps=tile.warps, num_stages=tile.stages, BY_DOT=dot_q, **common)
        _key_pass[(n_kb, b * hk)](*inputs, dk, dv, written, summary, table, seed if on_device else dq, q_rows, q_tile,
                                  q_parts, *grad_strides[4:], *sizes, 0,
                                  r.tile, r.keys,
                                  FIRST=status, REPAIR=bool(attempt), GIVEN=given is not None,
                                  num_warps=pass_warps(tile, "_key_pass", check, dot_k), num_stages=tile.stages,
                                  BY_DOT=dot_k, **common)
    if not mode:
        return dq, dk, dv, None
    return dq, dk, dv, Launch(b, h, hk, n_kb, n_qb, status, summary, repaired)


if triton is not None:
    _keep = triton_dropout.keep

    @triton.jit
    def _delta(OUT, DO, DELTA, Q, QROWS, QTILE, QPARTS, ONORM, so_b, so_h, so_t, so_d, sdo_b, sdo_h, sdo_t, sdo_d,
               sq_b, sq_h, sq_t, sq_d, H, T, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TERMS: tl.constexpr,
               BY_DOT: tl.constexpr, O_NORM: tl.constexpr = False):
        """δ = rowsum(dO ∘ O) in fp32 (the forward's output, as it was verified). TERMS (check "abft"): also what the
        key pass's checks take from this query block alone, made once per call here rather than again by every key
        program that visits the block: ``_block_terms`` of q (QROWS rows 0-2; QTILE's first BLOCK_D and scalars 0, 1)
        and of dO (rows 3-5; the next BLOCK_D, scalars 2, 3). QROWS (B·H, 6, T), QTILE (B·H, query blocks, 2·BLOCK_D
        + 8), fp32. BY_DOT (its bit 2): also the block's q·e, q·w and dO·e, dO·w as ``triton_checks.store_parts``
        (QPARTS (B·H, query blocks, 2, BLOCK_M, PARTS) of q's dtype; the scales are QTILE's scalars 4-7), which the key
        pass's dK and dV references take on the tensor cores. O_NORM: also ‖O_i‖ per row into ONORM (B·H, T), the
        check over given gradients' term for δ (kernels/triton_given_backward_check.py)."""
        n = tl.program_id(1)
        bb, hh = n // H, n % H
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        inside = (rows[:, None] < T) & (cols[None, :] < D)
        o = tl.load(OUT + bb * so_b + hh * so_h + rows[:, None] * so_t + cols[None, :] * so_d, mask=inside, other=0.0)
        do = tl.load(DO + bb * sdo_b + hh * sdo_h + rows[:, None] * sdo_t + cols[None, :] * sdo_d, mask=inside,
                     other=0.0)
        tl.store(DELTA + n * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < T)
        if O_NORM:
            o32 = o.to(tl.float32)
            tl.store(ONORM + n * T + rows, tl.sqrt(tl.sum(o32 * o32, 1)), mask=rows < T)
        if TERMS:
            q = tl.load(Q + bb * sq_b + hh * sq_h + rows[:, None] * sq_t + cols[None, :] * sq_d, mask=inside,
                        other=0.0)
            w_d = tl.where(cols < D, (cols + 1).to(tl.float32), 0.0)
            block = n * tl.num_programs(0) + tl.program_id(0)
            tile_at = QTILE + block * (2 * BLOCK_D + 8)
            q1, q2 = _block_terms(q.to(tl.float32), w_d, cols, QROWS + n * 6 * T, T, rows, tile_at,
                                  tile_at + 2 * BLOCK_D)
            do1, do2 = _block_terms(do.to(tl.float32), w_d, cols, QROWS + (n * 6 + 3) * T, T, rows, tile_at + BLOCK_D,
                                    tile_at + 2 * BLOCK_D + 2)
            if BY_DOT >= 2:
                parts_at = QPARTS + block * 2 * BLOCK_M * N_PARTS
                q_se, q_sw = tc.store_parts(parts_at, q1, q2, q.dtype)
                do_se, do_sw = tc.store_parts(parts_at + BLOCK_M * N_PARTS, do1, do2, do.dtype)
                tl.store(tile_at + 2 * BLOCK_D + 4, q_se)
                tl.store(tile_at + 2 * BLOCK_D + 5, q_sw)
                tl.store(tile_at + 2 * BLOCK_D + 6, do_se)
                tl.store(tile_at + 2 * BLOCK_D + 7, do_sw)

    @triton.jit
    def _key_terms(K, V, KROWS, KTILE, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, HK, S, D,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """What the query pass's checks take from one key block alone, made once per call rather than again by every
        query program that visits the block: K's ``_block_terms`` (KROWS rows 0-2, KTILE) and each value's norm
        (KROWS row 3). KROWS (B·HK, 4, S), KTILE (B·HK, key blocks, BLOCK_D + 2), fp32."""
        nk = tl.program_id(1)
        bb, hk = nk // HK, nk % HK
        keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        inside = (keys[:, None] < S) & (cols[None, :] < D)
        k = tl.load(K + bb * sk_b + hk * sk_h + keys[:, None] * sk_s + cols[None, :] * sk_d, mask=inside, other=0.0)
        v = tl.load(V + bb * sv_b + hk * sv_h + keys[:, None] * sv_s + cols[None, :] * sv_d, mask=inside,
                    other=0.0).to(tl.float32)
        w_d = tl.where(cols < D, (cols + 1).to(tl.float32), 0.0)
        tile_at = KTILE + (nk * tl.num_programs(0) + tl.program_id(0)) * (BLOCK_D + 2)
        _block_terms(k.to(tl.float32), w_d, cols, KROWS + nk * 4 * S, S, keys, tile_at, tile_at + BLOCK_D)
        tl.store(KROWS + (nk * 4 + 3) * S + keys, tl.sqrt(tl.sum(v * v, 1)), mask=keys < S)

    N_PARTS: Any = tl.constexpr(tc.SPLIT_COLUMNS)
    FAULT_ROW_C: Any = tl.constexpr(FAULT_ROW)

    @device_function
    def _block_terms(x, w_d, cols, ROWS, L, rows, COLS, SCALARS):
        """One block x (R, BLOCK_D) fp32 of an operand (q, dO, k or v), as the other pass's checks use it: per row r
        its norm, x_r·e and x_r·w_d at ROWS + f·L + r (f = 0, 1, 2); its columns' Σ_r x_rd² at COLS + d; Σ_r (x_r·e)²
        and Σ_r (x_r·w_d)² at SCALARS, SCALARS + 1. Rows past L are zeros in x and not stored. Returns the rows'
        x·e and x·w_d."""
        row_in = rows < L
        x1, x2 = tl.sum(x, 1), tl.sum(x * w_d[None, :], 1)
        tl.store(ROWS + rows, tl.sqrt(tl.sum(x * x, 1)), mask=row_in)
        tl.store(ROWS + L + rows, x1, mask=row_in)
        tl.store(ROWS + 2 * L + rows, x2, mask=row_in)
        tl.store(COLS + cols, tl.sum(x * x, 0))
        tl.store(SCALARS, tl.sum(x1 * x1, 0))
        tl.store(SCALARS + 1, tl.sum(x2 * x2, 0))
        return x1, x2

    @device_function
    def _hypot2(x, y):
        """sqrt(x² + y²) of non-negative terms, scaled by a power of 2 near the larger (triton_checks.pow2_scale: two
        multiplies, where a division by the larger was): no square of a small norm underflows, nor of a large one
        overflows."""
        inv, unit = tc.pow2_scale(tl.maximum(x, y))
        x, y = x * inv, y * inv
        return unit * tl.sqrt(x * x + y * y)

    @device_function
    def _bound(a, bsum, bsq1, bsq2, r1, r2, sq, ref1, ref2, R):
        """abft.vector_rules.ProductRule per vector: (bound on |d1|, on |d2|). R: its ``scalars()``."""
        a = a + R[0]
        rig1 = R[1] * a * bsum + R[2]
        rig2 = rig1 * R[8]
        t_sq = R[7] * tl.sqrt(sq + R[9])
        # hypot(a·x, a·y, t) = hypot(a·hypot(x, y), t): the per-block part made once where B is the program's.
        s1 = _hypot2(a * _hypot2(tl.sqrt(bsq1) * R[5], r1 * R[6]), t_sq)
        s2 = _hypot2(a * _hypot2(tl.sqrt(bsq2) * R[5], r2 * R[6]), t_sq * R[8])
        ref1 = tl.where(tl.abs(ref1) < float("inf"), tl.abs(ref1), 0.0)
        ref2 = tl.where(tl.abs(ref2) < float("inf"), tl.abs(ref2), 0.0)
        c1 = R[4] * s1 + R[2] + R[11] * ref1
        c2 = R[4] * s2 + R[10] + R[11] * ref2
        b1 = tl.where(R[3] > 0, tl.minimum(rig1, c1), rig1)
        b2 = tl.where(R[3] > 0, tl.minimum(rig2, c2), rig2)
        # An undefined bound (an operand norm that overflowed) reads NEAR_INF, as abft's _clamp.
        b1 = tl.where(b1 < float("inf"), b1, 1e10)
        b2 = tl.where(b2 < float("inf"), b2, 1e10)
        return b1, b2

    @device_function
    def _ratio(d1, d2, b1, b2):
        """max(|d1|/b1, |d2|/b2); INF where it is NaN (a NaN residual flags)."""
        r = tl.maximum(tl.abs(d1) / tl.maximum(b1, 1e-30), tl.abs(d2) / tl.maximum(b2, 1e-30))
        return tl.where(r == r, r, float("inf"))

    @device_function
    def _overflowed(x, x_c):
        """1 where some finite x rounded to an INF x_c: the dtype's range, not a fault (fp16 under GradScaler, which
        skips such a step); the products that read x_c are then not flagged, as gemm.check._overflowed leaves them."""
        return tl.max(((tl.abs(x) < float("inf")) & (tl.abs(x_c.to(tl.float32)) == float("inf"))).to(tl.int32))

    @device_function
    def _b_terms(norm_V, ref1_sq, ref2_sq, valid_V, w_V, R):
        """What a block B contributes to the rule of every vector checked against it (abft.vector_rules.
        product_terms): (Σ‖B_j‖', Σ‖B_j‖'², Σ j²‖B_j‖'², ‖B e‖', ‖B w‖'). norm_V: ‖B_j‖ per column j of B, valid_V
        which of them exist, w_V the weights; ref_sq: ‖B e‖², ‖B w‖²."""
        nb = tl.where(valid_V, norm_V + R[0], 0.0)
        return (tl.sum(nb, 0), tl.sum(nb * nb, 0), tl.sum(nb * nb * w_V * w_V, 0), tl.sqrt(ref1_sq) + R[0],
                tl.sqrt(ref2_sq) + R[0])

    @device_function
    def _sq(x):
        return tl.sum(x * x, 0)

    @device_function
    def _emulate(x, FAULTS, n_faults, OP: tl.constexpr, SIDE: tl.constexpr, n, rows, cols, REPAIR: tl.constexpr,
                 first):
        """x with the emulated faults of (OP, SIDE, matrix n) written at (rows, cols) (tile coordinates of the whole
        matrix); first: None, or 1.0 where this tile is the first share of a sum (dV, dK, dQ take faults there), 0.0
        elsewhere. A fault written here leaves (1, value before, value after) in its row's seen slots for this run
        (FAULT_ROW; the first of its elements a tile holds: one, but for a fault of several table rows)."""
        for f in range(n_faults):
            row = FAULTS + f * FAULT_ROW_C
            # Whether this fault fires here, as 0/1 (the interpreter cannot AND a scalar bool into a block).
            fires = ((tl.load(row) == OP).to(tl.float32) * (tl.load(row + 1) == SIDE).to(tl.float32)
                     * (tl.load(row + 2) == n).to(tl.float32))
            if REPAIR:
                fires = fires * (tl.load(row + 7) != 0).to(tl.float32)
            if first is not None:
                fires = fires * first
            at = tl.where((rows[:, None] == tl.load(row + 3)) & (cols[None, :] == tl.load(row + 4)), fires, 0.0) > 0.5
            kind = tl.load(row + 5)
            value = tl.load(row + 6)
            bits = x.to(tl.int32, bitcast=True)
            flipped = (bits ^ tl.where(tl.abs(x) < 2.0, 1 << 30, 1 << 29)).to(tl.float32, bitcast=True)
            new = tl.where(kind == 0, value, tl.where(kind == 1, x + value, flipped))
            if tl.sum(tl.sum(at.to(tl.int32), 1), 0) > 0:
                seen = row + 8 + REPAIR * 3
                tl.store(seen, 1.0)
                tl.store(seen + 1, tl.sum(tl.sum(tl.where(at, x, 0.0), 1), 0))
                tl.store(seen + 2, tl.sum(tl.sum(tl.where(at, new, 0.0), 1), 0))
            x = tl.where(at, new, x)
        return x

    @device_function
    def _fold(kept, ratio_V, at_V, error_V, bound_V, valid_V):
        """A tile's checked vectors folded into the loop's worst per tile position, kept = (ratio, at, error, bound)
        vectors: no reduction across the block's warps per tile (``_keep_worst`` takes them once, after the loop).
        A later tile replaces a position only when it is worse, so ties keep the first."""
        r = tl.where(valid_V, ratio_V, 0.0)
        worse = r > kept[0]
        return (tl.where(worse, r, kept[0]), tl.where(worse, at_V, kept[1]), tl.where(worse, error_V, kept[2]),
                tl.where(worse, bound_V, kept[3]))

    @device_function
    def _tile_check(c, a_V, ref1_V, ref2_V, w_U, bt, R, AXIS: tl.constexpr):
        """One tile product c checked along AXIS (1: its rows, each over the tile's columns; 0: its columns) with
        weights (e, w_U): (d1, bound1 per vector, ratio per vector). bt: the other block's ``_b_terms``."""
        if AXIS == 1:
            act1, act2 = tl.sum(c, 1), tl.sum(c * w_U[None, :], 1)
        else:
            act1, act2 = tl.sum(c, 0), tl.sum(c * w_U[:, None], 0)
        b1, b2 = _bound(a_V, bt[0], bt[1], bt[2], bt[3], bt[4], tl.sum(c * c, AXIS), ref1_V, ref2_V, R)
        d1, d2 = act1 - ref1_V, act2 - ref2_V
        return d1, b1, _ratio(d1, d2, b1, b2)

    @device_function
    def _trip(x, rows_V, valid, head, best, SUMMARY, slot, WRITE: tl.constexpr):
        """Tier 1 on an output block (as stored): INF, NaN or |x| > NEAR_INF. Its summary: ratio max|x|/NEAR_INF
        (INF for NaN), the row of the largest, the largest signed value (NaN if any)."""
        x = tl.where(valid, x, 0.0)
        nan = tl.sum((x != x).to(tl.int32), 1) > 0
        mag = tl.where(nan, float("inf"), tl.max(tl.abs(x), 1))
        hi, lo = tl.max(tl.where(x == x, x, 0.0), 1), tl.min(tl.where(x == x, x, 0.0), 1)
        value = tl.where(nan, float("nan"), tl.where(hi >= -lo, hi, lo))
        ratio = mag / 1e10
        ratio = tl.where(ratio == ratio, ratio, float("inf"))
        return _keep_worst(best, ratio, rows_V, value, tl.full(ratio.shape, 1e10, tl.float32), rows_V >= 0, head,
                           0, SUMMARY, slot, WRITE)

    @device_function
    def _scores_to_probs(s, q_rows, k_cols, r0, c0, lse, n, bb, hh, MASK, sm_b, sm_h, sm_t, sm_s, T, S, scale, window,
                         p_drop, seed, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK_KIND: tl.constexpr,
                         DROPOUT: tl.constexpr):
        """(AP, Z, the live additive mask's |value| per row) of one tile, its rows from r0 and its keys from c0: AP =
        exp(scale·S + mask - lse) where the key is seen, 0 elsewhere; Z = keep/(1-p) (ones without dropout). In base
        2, as a GPU's exp is (ex2): 2^(log2(e)·(scale·S + mask) - log2(e)·lse), the rounding of log2(e)·lse within
        the bound's lse term (vector_rules.softmax_grad_rule: 8 units of |lse|). The unseen keys are zeroed on the
        tiles that may hold any (tc.holds_masked, and every tile under a bool mask, which may drop any key): the rest
        skip the per-element test."""
        block_m: tl.constexpr = q_rows.shape[0]
        block_n: tl.constexpr = k_cols.shape[0]
        seen = (q_rows[:, None] < T) & (k_cols[None, :] < S)
        if CAUSAL:
            seen = seen & (k_cols[None, :] <= q_rows[:, None])
        if WINDOW:
            seen = seen & (q_rows[:, None] - k_cols[None, :] < window)
        edge = tc.holds_masked(r0, c0, T, S, window, block_m, block_n, CAUSAL, WINDOW)
        z = s * (scale * tc.LOG2E)
        live = tl.zeros(q_rows.shape, tl.float32)
        if MASK_KIND == 1:
            m = tl.load(MASK + bb * sm_b + hh * sm_h + q_rows[:, None] * sm_t + k_cols[None, :] * sm_s, mask=seen,
                        other=0.0).to(tl.float32)
            z = z + m * tc.LOG2E
            live = tl.max(tl.where(seen & (m > -200.0), tl.abs(m), 0.0), 1)
        if MASK_KIND == 2:
            keep_key = tl.load(MASK + bb * sm_b + hh * sm_h + q_rows[:, None] * sm_t + k_cols[None, :] * sm_s,
                               mask=seen, other=0)
            seen = seen & (keep_key != 0)
        # A row with every key masked has lse = +INF (the tiled paths' convention; -INF is read the same way).
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        p = tl.math.exp2(z - (lse * tc.LOG2E)[:, None])
        if edge | (MASK_KIND == 2):
            p = tl.where(seen, p, 0.0)
        if DROPOUT:
            kept = _keep(seed, n, T, S, q_rows[:, None], k_cols[None, :], p_drop)
            zs = tl.where(kept, 1.0 / (1.0 - p_drop), 0.0)
        else:
            zs = tl.full(p.shape, 1.0, tl.float32)
        return p, zs, live

    @triton.jit
    def _query_pass(Q, K, V, DO, LSE, DELTA, MASK, DQ, STATUS, SUMMARY, FAULTS, SEED, KROWS, KTILE,
                    sdq_b, sdq_h, sdq_t, sdq_d, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                    sdo_b, sdo_h, sdo_t, sdo_d, sl_b, sl_h, sl_t, sm_b, sm_h, sm_t, sm_s,
                    H, HK, T, S, D, scale, window, p_drop, seed, n_faults, P0, R_TILE, R_Q, R_SM, FIRST,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, CHECK: tl.constexpr,
                    FAULTS_ON: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
                    REPAIR: tl.constexpr, SEED_ON_DEVICE: tl.constexpr, GIVEN: tl.constexpr = False,
                    BY_DOT: tl.constexpr = 0):
        """dQ of one query block of one head (module doc), with its checks. KROWS, KTILE: ``_key_terms``' (check
        "abft"). GIVEN: the repair of a tier-1 first pass over given gradients (``_trip_given``). BY_DOT (bf16, fp16;
        ``by_dot``): bit 1, the S and dP column checks' references on the tensor cores (``triton_checks.parts_of``);
        dQ's stay fp32 sums (on the tensor cores they took this loop from about 1,800 to 3,800 instructions at D = 64,
        bench/triton_kernels.py --mix)."""
        n = tl.program_id(1)
        bb, hh = n // H, n % H
        hk = hh // (H // HK)
        pid = P0 + n * tl.num_programs(0) + tl.program_id(0)
        if REPAIR:
            if tl.load(FIRST + pid) == 0:
                tl.store(STATUS + pid, 0)
                return
        if SEED_ON_DEVICE:
            seed = tl.load(SEED)
        start_m = tl.program_id(0) * BLOCK_M
        rows = start_m + tl.arange(0, BLOCK_M)
        feats = tl.arange(0, BLOCK_D)
        row_in, feat_in = rows < T, feats < D
        io = row_in[:, None] & feat_in[None, :]
        q = tl.load(Q + bb * sq_b + hh * sq_h + rows[:, None] * sq_t + feats[None, :] * sq_d, mask=io, other=0.0)
        do = tl.load(DO + bb * sdo_b + hh * sdo_h + rows[:, None] * sdo_t + feats[None, :] * sdo_d, mask=io,
                     other=0.0)
        lse = tl.load(LSE + bb * sl_b + hh * sl_h + rows * sl_t, mask=row_in, other=0.0).to(tl.float32)
        delta = tl.load(DELTA + n * T + rows, mask=row_in, other=0.0)
        # A non-finite input (q, dO, O through δ, the lse; K and V below) makes a non-finite backward on any path:
        # its producer's check reports it, and nothing here is flagged for it (as attention.backward.encoded).
        bad_in = tl.full((), 0, tl.int32)
        if CHECK > 0:
            bad_in = _rows_nonfinite(q, do, delta, lse)
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        w_m = (tl.arange(0, BLOCK_M) + 1).to(tl.float32)
        w_d = tl.where(feat_in, (feats + 1).to(tl.float32), 0.0)
        # Checks' state: the worst ratio per op, the running references and norms of dQ's check, Σ_j dS_ij.
        worst_s = tl.full((), 0.0, tl.float32)
        worst_p = tl.full((), 0.0, tl.float32)
        worst_q = tl.full((), 0.0, tl.float32)
        # dQ's references and norms and the two identities' row sums, kept as tiles and summed over the keys once
        # after the loop (no reduction across the warps per tile).
        ref_q1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        ref_q2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        ds_sq = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        ds_sum = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        p_sum = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        k_col_sq = tl.zeros((BLOCK_D,), tl.float32)
        k_ref1_sq = tl.full((), 0.0, tl.float32)
        k_ref2_sq = tl.full((), 0.0, tl.float32)
        # The largest key and value norm per tile column, reduced once after the loop.
        k_max = tl.zeros((BLOCK_N,), tl.float32)
        v_max = tl.zeros((BLOCK_N,), tl.float32)
        # The column checks' worst per tile column (_fold): ratio, key, error, bound.
        kept_s = (tl.zeros((BLOCK_N,), tl.float32), tl.zeros((BLOCK_N,), tl.int32), tl.zeros((BLOCK_N,), tl.float32),
                  tl.zeros((BLOCK_N,), tl.float32))
        kept_p = kept_s
        k_terms = KROWS + (bb * HK + hk) * 4 * S
        k_tiles = KTILE + (bb * HK + hk) * tl.cdiv(S, BLOCK_N) * (BLOCK_D + 2)
        live = tl.zeros((BLOCK_M,), tl.float32)
        overflow = tl.full((), 0, tl.int32)
        slot = pid * 5
        write = not REPAIR
        if CHECK > 0:
            if write:
                _clear_summary(SUMMARY, slot)
        if CHECK == 2:
            # The block this program keeps is the B of its tiles' column checks (Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ).
            qf, dof = q.to(tl.float32), do.to(tl.float32)
            q_norm = tl.sqrt(tl.sum(qf * qf, 1))
            do_norm = tl.sqrt(tl.sum(dof * dof, 1))
            qbar1, qbar2 = tl.sum(qf, 0), tl.sum(qf * w_m[:, None], 0)
            dobar1, dobar2 = tl.sum(dof, 0), tl.sum(dof * w_m[:, None], 0)
            bt_q = _b_terms(q_norm, _sq(qbar1), _sq(qbar2), row_in, w_m, R_TILE)
            bt_do = _b_terms(do_norm, _sq(dobar1), _sq(dobar2), row_in, w_m, R_TILE)
            if BY_DOT % 2 == 1:
                q_parts, q_se, q_sw = tc.parts_of(qbar1, qbar2, q.dtype, 16)
                do_parts, do_se, do_sw = tc.parts_of(dobar1, dobar2, do.dtype, 16)
                q_parts_t, do_parts_t = tl.trans(q_parts), tl.trans(do_parts)  # (16, D): the parts as rows
        lo, hi = 0, S
        if CAUSAL:
            hi = tl.minimum(S, start_m + BLOCK_M)
        if WINDOW:
            lo = tl.maximum(0, start_m - window + 1) // BLOCK_N * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            keys, key_in, _kv_io, k, v = _key_block(K, V, bb, hk, start_n, S, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h,
                                                    sv_s, sv_d, feats, feat_in, BLOCK_N)
            s = _dot(q, tl.trans(k), PRECISION, INTERPRET)
            if FAULTS_ON:
                s = _emulate(s, FAULTS, n_faults, 0, 1, n, rows, keys, REPAIR, None)
            dp = _dot(do, tl.trans(v), PRECISION, INTERPRET)
            if FAULTS_ON:
                dp = _emulate(dp, FAULTS, n_faults, 1, 1, n, rows, keys, REPAIR, None)
            if CHECK == 2:
                k_norm = tl.load(k_terms + keys, mask=key_in, other=0.0)
                v_norm = tl.load(k_terms + 3 * S + keys, mask=key_in, other=0.0)
                if BY_DOT % 2 == 1:
                    # Kᵀ and Vᵀ as the B of a product with the parts as rows (16, D): the references come out along
                    # the columns of a tile laid out as S's and dP's, where the column sums are. The other way round
                    # (K·parts, summed along its rows) they had to move across the warps through shared memory, for
                    # every tile: 1,287 instructions a tile against 889 (sm_90, bf16, D 64; bench/triton_kernels.py).
                    s_ref1, s_ref2 = tc.fold_rows(_dot(q_parts_t, tl.trans(k), "ieee", INTERPRET), q_se, q_sw)
                    p_ref1, p_ref2 = tc.fold_rows(_dot(do_parts_t, tl.trans(v), "ieee", INTERPRET), do_se, do_sw)
                else:
                    kf, vf = k.to(tl.float32), v.to(tl.float32)
                    s_ref1, s_ref2 = tl.sum(kf * qbar1[None, :], 1), tl.sum(kf * qbar2[None, :], 1)
                    p_ref1, p_ref2 = tl.sum(vf * dobar1[None, :], 1), tl.sum(vf * dobar2[None, :], 1)
                d1, b1, ratio = _tile_check(s, k_norm, s_ref1, s_ref2, w_m, bt_q, R_TILE, 0)
                kept_s = _fold(kept_s, ratio, keys, d1, b1, key_in)
                d1, b1, ratio = _tile_check(dp, v_norm, p_ref1, p_ref2, w_m, bt_do, R_TILE, 0)
                kept_p = _fold(kept_p, ratio, keys, d1, b1, key_in)
                k_max = tl.maximum(k_max, k_norm)
                v_max = tl.maximum(v_max, v_norm)
            p, zs, live_t = _scores_to_probs(s, rows, keys, start_m, start_n, lse, n, bb, hh, MASK, sm_b, sm_h, sm_t,
                                             sm_s, T, S, scale, window, p_drop, seed, CAUSAL, WINDOW, MASK_KIND,
                                             DROPOUT)
            ds = p * (dp * zs - delta[:, None])
            ds_c = ds.to(k.dtype)
            overflow = tl.maximum(overflow, _overflowed(ds, ds_c))
            part = _dot(ds_c, k, PRECISION, INTERPRET)
            if FAULTS_ON:
                part = _emulate(part, FAULTS, n_faults, 4, 1, n, rows, feats, REPAIR, (start_n == lo) * 1.0)
            dq += part
            if CHECK == 2:
                # dQ's reference Σ_j dS_ij (K_j w) and its rule's norms, accumulated as dQ is.
                dsf = ds_c.to(tl.float32)
                kw1 = tl.load(k_terms + S + keys, mask=key_in, other=0.0)
                kw2 = tl.load(k_terms + 2 * S + keys, mask=key_in, other=0.0)
                ref_q1 += dsf * kw1[None, :]
                ref_q2 += dsf * kw2[None, :]
                ds_sq += dsf * dsf
                tile_at = k_tiles + (start_n // BLOCK_N) * (BLOCK_D + 2)
                k_col_sq += tl.load(tile_at + feats)
                k_ref1_sq += tl.load(tile_at + BLOCK_D)
                k_ref2_sq += tl.load(tile_at + BLOCK_D + 1)
                ds_sum += ds
                p_sum += p
                live = tl.maximum(live, live_t)
        flags = 0
        if CHECK == 2:
            worst_s = _keep_worst(worst_s, kept_s[0], kept_s[1], kept_s[2], kept_s[3], kept_s[0] >= 0, hh, 1, SUMMARY,
                                  slot + 0, write)
            worst_p = _keep_worst(worst_p, kept_p[0], kept_p[1], kept_p[2], kept_p[3], kept_p[0] >= 0, hh, 1, SUMMARY,
                                  slot + 1, write)
            bt_k = _b_terms(tl.sqrt(k_col_sq), k_ref1_sq, k_ref2_sq, feat_in, w_d, R_Q)
            ref_q1, ref_q2, ds_sq = tl.sum(ref_q1, 1), tl.sum(ref_q2, 1), tl.sum(ds_sq, 1)
            ds_sum, p_sum = tl.sum(ds_sum, 1), tl.sum(p_sum, 1)
            d1, b1, ratio = _tile_check(dq, tl.sqrt(ds_sq), ref_q1, ref_q2, w_d, bt_k, R_Q, 1)
            ratio = tl.where(overflow > 0, 0.0, ratio)
            worst_q = _keep_worst(worst_q, ratio, rows, d1, b1, row_in, hh, 0, SUMMARY, slot + 4, write)
            # Σ_j dS_ij = 0 (op grad_probs), and Σ_j AP_ij = 1 (op scores_bwd: the recomputed AP against the
            # forward's lse, which a uniform error in a row's AP, such as a wrong lse, leaves Σ_j dS_ij blind to):
            # bounds from q, the keys read, the lse, dO and the values read (abft.vector_rules.SoftmaxGradRule).
            lse_abs = tl.where(tl.abs(lse) < float("inf"), tl.abs(lse), 0.0)
            k_max, v_max = tl.max(k_max, 0), tl.max(v_max, 0)
            rho = tl.exp(R_SM[0] * (scale * q_norm * k_max + live) + R_SM[1] * (1.0 + lse_abs))
            g = R_SM[2] * do_norm * v_max * (1.0 + rho) / (1.0 - p_drop)
            bound = R_SM[4] * (g * ((rho - 1.0) + rho * R_SM[3]) + R_SM[5] * (1.0 + g))
            bound = tl.where(R_SM[6] > 0, R_SM[4], bound)
            ratio = tl.abs(ds_sum) / tl.maximum(bound, 1e-30)
            ratio = tl.where(ratio == ratio, ratio, float("inf"))
            worst_p = _keep_worst(worst_p, ratio, rows, ds_sum, bound, row_in, hh, 0, SUMMARY, slot + 1, write, True)
            bound = tl.where(R_SM[6] > 0, R_SM[4], R_SM[4] * ((rho - 1.0) + rho * R_SM[7]))
            ratio = tl.abs(p_sum - 1.0) / bound
            ratio = tl.where(ratio == ratio, ratio, float("inf"))
            # A row with every key masked (lse +INF) has no AP to sum.
            alive = row_in & (lse < float("inf"))
            worst_s = _keep_worst(worst_s, ratio, rows, p_sum - 1.0, bound, alive, hh, 0, SUMMARY, slot + 0, write,
                                  True)
            flags = (worst_s > 1.0).to(tl.int32) | ((worst_p > 1.0).to(tl.int32) << 1) | (
                (worst_q > 1.0).to(tl.int32) << 4)
        spilled = tl.full((), 0, tl.int32)
        beyond = tl.full((), 0, tl.int32)
        if CHECK == 1:
            worst_q = _trip(dq * scale, rows, io, hh, worst_q, SUMMARY, slot + 4, write)
            flags = (worst_q > 1.0).to(tl.int32) << 4
            if REPAIR:
                spilled = overflow
                if flags != 0:
                    # A row that trips again is what its inputs give only up to what they can give: |dS_ij| ≤
                    # AP_ij·(‖dO_i‖‖V_j‖/(1-p) + |δ_i|) and Σ_j AP_ij = 1, so |dQ_id| ≤ scale·(‖dO_i‖·max‖V‖/(1-p) +
                    # |δ_i|)·max‖K‖. Past it (twice, for rounding), a fault that came back in the recompute.
                    k_top, v_top = _keys_top(K, V, bb, hk, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, lo, hi, S,
                                             feats, feat_in, BLOCK_N)
                    bound_M = scale * (_row_norms(do) * v_top / (1.0 - p_drop) + tl.abs(delta)) * k_top
                    beyond = _beyond(dq * scale, io, bound_M)
                if GIVEN:
                    # dQ rounded past its dtype's range is the dtype's (GradScaler's overflow steps) only where the
                    # value is one the inputs can give.
                    spilled = tl.maximum(spilled, tl.where(beyond > 0, 0, _overflowed(
                        tl.where(io, dq * scale, 0.0), (dq * scale).to(DQ.dtype.element_ty))))
        tl.store(DQ + bb * sdq_b + hh * sdq_h + rows[:, None] * sdq_t + feats[None, :] * sdq_d,
                 (dq * scale).to(DQ.dtype.element_ty), mask=io)
        if CHECK > 0:
            if flags != 0:
                # Whether the keys and values it read were finite matters only to a program that flagged: it reads
                # them again. A clean program does not reduce each K and V tile to a scalar in its loop (two
                # reductions across the block's warps per tile, in every query block's loop).
                bad_in = tl.maximum(bad_in, _keys_nonfinite(K, V, bb, hk, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s,
                                                            sv_d, lo, hi, S, feats, feat_in, BLOCK_N))
            _store_status(STATUS, pid, flags, bad_in, REPAIR, spilled, beyond)

    @triton.jit
    def _key_pass(Q, K, V, DO, LSE, DELTA, MASK, DK, DV, STATUS, SUMMARY, FAULTS, SEED, QROWS, QTILE, QPARTS,
                  sdk_b, sdk_h, sdk_s, sdk_d, sdv_b, sdv_h, sdv_s, sdv_d,
                  sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                  sdo_b, sdo_h, sdo_t, sdo_d, sl_b, sl_h, sl_t, sm_b, sm_h, sm_t, sm_s,
                  H, HK, T, S, D, scale, window, p_drop, seed, n_faults, P0, R_TILE, R_KV, FIRST,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, CHECK: tl.constexpr,
                  FAULTS_ON: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
                  REPAIR: tl.constexpr, SEED_ON_DEVICE: tl.constexpr, GIVEN: tl.constexpr = False,
                  BY_DOT: tl.constexpr = 0):
        """dK and dV of one key block of one KV head, over every query head of its group (module doc), with its
        checks. QROWS, QTILE, QPARTS: ``_delta``'s terms (check "abft"). GIVEN: as the query pass's. BY_DOT (bf16,
        fp16; ``by_dot``): bit 1, the S and dP row checks' references on the tensor cores (``triton_checks.
        parts_of``); bit 2, dV's and dK's."""
        nk = tl.program_id(1)
        bb, hk = nk // HK, nk % HK
        group = H // HK
        pid = P0 + nk * tl.num_programs(0) + tl.program_id(0)
        if REPAIR:
            if tl.load(FIRST + pid) == 0:
                tl.store(STATUS + pid, 0)
                return
        if SEED_ON_DEVICE:
            seed = tl.load(SEED)
        start_n = tl.program_id(0) * BLOCK_N
        feats = tl.arange(0, BLOCK_D)
        feat_in = feats < D
        keys, key_in, kv_io, k, v = _key_block(K, V, bb, hk, start_n, S, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s,
                                               sv_d, feats, feat_in, BLOCK_N)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        # Non-finite inputs: nothing flagged for them (the query pass says why).
        bad_in = tl.full((), 0, tl.int32)
        if CHECK > 0:
            bad_in = tl.maximum(_nonfinite(k), _nonfinite(v))
        w_n = (tl.arange(0, BLOCK_N) + 1).to(tl.float32)
        w_d = tl.where(feat_in, (feats + 1).to(tl.float32), 0.0)
        worst_s = tl.full((), 0.0, tl.float32)
        worst_p = tl.full((), 0.0, tl.float32)
        worst_v = tl.full((), 0.0, tl.float32)
        worst_k = tl.full((), 0.0, tl.float32)
        # dV's and dK's references: by tile element, summed over the rows after the loop; or (BY_DOT) the products
        # of the tiles with _delta's parts, their columns summed after the loop.
        col16 = tl.arange(0, 16)
        if BY_DOT >= 2:
            ref_v = tl.zeros((BLOCK_N, 16), tl.float32)
            ref_k = tl.zeros((BLOCK_N, 16), tl.float32)
        else:
            ref_v1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            ref_v2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            ref_k1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            ref_k2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        p_sq = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        ds_sq = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        q_col_sq = tl.zeros((BLOCK_D,), tl.float32)
        do_col_sq = tl.zeros((BLOCK_D,), tl.float32)
        q_ref1_sq = tl.full((), 0.0, tl.float32)
        q_ref2_sq = tl.full((), 0.0, tl.float32)
        do_ref1_sq = tl.full((), 0.0, tl.float32)
        do_ref2_sq = tl.full((), 0.0, tl.float32)
        # The row checks' worst per tile row (_fold): ratio, g·T + row (g: the query head within the group), error,
        # bound.
        kept_s = (tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M,), tl.int32), tl.zeros((BLOCK_M,), tl.float32),
                  tl.zeros((BLOCK_M,), tl.float32))
        kept_p = kept_s
        overflow = tl.full((), 0, tl.int32)
        slot = pid * 5
        write = not REPAIR
        if CHECK > 0:
            if write:
                _clear_summary(SUMMARY, slot)
        if CHECK == 2:
            # The block this program keeps is the B of its tiles' row checks (S = Q_i K_jᵀ, dP = dO_i V_jᵀ).
            kf, vf = k.to(tl.float32), v.to(tl.float32)
            kbar1, kbar2 = tl.sum(kf, 0), tl.sum(kf * w_n[:, None], 0)
            vbar1, vbar2 = tl.sum(vf, 0), tl.sum(vf * w_n[:, None], 0)
            bt_k = _b_terms(tl.sqrt(tl.sum(kf * kf, 1)), _sq(kbar1), _sq(kbar2), key_in, w_n, R_TILE)
            bt_v = _b_terms(tl.sqrt(tl.sum(vf * vf, 1)), _sq(vbar1), _sq(vbar2), key_in, w_n, R_TILE)
            if BY_DOT % 2 == 1:
                # The row references Q_i·(K_jᵀ e), ... as one tensor-core product per tile of the operand the tile's
                # own product takes (triton_checks.parts_of: exact to 2⁻²⁵ of the largest sum).
                k_parts, k_se, k_sw = tc.parts_of(kbar1, kbar2, k.dtype, 16)
                v_parts, v_se, v_sw = tc.parts_of(vbar1, vbar2, v.dtype, 16)
        lo, hi = 0, T
        if CAUSAL:
            lo = start_n // BLOCK_M * BLOCK_M
        if WINDOW:
            hi = tl.minimum(T, start_n + BLOCK_N - 1 + window)
        for g in range(0, group):
            hh = hk * group + g
            n = bb * H + hh
            for start_m in range(lo, hi, BLOCK_M):
                rows, row_in, q, do, lse, delta = _query_block(
                    Q, DO, LSE, DELTA, bb, hh, H, T, start_m, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d,
                    sl_b, sl_h, sl_t, feats, feat_in, BLOCK_M)
                s = _dot(q, tl.trans(k), PRECISION, INTERPRET)
                if FAULTS_ON:
                    s = _emulate(s, FAULTS, n_faults, 0, 0, n, rows, keys, REPAIR, None)
                dp = _dot(do, tl.trans(v), PRECISION, INTERPRET)
                if FAULTS_ON:
                    dp = _emulate(dp, FAULTS, n_faults, 1, 0, n, rows, keys, REPAIR, None)
                if CHECK == 2:
                    q_terms = QROWS + n * 6 * T + rows
                    q_norm = tl.load(q_terms, mask=row_in, other=0.0)
                    do_norm = tl.load(q_terms + 3 * T, mask=row_in, other=0.0)
                    if BY_DOT % 2 == 1:
                        s_ref1, s_ref2 = tc.fold_parts(_dot(q, k_parts, "ieee", INTERPRET), k_se, k_sw)
                        p_ref1, p_ref2 = tc.fold_parts(_dot(do, v_parts, "ieee", INTERPRET), v_se, v_sw)
                    else:
                        qf, dof = q.to(tl.float32), do.to(tl.float32)
                        s_ref1, s_ref2 = tl.sum(qf * kbar1[None, :], 1), tl.sum(qf * kbar2[None, :], 1)
                        p_ref1, p_ref2 = tl.sum(dof * vbar1[None, :], 1), tl.sum(dof * vbar2[None, :], 1)
                    d1, b1, ratio = _tile_check(s, q_norm, s_ref1, s_ref2, w_n, bt_k, R_TILE, 1)
                    kept_s = _fold(kept_s, ratio, g * T + rows, d1, b1, row_in)
                    d1, b1, ratio = _tile_check(dp, do_norm, p_ref1, p_ref2, w_n, bt_v, R_TILE, 1)
                    kept_p = _fold(kept_p, ratio, g * T + rows, d1, b1, row_in)
                p, zs, _live = _scores_to_probs(s, rows, keys, start_m, start_n, lse, n, bb, hh, MASK, sm_b, sm_h,
                                                sm_t, sm_s, T, S, scale, window, p_drop, seed, CAUSAL, WINDOW,
                                                MASK_KIND, DROPOUT)
                pd = p * zs
                ds = p * (dp * zs - delta[:, None])
                pd_c, ds_c = pd.to(do.dtype), ds.to(q.dtype)
                overflow = tl.maximum(overflow, tl.maximum(_overflowed(pd, pd_c), _overflowed(ds, ds_c)))
                first = ((g == 0) & (start_m == lo)) * 1.0
                part = _dot(tl.trans(pd_c), do, PRECISION, INTERPRET)
                if FAULTS_ON:
                    part = _emulate(part, FAULTS, n_faults, 2, 0, nk, keys, feats, REPAIR, first)
                dv += part
                part = _dot(tl.trans(ds_c), q, PRECISION, INTERPRET)
                if FAULTS_ON:
                    part = _emulate(part, FAULTS, n_faults, 3, 0, nk, keys, feats, REPAIR, first)
                dk += part
                if CHECK == 2:
                    # dV's and dK's references Σ_i (AP∘Z)_ijᵀ (dO_i w), Σ_i dS_ijᵀ (Q_i w), and their rules' norms,
                    # accumulated as dV and dK are, over the operands as the products took them.
                    pdf, dsf = pd_c.to(tl.float32), ds_c.to(tl.float32)
                    block = n * tl.cdiv(T, BLOCK_M) + start_m // BLOCK_M
                    tile_at = QTILE + block * (2 * BLOCK_D + 8)
                    if BY_DOT >= 2:
                        parts_at = (QPARTS + block * 2 * BLOCK_M * N_PARTS + tl.arange(0, BLOCK_M)[:, None] * N_PARTS
                                    + col16[None, :])
                        in_parts = col16[None, :] < N_PARTS
                        qw_parts = tl.load(parts_at, mask=in_parts, other=0.0)
                        dow_parts = tl.load(parts_at + BLOCK_M * N_PARTS, mask=in_parts, other=0.0)
                        q_se, q_sw = tl.load(tile_at + 2 * BLOCK_D + 4), tl.load(tile_at + 2 * BLOCK_D + 5)
                        do_se, do_sw = tl.load(tile_at + 2 * BLOCK_D + 6), tl.load(tile_at + 2 * BLOCK_D + 7)
                        ref_v += _dot(tl.trans(pd_c), dow_parts, "ieee", INTERPRET) * tl.where(
                            col16 < 3, do_se, tl.where(col16 < 6, do_sw, 0.0))[None, :]
                        ref_k += _dot(tl.trans(ds_c), qw_parts, "ieee", INTERPRET) * tl.where(
                            col16 < 3, q_se, tl.where(col16 < 6, q_sw, 0.0))[None, :]
                    else:
                        qw1 = tl.load(q_terms + T, mask=row_in, other=0.0)
                        qw2 = tl.load(q_terms + 2 * T, mask=row_in, other=0.0)
                        dow1 = tl.load(q_terms + 4 * T, mask=row_in, other=0.0)
                        dow2 = tl.load(q_terms + 5 * T, mask=row_in, other=0.0)
                        ref_v1 += pdf * dow1[:, None]
                        ref_v2 += pdf * dow2[:, None]
                        ref_k1 += dsf * qw1[:, None]
                        ref_k2 += dsf * qw2[:, None]
                    p_sq += pdf * pdf
                    ds_sq += dsf * dsf
                    q_col_sq += tl.load(tile_at + feats)
                    do_col_sq += tl.load(tile_at + BLOCK_D + feats)
                    q_ref1_sq += tl.load(tile_at + 2 * BLOCK_D)
                    q_ref2_sq += tl.load(tile_at + 2 * BLOCK_D + 1)
                    do_ref1_sq += tl.load(tile_at + 2 * BLOCK_D + 2)
                    do_ref2_sq += tl.load(tile_at + 2 * BLOCK_D + 3)
        flags = 0
        if CHECK == 2:
            if BY_DOT >= 2:
                ref_v1, ref_v2 = tc.fold_parts(ref_v, 1.0, 1.0)
                ref_k1, ref_k2 = tc.fold_parts(ref_k, 1.0, 1.0)
            else:
                ref_v1, ref_v2 = tl.sum(ref_v1, 0), tl.sum(ref_v2, 0)
                ref_k1, ref_k2 = tl.sum(ref_k1, 0), tl.sum(ref_k2, 0)
            p_sq, ds_sq = tl.sum(p_sq, 0), tl.sum(ds_sq, 0)
            worst_s = _keep_worst(worst_s, kept_s[0], kept_s[1] % T, kept_s[2], kept_s[3], kept_s[0] >= 0,
                                  hk * group + kept_s[1] // T, 0, SUMMARY, slot + 0, write)
            worst_p = _keep_worst(worst_p, kept_p[0], kept_p[1] % T, kept_p[2], kept_p[3], kept_p[0] >= 0,
                                  hk * group + kept_p[1] // T, 0, SUMMARY, slot + 1, write)
            bt = _b_terms(tl.sqrt(do_col_sq), do_ref1_sq, do_ref2_sq, feat_in, w_d, R_KV)
            d1, b1, ratio = _tile_check(dv, tl.sqrt(p_sq), ref_v1, ref_v2, w_d, bt, R_KV, 1)
            ratio = tl.where(overflow > 0, 0.0, ratio)
            worst_v = _keep_worst(worst_v, ratio, keys, d1, b1, key_in, hk, 0, SUMMARY, slot + 2, write)
            bt = _b_terms(tl.sqrt(q_col_sq), q_ref1_sq, q_ref2_sq, feat_in, w_d, R_KV)
            d1, b1, ratio = _tile_check(dk, tl.sqrt(ds_sq), ref_k1, ref_k2, w_d, bt, R_KV, 1)
            ratio = tl.where(overflow > 0, 0.0, ratio)
            worst_k = _keep_worst(worst_k, ratio, keys, d1, b1, key_in, hk, 0, SUMMARY, slot + 3, write)
            flags = ((worst_s > 1.0).to(tl.int32) | ((worst_p > 1.0).to(tl.int32) << 1)
                     | ((worst_v > 1.0).to(tl.int32) << 2) | ((worst_k > 1.0).to(tl.int32) << 3))
        spilled = tl.full((), 0, tl.int32)
        beyond = tl.full((), 0, tl.int32)
        if CHECK == 1:
            worst_v = _trip(dv, keys, kv_io, hk, worst_v, SUMMARY, slot + 2, write)
            worst_k = _trip(dk * scale, keys, kv_io, hk, worst_k, SUMMARY, slot + 3, write)
            flags = ((worst_v > 1.0).to(tl.int32) << 2) | ((worst_k > 1.0).to(tl.int32) << 3)
            if REPAIR:
                spilled = overflow
                if flags != 0:
                    # What the inputs can give a key's gradients (the query pass says why): AP_ij ≤ 1 over the
                    # group's n = group·T query rows, so |dV_jd| ≤ n·max‖dO‖/(1-p) and |dK_jd| ≤ scale·n·(max‖dO‖·
                    # ‖V_j‖/(1-p) + max|δ|)·max‖Q‖. Past either (twice, for rounding), a fault that came back.
                    q_top, do_top, delta_top = _queries_top(
                        Q, DO, LSE, DELTA, bb, hk, group, H, T, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d,
                        sl_b, sl_h, sl_t, lo, hi, feats, feat_in, BLOCK_M)
                    rows_n = (group * T) * 1.0
                    keep = 1.0 / (1.0 - p_drop)
                    bound_v = tl.zeros((BLOCK_N,), tl.float32) + rows_n * do_top * keep
                    bound_k = scale * rows_n * (do_top * _row_norms(v) * keep + delta_top) * q_top
                    beyond = tl.maximum(_beyond(dv, kv_io, bound_v), _beyond(dk * scale, kv_io, bound_k))
                if GIVEN:
                    # As in the query pass: the dtype's range only where the values are ones the inputs can give.
                    dks = tl.where(kv_io, dk * scale, 0.0)
                    spilled = tl.maximum(spilled, tl.where(beyond > 0, 0, tl.maximum(
                        _overflowed(tl.where(kv_io, dv, 0.0), dv.to(DV.dtype.element_ty)),
                        _overflowed(dks, dks.to(DK.dtype.element_ty)))))
        tl.store(DK + bb * sdk_b + hk * sdk_h + keys[:, None] * sdk_s + feats[None, :] * sdk_d,
                 (dk * scale).to(DK.dtype.element_ty), mask=kv_io)
        tl.store(DV + bb * sdv_b + hk * sdv_h + keys[:, None] * sdv_s + feats[None, :] * sdv_d,
                 dv.to(DV.dtype.element_ty), mask=kv_io)
        if CHECK > 0:
            if flags != 0:
                # As in the query pass: only a program that flagged reads its query blocks' inputs again to ask
                # whether they were finite.
                bad_in = tl.maximum(bad_in, _queries_nonfinite(
                    Q, DO, LSE, DELTA, bb, hk, group, H, T, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d, sl_b,
                    sl_h, sl_t, lo, hi, feats, feat_in, BLOCK_M))
            _store_status(STATUS, pid, flags, bad_in, REPAIR, spilled, beyond)


    @triton.jit
    def _trip_given(Q, K, V, DO, LSE, DELTA, OUT, DQ, DK, DV, STATUS, SUMMARY,
                    sdq_b, sdq_h, sdq_t, sdq_d, sdk_b, sdk_h, sdk_s, sdk_d, sdv_b, sdv_h, sdv_s, sdv_d,
                    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                    sdo_b, sdo_h, sdo_t, sdo_d, sl_b, sl_h, sl_t, so_b, so_h, so_t, so_d,
                    H, HK, T, S, D, window, n_kb, n_qb, p_keys,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW: tl.constexpr):
        """Tier 1 on gradients an unchecked backward made (SDPA's): program p looks at the block that program p of
        the passes writes (a key program: dK and dV of its key block, over its KV head; a query program: dQ of its
        query block), as their check "tripwire" looks at it (``_trip``: INF, NaN, |x| > NEAR_INF), and writes the
        same status word and summary, so the passes' repair launches recompute exactly the flagged blocks. Each
        gradient is read once; the inputs (for their finiteness) only by a program that flagged, as in the passes.
        dq (B, H, T, D) and dk, dv (B, HK, S, D) in any layout (their strides). The values are read as stored:
        a half-precision gradient rounded past its range is INF here, where the passes see their fp32 sums; the
        repair tells the two apart (``_store_status``'s 3). A query program also makes its rows' δ = rowsum(dO ∘ O)
        into DELTA (B·H, T), for the repair launches after it: ``_delta``'s launch is not needed. A key program that
        flagged asks whether O was finite where the passes ask of δ (another program of this launch makes it)."""
        pid = tl.program_id(0)
        feats = tl.arange(0, BLOCK_D)
        feat_in = feats < D
        slot = pid * 5
        _clear_summary(SUMMARY, slot)
        flags = tl.full((), 0, tl.int32)
        bad_in = tl.full((), 0, tl.int32)
        if pid < p_keys:
            nk = pid // n_kb
            bb, hk = nk // HK, nk % HK
            group = H // HK
            start_n = (pid % n_kb) * BLOCK_N
            keys = start_n + tl.arange(0, BLOCK_N)
            kv_io = (keys < S)[:, None] & feat_in[None, :]
            dv = tl.load(DV + bb * sdv_b + hk * sdv_h + keys[:, None] * sdv_s + feats[None, :] * sdv_d, mask=kv_io,
                         other=0.0).to(tl.float32)
            dk = tl.load(DK + bb * sdk_b + hk * sdk_h + keys[:, None] * sdk_s + feats[None, :] * sdk_d, mask=kv_io,
                         other=0.0).to(tl.float32)
            worst_v = _trip(dv, keys, kv_io, hk, tl.full((), 0.0, tl.float32), SUMMARY, slot + 2, True)
            worst_k = _trip(dk, keys, kv_io, hk, tl.full((), 0.0, tl.float32), SUMMARY, slot + 3, True)
            flags = ((worst_v > 1.0).to(tl.int32) << 2) | ((worst_k > 1.0).to(tl.int32) << 3)
            if flags != 0:
                k = tl.load(K + bb * sk_b + hk * sk_h + keys[:, None] * sk_s + feats[None, :] * sk_d, mask=kv_io,
                            other=0.0)
                v = tl.load(V + bb * sv_b + hk * sv_h + keys[:, None] * sv_s + feats[None, :] * sv_d, mask=kv_io,
                            other=0.0)
                bad_in = tl.maximum(_nonfinite(k), _nonfinite(v))
                lo, hi = 0, T
                if CAUSAL:
                    lo = start_n // BLOCK_M * BLOCK_M
                if WINDOW:
                    hi = tl.minimum(T, start_n + BLOCK_N - 1 + window)
                bad_in = tl.maximum(bad_in, _queries_nonfinite(
                    Q, DO, LSE, DELTA, bb, hk, group, H, T, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d, sl_b,
                    sl_h, sl_t, lo, hi, feats, feat_in, BLOCK_M, OUT, so_b, so_h, so_t, so_d, True))
        else:
            n = (pid - p_keys) // n_qb
            bb, hh = n // H, n % H
            hk = hh // (H // HK)
            start_m = ((pid - p_keys) % n_qb) * BLOCK_M
            rows = start_m + tl.arange(0, BLOCK_M)
            row_in = rows < T
            io = row_in[:, None] & feat_in[None, :]
            dq = tl.load(DQ + bb * sdq_b + hh * sdq_h + rows[:, None] * sdq_t + feats[None, :] * sdq_d, mask=io,
                         other=0.0).to(tl.float32)
            o = tl.load(OUT + bb * so_b + hh * so_h + rows[:, None] * so_t + feats[None, :] * so_d, mask=io, other=0.0)
            do = tl.load(DO + bb * sdo_b + hh * sdo_h + rows[:, None] * sdo_t + feats[None, :] * sdo_d, mask=io,
                         other=0.0)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
            tl.store(DELTA + n * T + rows, delta, mask=row_in)
            worst_q = _trip(dq, rows, io, hh, tl.full((), 0.0, tl.float32), SUMMARY, slot + 4, True)
            flags = (worst_q > 1.0).to(tl.int32) << 4
            if flags != 0:
                q = tl.load(Q + bb * sq_b + hh * sq_h + rows[:, None] * sq_t + feats[None, :] * sq_d, mask=io,
                            other=0.0)
                lse = tl.load(LSE + bb * sl_b + hh * sl_h + rows * sl_t, mask=row_in, other=0.0).to(tl.float32)
                bad_in = _rows_nonfinite(q, do, delta, lse)
                lo, hi = 0, S
                if CAUSAL:
                    hi = tl.minimum(S, start_m + BLOCK_M)
                if WINDOW:
                    lo = tl.maximum(0, start_m - window + 1) // BLOCK_N * BLOCK_N
                bad_in = tl.maximum(bad_in, _keys_nonfinite(K, V, bb, hk, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s,
                                                            sv_d, lo, hi, S, feats, feat_in, BLOCK_N))
        _store_status(STATUS, pid, flags, bad_in, False)


BENCH_FORMS: tuple[str, ...] = (*CHECKS, "abft_fp32_refs", "sdpa", "tripwire_given", "abft_given")
"""What ``bench_checks`` can time."""


def bench_checks(*, b: int, h: int, t: int, d: int, device: str, causal: bool = True, reps: int = 20,
                 dtype: torch.dtype = torch.bfloat16, tile: Tiles | None = None,
                 forms: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The cost of the checks inside the kernels (bench/gpu_suite.py): one backward with check "off", "tripwire"
    and "abft" (with its repair launch, which returns at once on clean data), interleaved over ``reps`` rounds,
    milliseconds per call (device-synchronised: a benchmark, not the fast path) and each variant over "off"; "sdpa",
    SDPA's own backward on the same inputs (its forward run before the timer), the unprotected step's; and
    "tripwire_given", what a tier-1 step without dropout runs (attention.backward.fused.sdpa_tier1_on_device): SDPA's
    forward again and its backward, then the tier-1 pass over its gradients and the two repair launches, also over
    "sdpa"; "abft_given", a full check's step where the vendor made the forward (half precision): SDPA's forward again
    and its backward, then the identities over its gradients (kernels/triton_given_backward_check.py) and the two
    repair launches, also over "sdpa" (the route itself calls the vendor's backward at its forward's results, without
    the forward again); and "abft_fp32_refs", "abft" with every reference an fp32 sum (``run(refs_by_dot=False)``), to
    weigh the tensor-core references on the GPU. tile: the kernels' tiles (default ``tiles`` for the head dim and
    device). forms: time only these of BENCH_FORMS ("off" always: the others are over it); None, all."""
    import statistics
    import time

    from ..abft.given_backward import CPU_FLASH, FP32_ACCUMULATION
    from ..abft.vector_rules import product_rule, softmax_grad_rule

    if forms is not None and set(forms) - set(BENCH_FORMS):
        raise ValueError(f"bench_checks: cannot time {sorted(set(forms) - set(BENCH_FORMS))}; choose from "
                         f"{BENCH_FORMS}")

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(b, h, t, d, generator=g, device=device).to(dtype) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    # The row log-sum-exp a forward hands on, made a block of rows at a time (T×S at once is GBs at T = 8192).
    lse = torch.empty(b, h, t, device=device, dtype=torch.float32)
    for r0 in range(0, t, 512):
        z = (q[..., r0:r0 + 512, :].float() @ k.float().mT) * scale
        if causal:
            z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool, device=device).triu(r0 + 1), -math.inf)
        lse[..., r0:r0 + 512] = torch.logsumexp(z, -1)
    tile = tile or tiles(d, q.device, dtype)
    tol, blk = Tolerance(), tile.block
    rules = Rules(product_rule(blk, d, tol).scalars(), product_rule(d, t, tol).scalars(),
                  product_rule(d, t, tol).scalars(), softmax_grad_rule(t=t, s=t, d=d, dtype=dtype, tol=tol).scalars())
    # (SDPA's forward keeps its scores in fp32: scores_dtype None.)
    identities = None
    if "abft_given" in (forms or BENCH_FORMS):
        identities = GivenIdentities.of(dtype, tol, CPU_FLASH(t) if device == "cpu" else FP32_ACCUMULATION)
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    names = tuple(c for c in BENCH_FORMS if forms is None or c == "off" or c in forms)
    times: dict[str, list[float]] = {c: [] for c in names}
    for r in range(reps + 1):
        turn = r % len(names)
        for c in names[turn:] + names[:turn]:
            if c in ("sdpa", "tripwire_given", "abft_given"):
                lq, lk, lv = (x.detach().requires_grad_() for x in (q, k, v))
                leaves = (lq, lk, lv)
            if c == "sdpa":
                graph = torch.nn.functional.scaled_dot_product_attention(lq, lk, lv, is_causal=causal, scale=scale)
            sync()
            t0 = time.perf_counter()
            if c == "sdpa":
                torch.autograd.grad(graph, leaves, do)
            elif c in ("tripwire_given", "abft_given"):
                with torch.enable_grad():
                    again = torch.nn.functional.scaled_dot_product_attention(lq, lk, lv, is_causal=causal, scale=scale)
                    grads = torch.autograd.grad(again, leaves, do)
                full = c == "abft_given"
                run(q, k, v, out, lse, do, scale=scale, is_causal=causal, window=None, attn_mask=None, dropout_p=0.0,
                    seed=0, check="abft" if full else "tripwire", rules=rules if full else None, tile=tile,
                    given=(grads[0], grads[1], grads[2]), identities=identities)
            else:
                full = c.startswith("abft")
                run(q, k, v, out, lse, do, scale=scale, is_causal=causal, window=None, attn_mask=None, dropout_p=0.0,
                    seed=0, check="abft" if full else c, rules=rules if full else None, tile=tile,
                    refs_by_dot=c == "abft")
            sync()
            if r:  # the first round compiles
                times[c].append((time.perf_counter() - t0) * 1e3)
    med = {c: statistics.median(times[c]) for c in names}
    got = {f"{c}_ms": med[c] for c in names} | {f"{c}_over_off": med[c] / med["off"] for c in names if c != "off"}
    for c in ("tripwire_given", "abft_given"):
        if c in med and "sdpa" in med:
            got[f"{c}_over_sdpa"] = med[c] / med["sdpa"]
    return got
