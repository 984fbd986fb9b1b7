"""The checked attention forward as one Triton kernel (FlashAttention-2 style: online softmax, each tile in registers)
that carries the tile contract of abft/tiled.py, and the repair kernel launched after it. For CUDA; on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1, tests).

Per program: one block of BLOCK_M query rows of one (batch, head), over its key tiles of BLOCK_N keys:

1. AS_ij = Q_i K_jᵀ (tl.dot, fp32 accumulation and output; TF32 for fp32 inputs where the matmul precision says so).
   Its rows are checked against Q_i·(K_jᵀ[e, w]) (K_jᵀ[e, w] and the key tile's other terms made once per call by
   _kv_tiles on IEEE calls, in the loop under TF32), with ΣAS² and the key norms for
   abft/tile_terms.py's bound (the engine's calibrated one, factored per vector). The columns, against
   K_j·(Q_iᵀ[e, w]), which locate a bad column or block, are the repair kernel's (below; ``cols=True`` checks them on
   every tile of the first pass too): one direction on the first pass, as the native CPU pass and the whole-step
   GEMMs do.
2. Online softmax of scale·AS + mask (causal, sliding window, key padding / additive read in place with broadcast
   strides), dropout by the counter-based keep mask of kernels/triton_dropout.py, which the backward regenerates.
3. CL_ij = P̃_ij V_j with P̃ rounded to V's dtype first: its rows against P̃_c·(V_j[e, w]) (its columns, against
   (wᵀP̃_c)·V_j, in the repair kernel). The references use the rounded P̃_c the GEMM multiplied (with P̃ unrounded
   a half-precision context false-alarms at once), and ‖P̃_i‖₂ <= sqrt(Σ P̃_i)/(1 - p) needs no pass over P̃.
4. Per block and op a record (``FIELDS``): flagged?, the flagged rows, the first flagged row, the worst flagged
   residual and its bound, and the first flagged row itself with its references (``Result.saved``), from which the
   host places the element (``located``) if this record is the one reported; per call a status (4,): any flag per
   op, the worst clean ratio per op. Nothing goes to the host. Only the first pass runs on a clean call, so the code a
   flag needs (locating, the columns' check) stays out of it: with it, the kernel compiled to 255 registers and a
   1.7 KB spill stack on sm_90 (bench/triton_resources.py).

The repair kernel is the same kernel (``REPAIR``): a program whose block is clean returns at once; a flagged block is
recomputed from Q, K, V with both directions checked on every tile, a located 0D/1D error of a fault that repeats is
corrected in the tile before it is folded (rebuilt from its checksum, then refreshed by an IEEE dot of its operands),
and the block's outcome is written on the device: recomputed (clean on recompute: transient; the first pass's record
stays), corrected, or uncorrectable (the recompute's record, with its columns). Its out and lse rows are
overwritten. No host-device sync anywhere: the host reads the records once per step, at the step boundary
(checks/deferred.py), and only when the status says something flagged.

Tier 1 (``mode="tier1"``) is the same kernel without checksums: per block the output rows summed (INF, NaN, near-INF)
and the row log-sum-exp against scale·‖q_i‖·max_j‖k_j‖ + log S + 1 (tripwire.py's test; max_j over the keys the block
visits, from a running max of the key norms that forward() makes once per call); a trip is recovered by the repair
kernel with full checks, on the device. Where the vendor's fused attention takes the call (no mask, dropout or
window: attention/vendor.py), tier 1 does not run this kernel at all: ``forward(given=(out, lse))`` reads the
vendor's output and log-sum-exp in one pass (``_trip_given``, the same tests, and the log-sum-exp's floor, since the
stored one is another kernel's output), and the repair kernel recomputes a tripped block into them.

Faults inside the kernel are emulated (tests, attnchecker.inject): a table of single elements (op, n, row, col, kind,
persistent) written into the tile just computed; transient ones on the first computation only.

Legend: B batch, H query heads, Hk key/value heads, T queries, S keys, D head dim; n = batch·H + head.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..abft.checksum import checksum_weights
from ..abft.given_forward import GIVEN_DTYPES, given_rule
from ..abft.repair import locate_and_fix
from ..abft.tile_terms import TileTerms, tile_terms
from ..abft.tolerance import NEAR_INF, Tolerance
from . import triton_checks as tc
from . import triton_dropout, triton_given_check
from .triton_common import (
    SMALL_SHARED_MEMORY,
    cdiv,
    device_function,
    host_table,
    interpreting,
    next_power_of_2,
    shared_per_block,
    triton,
)

if triton is not None:
    import triton.language as tl

    from .triton_attention_tiles import dot, operand, publish, query_block, rows

__all__ = ["BY_DOT_MIN_ROWS", "FIELDS", "OPS", "OUTCOMES", "SAVED_FIELDS", "TILE_NORMS", "Checks", "Fault", "Result",
           "available", "emulated_faults", "forward", "interpreting", "located", "not_available_reason", "refs_by_dot",
           "take_faults"]

OPS = ("scores", "context")
FIELDS = ("flag", "n_rows", "row", "n_cols", "col", "value", "residual", "bound", "outcome", "saved")
"""A block's record per op (Result.records, last dim; 16 wide, the rest unused). flag: 0 clean, 1 flagged by its
checksums, 2 a tier-1 trip. row, col: whole-matrix indices of the first flagged element (-1: unknown; col is a key of
the scores, a feature of the context). residual: |d1| of the worst flagged vector (NaN: not finite). outcome: what the
repair kernel did (OUTCOMES). saved: 1 on a record of the fast pass, which checks rows only: its n_cols, col and value
are the host's, from the row it kept (``located``); the repair kernel's records, and the fast pass's with
``Checks.cols``, have them from the kernel."""
SAVED_FIELDS = ("length", "col0", "ref1", "ref2", "bound")
"""What the fast pass keeps of a flagged block's first flagged row, per op (Result.saved, last dim): the row's length
L, the whole-matrix index of its first element, its two checksum references, the bound on its plain sum's rounding;
then its L values."""
OUTCOMES = ("none", "recomputed", "corrected", "uncorrectable", "dismissed")
"""none: not repaired (detect mode, or clean); dismissed: a tier-1 trip the recompute shows was what the operands
give (an ALiBi-like positive bias under the log-sum-exp bound, values past 1e10 in diverged training)."""
RECORD = 16
TILE_NORMS = 6
"""Per key tile, the row checks' scalars that _kv_tiles makes (_tile_terms): other_side's two norms, the two weighted
sums' ref_norm, and their split3 scales (bf16, fp16)."""
_KINDS = {"set": 0, "add": 1, "bitflip": 2}


def not_available_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (None: they can)."""
    if triton is None:
        return "triton is not installed (it comes with PyTorch's CUDA wheels; or pip install triton)"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device"
    if device.type == "cpu":
        return None if interpreting() else ("CPU tensors: the kernel runs on CUDA, or on the CPU under Triton's "
                                            "interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    return f"tensors on {device.type}: the kernel runs on CUDA"


def available(device: torch.device | str = "cuda") -> bool:
    return not_available_reason(torch.device(device)) is None


# ------------------------------------------------------------------------------------------------------ faults

Fault = tuple[str, int, int, int, str, float, bool]
"""(op, n, row, col, kind, value, persistent): one element of the scores (col a key) or of the first partial context
product of its query block, CL_i,first (col a feature), of matrix n, overwritten in the tile right after the GEMM that
computed it. kind: "set" (value), "add" (+value), "bitflip" (an exponent bit, as attnchecker.inject.bitflip)."""
_pending: list[Fault] = []


@contextlib.contextmanager
def emulated_faults(faults: list[Fault]) -> Iterator[None]:
    """Tests: the next kernel call inside the block writes these faults as a fault of its own arithmetic would
    (persistent ones again in the repair's recompute). The PyTorch paths never see them."""
    _pending[:] = list(faults)
    try:
        yield
    finally:
        _pending.clear()


def take_faults() -> list[Fault]:
    """The pending emulated faults, now consumed."""
    got = list(_pending)
    _pending.clear()
    return got


# ------------------------------------------------------------------------------------------------------ host side


@dataclass(frozen=True, slots=True, kw_only=True)
class Checks:
    """What a call verifies. mode: "full" (the tile contract), "tier1" (the tripwire), or None (no checks: the
    kernel with its emulated faults only)."""

    mode: str | None
    scores: bool = True
    context: bool = True
    tol: Tolerance = field(default_factory=Tolerance)
    operand_roundoff: float | None = None
    """fp32 inputs whose GEMMs round their operands (TF32, matmul_precision.fp32_matmul_operand_roundoff)."""
    repair: bool = True
    """Launch the repair kernel (correct mode); False: flagged blocks are only reported (detect mode)."""
    cols: bool = False
    """Check columns on every tile (tests hold them to the Python checks), not only on a flagged one."""
    refs_by_dot: bool | None = None
    """The row checks' references in bf16 and fp16: None as ``refs_by_dot`` picks for the tiles (the tensor cores on
    tiles of 64 query rows); False in fp32 on the CUDA cores, as before they moved (bench_checks times both, and
    compares their worst clean ratios); True on the tensor cores on any tiles."""


@dataclass(frozen=True, slots=True)
class Result:
    out_BHTD: torch.Tensor
    lse_BHT: torch.Tensor
    """fp32; +INF on a row with every key masked (its out is 0)."""
    status: torch.Tensor
    """(4,) fp32: [scores flagged, context flagged, worst clean ratio of the scores, of the context]."""
    records: torch.Tensor | None
    """(B·H, blocks, 2 ops, RECORD) fp32 (FIELDS), None without checks."""
    block_m: int
    faults_seen: torch.Tensor | None
    """(F, 2 attempts, 3): per emulated fault (applied, value before, value after) in the first computation and the
    repair's recompute."""
    saved: torch.Tensor | None = None
    """(B·H, blocks, 2 ops, len(SAVED_FIELDS) + the longest tile side) fp32: the fast pass's kept rows (FIELDS'
    saved), read by ``located``; None without full checks or with ``Checks.cols``. Only a saved record's slot is
    written."""
    debug: torch.Tensor | None = None

    def located_records(self) -> torch.Tensor | None:
        """``records`` with the fast pass's kept rows located (``located``). Syncs: the slow path's, at the step
        boundary or in a test."""
        return None if self.records is None else located(self.records, self.saved)


@dataclass(frozen=True, slots=True)
class Blocks:
    m: int
    n: int
    d: int
    warps: int
    stages: int


def block_sizes(d: int, device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
                full: bool = True) -> Blocks:
    """Tile sizes: 16 × 16 under the interpreter (small tests cross many tiles, and it runs per op, not per element);
    on a GPU ``gpu_blocks`` for that device's shared memory per block, the inputs' dtype and whether the call runs
    the full checks."""
    if interpreting():
        return Blocks(16, 16, max(16, next_power_of_2(d)), 4, 1)
    return gpu_blocks(d, None if device is None else shared_per_block(device), dtype, full)


WIDE_TILES_SHARED = 172032
"""The most shared memory the 64 × 32 tiles needed at head dim 256 (the repair kernel, a bool mask, no causal mask;
compiled for sm_80): a GPU with less per block takes 16 × 16 tiles there (``gpu_blocks``)."""

REPAIR_WARPS = 8
"""The repair kernel's warps, whatever the first pass's: it runs on flagged blocks only, and on 4 warps its spill
stack grows from 2.3 to 3.8 KB a thread (bf16, D = 64, sm_90), which the driver reserves for every resident thread."""


def gpu_blocks(d: int, shared_per_block: int | None = None, dtype: torch.dtype = torch.bfloat16,
               full: bool = True) -> Blocks:
    """On a GPU: 64 queries × 64 keys (32 past D = 128), 2 stages, one tile shape for every variant, so that the
    checks' cost is timed against the same tiles with them off; 4 warps or 8 (``_four_warps``: at head dim 128 the
    full checks, ``full``, keep 8 where the rest take 4). Where a GPU gives a block less shared memory
    (``shared_per_block``), smaller tiles, compiled for sm_89 and sm_80 (docs/performance.md §7):
    - D = 128 under SMALL_SHARED_MEMORY (sm_86 and sm_89, 99 KB): 32 keys. 64 × 64 tiles needed up to 132 KB there
      and half of the variants could not launch; 64 × 32 needed at most 88 KB.
    - D = 256 under WIDE_TILES_SHARED (every GPU but H100, H200 and their successors): 16 × 16, the interpreter's
      tiles, which the suite runs. 64 × 32 needed up to 168 KB, more than an A100's 163; 32 × 32 on one stage up to
      116 KB; 16 × 16 at most 55 KB.
    The full-size tiles stay where they fit, as they were timed on the H200.
    TODO(triton-fwd): tune on a GPU. Untuned, on the first H200 run the kernel with its checks off reached 33 to
    132 TFLOP/s in bf16 (docs/performance.md §8)."""
    block_d = max(16, next_power_of_2(d))
    warps = 4 if _four_warps(d, shared_per_block, dtype, full) else 8
    if d > 128:
        if shared_per_block is not None and shared_per_block < WIDE_TILES_SHARED:
            return Blocks(16, 16, block_d, 8, 2)
        return Blocks(64, 32, block_d, 8, 2)
    small = d > 64 and shared_per_block is not None and shared_per_block < SMALL_SHARED_MEMORY
    return Blocks(64, 32 if small else 64, block_d, warps, 2)


def _four_warps(d: int, shared_per_block: int | None, dtype: torch.dtype, full: bool) -> bool:
    """A 64-row tile on one warpgroup (4 warps) rather than two. On two, Triton gives each warpgroup the whole
    64 × 64 tile of scores or half of every row: it computes QKᵀ and the softmax twice, or reduces each row across
    the warpgroups through shared memory on every tile. Compiled for sm_90 as a GPU's JIT launches it (bf16,
    bench/triton_resources.py --mix [--warps 8]), a tile with no masked element issues per 1,000 scores on 4 warps
    against 8: D = 64, 379 against 656 instructions without checks, 1,310 against 2,453 on the full checks' clean
    path; D = 128, 468 against 822 and 1,573 against 2,754 (32 B spilled). Where two 4-warp programs' shared memory
    fits an SM, so that it keeps 8 warps resident, as the JIT's pipelined loads need it (bench/triton_resources.py's
    shared_launch): D <= 64 from the A100's 163 KB a block (at most 61 KB a program on sm_80, 82 KB on sm_90); at
    D = 128 on H100 and H200 without the full checks (82 KB), whose programs need 127 to 143 KB there, so one would
    hold an SM on its 4 warps. bf16 and fp16 only: with fp32 inputs 4 warps spill 584 B (TF32 full checks, D = 64),
    and at D = 256 968 B. Not yet timed on a GPU: bench/gpu_suite.py's tiles section times both counts."""
    if dtype not in (torch.bfloat16, torch.float16) or d > 128 or shared_per_block is None:
        return False
    if d > 64:
        return not full and shared_per_block >= WIDE_TILES_SHARED
    return shared_per_block >= SMALL_SHARED_MEMORY


BY_DOT_MIN_ROWS = 64
"""Query rows per tile from which the row checks' references are a tensor-core product (``refs_by_dot``)."""


def refs_by_dot(dtype: torch.dtype, block_m: int) -> bool:
    """The kernels' BY_DOT: the rows' references of both products as one small tensor-core product per tile, of the
    tile's A operand with the other side's weighted sums split into three parts of the operands' dtype
    (triton_checks.refs_by_dot; _kv_tiles makes the parts once per call), in place of fp32 products reduced across the
    lanes. bf16 and fp16 only (fp32 operands would make it an fp32 product on the CUDA cores), and on tiles of
    BY_DOT_MIN_ROWS query rows or more. Offline (bench/triton_resources.py --by-dot, bf16, the clean path's key-tile
    loop) it takes the loop from 2,668 to 2,126 instructions on sm_90 at D = 64 (64 × 64 tiles), from 5,096 to 2,314
    on sm_89 at D = 128 (64 × 32), from 5,370 to 3,131 on sm_90 at D = 256, but from 2,045 to 2,794 on the 16 × 16
    tiles of D = 256 on the 99 KB GPUs, which keep the fp32 references. Under the interpreter every tile takes it
    where the dtype does, so that the suite runs it (its 16 × 16 tiles stand in for a GPU's)."""
    return dtype in (torch.bfloat16, torch.float16) and (block_m >= BY_DOT_MIN_ROWS or interpreting())


def dot_mode(dtype: torch.dtype, operand_roundoff: float | None) -> int:
    """How the tile GEMMs take their operands (the kernel's DOT): 0 as they are (IEEE fp32, bf16, fp16: fp32
    accumulation), 1 fp32 as TF32 (tensor cores), 2 cast to fp32 (bf16 under the interpreter, whose tl.dot mishandles
    bf16 operands: bf16 values and their products are exact in fp32), 3 fp32 truncated to TF32's 10 mantissa bits in
    the kernel (the interpreter does not emulate TF32; truncation is what a tensor core may do, the bound's unit)."""
    if dtype == torch.float32 and operand_roundoff is not None:
        return 3 if interpreting() else 1
    if dtype == torch.bfloat16 and interpreting():
        return 2
    return 0


def forward(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    scale: float,
    checks: Checks,
    is_causal: bool = False,
    window: int | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    faults: list[Fault] | None = None,
    blocks: Blocks | None = None,
    debug: bool = False,
    given: tuple[torch.Tensor, torch.Tensor] | None = None,
    normalise_lse: bool = False,
    zeros: Callable[[int], torch.Tensor] | None = None,
) -> Result:
    """One checked attention forward: the kernel, then (checks.repair, and checks on) the repair kernel. q (B, H, T, D),
    k/v (B, Hk, S, D) with Hk dividing H (GQA: no copy), any strides; attn_mask bool (True = attend) or additive,
    broadcastable to (B, H, T, S), read in place; is_causal: key j <= query i (top-left, as SDPA); window: also
    i - j < window; dropout_p with seed ((1,) int64 on the device): kernels/triton_dropout.keep. No host-device sync
    (faults, a test feature, copy their table to the device).

    given: (out (B, H, T, D) any strides, lse (B, H, T) fp32 contiguous), a forward another kernel computed at these
    operands (the vendor's fused attention: attention/vendor.py), without a mask, window, dropout or faults. In place
    of the first pass: for tier 1, ``_trip_given`` reads them once and writes the records tier 1's pass writes; for
    the full checks (bf16 and fp16, both ops, a round-off tolerance), kernels/triton_given_check.py tests the
    identities of abft/given_forward.py and writes the records the first pass writes. The repair kernel then
    recomputes a flagged block into them, as after that pass. normalise_lse (full checks over a given forward): the
    given lse made exact to fp32's rounding in place, for a backward checked in full (kernels/triton_given_check.py).
    zeros: n -> (n,) fp32 zeros on the device that nothing else holds (a guard's arena, checks/zeroed.py) for the
    call's status; None: a memset here."""
    b, h, t, d = q_BHTD.shape
    hk, s = k_BHSD.shape[1], k_BHSD.shape[2]
    blk = blocks or block_sizes(d, q_BHTD.device, q_BHTD.dtype, full=checks.mode == "full")
    n_blocks = cdiv(t, blk.m)
    dev = q_BHTD.device
    if given is not None:
        if checks.mode is None or attn_mask is not None or window is not None or dropout_p > 0.0 or faults \
                or debug or checks.cols:
            raise ValueError("forward(given=...) checks another kernel's result: checks.mode 'tier1' or 'full', with "
                             "no mask, window, dropout, faults, debug or cols")
        if checks.mode == "full" and not given_full_takes(q_BHTD.dtype, checks):
            raise ValueError(f"forward(given=...) with the full checks takes bfloat16 or float16 inputs, both ops and "
                             f"a round-off tolerance (abft/given_forward.py), got {q_BHTD.dtype}, scores="
                             f"{checks.scores}, context={checks.context}, tolerance {checks.tol.mode!r}")
        if normalise_lse and checks.mode != "full":
            raise ValueError("forward(normalise_lse=True) needs the full checks over a given forward")
        out, lse = given
        if out.shape != q_BHTD.shape or lse.shape != (b, h, t) or lse.dtype != torch.float32 \
                or not lse.is_contiguous():
            raise ValueError(f"given out {tuple(out.shape)} and lse {tuple(lse.shape)} {lse.dtype}: expected out "
                             f"{tuple(q_BHTD.shape)} and a contiguous float32 lse {(b, h, t)}")
    else:
        out = torch.empty((b, h, t, d), dtype=q_BHTD.dtype, device=dev)
        lse = torch.empty((b, h, t), dtype=torch.float32, device=dev)
    checking = checks.mode is not None and (checks.scores or checks.context)
    # The one device op besides the kernels: the call's status, which the programs raise with atomics; over a given
    # forward's full checks, each key head's largest |v·e| and |v·w| after it (_value_sums raises them too).
    given_full = given is not None and checks.mode == "full"
    n_zeros = 4 + (2 * b * hk if given_full else 0)
    if not checking:
        zeroed = out
    elif zeros is not None:
        zeroed = zeros(n_zeros)
    else:
        zeroed = torch.zeros(n_zeros, dtype=torch.float32, device=dev)
    status = zeroed[:4]
    records = torch.empty((b * h, n_blocks, 2, RECORD), dtype=torch.float32, device=dev) if checking else None
    # The fast pass keeps a flagged block's first flagged row where it checks rows only (_note_rows).
    saved = torch.empty((b * h, n_blocks, 2, len(SAVED_FIELDS) + max(blk.m, blk.n, blk.d)), dtype=torch.float32,
                        device=dev) if checking and checks.mode == "full" and not (checks.cols or debug or given) \
        else None
    mask_kind, mask, mask_strides = _mask_layout(attn_mask, (b, h, t, s))
    terms = _terms(checks, blk, d)
    table = values = seen = None
    if faults:
        # The fault plan's tables (tests, injection campaigns), copied without a sync (host_table).
        table = host_table([[OPS.index(op), n, r, c, _KINDS[kind], int(p)] for op, n, r, c, kind, _, p in faults],
                           torch.int64, dev)
        values = host_table([v for *_, v, _ in faults], torch.float32, dev)
        seen = torch.zeros((len(faults), 2, 3), dtype=torch.float32, device=dev)
    n_tiles = cdiv(s, blk.n)
    dbg = torch.full((b * h, n_blocks, n_tiles, 4, max(blk.m, blk.n, blk.d), 16), math.nan, device=dev) if debug \
        else None
    operand_roundoff = checks.operand_roundoff if q_BHTD.dtype == torch.float32 else None
    mode = {None: 0, "tier1": 1, "full": 2}[checks.mode if checking else None]
    k_max_BHkS = None
    if (mode == 1 and window is None) or (given is not None and mode == 2):
        # Tier 1's log-sum-exp bound takes the largest norm of the keys a block visits: a prefix of them, causal or
        # not (a window's start moves: that case keeps the norms in the loop). Two reductions over K once per call,
        # instead of every query block's key loop computing every key's norm again, which was most of what tier 1
        # added to that loop (bench/triton_resources.py --mix). A NaN norm counts as 0, as the loop's max skips it.
        norms_BHkS = torch.linalg.vector_norm(k_BHSD, dim=-1, dtype=torch.float32).nan_to_num_(nan=0.0)
        k_max_BHkS = torch.cummax(norms_BHkS, dim=-1).values
    # What the row checks take from a key tile alone (scores) and from a value tile alone (context), made once per
    # call by one launch (_kv_tiles) rather than again by every query block that visits the tile. The TF32 path's
    # operand moments still need the tiles themselves: it keeps making them in the loop.
    n_key_tiles = cdiv(s, blk.n)
    by_dot = refs_by_dot(q_BHTD.dtype, blk.m) if checks.refs_by_dot is None else \
        checks.refs_by_dot and q_BHTD.dtype in (torch.bfloat16, torch.float16)
    key_tiles = key_norms = key_parts = value_tiles = value_norms = value_parts = None
    tiles_of = (b * hk, n_key_tiles)
    if mode == 2 and operand_roundoff is None and (checks.scores or checks.context) and given is None:
        if checks.scores:
            key_tiles = torch.empty((*tiles_of, 2 * blk.d + blk.n + 1), dtype=torch.float32, device=dev)
            key_norms = torch.empty((*tiles_of, TILE_NORMS), dtype=torch.float32, device=dev)
            if by_dot:
                key_parts = torch.empty((*tiles_of, blk.d, tc.SPLIT_COLUMNS), dtype=k_BHSD.dtype, device=dev)
        if checks.context:
            value_tiles = torch.empty((*tiles_of, 2 * blk.n + blk.d + 1), dtype=torch.float32, device=dev)
            value_norms = torch.empty((*tiles_of, TILE_NORMS), dtype=torch.float32, device=dev)
            if by_dot:
                value_parts = torch.empty((*tiles_of, blk.n, tc.SPLIT_COLUMNS), dtype=v_BHSD.dtype, device=dev)
    # A buffer a call does not use is passed as a spare tensor of its pointer's dtype, never read.
    kv_buffers = [x if x is not None else spare for x, spare in zip(
        (key_tiles, key_norms, key_parts, value_tiles, value_norms, value_parts),
        (lse, lse, k_BHSD, lse, lse, v_BHSD), strict=True)]
    if key_tiles is not None or value_tiles is not None:
        with _ieee_quietly():
            _kv_tiles[(n_key_tiles, b * hk)](
                k_BHSD, v_BHSD, *kv_buffers, *k_BHSD.stride(), *v_BHSD.stride(), hk, s, d, n_key_tiles, terms[0][0],
                terms[2][0],
                KEYS=key_tiles is not None, VALUES=value_tiles is not None, BLOCK_N=blk.n, BLOCK_D=blk.d,
                BY_DOT=by_dot, num_warps=blk.warps)
    launch = functools.partial(
        _attention[(n_blocks, b * h)],
        q_BHTD, k_BHSD, v_BHSD, out, lse, mask if mask is not None else q_BHTD,
        seed if seed is not None else q_BHTD, status, records if records is not None else out,
        saved if saved is not None else out,
        table if table is not None else q_BHTD, values if values is not None else q_BHTD,
        seen if seen is not None else q_BHTD, dbg if dbg is not None else out,
        k_max_BHkS if k_max_BHkS is not None else lse,
        *kv_buffers,
        *q_BHTD.stride(), *k_BHSD.stride(), *v_BHSD.stride(), *out.stride(), *mask_strides,
        *(k_max_BHkS.stride()[:2] if k_max_BHkS is not None else (0, 0)),
        h, h // hk, t, s, d, n_blocks, n_tiles, n_key_tiles,
        scale, dropout_p, window or 0, 0 if table is None else table.shape[0],
        *terms, (NEAR_INF, checks.tol.fix_threshold),
        BLOCK_M=blk.m, BLOCK_N=blk.n, BLOCK_D=blk.d,
        IS_CAUSAL=is_causal, WINDOWED=window is not None, MASK_KIND=mask_kind, DROPOUT=dropout_p > 0.0,
        CHECK_SCORES=checking and checks.scores, CHECK_CONTEXT=checking and checks.context,
        CALIBRATED=checks.tol.mode == "roundoff" and checks.tol.calibrated,
        TF32=operand_roundoff is not None, DOT=dot_mode(q_BHTD.dtype, operand_roundoff),
        COLS=checks.cols or debug, FAULTS=table is not None, DEBUG=dbg is not None,
        K_MAX_GIVEN=k_max_BHkS is not None, KEY_TILES=key_tiles is not None, VALUE_TILES=value_tiles is not None,
        BY_DOT=by_dot, num_warps=blk.warps, num_stages=blk.stages,
    )
    with _ieee_quietly():
        if given is None:
            launch(MODE=mode, REPAIR=False)
        elif checking and mode == 2:
            assert records is not None and k_max_BHkS is not None
            _check_given(q_BHTD, k_BHSD, v_BHSD, out, lse, k_max_BHkS, status, zeroed[4:].view(b * hk, 2), records,
                         scale=scale, checks=checks, blk=blk, n_blocks=n_blocks, is_causal=is_causal,
                         normalise_lse=normalise_lse)
        elif checking:
            assert records is not None and k_max_BHkS is not None
            _trip_given[(n_blocks, b * h)](
                q_BHTD, out, lse, status, records, k_max_BHkS, *q_BHTD.stride(), *out.stride(),
                *k_max_BHkS.stride()[:2], h, h // hk, t, s, d, n_blocks, scale,
                BLOCK_M=blk.m, BLOCK_N=blk.n, BLOCK_D=blk.d, IS_CAUSAL=is_causal, num_warps=blk.warps)
        if checking and checks.repair:
            launch(MODE=2, REPAIR=True, num_warps=REPAIR_WARPS)
    return Result(out, lse, status, records, blk.m, seen, saved, dbg)


def given_full_takes(dtype: torch.dtype, checks: Checks) -> bool:
    """Whether ``forward(given=...)`` runs the full checks over another kernel's result (abft/given_forward.py):
    bf16 or fp16 inputs, both ops, a round-off tolerance (its bounds have no absolute threshold)."""
    return dtype in GIVEN_DTYPES and checks.scores and checks.context and checks.tol.mode == "roundoff"


GIVEN_CHECK_WARPS = 4
"""The warps of a ``_check_given`` program on a GPU's tiles, whatever the full checks' kernel takes: it holds no
value tile and no context (24 KB of shared memory at D = 64, 48 KB at 128), so two programs fit an SM on 4 warps
where our checked kernel's one holds it on 8. Compiled offline for sm_90 at D = 128 (bf16, bench/triton_resources.py
--mix [--warps 8]), its key-tile loop issues 742 instructions per 1,000 scores of a tile with no masked element on 8
warps, which compute the tile twice (``_four_warps``), and 511 on 4 (a 40 B spill stack)."""


def given_check_blocks(blk: Blocks) -> Blocks:
    """The tiles of the full checks' pass over a given forward: the call's (its repair launch recomputes those
    blocks), on GIVEN_CHECK_WARPS warps where the tile has 64 rows (a GPU's; the interpreter's 16 × 16 keep theirs)."""
    return dataclasses.replace(blk, warps=GIVEN_CHECK_WARPS) if blk.m >= 64 else blk


def _check_given(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 k_max_BHkS: torch.Tensor, status: torch.Tensor, vc_max_BHk2: torch.Tensor, records: torch.Tensor, *,
                 scale: float, checks: Checks, blk: Blocks, n_blocks: int, is_causal: bool,
                 normalise_lse: bool = False) -> None:
    """The full checks' first pass over a given forward: v·[e, w] per key and their largest magnitudes per key head
    (one launch; vc_max_BHk2 zeroed by the caller), then the identities per query block (one launch) into
    ``records`` and ``status``, as ``_attention``'s first pass writes them; normalise_lse: and the rows within A's
    bound their lse + ln Σ_j P', in place."""
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    warps = given_check_blocks(blk).warps
    n_key_tiles = cdiv(s, blk.n)
    vc_BHk2S = torch.empty((b * hk, 2, n_key_tiles * blk.n), dtype=torch.float32, device=q.device)
    triton_given_check._value_sums[(n_key_tiles, b * hk)](
        v, vc_BHk2S, vc_max_BHk2, *v.stride(), hk, s, n_key_tiles * blk.n, d, BLOCK_N=blk.n, BLOCK_D=blk.d,
        num_warps=warps)
    tau_u, kappa_u32, kappa_a_u32, a_floor_u = given_rule(q.dtype, checks.tol).scalars()
    triton_given_check._check_given[(n_blocks, b * h)](
        q, k, out, lse, vc_BHk2S, vc_max_BHk2, k_max_BHkS, status, records, *q.stride(), *k.stride(), *out.stride(),
        *k_max_BHkS.stride()[:2], h, h // hk, t, s, n_key_tiles * blk.n, d, n_blocks, scale, tau_u, kappa_u32,
        kappa_a_u32, a_floor_u, checks.tol.near_inf,
        BLOCK_M=blk.m, BLOCK_N=blk.n, BLOCK_D=blk.d, IS_CAUSAL=is_causal, DOT=dot_mode(q.dtype, None),
        NORMALISE_LSE=normalise_lse, num_warps=warps)


@contextlib.contextmanager
def _ieee_quietly() -> Iterator[None]:
    """Under the interpreter, numpy's warnings for IEEE arithmetic a GPU does silently (INF - INF, x / 0, the max of
    an all-NaN row): the kernel's faults and masked rows make them on purpose."""
    if not interpreting():
        yield
        return
    import warnings

    import numpy as np

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _terms(checks: Checks, blk: Blocks, d: int) -> tuple[tuple[float, ...], ...]:
    """The bound's scalars per op and direction (abft/tile_terms.py): scores rows (n = BLOCK_N keys, k = D), scores
    columns (BLOCK_M queries, D), context rows (D features, BLOCK_N keys), context columns (BLOCK_M, BLOCK_N)."""
    return _terms_of(checks.tol, checks.operand_roundoff, blk.m, blk.n, d)


@functools.lru_cache(maxsize=64)
def _terms_of(tol: Tolerance, u_in: float | None, bm: int, bn: int, d: int) -> tuple[tuple[float, ...], ...]:
    shapes = ((bn, d), (bm, d), (d, bn), (bm, bn))
    rules: list[TileTerms] = [tile_terms(n, k, tol, operand_roundoff=u_in) for n, k in shapes]
    return tuple(r.as_tuple() for r in rules)


def _mask_layout(attn_mask: torch.Tensor | None, shape: tuple[int, int, int, int]
                 ) -> tuple[int, torch.Tensor | None, tuple[int, int, int, int]]:
    """(kind: 0 none, 1 bool, 2 additive; the mask; its (b, h, t, s) strides, 0 where it broadcasts): read in place,
    no copy (a key-padding mask (B, 1, 1, S) costs S values a batch)."""
    if attn_mask is None:
        return 0, None, (0, 0, 0, 0)
    mask = attn_mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    # broadcast_to is a view: a dimension it broadcasts gets stride 0.
    mask = torch.broadcast_to(mask, shape)
    if mask.dtype == torch.bool:
        # Its bytes as uint8 (a view): the kernel adds a masked key's -INF from them (_attention's MASK_KIND 1).
        return 1, mask.view(torch.uint8), tuple(mask.stride())  # type: ignore[return-value]
    return 2, mask, tuple(mask.stride())  # type: ignore[return-value]


def located(records: torch.Tensor, saved: torch.Tensor | None) -> torch.Tensor:
    """``records`` (B·H, blocks, 2, RECORD) with every saved record (FIELDS) completed from its kept row
    (Result.saved), as the kernel's column check would have placed it:

    - the one element abft.repair.locate_and_fix places in the row (an extreme element by value, else d2/d1, with
      the other weighted sum's residual within its rounding once that element is taken out): col and value are that
      element's, n_cols 1 (a point, or with several flagged rows a column);
    - a row it cannot place holds two or more errors (or came with a non-finite reference): n_cols 2 (the row as a
      line, or with several flagged rows a block); col is its first extreme element (a block's left edge), -1 if it
      has none; value that element, else the row's most extreme one.

    A new tensor where anything was saved; records itself otherwise. Syncs: the slow path's (a flagged call, read at
    the step boundary)."""
    if saved is None:
        return records
    kept = records[..., FIELDS.index("saved")] == 1.0
    at = kept.nonzero(as_tuple=True)  # sync: slow path only
    if at[0].numel() == 0:
        return records
    out = records.clone()
    rows_PS = saved[at]
    head = len(SAVED_FIELDS)
    lengths = rows_PS[:, 0].long()
    for length in lengths.unique().tolist():  # sync: slow path only
        sel = (lengths == length).nonzero()[:, 0]
        v_PL = rows_PS[sel, head:head + length]
        ref_P2 = rows_PS[sel, 2:4]
        loc_P, _, placed_P = locate_and_fix(v_PL, ref_P2, Tolerance())
        extreme_PL = ~torch.isfinite(v_PL) | (v_PL.abs() > NEAR_INF)
        has_extreme_P = extreme_PL.any(1)
        # d2/d1 lands near an integer by chance for many rows with several errors (locate_and_fix allows 0.3 of
        # slack): a finite error placed at column c must also leave d2 - (c + 1)·d1 within the two sums' rounding,
        # at most (L + c + 1) times the plain sum's bound (the weights are 1..L).
        finite_PL = torch.where(extreme_PL, 0.0, v_PL)
        d_P2 = ref_P2 - finite_PL @ checksum_weights(length, v_PL.device, v_PL.dtype)
        slack_P = (length + loc_P + 1) * rows_PS[sel, 4]
        single_P = (d_P2[:, 1] - (loc_P + 1) * d_P2[:, 0]).abs() <= slack_P
        placed_P &= has_extreme_P | single_P
        first_extreme_P = extreme_PL.to(torch.int8).argmax(1)
        at_P = torch.where(placed_P, loc_P, first_extreme_P)
        found_P = placed_P | has_extreme_P
        value_P = torch.where(found_P, v_PL.gather(1, at_P[:, None])[:, 0], _extreme_of(v_PL))
        idx = tuple(a[sel] for a in at)
        fields = out[idx]
        fields[:, FIELDS.index("col")] = torch.where(found_P, rows_PS[sel, 1] + at_P, -1.0)
        fields[:, FIELDS.index("value")] = value_P
        fields[:, FIELDS.index("n_cols")] = torch.where(placed_P, 1.0, 2.0)
        out[idx] = fields
    return out


def _extreme_of(v_PL: torch.Tensor) -> torch.Tensor:
    """(P,) each row's most extreme element: NaN first, then the largest magnitude, signed (tc.extreme_of)."""
    mag_PL = torch.where(v_PL.isnan(), -1.0, v_PL.abs())
    value_P = v_PL.gather(1, mag_PL.argmax(1, keepdim=True))[:, 0]
    return torch.where(v_PL.isnan().any(1), math.nan, value_P)


# ------------------------------------------------------------------------------------------------------ device side

if triton is not None:
    _jit: Any = device_function
    _F32_MAX: Any = tl.constexpr(3.4028234663852886e38)
    SAVED_HEAD: Any = tl.constexpr(len(SAVED_FIELDS))
    N_TILE_NORMS: Any = tl.constexpr(TILE_NORMS)

    @_jit
    def _inject(x, Faults, Values, Seen, n_faults, pid_n, rows, cols, OP: tl.constexpr, ATTEMPT: tl.constexpr):
        """Write the table's faults of op OP, matrix pid_n, that fall in this tile (rows (R,), cols (C,): whole-matrix
        indices) into x; transient ones on the first computation only. Records (applied, before, after)."""
        for f in range(n_faults):
            at = Faults + f * 6
            hit = (rows[:, None] == tl.load(at + 2)) & (cols[None, :] == tl.load(at + 3))
            hit = hit & (tl.load(at) == OP) & (tl.load(at + 1) == pid_n)
            if ATTEMPT == 1:
                hit = hit & (tl.load(at + 5) != 0)
            if tc.rsum(hit.to(tl.int32), None) > 0:
                old = tc.rsum(tl.where(hit, x, 0.0), None)
                kind = tl.load(at + 4)
                value = tl.load(Values + f)
                bit = tl.where(tl.abs(old) < 2.0, 30, 29)
                flipped = (old.to(tl.int32, bitcast=True) ^ (tl.full([], 1, tl.int32) << bit)).to(tl.float32,
                                                                                                   bitcast=True)
                new = tl.where(kind == 0, value, tl.where(kind == 1, old + value, flipped))
                x = tl.where(hit, new, x)
                rec = Seen + (f * 2 + ATTEMPT) * 3
                tl.store(rec, 1.0)
                tl.store(rec + 1, old)
                tl.store(rec + 2, new)
        return x

    @_jit
    def _scores_rows(s, a_op, a_norm, b_op, b_norm, w, terms, TF32: tl.constexpr, CALIBRATED: tl.constexpr):
        """The rows of a scores tile s = A·Bᵀ (R, C) (A = Q_i, B = K_j; for its columns, sᵀ with A = K_j, B = Q_i):
        references A·(Bᵀ[e, w]) from the operands in fp32, bounded with ‖A_r‖ and the norms of B's rows.
        (bad, d1, b1, ratio, ref1, ref2, mom1, mom2) (R,)."""
        bar_e = tc.rsum(b_op, 0)
        bar_w = tc.rsum(b_op * w[:, None], 0)
        b_sum, b_norm1, b_norm2 = tc.other_side(b_norm, tl.full([b_norm.shape[0]], 1, tl.int1), terms[0])
        ref1, ref2 = tc.refs(a_op, bar_e, bar_w)
        mom1 = tl.full([s.shape[0]], 0, tl.float32)
        mom2 = tl.full([s.shape[0]], 0, tl.float32)
        if TF32:
            mom1, mom2 = _scores_moments(a_op * a_op, b_op * b_op, bar_e, bar_w, w, terms[11])
        bad, d1, b1, ratio = tc.check(s, ref1, ref2, a_norm, b_sum, b_norm1, b_norm2, tc.ref_norm(bar_e, terms[0]),
                                      tc.ref_norm(bar_w, terms[0]), mom1, mom2, terms, CALIBRATED)
        return bad, d1, b1, ratio, ref1, ref2, mom1, mom2

    @_jit
    def _rows_of_tile(x, a_op, a_dot, a_norm, At, AtNorms, Parts, terms, CALIBRATED: tl.constexpr, L: tl.constexpr,
                      M: tl.constexpr, BY_DOT: tl.constexpr):
        """The rows of a tile x = A·B (R, C) against their references, with what they take from the tile of B alone
        read from its _kv_tiles row (At: B's two weighted sums (L,) each, its M norms, their other_side sum; AtNorms:
        other_side's two norms, the two sums' ref_norm and their split3 scales; fp32; Parts: the sums' split3
        parts): _scores_rows (L = BLOCK_D, M = BLOCK_N) and _context_rows (L = BLOCK_N, M = BLOCK_D) of IEEE
        products, which have no operand moments. BY_DOT (bf16, fp16): the references by a tensor-core product of
        a_dot, A as its GEMM takes it (tc.refs_by_dot); else in fp32 from a_op."""
        offs = tl.arange(0, L)
        if BY_DOT:
            ref1, ref2 = tc.refs_by_dot(a_dot, Parts, tl.load(AtNorms + 4), tl.load(AtNorms + 5))
        else:
            ref1, ref2 = tc.refs(a_op, tl.load(At + offs), tl.load(At + L + offs))
        mom = tl.full([x.shape[0]], 0, tl.float32)
        bad, d1, b1, ratio = tc.check(x, ref1, ref2, a_norm, tl.load(At + 2 * L + M), tl.load(AtNorms),
                                      tl.load(AtNorms + 1), tl.load(AtNorms + 2), tl.load(AtNorms + 3), mom, mom, terms,
                                      CALIBRATED)
        return bad, d1, b1, ratio, ref1, ref2, mom, mom

    @_jit
    def _tile_terms(x, valid, floor, Out, OutNorms, Parts, row, BY_DOT: tl.constexpr):
        """One tile's row of _kv_tiles' outputs from x (R, L) fp32, in the layout _rows_of_tile reads. Out
        (2·L + R + 1,) fp32: Σ_i x_i and Σ_i i·x_i over x's rows (i = 1..R), each row's norm, their other_side sum
        (valid (R,): the rows that exist); OutNorms (TILE_NORMS,) fp32: other_side's two norms, the two sums' norms
        + floor (tc.ref_norm), and with BY_DOT the two sums' split3 scales, their parts at Parts ((L, PARTS) in the
        operands' dtype)."""
        n_rows: tl.constexpr = x.shape[0]
        n_cols: tl.constexpr = x.shape[1]
        e = tc.rsum(x, 0)
        w = tc.rsum(x * tc.weights(n_rows)[:, None], 0)
        norms = tl.sqrt(tc.rsum(x * x, 1))
        b_sum, b_norm1, b_norm2 = tc.other_side(norms, valid, floor)
        at = Out + row * (2 * n_cols + n_rows + 1)
        tl.store(at + tl.arange(0, n_cols), e)
        tl.store(at + n_cols + tl.arange(0, n_cols), w)
        tl.store(at + 2 * n_cols + tl.arange(0, n_rows), norms)
        tl.store(at + 2 * n_cols + n_rows, b_sum)
        at_norms = OutNorms + row * N_TILE_NORMS
        tl.store(at_norms, b_norm1)
        tl.store(at_norms + 1, b_norm2)
        tl.store(at_norms + 2, tc.ref_norm(e, floor))
        tl.store(at_norms + 3, tc.ref_norm(w, floor))
        if BY_DOT:
            scale_e, scale_w = tc.store_parts(Parts + row * (n_cols * tc.PARTS), e, w, Parts.dtype.element_ty)
            tl.store(at_norms + 4, scale_e)
            tl.store(at_norms + 5, scale_w)

    @triton.jit
    def _kv_tiles(K, V, KOut, KNorms, KParts, VOut, VNorms, VParts, skb, skh, sks, skd, svb, svh, svs, svd, HK, S, D,
                  N_KEY_TILES, floor_s, floor_c, KEYS: tl.constexpr, VALUES: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BY_DOT: tl.constexpr):
        """Per tile of BLOCK_N keys of one (batch, key head), what the row checks take from it alone.
        KEYS (_scores_rows): KOut (2·BLOCK_D + BLOCK_N + 1,) fp32: Σ_j k_j and Σ_j j·k_j over its keys
        (j = 1..BLOCK_N), each key's norm, Σ_j (‖k_j‖ + floor); KNorms (TILE_NORMS,) fp32: √Σ_j (‖k_j‖ + floor)²,
        √Σ_j j²(‖k_j‖ + floor)², the two sums' norms + floor (tc.other_side, tc.ref_norm), and with BY_DOT the
        two sums' split3 scales; KParts (BLOCK_D, PARTS) in K's dtype: their split3 parts.
        VALUES (_context_rows): VOut (2·BLOCK_N + BLOCK_D + 1,) fp32: each key's Σ_d v_jd and Σ_d d·v_jd, each
        feature's norm over the tile's keys, and that norm's other_side sum over the D features; VNorms the same
        norms and scales, VParts (BLOCK_N, PARTS) the parts. Keys past S and features past D are zeros, as the
        attention kernel loads them."""
        tile = tl.program_id(0)
        n = tl.program_id(1)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        inside = (offs_n < S)[:, None] & d_ok[None, :]
        row = (n * N_KEY_TILES + tile).to(tl.int64)
        if KEYS:
            # The scores' rows reduce over keys: the key tile as it is (keys × features).
            k = tl.load(K + (n // HK).to(tl.int64) * skb + (n % HK).to(tl.int64) * skh + offs_n[:, None] * sks
                        + offs_d[None, :] * skd, mask=inside, other=0.0)
            _tile_terms(k.to(tl.float32), tl.full([BLOCK_N], 1, tl.int1), floor_s, KOut, KNorms, KParts, row, BY_DOT)
        if VALUES:
            # The context's rows reduce over features: the value tile transposed (features × keys).
            v = tl.load(V + (n // HK).to(tl.int64) * svb + (n % HK).to(tl.int64) * svh + offs_n[:, None] * svs
                        + offs_d[None, :] * svd, mask=inside, other=0.0)
            _tile_terms(tl.trans(v.to(tl.float32)), d_ok, floor_c, VOut, VNorms, VParts, row, BY_DOT)

    @_jit
    def _scores_moments(a_sq, b_sq, bar_e, bar_w, w, tiny):
        """abft.operand_moments.scores_moments of one tile direction, one group: per vector (M_1 + R_1, M_2 + R_2)
        fp32, the TF32 rounding of A (a_sq (R, D): A squared) and B (b_sq (C, D)), independent along the head dim."""
        beta_e = tc.rsum(b_sq, 0)
        beta_w = tc.rsum(b_sq * (w * w)[:, None], 0)
        a_tot = tc.rsum(a_sq, 1)
        m1 = tc.rsum(a_sq * beta_e[None, :], 1) + tiny * (tc.rsum(beta_e, 0) + a_tot * tc.rsum(w * 0.0 + 1.0, 0))
        m2 = tc.rsum(a_sq * beta_w[None, :], 1) + tiny * (tc.rsum(beta_w, 0) + a_tot * tc.rsum(w * w, 0))
        # Floors: a flushed square loses <= tiny times its term's weight (Σ w² per M column, 1 per R column).
        r1 = tc.rsum(a_sq * (bar_e * bar_e)[None, :], 1) + tiny * (tc.rsum(bar_e * bar_e, 0) + a_tot)
        r2 = tc.rsum(a_sq * (bar_w * bar_w)[None, :], 1) + tiny * (tc.rsum(bar_w * bar_w, 0) + a_tot)
        return 1.01 * (m1 + r1), 1.01 * (m2 + r2)

    @_jit
    def _context_rows(cl, pcf, vf, v_col, a_c, w_d, d_ok, D, terms, TF32: tl.constexpr, CALIBRATED: tl.constexpr):
        """The rows of a context tile CL = P̃_c·V (R, D): references P̃_c·(V[e, w]), bounded with a_c (>= ‖P̃_c,r‖)
        and V's column norms over the tile's keys (the D features that exist)."""
        vw_e = tc.rsum(vf, 1)
        vw_w = tc.rsum(vf * w_d[None, :], 1)
        b_sum, b_norm1, b_norm2 = tc.other_side(v_col, d_ok, terms[0])
        ref1, ref2 = tc.refs(pcf, vw_e, vw_w)
        mom1 = tl.full([cl.shape[0]], 0, tl.float32)
        mom2 = tl.full([cl.shape[0]], 0, tl.float32)
        if TF32:
            # abft.operand_moments.context_moments, rows: P_tk is shared along row t (one group).
            l1 = tc.rsum(pcf, 1)
            vsq = tl.where(d_ok[None, :], vf * vf, 0.0)
            df = D * 1.0
            row_m1 = tc.rsum(pcf * tc.rsum(vsq, 1)[None, :], 1)
            row_m2 = tc.rsum(pcf * tc.rsum(vsq * (w_d * w_d)[None, :], 1)[None, :], 1)
            row_r1 = tc.rsum(pcf * (vw_e * vw_e)[None, :], 1)
            row_r2 = tc.rsum(pcf * (vw_w * vw_w)[None, :], 1)
            tiny = terms[11]
            mom1 = 1.01 * l1 * (row_m1 + row_r1 + tiny * l1 * (df + 1.0))
            mom2 = 1.01 * l1 * (row_m2 + row_r2 + tiny * l1 * (df * (df + 1.0) * (2.0 * df + 1.0) / 6.0 + 1.0))
        bad, d1, b1, ratio = tc.check(cl, ref1, ref2, a_c, b_sum, b_norm1, b_norm2, tc.ref_norm(vw_e, terms[0]),
                                      tc.ref_norm(vw_w, terms[0]), mom1, mom2, terms, CALIBRATED)
        return bad, d1, b1, ratio, ref1, ref2, mom1, mom2

    @_jit
    def _context_cols(cl, pcf, vf, v_col, a_c, w_m, d_ok, terms, TF32: tl.constexpr, CALIBRATED: tl.constexpr):
        """The columns of a context tile (features): references (wᵀP̃_c)·V, bounded with ‖V_:,d‖ and a_c."""
        pw_e = tc.rsum(pcf, 0)
        pw_w = tc.rsum(pcf * w_m[:, None], 0)
        b_sum, b_norm1, b_norm2 = tc.other_side(a_c, tl.full([a_c.shape[0]], 1, tl.int1), terms[0])
        vt = tl.trans(vf)
        ref1, ref2 = tc.refs(vt, pw_e, pw_w)
        mom1 = tl.full([cl.shape[1]], 0, tl.float32)
        mom2 = tl.full([cl.shape[1]], 0, tl.float32)
        if TF32:
            # abft.operand_moments.context_moments, columns: V_kj is shared along column j.
            tiny = terms[11]
            l1 = tc.rsum(pcf, 1)
            vsq_t = tl.where(d_ok[:, None], vt * vt, 0.0)
            m_e = tc.rsum(pcf * l1[:, None], 0)
            m_w = tc.rsum(pcf * (l1 * w_m * w_m)[:, None], 0)
            mass_e = tc.rsum(pw_e, 0)
            mass_w = tc.rsum(pw_w, 0)
            col_m1 = tc.rsum(vsq_t * m_e[None, :], 1) + tiny * tc.rsum(m_e, 0)
            col_m2 = tc.rsum(vsq_t * m_w[None, :], 1) + tiny * tc.rsum(m_w, 0)
            col_r1 = mass_e * (tc.rsum(vsq_t * pw_e[None, :], 1) + tiny * mass_e)
            col_r2 = mass_w * (tc.rsum(vsq_t * pw_w[None, :], 1) + tiny * mass_w)
            mom1 = 1.01 * (col_m1 + col_r1)
            mom2 = 1.01 * (col_m2 + col_r2)
        bad, d1, b1, ratio = tc.check(tl.trans(cl), ref1, ref2, v_col, b_sum, b_norm1, b_norm2,
                                      tc.ref_norm(pw_e, terms[0]), tc.ref_norm(pw_w, terms[0]), mom1, mom2, terms,
                                      CALIBRATED)
        return bad, d1, b1, ratio, ref1, ref2, mom1, mom2

    @_jit
    def _settle(x, exact, bad, ref1, ref2, cbad, cref1, cref2, fixing):
        """A flagged tile of the repair's recompute, the fault having repeated: each located error corrected by its
        row, then the columns still flagged by theirs (a bad row is fixed column by column), every changed element
        then refreshed from ``exact`` (the tile's IEEE fp32 product: CUDA-core FMAs, not the tensor cores), as
        abft.repair refreshes a correction with its exact dot product."""
        x, hit = tc.fix(x, ref1, ref2, bad, fixing[0], fixing[1])
        xt, hit_t = tc.fix(tl.trans(x), cref1, cref2, cbad & (tc.rsum(hit.to(tl.int32), 0) == 0), fixing[0],
                           fixing[1])
        return tl.where(hit | tl.trans(hit_t), exact, tl.trans(xt))

    @_jit
    def _tally(worst, rec, rows_seen, x, rows, cols, r0, c0, near_inf):
        """One checked tile x folded into its block's state: each row's worst clean ratio so far (worst (R,),
        NaN-sticky), and when a row or column flagged, the block's record (_note). rows, cols: (bad, d1, b1, ratio,
        ref1, ref2) of each direction. Returns (worst, rec, rows_seen, flagged)."""
        worst = tc.max_nan(worst, tl.where(rows[0], 0.0, rows[3]))
        flagged = tc.rsum(rows[0].to(tl.int32), 0) + tc.rsum(cols[0].to(tl.int32), 0) > 0
        if flagged:
            rec, rows_seen = _note(rec, rows_seen, x, rows[0], rows[1], rows[2], rows[3], rows[4], rows[5], cols[0],
                                   cols[1], cols[2], cols[3], cols[4], cols[5], r0, c0, near_inf)
        return worst, rec, rows_seen, flagged

    @_jit
    def _note(rec, rows_seen, x, bad, d1, b1, ratio, ref1, ref2, cbad, cd1, cb1, cratio, cref1, cref2, r0, c0,
              near_inf):
        """Fold one flagged tile x (R, C) into its block's record (FIELDS): the first flagged tile sets the place,
        value, residual and bound; every one adds its flagged columns; rows_seen (R,) gathers the flagged rows
        (a row crossing several tiles is one row)."""
        fi = tl.arange(0, 16)
        r = tc.first(bad)
        c = tc.first(cbad)
        # A flagged row without a flagged column: the element its checksums locate (d2/d1, or the extreme value).
        loc_c, ok_c, _, _, _ = tc.locate(x, ref1, ref2, near_inf)
        c = tl.where((c < 0) & (r >= 0) & (tc.pick(ok_c.to(tl.int32), r) != 0), tc.pick(loc_c, r), c)
        loc_r, ok_r, _, _, _ = tc.locate(tl.trans(x), cref1, cref2, near_inf)
        r = tl.where((r < 0) & (c >= 0) & (tc.pick(ok_r.to(tl.int32), c) != 0), tc.pick(loc_r, c), r)
        row_vals = tc.rsum(tl.where(tl.arange(0, x.shape[0])[:, None] == r, x, 0.0), 0)
        value = tl.where(c >= 0, tc.pick2(x, r, c), tc.pick(tc.extreme_of(row_vals[None, :]), 0))
        worst_r, res_r, bnd_r = tc.worst_flagged(bad, d1, b1, ratio)
        worst_c, res_c, bnd_c = tc.worst_flagged(cbad, cd1, cb1, cratio)
        new = tl.where(fi == 0, 1.0, 0.0)
        new += tl.where(fi == 2, tl.where(r >= 0, r0 + r, -1).to(tl.float32), 0.0)
        new += tl.where(fi == 4, tl.where(c >= 0, c0 + c, -1).to(tl.float32), 0.0)
        new += tl.where(fi == 7, tl.where(worst_c > worst_r, bnd_c, bnd_r), 0.0)
        # Set apart: a NaN (value, residual) would poison the sums above.
        new = tl.where(fi == 5, value, new)
        new = tl.where(fi == 6, tl.where(worst_c > worst_r, res_c, res_r), new)
        # (where, not a scalar & a vector: the interpreter mistypes that when the scalar comes from a reduction)
        rec = tl.where(tc.pick(rec, 0) == 0.0, tl.where(fi != 3, new, rec), rec)
        rec += tl.where(fi == 3, tc.rsum(cbad.to(tl.float32), 0), 0.0)
        return rec, rows_seen | bad.to(tl.int32)

    @_jit
    def _tally_rows(worst, rec, rows_seen, x, bad, d1, b1, ratio, ref1, ref2, r0, c0, At):
        """_tally for the fast pass, which checks rows only: each row's worst clean ratio, and on a flagged row
        _note_rows. Returns (worst, rec, rows_seen). The rows' worst is reduced across the block once, after the key
        loop: reduced per tile, across the warps, it cost 171 of the clean loop's 2,297 instructions (bf16, D = 64,
        sm_90)."""
        worst = tc.max_nan(worst, tl.where(bad, 0.0, ratio))
        if tc.rsum(bad.to(tl.int32), 0) > 0:
            rec, rows_seen = _note_rows(rec, rows_seen, x, bad, d1, b1, ratio, ref1, ref2, r0, c0, At)
        return worst, rec, rows_seen

    @_jit
    def _note_rows(rec, rows_seen, x, bad, d1, b1, ratio, ref1, ref2, r0, c0, At):
        """Fold a tile x (R, C) with flagged rows into its block's record in the fast pass. The first flagged tile
        sets the row, residual and bound, and keeps its first flagged row at At (``SAVED_FIELDS``: the row's length,
        its first column's whole-matrix index, its two references and its bound, its C values), from which the host
        locates the element (``located``) when this record is the one reported. Locating here (_note's column check
        and locate) is what took the full-check kernel to 255 registers and a spill stack (bench/triton_resources.py):
        the repair kernel, launched for every flagged block, checks both directions anyway."""
        n_rows: tl.constexpr = x.shape[0]
        n_cols: tl.constexpr = x.shape[1]
        fi = tl.arange(0, 16)
        if tc.pick(rec, 0) == 0.0:
            r = tc.first(bad)
            rows = tl.arange(0, n_rows)
            at_r = rows == r
            # Masked stores of the one row: no reduction across the tile.
            tl.store(At + SAVED_HEAD + tl.arange(0, n_cols)[None, :] + 0 * rows[:, None], x, mask=at_r[:, None])
            tl.store(At + 2 + 0 * rows, ref1, mask=at_r)
            tl.store(At + 3 + 0 * rows, ref2, mask=at_r)
            tl.store(At + 4 + 0 * rows, b1, mask=at_r)
            tl.store(At, tl.full([], n_cols, tl.float32))
            tl.store(At + 1, tl.full([], 0, tl.float32) + c0)
            _, res, bnd = tc.worst_flagged(bad, d1, b1, ratio)
            new = tl.where(fi == 0, 1.0, 0.0)
            new += tl.where(fi == 2, (r0 + r).to(tl.float32), 0.0)
            new += tl.where(fi == 4, -1.0, 0.0)
            new += tl.where(fi == 7, bnd, 0.0)
            new += tl.where(fi == 9, 1.0, 0.0)
            # Set apart: a NaN residual would poison the sums above; the value is the host's (``located``).
            new = tl.where(fi == 5, float("nan"), new)
            rec = tl.where(fi == 6, res, new)
        return rec, rows_seen | bad.to(tl.int32)

    @_jit
    def _debug(Debug, tile, part, sum_x, sum_wx, sq, ref1, ref2, a, b1, ratio, bad, mom1, mom2, VMAX: tl.constexpr):
        """Tests: one direction's per-vector [Σx, Σw·x, Σx², ref1, ref2, a, bound on |d1|, ratio, bad, mom1, mom2] of
        a tile (part: 0 scores rows, 1 scores columns, 2 context rows, 3 context columns; 11, 12: _debug_norms)."""
        at = Debug + ((tile * 4 + part) * VMAX + tl.arange(0, sum_x.shape[0])) * 16
        tl.store(at + 0, sum_x)
        tl.store(at + 1, sum_wx)
        tl.store(at + 2, sq)
        tl.store(at + 3, ref1)
        tl.store(at + 4, ref2)
        tl.store(at + 5, a)
        tl.store(at + 6, b1)
        tl.store(at + 7, ratio)
        tl.store(at + 8, bad.to(tl.float32))
        tl.store(at + 9, mom1.to(tl.float32))
        tl.store(at + 10, mom2.to(tl.float32))

    @_jit
    def _debug_norms(Debug, tile, part, n: tl.constexpr, r1, r2, VMAX: tl.constexpr):
        at = Debug + ((tile * 4 + part) * VMAX + tl.arange(0, n)) * 16
        tl.store(at + 11, tl.full([n], 0, tl.float32) + r1.to(tl.float32))
        tl.store(at + 12, tl.full([n], 0, tl.float32) + r2.to(tl.float32))

    @_jit
    def _debug_tile(Debug, tile, part, x, bad, ratio, ref1, ref2, a, b1, mom1, mom2, VMAX: tl.constexpr):
        w = tc.weights(x.shape[1])
        _debug(Debug, tile, part, tc.rsum(x, 1), tc.rsum(x * w[None, :], 1), tc.rsum(x * x, 1), ref1, ref2, a, b1,
               ratio, bad, mom1, mom2, VMAX)

    @_jit
    def _lse_bound(q_norm, k_max, scale, n_keys):
        """tripwire.lse_over_bound's bound without the mask's largest value (added only after a trip, by the repair)."""
        return tl.abs(scale) * q_norm * k_max * 1.01 + tl.log(tl.maximum(n_keys, 1).to(tl.float32)) + 1.0

    @_jit
    def _lse_floor(q_norm, k_max, scale):
        """The log-sum-exp's lower bound without a mask: at least the row's largest scaled score, which is at least
        -|scale|·‖q_i‖·max_j‖k_j‖ (1.01 and 1: rounding). Only a fault in a stored log-sum-exp goes under it (one
        bad score cannot pull a row's log-sum-exp under the others'), so the kernels' own tier 1 never tests it;
        ``_trip_given`` does, and the repair counts a row that was under it and is not now as a real trip."""
        return -(tl.abs(scale) * q_norm * k_max * 1.01) - 1.0

    @_jit
    def _tripwire(o, lse, m_i, dead, row_ok, q_norm, k_max, scale, n_keys, r0):
        """Tier 1 at the end of a block (tripwire.py): (scores record, context record). The output rows summed:
        INF, NaN or near-INF trips "context"; the log-sum-exp over scale·‖q_i‖·max‖k_j‖ + log S + 1 (a huge score
        the output never shows) trips "scores". A trip's value: the output row's most extreme element; for the
        log-sum-exp, the row's largest scaled score divided by the scale (NaN if the lse is NaN)."""
        fi = tl.arange(0, 16)
        out_bad = ((tl.abs(tc.rsum(o, 1)) <= 1e10) == 0) & row_ok
        lse_bad = (dead == 0) & ((lse <= _lse_bound(q_norm, k_max, scale, n_keys)) == 0) & row_ok
        r_out = tc.first(out_bad)
        r_lse = tc.first(lse_bad)
        lse_value = tl.where(lse != lse, float("nan"), m_i / tl.abs(scale))
        # No place beyond the row and no residual: a trip is a value test (col -1, residual NaN, bound NEAR_INF).
        base = tl.where(fi == 0, 2.0, 0.0) + tl.where(fi == 4, -1.0, 0.0) + tl.where(fi == 7, 1e10, 0.0)
        base = tl.where(fi == 6, float("nan"), base)
        rec_c = tl.where(fi == 2, (r0 + r_out).to(tl.float32), base)
        rec_c = tl.where(fi == 5, tc.pick(tc.extreme_of(o), r_out), rec_c)
        rec_s = tl.where(fi == 2, (r0 + r_lse).to(tl.float32), base)
        rec_s = tl.where(fi == 5, tc.pick(lse_value, r_lse), rec_s)
        return tl.where(r_lse >= 0, rec_s, 0.0), tl.where(r_out >= 0, rec_c, 0.0)

    @_jit
    def _outcome(fast, rec, rows_seen, failed, real):
        """The repair's record of one op of its block (FIELDS): what the recompute found and did, or, clean on
        recompute, a transient fault ("recomputed") or a tier-1 trip the recompute reproduces ("dismissed": what the
        operands give; real is False then)."""
        fi = tl.arange(0, 16)
        found = tc.pick(rec, 0) != 0.0
        flag = tc.pick(fast, 0)
        outcome = tl.where(found, tl.where(failed != 0, 3.0, 2.0),
                           tl.where(flag == 1.0, 1.0, tl.where(flag == 2.0, tl.where(real, 1.0, 4.0), 0.0)))
        # Found on recompute: the record describes the fault that repeated (the flag kept; 1 if the fast pass did
        # not see it). Else the fast pass's record.
        rec = tl.where(fi == 1, tc.rsum(rows_seen, 0).to(tl.float32), rec)
        rec = tl.where(fi == 0, tl.where(flag != 0.0, flag, 1.0), rec)
        return tl.where(fi == 8, outcome, tl.where(found, rec, fast))

    @triton.jit
    def _attention(
        Q, K, V, Out, Lse, Mask, Seed, Status, Records, Saved, Faults, FaultValues, FaultSeen, Debug, KMax, KeyTiles,
        KeyNorms, KeyParts, ValueTiles, ValueNorms, ValueParts,
        sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sot, sod, smb, smh, smt, sms,
        skmb, skmh,
        H, GROUP, T, S, D, N_BLOCKS, N_TILES, N_KEY_TILES,
        scale, dropout_p, window, n_faults,
        s_row, s_col, c_row, c_col, fixing,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IS_CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
        MODE: tl.constexpr, CHECK_SCORES: tl.constexpr, CHECK_CONTEXT: tl.constexpr, CALIBRATED: tl.constexpr,
        TF32: tl.constexpr, DOT: tl.constexpr, COLS: tl.constexpr, REPAIR: tl.constexpr, FAULTS: tl.constexpr,
        DEBUG: tl.constexpr, K_MAX_GIVEN: tl.constexpr, KEY_TILES: tl.constexpr, VALUE_TILES: tl.constexpr,
        BY_DOT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rec_at = Records + (pid_n * N_BLOCKS + pid_m).to(tl.int64) * (2 * 16)
        fi = tl.arange(0, 16)
        if REPAIR:
            fast_s = tl.load(rec_at + fi)
            fast_c = tl.load(rec_at + 16 + fi)
            # A clean block returns at once: on a clean call the repair costs a launch and a load per program.
            if (tc.pick(fast_s, 0) == 0.0) & (tc.pick(fast_c, 0) == 0.0):
                return
        FULL: tl.constexpr = MODE == 2
        # Columns on every tile (tests, and the repair, which locates with them); else only on a tile that flags.
        ALL_COLS: tl.constexpr = COLS or REPAIR
        # The repair kernel, which runs on flagged blocks only, keeps the rows' references in fp32: with the extra
        # product per tile ptxas gave it 128 registers and a 5 KB spill stack on sm_89, against 255 and 1.4 KB
        # without (D = 128, a bool mask; Triton 3.9).
        ROWS_BY_DOT: tl.constexpr = BY_DOT and not REPAIR
        # Every key's norm in the loop: the full checks' bound needs them; tier 1 only their running max, which
        # forward() hands over per key prefix (KMax, (B, Hk, S)) where it can.
        KEY_NORMS: tl.constexpr = MODE == 2 or (MODE == 1 and K_MAX_GIVEN == 0)
        VMAX: tl.constexpr = max(BLOCK_M, BLOCK_N, BLOCK_D)
        SAVED: tl.constexpr = VMAX + SAVED_HEAD
        # The fast pass's kept row per op (_note_rows): scores at saved_at, the context at saved_at + SAVED.
        saved_at = Saved + (pid_n * N_BLOCKS + pid_m).to(tl.int64) * (2 * SAVED)
        b, h, hk, offs_m, offs_d, row_ok, d_ok = query_block(pid_m, pid_n, H, GROUP, T, D, BLOCK_M, BLOCK_D)
        q = rows(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, sqd, row_ok, d_ok)
        qf = q.to(tl.float32)
        q_op = operand(q, DOT)
        q_norm = tl.sqrt(tc.rsum(qf * qf, 1))
        k_at = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_at = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        m_at = Mask + b.to(tl.int64) * smb + h.to(tl.int64) * smh
        w_m = tc.weights(BLOCK_M)
        w_n = tc.weights(BLOCK_N)
        w_d = tc.weights(BLOCK_D)
        inv_keep = 1.0
        seed = 0
        if DROPOUT:
            inv_keep = 1.0 / (1.0 - dropout_p)
            seed = tl.load(Seed)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0, tl.float32)
        rec_s = tl.full([16], 0, tl.float32)
        rec_c = tl.full([16], 0, tl.float32)
        rows_s = tl.full([BLOCK_M], 0, tl.int32)
        rows_c = tl.full([BLOCK_M], 0, tl.int32)
        # Each row's worst clean ratio over the tiles, reduced across the block once, after the loop.
        worst_s = tl.full([BLOCK_M], 0, tl.float32)
        worst_c = tl.full([BLOCK_M], 0, tl.float32)
        failed_s = tl.full([], 0, tl.int32)
        failed_c = tl.full([], 0, tl.int32)
        k_max = tl.full([], 0, tl.float32)
        mask_max = tl.full([BLOCK_M], float("-inf"), tl.float32)

        lo = 0
        hi = S
        if IS_CAUSAL:
            hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
        if WINDOWED:
            lo = tl.maximum(0, pid_m * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_ok = offs_n < S
            tile = (pid_n * N_BLOCKS + pid_m) * N_TILES + (start_n - lo) // BLOCK_N
            k = tl.load(k_at + offs_n[:, None] * sks + offs_d[None, :] * skd, mask=key_ok[:, None] & d_ok[None, :],
                        other=0.0)
            v = tl.load(v_at + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=key_ok[:, None] & d_ok[None, :],
                        other=0.0)
            kf = k.to(tl.float32)
            s = dot(q_op, tl.trans(operand(k, DOT)), DOT)
            if FAULTS:
                s = _inject(s, Faults, FaultValues, FaultSeen, n_faults, pid_n, offs_m, offs_n, 0, REPAIR)
            if KEY_TILES or VALUE_TILES:
                # This key tile's row of _kv_tiles' outputs (the same device functions made them, on the same tile).
                kt_at = (b * (H // GROUP) + hk).to(tl.int64) * N_KEY_TILES + start_n // BLOCK_N
            if KEY_NORMS:
                if KEY_TILES:
                    k_norm = tl.load(KeyTiles + kt_at * (2 * BLOCK_D + BLOCK_N + 1) + 2 * BLOCK_D
                                     + tl.arange(0, BLOCK_N))
                else:
                    k_norm = tl.sqrt(tc.rsum(kf * kf, 1))
                if K_MAX_GIVEN == 0:
                    k_max = tl.maximum(k_max, tc.rmax(tl.where(key_ok, k_norm, 0.0), 0))
            if FULL and CHECK_SCORES:
                # Rows: q_i·(K_jᵀ[e, w]) against Σ_j AS_ij, Σ_j j·AS_ij; columns (a flag, or every tile with COLS)
                # the same on AS_ijᵀ = K_j Q_iᵀ.
                if KEY_TILES:
                    bad, d1, b1, ratio, ref1, ref2, mom1, mom2 = _rows_of_tile(
                        s, qf, q_op, q_norm, KeyTiles + kt_at * (2 * BLOCK_D + BLOCK_N + 1),
                        KeyNorms + kt_at * N_TILE_NORMS, KeyParts + kt_at * (BLOCK_D * tc.PARTS), s_row, CALIBRATED,
                        BLOCK_D, BLOCK_N, ROWS_BY_DOT)
                else:
                    bad, d1, b1, ratio, ref1, ref2, mom1, mom2 = _scores_rows(s, qf, q_norm, kf, k_norm, w_n, s_row,
                                                                              TF32, CALIBRATED)
                if ALL_COLS:
                    cbad, cd1, cb1, cratio, cref1, cref2, cmom1, cmom2 = _scores_rows(
                        tl.trans(s), kf, k_norm, qf, q_norm, w_m, s_col, TF32, CALIBRATED)
                    if DEBUG:
                        _debug_tile(Debug, tile, 0, s, bad, ratio, ref1, ref2, q_norm, b1, mom1, mom2, VMAX)
                        _debug_tile(Debug, tile, 1, tl.trans(s), cbad, cratio, cref1, cref2, k_norm, cb1, cmom1,
                                    cmom2, VMAX)
                    worst_s, rec_s, rows_s, flagged = _tally(worst_s, rec_s, rows_s, s,
                                                             (bad, d1, b1, ratio, ref1, ref2),
                                                             (cbad, cd1, cb1, cratio, cref1, cref2), pid_m * BLOCK_M,
                                                             start_n, fixing[0])
                else:
                    # The fast pass: rows only. A flag keeps the first flagged row's values and references
                    # (_note_rows); the repair kernel checks the block's columns.
                    worst_s, rec_s, rows_s = _tally_rows(worst_s, rec_s, rows_s, s, bad, d1, b1, ratio, ref1, ref2,
                                                         pid_m * BLOCK_M, start_n, saved_at)
                    flagged = False
                if REPAIR and flagged:
                    s = _settle(s, tl.dot(qf, tl.trans(kf), input_precision="ieee"), bad, ref1, ref2, cbad,
                                cref1, cref2, fixing)
                    again = _scores_rows(s, qf, q_norm, kf, k_norm, w_n, s_row, TF32, CALIBRATED)[0]
                    again_t = _scores_rows(tl.trans(s), kf, k_norm, qf, q_norm, w_m, s_col, TF32, CALIBRATED)[0]
                    failed_s = tl.maximum(failed_s, tc.rmax(again.to(tl.int32), 0))
                    failed_s = tl.maximum(failed_s, tc.rmax(again_t.to(tl.int32), 0))

            # The online softmax (abft.tiled.fold_scores) in base 2, as a GPU's exp is (ex2): z = log2(e)·(scale·AS +
            # mask), P̃ = 2^(z - m_new) in [0, 1], the log-sum-exp back in base e after the loop. Masked keys -INF,
            # on the tiles that may hold any (tc.holds_masked); the rest skip the per-element test.
            z = s * (scale * tc.LOG2E)
            valid = key_ok[None, :] & row_ok[:, None]
            if IS_CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            if WINDOWED:
                valid = valid & (offs_m[:, None] - offs_n[None, :] < window)
            edge = tc.holds_masked(pid_m * BLOCK_M, start_n, T, S, window, BLOCK_M, BLOCK_N, IS_CAUSAL, WINDOWED)
            if MASK_KIND == 1:
                # The bool mask read as bytes (0 or 1) and added as 0 or -INF (1 - 1/0, IEEE's division: the fast
                # one promises no INF): no boolean tile from a load, which the repair kernel could not compile
                # (triton_dropout.keep_scale says why).
                allowed = tl.load(m_at + offs_m[:, None].to(tl.int64) * smt + offs_n[None, :] * sms, mask=valid,
                                  other=0).to(tl.float32)
                z = z + (1.0 - tl.math.div_rn(tl.full(allowed.shape, 1.0, tl.float32), allowed))
            if MASK_KIND == 2:
                bias = tl.load(m_at + offs_m[:, None].to(tl.int64) * smt + offs_n[None, :] * sms, mask=valid,
                               other=0.0).to(tl.float32)
                z = z + bias * tc.LOG2E
                if REPAIR:
                    mask_max = tl.maximum(mask_max, tc.rmax(tl.where(valid & (bias == bias), bias, float("-inf")), 1))
            if edge:
                z = tl.where(valid, z, float("-inf"))
            m_new = tl.maximum(m_i, tc.rmax(z, 1))
            # A row with every key so far masked has m = -INF: shift by 0 there (P̃ = 0, alpha = 0).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(z - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            p_sum = tc.rsum(p, 1)
            l_i = l_i * alpha + p_sum
            m_i = m_new
            if DROPOUT:
                p = p * triton_dropout.keep_scale(seed, pid_n, T, S, offs_m[:, None], offs_n[None, :], dropout_p,
                                                  inv_keep)
            # P̃ rounded to V's dtype, as the GEMM takes it: the context's references use the same values.
            p_c = p.to(v.dtype)
            cl = dot(operand(p_c, DOT), operand(v, DOT), DOT)
            if FAULTS:
                # A context fault lands in the first partial product its block folds in (as the PyTorch tile loop).
                cl = _inject(cl, Faults, FaultValues, FaultSeen, n_faults, pid_n,
                             tl.where(start_n == lo, offs_m, -1 - 0 * offs_m), offs_d, 1, REPAIR)
            if FULL and CHECK_CONTEXT:
                pcf = p_c.to(tl.float32)
                vf = v.to(tl.float32)
                # ‖P̃_c,i‖₂ <= sqrt(Σ_j P̃_ij)/(1 - p): 0 <= P̃ <= 1 before dropout's scaling (1.01: its rounding).
                a_c = tl.sqrt(p_sum) * 1.01 * inv_keep
                if VALUE_TILES:
                    vt_at = ValueTiles + kt_at * (2 * BLOCK_N + BLOCK_D + 1)
                    v_col = tl.load(vt_at + 2 * BLOCK_N + tl.arange(0, BLOCK_D))
                    bad, d1, b1, ratio, ref1, ref2, mom1, mom2 = _rows_of_tile(
                        cl, pcf, operand(p_c, DOT), a_c, vt_at, ValueNorms + kt_at * N_TILE_NORMS,
                        ValueParts + kt_at * (BLOCK_N * tc.PARTS), c_row, CALIBRATED, BLOCK_N, BLOCK_D, ROWS_BY_DOT)
                else:
                    v_col = tl.sqrt(tc.rsum(vf * vf, 0))
                    bad, d1, b1, ratio, ref1, ref2, mom1, mom2 = _context_rows(cl, pcf, vf, v_col, a_c, w_d, d_ok,
                                                                               D, c_row, TF32, CALIBRATED)
                if ALL_COLS:
                    cbad, cd1, cb1, cratio, cref1, cref2, cmom1, cmom2 = _context_cols(cl, pcf, vf, v_col, a_c, w_m,
                                                                                       d_ok, c_col, TF32, CALIBRATED)
                    if DEBUG:
                        _debug_tile(Debug, tile, 2, cl, bad, ratio, ref1, ref2, a_c, b1, mom1, mom2, VMAX)
                        _debug_tile(Debug, tile, 3, tl.trans(cl), cbad, cratio, cref1, cref2, v_col, cb1, cmom1,
                                    cmom2, VMAX)
                        # The columns' reference weight-vector norms (‖wᵀP̃_c‖): an input of their rule made from P̃.
                        _debug_norms(Debug, tile, 3, BLOCK_D, tc.ref_norm(tc.rsum(pcf, 0), 0.0),
                                     tc.ref_norm(tc.rsum(pcf * w_m[:, None], 0), 0.0), VMAX)
                    worst_c, rec_c, rows_c, flagged = _tally(worst_c, rec_c, rows_c, cl,
                                                             (bad, d1, b1, ratio, ref1, ref2),
                                                             (cbad, cd1, cb1, cratio, cref1, cref2), pid_m * BLOCK_M,
                                                             0, fixing[0])
                else:
                    worst_c, rec_c, rows_c = _tally_rows(worst_c, rec_c, rows_c, cl, bad, d1, b1, ratio, ref1, ref2,
                                                         pid_m * BLOCK_M, 0, saved_at + SAVED)
                    flagged = False
                if REPAIR and flagged:
                    cl = _settle(cl, tl.dot(pcf, vf, input_precision="ieee"), bad, ref1, ref2, cbad, cref1,
                                 cref2, fixing)
                    again = _context_rows(cl, pcf, vf, v_col, a_c, w_d, d_ok, D, c_row, TF32, CALIBRATED)[0]
                    again_t = _context_cols(cl, pcf, vf, v_col, a_c, w_m, d_ok, c_col, TF32, CALIBRATED)[0]
                    failed_c = tl.maximum(failed_c, tc.rmax(again.to(tl.int32), 0))
                    failed_c = tl.maximum(failed_c, tc.rmax(again_t.to(tl.int32), 0))
            acc = acc * alpha[:, None] + cl

        if K_MAX_GIVEN:
            # The largest norm of the keys the loop visited, [lo, n_seen): its tiles, cut at S.
            n_seen = tl.minimum(S, lo + tl.cdiv(hi - lo, BLOCK_N) * BLOCK_N)
            k_max = tl.load(KMax + b.to(tl.int64) * skmb + hk.to(tl.int64) * skmh + tl.maximum(n_seen - 1, 0),
                            mask=n_seen > lo, other=0.0)
        # abft.tiled.finish: a row with every key masked gets out 0 (SDPA's safe softmax) and lse +INF.
        dead = l_i == 0.0
        l_safe = tl.where(dead, 1.0, l_i)
        o = tl.where(dead[:, None], 0.0, acc / l_safe[:, None])
        m_i = m_i * tc.LN2  # base e from here
        lse = tl.where(dead, float("inf"), m_i + tl.log(l_safe))
        lse_at = Lse + pid_n.to(tl.int64) * T + offs_m
        if MODE == 1:
            rec_s, rec_c = _tripwire(o, lse, m_i, dead, row_ok, q_norm, k_max, scale, hi - lo, pid_m * BLOCK_M)
        if REPAIR:
            # A tier-1 trip is real when the recompute no longer trips; the lse test now with the mask's largest
            # value in its bound (an ALiBi-like positive bias lifts a clean lse).
            lse_fast = tl.load(lse_at, mask=row_ok, other=0.0)
            bound = _lse_bound(q_norm, k_max, scale, hi - lo) + tl.maximum(mask_max, 0.0)
            # +INF is a row with every key masked (out 0) where the recompute has it too; where it does not, the
            # first value was a fault (an +INF a given log-sum-exp held).
            floor = _lse_floor(q_norm, k_max, scale)
            dead_now = lse == float("inf")
            over_fast = (((lse_fast <= bound) == 0) | (lse_fast < floor)) & (dead_now == 0) & row_ok
            over_now = (((lse <= bound) == 0) | (lse < floor)) & (dead_now == 0) & row_ok
            real_s = tc.rsum((over_fast & (over_now == 0)).to(tl.int32), 0) > 0
            real_c = tc.rsum((((tl.abs(tc.rsum(o, 1)) <= 1e10) == 0) & row_ok).to(tl.int32), 0) == 0
            rec_s = _outcome(fast_s, rec_s, rows_s, failed_s, real_s)
            rec_c = _outcome(fast_c, rec_c, rows_c, failed_c, real_c)
        else:
            rec_s += tl.where(fi == 1, tc.rsum(rows_s, 0).to(tl.float32), 0.0)
            rec_c += tl.where(fi == 1, tc.rsum(rows_c, 0).to(tl.float32), 0.0)
        tl.store(Out + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
                 o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_at, lse, mask=row_ok)
        if MODE != 0:
            publish(rec_at, rec_s, rec_c, Status)
            if FULL and not REPAIR:
                # A non-finite ratio is a check whose inputs already carried a fault reported elsewhere: left out.
                block_s = tc.rmax(worst_s, 0)
                block_c = tc.rmax(worst_c, 0)
                tl.atomic_max(Status + 2, tl.where(block_s <= _F32_MAX, block_s, 0.0))
                tl.atomic_max(Status + 3, tl.where(block_c <= _F32_MAX, block_c, 0.0))


    @triton.jit
    def _trip_given(
        Q, Out, Lse, Status, Records, KMax,
        sqb, sqh, sqt, sqd, sob, soh, sot, sod, skmb, skmh,
        H, GROUP, T, S, D, N_BLOCKS, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
    ):
        """Tier 1 over a forward another kernel computed (forward(given=...)): per query block, its output rows and
        log-sum-exp read once and tested as the first pass's tier 1 tests its own (``_tripwire``), the block's
        records and the call's status written as that pass writes them, so that the repair launch recomputes
        exactly the tripped blocks. The bound takes the same keys as the pass: a causal block's tiles up to its
        last query, the largest norm among them from KMax ((B, Hk, S) running max, made once per call). No mask
        here, so no row is dead, and the log-sum-exp is bounded from below too (``_lse_floor``): the stored one is
        an output of the other kernel, where a fault can land. A trip's value for the log-sum-exp is lse / |scale|
        (the pass keeps the row's largest scaled score, which only the products show; lse exceeds it by at most
        log S)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        b, h, hk, offs_m, offs_d, row_ok, d_ok = query_block(pid_m, pid_n, H, GROUP, T, D, BLOCK_M, BLOCK_D)
        q = rows(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, sqd, row_ok, d_ok).to(tl.float32)
        o = rows(Out, b, h, offs_m, offs_d, sob, soh, sot, sod, row_ok, d_ok).to(tl.float32)
        lse = tl.load(Lse + pid_n.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
        q_norm = tl.sqrt(tc.rsum(q * q, 1))
        hi = S
        if IS_CAUSAL:
            hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
        n_seen = tl.minimum(S, tl.cdiv(hi, BLOCK_N) * BLOCK_N)
        k_max = tl.load(KMax + b.to(tl.int64) * skmb + hk.to(tl.int64) * skmh + tl.maximum(n_seen - 1, 0),
                        mask=n_seen > 0, other=0.0)
        dead = row_ok & (row_ok == 0)
        # Under the floor (a fault in the stored lse itself) tests as over the bound; the record keeps the value.
        lse_test = tl.where(lse < _lse_floor(q_norm, k_max, scale), float("inf"), lse)
        rec_s, rec_c = _tripwire(o, lse_test, lse, dead, row_ok, q_norm, k_max, scale, hi, pid_m * BLOCK_M)
        publish(Records + (pid_n * N_BLOCKS + pid_m).to(tl.int64) * (2 * 16), rec_s, rec_c, Status)


BENCH_FORMS: tuple[str, ...] = ("off", "tier1", "full", "full_scores", "full_context", "full_no_repair",
                                 "full_fp32_refs", "sdpa", "vendor", "tier1_given", "full_given")
"""What ``bench_checks`` can time (the last three need ``vendor``)."""


def bench_checks(*, b: int, h: int, t: int, d: int, device: str, causal: bool = True, reps: int = 20,
                 dtype: torch.dtype = torch.bfloat16, vendor: Any = None, blocks: Blocks | None = None,
                 forms: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The cost of the checks inside the kernel (bench/gpu_suite.py): one forward with checks off, with tier 1 and
    with the full checks (its repair launch included, which returns at once on clean data), interleaved over ``reps``
    rounds, milliseconds per call (device-synchronised: a benchmark, not the fast path) and each over checks off.

    Beside them, to tell where the full checks' cost lies (the first H200 run measured them at 7 to 20× the kernel,
    docs/performance.md §8): the scores' checks alone, the context's alone, both without the repair launch, the full
    checks with the row references in fp32 (``Checks.refs_by_dot`` False, the form before they moved to the tensor
    cores), and SDPA's own forward on the same inputs (the unprotected step's attention). After the timing, one
    clean call each of the full checks with either form of the references: whether it flagged and its worst clean
    ratio (how near the bound a clean call comes on this GPU's tensor cores; a sync, outside the timing).

    vendor: attention/vendor.forward, to time tier 1 as a default step runs it where the vendor takes the
    call: the vendor's forward alone ("vendor") and with the pass over it and the repair launch ("tier1_given"),
    each also over SDPA's forward; and the full checks over the vendor's forward, as a full step runs them there
    (abft/given_forward.py: "full_given", over the vendor's and SDPA's forwards and over ``full``), with its worst
    clean ratio and whether it flagged. blocks: the kernel's tiles (default ``block_sizes`` for the device). forms: time
    only these of BENCH_FORMS ("off" always: the others are over it); None, all (the vendor's where it is given)."""
    import statistics
    import time

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g, device=device).to(dtype) for _ in range(3))
    scale = 1 / math.sqrt(d)
    variants: dict[str, Checks | str] = {
        "off": Checks(mode=None), "tier1": Checks(mode="tier1"), "full": Checks(mode="full"),
        "full_scores": Checks(mode="full", context=False), "full_context": Checks(mode="full", scores=False),
        "full_no_repair": Checks(mode="full", repair=False), "full_fp32_refs": Checks(mode="full", refs_by_dot=False),
        "sdpa": "sdpa"}
    if vendor is not None:
        variants |= {"vendor": "vendor", "tier1_given": "tier1_given"}
        if given_full_takes(dtype, Checks(mode="full")):
            variants["full_given"] = "full_given"
    if forms is not None:
        bad = sorted(set(forms) - set(variants))  # unknown, or the vendor's without one
        if bad:
            raise ValueError(f"bench_checks: cannot time {bad} here; choose from {BENCH_FORMS} (the vendor's three "
                             f"need vendor=, full_given bf16 or fp16)")
        variants = {name: form for name, form in variants.items() if name == "off" or name in forms}
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(reps + 1):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            checks = variants[name]
            sync()
            t0 = time.perf_counter()
            if checks == "sdpa":
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            elif checks == "vendor":
                vendor(q, k, v, is_causal=causal, scale=scale)
            elif checks in ("tier1_given", "full_given"):
                made = vendor(q, k, v, is_causal=causal, scale=scale)
                forward(q, k, v, scale=scale, checks=Checks(mode="tier1" if checks == "tier1_given" else "full"),
                        is_causal=causal, given=(made.out_BHTD, made.lse_BHT), blocks=blocks)
            else:
                assert isinstance(checks, Checks)
                forward(q, k, v, scale=scale, checks=checks, is_causal=causal, blocks=blocks)
            sync()
            if r:  # the first round compiles
                times[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(xs) for name, xs in times.items()}
    got: dict[str, Any] = {f"{name}_ms": ms for name, ms in med.items()} | {
        f"{name}_over_off": med[name] / med["off"] for name in names if name != "off"}
    # The warps each form ran on (block_sizes: the full checks' may differ from the others').
    dev = torch.device(device)
    got["warps_by_form"] = {form: (blocks or block_sizes(d, dev, dtype, full=form == "full")).warps
                            for form in ("off", "full")}
    for name, by_dot in ((n, by) for n, by in (("full", None), ("full_fp32_refs", False)) if n in variants):
        status = forward(q, k, v, scale=scale, checks=Checks(mode="full", repair=False, refs_by_dot=by_dot),
                         is_causal=causal, blocks=blocks).status.tolist()  # syncs: read once, after the timing
        got |= {f"{name}_flagged": bool(status[0] or status[1]), f"{name}_worst_ratio": max(status[2], status[3])}
    if "full_given" in variants:
        made = vendor(q, k, v, is_causal=causal, scale=scale)
        status = forward(q, k, v, scale=scale, checks=Checks(mode="full", repair=False), is_causal=causal,
                         given=(made.out_BHTD, made.lse_BHT), blocks=blocks).status.tolist()  # syncs: as above
        got |= {"full_given_flagged": bool(status[0] or status[1]), "full_given_worst_ratio": max(status[2:4])}
        for over in ("vendor", "sdpa", "full"):
            if over in variants:
                got[f"full_given_over_{over}"] = med["full_given"] / med[over]
    if {"vendor", "tier1_given", "tier1", "sdpa"} <= set(variants):
        got |= {"tier1_given_over_vendor": med["tier1_given"] / med["vendor"],
                "tier1_given_over_sdpa": med["tier1_given"] / med["sdpa"],
                "tier1_over_sdpa": med["tier1"] / med["sdpa"]}
    return got
