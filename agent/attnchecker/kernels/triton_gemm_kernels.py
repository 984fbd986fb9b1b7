"""The Triton kernels of the GEMM checks (launched by ``triton_gemm_check``, which says when and how; imported only
there, once triton is known to be importable). Four kernels, each one pass (the third also as a pair):

- ``operand_pass``: one read of an operand X (..., R, C): X·V and X·w (w the checksum weights ones and 1..C), Xᵀ·L and
  Xᵀ·w, and X's squared row and column sums; the references and norms of a row check come from one such pass per
  operand side (the skinny GEMMs X·[B w] and the like), never from C. The GPU sibling of fused_pass.c.
- ``check_pass``: one read of C (..., M, N): each row's checksums (weights ones and 1..N), ΣC², Σ|C| (half outputs) and
  its extreme values, the row rule (abft/gemm_rule.py) against the references, the flags. A flagged row is located
  and corrected in the same program (an extreme element by value, else d2/d1; the element recomputed exactly from
  A's row and B's column, then the row re-verified), or marked for recomputation. The per-row work past the first
  read runs only in programs that hold a flagged row.
- ``trip_pass``: tier 1: the extreme-value test alone (INF, NaN, |x| > near_inf), one read of C; a program whose rows
  hold an extreme element recomputes them itself (a tl.dot over K per tile) and judges them by what the operands
  allow, without references. One launch per tier-1 GEMM; ``trip_pass_pair``, one for two (a Linear's dX and dW).
- ``repair_rows``: recomputes the rows the check pass marked (a tl.dot over K per tile), re-verifies them and writes
  them back; every program returns at once on a clean call.

Outcomes live on the device (``state``, per-row ``code``, a few ``slot`` summaries for the reports); the host reads them
at the step boundary (checks/deferred.py). Layouts: the leading dims of a batched product are (nb0, nb1) with their own
strides (B, H for attention; nb = 1 for a Linear GEMM); per-row outputs are dense (nb, M). Legend: M rows of C, N its
columns, K the reduction length, R/C an operand's rows/columns.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Outcome codes of a row (triton_gemm_check.OUTCOMES names them).
CLEAN = tl.constexpr(0)
CORRECTED = tl.constexpr(1)
NEED_RECOMPUTE = tl.constexpr(2)
RECOMPUTED = tl.constexpr(3)
UNCORRECTABLE = tl.constexpr(4)
CONSISTENT = tl.constexpr(5)
DETECTED = tl.constexpr(6)
UPSTREAM = tl.constexpr(7)
# state[] slots (triton_gemm_check.STATE).
S_FLAGGED = tl.constexpr(0)
S_WORST = tl.constexpr(1)
S_EXTREME = tl.constexpr(2)
S_RECOMPUTE = tl.constexpr(3)
S_CORRECTED = tl.constexpr(4)
S_RECOMPUTED = tl.constexpr(5)
S_UNCORRECTABLE = tl.constexpr(6)
S_CONSISTENT = tl.constexpr(7)
S_DETECTED = tl.constexpr(8)
S_UPSTREAM = tl.constexpr(9)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
LOCATE_SLACK = tl.constexpr(0.3)
"""abft.repair._LOCATE_SLACK: d2/d1 this far from an integer is not a position."""
# tl.sum and tl.max are tl.reduce over these combine functions behind a @jit wrapper of their own (tl.zeros likewise
# wraps tl.full); Triton's interpreter re-patches the language on every call of a @jit function (about 1.5 ms), which
# made most of these kernels' time there, so they call tl.reduce and tl.full directly. Compiled, it is the same code.
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max
_min = tl.standard._elementwise_min


@triton.jit
def operand_pass(
    x_ptr, R, C, nb1, sx0, sx1, sxr, sxc,
    v_ptr, sv0, sv1, svk, svj,
    l_ptr, sl0, sl1, slr, slj,
    xv_ptr, xw_ptr, rsq_ptr, lx_ptr, wx_ptr, csq_ptr, vsq_ptr, lsq_ptr,
    jv, jl, run_c, run_r, jw, jlw,
    RIGHT_V: tl.constexpr, RIGHT_W: tl.constexpr, LEFT_L: tl.constexpr, LEFT_W: tl.constexpr,
    ROW_SQ: tl.constexpr, COL_SQ: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, JP: tl.constexpr,
    TC: tl.constexpr = False, WHOLE_W: tl.constexpr = False, CAST: tl.constexpr = 0,
):
    """One read of X (.., R, C), BR rows a program: xv = X·V (V (.., C, 2)), xw = X·[1, 1..C], rsq = ΣX² per row
    (dense (nb, R, 2) / (nb, R)); lx = Xᵀ·L (L (.., R, 2)), wx = Xᵀ·[1, 1..R], csq = ΣX² per column (dense (nb, C, 2)
    / (nb, C), zeroed by the caller: the programs add their rows' parts). With V, vsq = ‖V‖² per column of V (nb, 2),
    stored by each matrix's first program (every program reads all of V); with L, lsq = ‖L‖² likewise (nb, 2, zeroed:
    each program adds its rows'): the norms of the vectors a row check's reference dots with, for its rule.

    JP > 0: the grouped form (``_operand_pass_wide``), for the references of rows checked in runs (check_pass's G):
    V (C, jv) and L (R, jl) any width up to JP, xw = X·[1, 1..run_c] per run of run_c columns (nb, R, jw = 2·runs),
    wx = Xᵀ·[1, 1..run_r] per run of run_r rows (nb, C, jlw), each as tl.dot with the weights made in registers.

    CAST (1, 3 bf16, 2 fp16: ``_gemm_operand``): X is the fp32 operand of a GEMM that rounds it to that dtype
    (autocast): its products are of X rounded so, as the GEMM's are (and, rounded, exact in TF32 for the tensor
    cores), its squared sums of X as given."""
    if JP > 0:
        _operand_pass_wide(x_ptr, R, C, nb1, sx0, sx1, sxr, sxc, v_ptr, sv0, sv1, svk, svj, l_ptr, sl0, sl1, slr, slj,
                           xv_ptr, xw_ptr, rsq_ptr, lx_ptr, wx_ptr, csq_ptr, vsq_ptr, lsq_ptr, jv, jl, run_c, run_r,
                           jw, jlw, RIGHT_V, RIGHT_W, LEFT_L, LEFT_W, ROW_SQ, COL_SQ, BR, BC, JP, TC, WHOLE_W, CAST)
        return
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    # Matrix pid_b of the (nb0, nb1) leading dims, each with its own strides.
    bi0 = (pid_b // nb1).to(tl.int64)
    bi1 = (pid_b % nb1).to(tl.int64)
    rows = pid_r * BR + tl.arange(0, BR)
    rmask = rows < R
    xb = x_ptr + (bi0 * sx0 + bi1 * sx1)
    vb = v_ptr + (bi0 * sv0 + bi1 * sv1)
    acc_v0 = tl.full([BR], 0, tl.float32)
    acc_v1 = tl.full([BR], 0, tl.float32)
    acc_w0 = tl.full([BR], 0, tl.float32)
    acc_w1 = tl.full([BR], 0, tl.float32)
    acc_sq = tl.full([BR], 0, tl.float32)
    l0 = tl.full([BR], 0, tl.float32)
    l1 = tl.full([BR], 0, tl.float32)
    if LEFT_L:
        lb = l_ptr + (bi0 * sl0 + bi1 * sl1)
        l0 = tl.load(lb + rows.to(tl.int64) * slr, mask=rmask, other=0.0).to(tl.float32)
        l1 = tl.load(lb + rows.to(tl.int64) * slr + slj, mask=rmask, other=0.0).to(tl.float32)
        tl.atomic_add(lsq_ptr + pid_b.to(tl.int64) * 2, tl.reduce(l0 * l0, 0, _add))
        tl.atomic_add(lsq_ptr + pid_b.to(tl.int64) * 2 + 1, tl.reduce(l1 * l1, 0, _add))
    vs0 = tl.full([BC], 0, tl.float32)
    vs1 = tl.full([BC], 0, tl.float32)
    # The checksum weights over the rows (1..R); rows past R read X as 0.
    wr = (rows + 1).to(tl.float32)
    out_c = pid_b.to(tl.int64) * C
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        cmask = cols < C
        x = tl.load(xb + rows.to(tl.int64)[:, None] * sxr + cols[None, :].to(tl.int64) * sxc,
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        xp = _gemm_operand(x, CAST)
        if RIGHT_V:
            v0 = tl.load(vb + cols.to(tl.int64) * svk, mask=cmask, other=0.0).to(tl.float32)
            v1 = tl.load(vb + cols.to(tl.int64) * svk + svj, mask=cmask, other=0.0).to(tl.float32)
            acc_v0 += tl.reduce(xp * v0[None, :], 1, _add)
            acc_v1 += tl.reduce(xp * v1[None, :], 1, _add)
            vs0 += v0 * v0
            vs1 += v1 * v1
        if RIGHT_W:
            acc_w0 += tl.reduce(xp, 1, _add)
            acc_w1 += tl.reduce(xp * (cols + 1).to(tl.float32)[None, :], 1, _add)
        x2 = x * x
        if ROW_SQ:
            acc_sq += tl.reduce(x2, 1, _add)
        if LEFT_L:
            tl.atomic_add(lx_ptr + (out_c + cols) * 2, tl.reduce(xp * l0[:, None], 0, _add), mask=cmask)
            tl.atomic_add(lx_ptr + (out_c + cols) * 2 + 1, tl.reduce(xp * l1[:, None], 0, _add), mask=cmask)
        if LEFT_W:
            tl.atomic_add(wx_ptr + (out_c + cols) * 2, tl.reduce(xp, 0, _add), mask=cmask)
            tl.atomic_add(wx_ptr + (out_c + cols) * 2 + 1, tl.reduce(xp * wr[:, None], 0, _add), mask=cmask)
        if COL_SQ:
            tl.atomic_add(csq_ptr + out_c + cols, tl.reduce(x2, 0, _add), mask=cmask)
    out_r = pid_b.to(tl.int64) * R + rows
    if RIGHT_V:
        tl.store(xv_ptr + out_r * 2, acc_v0, mask=rmask)
        tl.store(xv_ptr + out_r * 2 + 1, acc_v1, mask=rmask)
        if pid_r == 0:
            tl.store(vsq_ptr + pid_b.to(tl.int64) * 2, tl.reduce(vs0, 0, _add))
            tl.store(vsq_ptr + pid_b.to(tl.int64) * 2 + 1, tl.reduce(vs1, 0, _add))
    if RIGHT_W:
        tl.store(xw_ptr + out_r * 2, acc_w0, mask=rmask)
        tl.store(xw_ptr + out_r * 2 + 1, acc_w1, mask=rmask)
    if ROW_SQ:
        tl.store(rsq_ptr + out_r, acc_sq, mask=rmask)


@triton.jit
def _operand_pass_wide(
    x_ptr, R, C, nb1, sx0, sx1, sxr, sxc, v_ptr, sv0, sv1, svk, svj, l_ptr, sl0, sl1, slr, slj,
    xv_ptr, xw_ptr, rsq_ptr, lx_ptr, wx_ptr, csq_ptr, vsq_ptr, lsq_ptr, jv, jl, run_c, run_r, jw, jlw,
    RIGHT_V: tl.constexpr, RIGHT_W: tl.constexpr, LEFT_L: tl.constexpr, LEFT_W: tl.constexpr,
    ROW_SQ: tl.constexpr, COL_SQ: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, JP: tl.constexpr,
    TC: tl.constexpr, WHOLE_W: tl.constexpr, CAST: tl.constexpr,
):
    """operand_pass's grouped form: the same one read of X, its skinny products as fp32 tl.dot (IEEE: a reference
    carries no TF32 rounding) against factors up to JP wide, the run weights generated per tile. On a GPU each
    loaded element costs JP multiply-adds per factor (16 at most groups: triton_gemm_check.MAX_RUNS) on the CUDA
    cores. TC (X bf16 or fp16): the same products on the tensor cores (``_dot_exact``), each factor as three TF32
    parts: X's values and every part are exact in TF32, so the products are the IEEE ones and only the fp32
    accumulation rounds; the FMA form left the pass issue-bound at several times the time of its read on sm_90
    (bench/triton_gemm_resources.py)."""
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    bi0 = (pid_b // nb1).to(tl.int64)
    bi1 = (pid_b % nb1).to(tl.int64)
    rows = pid_r * BR + tl.arange(0, BR)
    rmask = rows < R
    jj = tl.arange(0, JP)
    xb = x_ptr + (bi0 * sx0 + bi1 * sx1)
    vb = v_ptr + (bi0 * sv0 + bi1 * sv1)
    acc_v = tl.full([BR, JP], 0, tl.float32)
    acc_w = tl.full([BR, JP], 0, tl.float32)
    acc_sq = tl.full([BR], 0, tl.float32)
    vs = tl.full([JP], 0, tl.float32)
    lt = tl.full([BR, JP], 0, tl.float32)
    if LEFT_L:
        lb = l_ptr + (bi0 * sl0 + bi1 * sl1)
        lt = tl.load(lb + rows.to(tl.int64)[:, None] * slr + jj[None, :].to(tl.int64) * slj,
                     mask=rmask[:, None] & (jj < jl)[None, :], other=0.0).to(tl.float32)
        tl.atomic_add(lsq_ptr + pid_b.to(tl.int64) * jl + jj, tl.reduce(lt * lt, 0, _add), mask=jj < jl)
    # The run weights over this program's rows (LEFT_W): column 2h is 1 on run h's rows, 2h + 1 their place in it.
    run_of_r = rows // run_r
    place_r = (rows - run_of_r * run_r + 1).to(tl.float32)
    wr = tl.where(rmask[:, None] & (jj[None, :] == 2 * run_of_r[:, None]), 1.0,
                  tl.where(rmask[:, None] & (jj[None, :] == 2 * run_of_r[:, None] + 1), place_r[:, None], 0.0))
    out_c = pid_b.to(tl.int64) * C
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        cmask = cols < C
        x = tl.load(xb + rows.to(tl.int64)[:, None] * sxr + cols[None, :].to(tl.int64) * sxc,
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        xp = _gemm_operand(x, CAST)
        if RIGHT_V:
            v = tl.load(vb + cols.to(tl.int64)[:, None] * svk + jj[None, :].to(tl.int64) * svj,
                        mask=cmask[:, None] & (jj < jv)[None, :], other=0.0).to(tl.float32)
            acc_v = _dot_exact(xp, v, acc_v, TC)
            vs += tl.reduce(v * v, 0, _add)
        if RIGHT_W:
            run_of_c = cols // run_c
            place_c = (cols - run_of_c * run_c + 1).to(tl.float32)
            wc = tl.where(cmask[:, None] & (jj[None, :] == 2 * run_of_c[:, None]), 1.0,
                          tl.where(cmask[:, None] & (jj[None, :] == 2 * run_of_c[:, None] + 1), place_c[:, None],
                                   0.0))
            acc_w = _dot_exact(xp, wc, acc_w, TC, WHOLE_W)
        x2 = x * x
        if ROW_SQ:
            acc_sq += tl.reduce(x2, 1, _add)
        if LEFT_L:
            part = _dot_exact(tl.trans(xp), lt, tl.full([BC, JP], 0, tl.float32), TC)
            tl.atomic_add(lx_ptr + (out_c + cols)[:, None] * jl + jj[None, :], part,
                          mask=cmask[:, None] & (jj < jl)[None, :])
        if LEFT_W:
            part = _dot_exact(tl.trans(xp), wr, tl.full([BC, JP], 0, tl.float32), TC, WHOLE_W)
            tl.atomic_add(wx_ptr + (out_c + cols)[:, None] * jlw + jj[None, :], part,
                          mask=cmask[:, None] & (jj < jlw)[None, :])
        if COL_SQ:
            tl.atomic_add(csq_ptr + out_c + cols, tl.reduce(x2, 0, _add), mask=cmask)
    out_r = pid_b.to(tl.int64) * R + rows
    if RIGHT_V:
        tl.store(xv_ptr + out_r[:, None] * jv + jj[None, :], acc_v, mask=rmask[:, None] & (jj < jv)[None, :])
        if pid_r == 0:
            tl.store(vsq_ptr + pid_b.to(tl.int64) * jv + jj, vs, mask=jj < jv)
    if RIGHT_W:
        tl.store(xw_ptr + out_r[:, None] * jw + jj[None, :], acc_w, mask=rmask[:, None] & (jj < jw)[None, :])
    if ROW_SQ:
        tl.store(rsq_ptr + out_r, acc_sq, mask=rmask)


@triton.jit
def _gemm_operand(x, CAST: tl.constexpr):
    """x (fp32) as a GEMM that rounds its operands to bf16 (CAST 1) or fp16 (2) takes it (round to nearest even), held
    in fp32. CAST 3: bf16 on the integer bits, for Triton's interpreter, whose conversion to bf16 truncates."""
    if CAST == 1:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    if CAST == 2:
        return x.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    if CAST == 3:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x


@triton.jit
def _tf32(v):
    """v (fp32) with its low 13 mantissa bits cleared: a TF32 value, the tensor cores' fp32 operand, exactly."""
    return (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot_exact(a, f, acc, TC: tl.constexpr, WHOLE: tl.constexpr = False):
    """acc + a·f in fp32 with exact products: IEEE fp32 on the CUDA cores, or with TC (a's values TF32-exact: bf16
    or fp16 held in fp32) TF32 products on the tensor cores, of f's parts f1 (f truncated to TF32), f2 (the rest
    truncated) and f3 (what is left, at most 2 bits): f1 + f2 + f3 = f exactly, and each product of TF32 values is
    exact in fp32. WHOLE: f holds integers below 2¹¹, exact in TF32 as they are (the checksum weights of runs of at
    most 2,048): one product. A non-finite element of f stays non-finite in the sum."""
    if TC:
        if WHOLE:
            return tl.dot(a, f, acc, input_precision="tf32")
        f1 = _tf32(f)
        rest = f - f1
        f2 = _tf32(rest)
        acc = tl.dot(a, f1, acc, input_precision="tf32")
        acc = tl.dot(a, f2, acc, input_precision="tf32")
        return tl.dot(a, rest - f2, acc, input_precision="tf32")
    return tl.dot(a, f, acc, input_precision="ieee")


@triton.jit
def _other_terms(bsq_b, sbn, bias_ptr, N, floor_b, HAS_BIAS: tl.constexpr, BN: tl.constexpr):
    """The rule's sums over the row's N columns (abft/gemm_rule.py): Σb (fp32), Σb² and Σj²b² (fp64), and of the
    bias: Σ|β| (fp32), Σβ², Σj²β² (fp64), Σβ, Σj·β (fp32, the bias's part of the references). b_j = √(B's squared
    column sum) + floor_b."""
    sb = tl.full([BN], 0, tl.float32)
    b2_1 = tl.full([BN], 0, tl.float64)
    b2_2 = tl.full([BN], 0, tl.float64)
    babs = tl.full([BN], 0, tl.float32)
    bw2_1 = tl.full([BN], 0, tl.float64)
    bw2_2 = tl.full([BN], 0, tl.float64)
    bref1 = tl.full([BN], 0, tl.float32)
    bref2 = tl.full([BN], 0, tl.float32)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        cmask = cols < N
        w = (cols + 1).to(tl.float32)
        w64 = w.to(tl.float64)
        b = tl.where(cmask, tl.sqrt(tl.load(bsq_b + cols * sbn, mask=cmask, other=0.0)) + floor_b, 0.0)
        b64 = b.to(tl.float64)
        sb += b
        b2_1 += b64 * b64
        b2_2 += (w64 * b64) * (w64 * b64)
        if HAS_BIAS:
            beta = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            beta64 = beta.to(tl.float64)
            babs += tl.abs(beta)
            bw2_1 += beta64 * beta64
            bw2_2 += (w64 * beta64) * (w64 * beta64)
            bref1 += beta
            bref2 += w * beta
    return (tl.reduce(sb, 0, _add), tl.reduce(b2_1, 0, _add), tl.reduce(b2_2, 0, _add), tl.reduce(babs, 0, _add),
            tl.reduce(bw2_1, 0, _add), tl.reduce(bw2_2, 0, _add), tl.reduce(bref1, 0, _add), tl.reduce(bref2, 0, _add))


@triton.jit
def _ref_norms(terms, rq):
    """``_other_terms``'s sums with ‖B_h w‖² (w = ones, 1..L) of this matrix's run h appended (rq points at them), in
    fp64: the operand pass made them beside the references (operand_pass's vsq / lsq)."""
    sb, b2_1, b2_2, babs, bw2_1, bw2_2, bref1, bref2 = terms
    return (sb, b2_1, b2_2, babs, bw2_1, bw2_2, bref1, bref2, tl.load(rq).to(tl.float64),
            tl.load(rq + 1).to(tl.float64))


@triton.jit
def _bound(a, sq, ab, ref1, ref2, terms, rule, nf, USE_ABS: tl.constexpr, CALIBRATED: tl.constexpr,
           FLUSH: tl.constexpr):
    """(bound on |d1|, bound on |d2|) per row: abft/gemm_rule.py's formulas, in its order of terms. terms:
    ``_other_terms``'s sums and the squared norms of B w (fp64, ``_ref_norms``); rule: the rule scalars the kernel was
    passed, as one tuple."""
    sb, b2_1, b2_2, babs, bw2_1, bw2_2, _, _, rn1, rn2 = terms
    rig_ab, rig_bias, abs_coef, under0, flush, var_b, var_ref, var_bias, sq_coef, tiny_pad, common, sigmas, near_inf, \
        sqrt_k = rule
    under = tl.full(a.shape, 0.0, tl.float32) + under0
    if FLUSH:
        under += flush * (sqrt_k * (sb + nf * a) + nf)
    rig1 = rig_ab * (a * sb) + rig_bias * babs + under
    if USE_ABS:
        rig1 += abs_coef * ab
    rig2 = rig1 * nf
    b1 = rig1
    b2 = rig2
    if CALIBRATED:
        a64 = a.to(tl.float64)
        a2 = a64 * a64
        sq64 = sq.to(tl.float64) + tiny_pad
        v1 = a2 * (var_b * b2_1 + var_ref * rn1) + var_bias * bw2_1 + sq_coef * sq64
        v2 = a2 * (var_b * b2_2 + var_ref * rn2) + var_bias * bw2_2 + (sq_coef * nf * nf) * sq64
        u64 = under.to(tl.float64)
        # |ref| read as 0 where it is not finite (Bound.pair's nan_to_num).
        ref1_abs = tl.where(tl.abs(ref1) <= FLT_MAX, tl.abs(ref1), 0.0).to(tl.float64)
        ref2_abs = tl.where(tl.abs(ref2) <= FLT_MAX, tl.abs(ref2), 0.0).to(tl.float64)
        c1 = sigmas * tl.sqrt(v1) + u64 + common * ref1_abs
        c2 = sigmas * tl.sqrt(v2) + u64 * ((nf + 1.0) / 2.0) + common * ref2_abs
        b1 = tl.minimum(rig1, c1.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)
        b2 = tl.minimum(rig2, c2.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)
    # tolerance._clamp: an undefined bound (NaN, +INF) reads near_inf.
    b1 = tl.where((b1 != b1) | (b1 > FLT_MAX), near_inf, b1)
    b2 = tl.where((b2 != b2) | (b2 > FLT_MAX), near_inf, b2)
    return b1, b2


@triton.jit
def _keep_summaries(state_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS, rep, n_rep, pid_b, M, rows, col, code, value,
                    d1, b1):
    """The reports' summaries of this program's flagged rows ``rep`` (n_rep of them): each takes the next slot of the
    check (state[S_FLAGGED] counts them all); the first SLOTS keep (batch, row, col, code) and (value, d1, bound),
    and every flagged row its slot index, where repair_rows writes its outcome."""
    first = tl.atomic_add(state_ptr + S_FLAGGED, n_rep)
    slot = first + tl.cumsum(rep.to(tl.int32), axis=0) - 1
    keep = rep & (slot < SLOTS)
    slot64 = slot.to(tl.int64)
    tl.store(slot_i_ptr + slot64 * 4, tl.full(slot.shape, 0, tl.int32) + pid_b, mask=keep)
    tl.store(slot_i_ptr + slot64 * 4 + 1, rows, mask=keep)
    tl.store(slot_i_ptr + slot64 * 4 + 2, col, mask=keep)
    tl.store(slot_i_ptr + slot64 * 4 + 3, code, mask=keep)
    tl.store(slot_f_ptr + slot64 * 4, value, mask=keep)
    tl.store(slot_f_ptr + slot64 * 4 + 1, d1, mask=keep)
    tl.store(slot_f_ptr + slot64 * 4 + 2, b1, mask=keep)
    tl.store(slot_ptr + pid_b.to(tl.int64) * M + rows.to(tl.int64), slot, mask=rep)


@triton.jit
def check_pass(
    c_ptr, M, _n, nb1, sc0, sc1, scm, scn,
    ref_ptr, sr0, sr1, srm, srj,
    asq_ptr, sa0, sa1, sam,
    bsq_ptr, sb0, sb1, sbn,
    refsq_ptr, srq0, srq1,
    bias_ptr,
    a_ptr, sA0, sA1, sAm, sAk,
    b_ptr, sB0, sB1, sBk, sBn, K,
    state_ptr, code_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS,
    floor_a, floor_b, rig_ab, rig_bias, abs_coef, under0, flush, var_b, var_ref, var_bias, sq_coef, tiny_pad, common,
    sigmas, near_inf, sqrt_k, G, L,
    CORRECT: tl.constexpr, USE_ABS: tl.constexpr, HAS_BIAS: tl.constexpr, CALIBRATED: tl.constexpr,
    FLUSH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """The row check of C = A·B (+ bias), BM rows of one matrix a program (module docstring), each row as G runs of L
    columns (N = G·L; G = 1: the whole row), each run its own checksum pair (weights ones and 1..L) and rule. ref:
    A·(B_h w) per run h and weighting, (.., M, 2G), without the bias; asq: ‖A_i‖²; bsq: ‖B_j‖²; refsq: ‖B_h w‖²
    (.., 2G). CORRECT: write corrections (else locate and report only: "detect")."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    # Matrix pid_b of the (nb0, nb1) leading dims, each with its own strides.
    bi0 = (pid_b // nb1).to(tl.int64)
    bi1 = (pid_b % nb1).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    cb = c_ptr + (bi0 * sc0 + bi1 * sc1)
    rb = ref_ptr + (bi0 * sr0 + bi1 * sr1)
    bsq_b = bsq_ptr + (bi0 * sb0 + bi1 * sb1)
    rq = refsq_ptr + (bi0 * srq0 + bi1 * srq1)
    rule = (rig_ab, rig_bias, abs_coef, under0, flush, var_b, var_ref, var_bias, sq_coef, tiny_pad, common, sigmas,
            near_inf, sqrt_k)
    lf = L * 1.0
    a = tl.sqrt(tl.load(asq_ptr + (bi0 * sa0 + bi1 * sa1) + rows64 * sam, mask=rmask, other=0.0)) + floor_a
    ext = tl.full([BM], 0, tl.int32)
    n_bad = tl.full([BM], 0, tl.int32)
    # Per row: its first flagged run (-1: none) and that run's d1 and bound, for locating and the reports; and the
    # first run whose reference is not finite while C's run holds an extreme value (an input's fault; its report
    # carries no residual, as a tier-1 trip's).
    first = tl.full([BM], -1, tl.int32)
    first_up = tl.full([BM], -1, tl.int32)
    d1_rep = tl.full([BM], float("nan"), tl.float32)
    b1_rep = tl.full([BM], 0, tl.float32) + near_inf
    worst = tl.full([BM], 0, tl.float32)
    for h in range(0, G):
        off = h * L
        s1 = tl.full([BM], 0, tl.float32)
        s2 = tl.full([BM], 0, tl.float32)
        sq = tl.full([BM], 0, tl.float32)
        ab = tl.full([BM], 0, tl.float32)
        ext_h = tl.full([BM], 0, tl.int32)
        # The one read of C.
        for n0 in range(0, L, BN):
            local = n0 + tl.arange(0, BN)
            m2 = rmask[:, None] & (local < L)[None, :]
            c = tl.load(cb + rows64[:, None] * scm + (off + local)[None, :].to(tl.int64) * scn, mask=m2, other=0.0)
            c = c.to(tl.float32)
            s1 += tl.reduce(c, 1, _add)
            s2 += tl.reduce(c * (local + 1).to(tl.float32)[None, :], 1, _add)
            sq += tl.reduce(c * c, 1, _add)
            if USE_ABS:
                ab += tl.reduce(tl.abs(c), 1, _add)
            ext_h += tl.reduce((~(tl.abs(c) <= near_inf)).to(tl.int32), 1, _add)
        terms = _ref_norms(_other_terms(bsq_b + off * sbn, sbn, bias_ptr + off, L, floor_b, HAS_BIAS, BN),
                           rq + 2 * h)
        ref1 = tl.load(rb + rows64 * srm + (2 * h) * srj, mask=rmask, other=0.0) + terms[6]
        ref2 = tl.load(rb + rows64 * srm + (2 * h + 1) * srj, mask=rmask, other=0.0) + terms[7]
        b1, b2 = _bound(a, sq, ab, ref1, ref2, terms, rule, lf, USE_ABS, CALIBRATED, FLUSH)
        d1 = ref1 - s1
        d2 = ref2 - s2
        ok = (tl.abs(d1) <= b1) & (tl.abs(d2) <= b2)
        # A non-finite reference is an input's fault, never this product's (abft.checksum.verify_direction).
        bad_h = rmask & (tl.abs(ref1) <= FLT_MAX) & ~ok
        up_h = rmask & (ext_h > 0) & ~(tl.abs(ref1) <= FLT_MAX)
        # The worst clean residual/bound ratio, for the histogram.
        ratio = tl.maximum(tl.abs(d1) / tl.maximum(b1, 1e-30), tl.abs(d2) / tl.maximum(b2, 1e-30))
        worst = tl.maximum(worst, tl.where(rmask & ~bad_h & (ratio <= FLT_MAX), ratio, 0.0))
        take = bad_h & (first < 0)
        first = tl.where(take, h, first)
        d1_rep = tl.where(take, d1, d1_rep)
        b1_rep = tl.where(take, b1, b1_rep)
        first_up = tl.where(up_h & (first_up < 0), h, first_up)
        n_bad += bad_h.to(tl.int32)
        ext += ext_h
    # Non-negative floats compare as their bits.
    tl.atomic_max(state_ptr + S_WORST, tl.reduce(worst, 0, _max).to(tl.int32, bitcast=True))
    n_ext = tl.reduce(ext, 0, _add)
    if n_ext > 0:
        tl.atomic_add(state_ptr + S_EXTREME, n_ext)
    bad = n_bad > 0
    upstream = first_up >= 0
    code = tl.full([BM], 0, tl.int32)
    rep = bad | upstream
    n_rep = tl.reduce(rep.to(tl.int32), 0, _add)
    if n_rep > 0:
        # The slow path, in the programs holding a flagged row only, run by run: each flagged row's first flagged run
        # (else its first upstream one) read again for what locating and reporting need.
        run = tl.where(bad, first, first_up)
        col = tl.full([BM], 0, tl.int32)
        value = tl.full([BM], 0, tl.float32)
        for h in range(0, G):
            sel = rep & (run == h)
            if tl.reduce(sel.to(tl.int32), 0, _add) > 0:
                code_h, col_h, value_h = _locate_run(
                    cb, rb, bsq_b, rq, bias_ptr, a_ptr + (bi0 * sA0 + bi1 * sA1), b_ptr + (bi0 * sB0 + bi1 * sB1),
                    rows64, sel, bad & (n_bad == 1), a, h, L, K, scm, scn, srm, srj, sbn, sAm, sAk, sBk, sBn,
                    floor_b, rule, lf, near_inf, CORRECT, USE_ABS, HAS_BIAS, CALIBRATED, FLUSH, BM, BN, BK)
                code = tl.where(sel, code_h, code)
                col = tl.where(sel, col_h, col)
                value = tl.where(sel, value_h, value)
        code = tl.where(bad, code, tl.where(upstream, UPSTREAM, CLEAN))
        # Counts, then the first SLOTS flagged rows' summaries for the reports (batch, row, col, code; value, d1,
        # bound): the column the fix went to, else the worst element's of the run.
        tl.atomic_add(state_ptr + S_CORRECTED, tl.reduce((code == CORRECTED).to(tl.int32), 0, _add))
        tl.atomic_add(state_ptr + S_RECOMPUTE, tl.reduce((code == NEED_RECOMPUTE).to(tl.int32), 0, _add))
        tl.atomic_add(state_ptr + S_CONSISTENT, tl.reduce((code == CONSISTENT).to(tl.int32), 0, _add))
        tl.atomic_add(state_ptr + S_DETECTED, tl.reduce((code == DETECTED).to(tl.int32), 0, _add))
        tl.atomic_add(state_ptr + S_UPSTREAM, tl.reduce((code == UPSTREAM).to(tl.int32), 0, _add))
        _keep_summaries(state_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS, rep, n_rep, pid_b, M, rows, col, code,
                        value, d1_rep, b1_rep)
    tl.store(code_ptr + pid_b.to(tl.int64) * M + rows64, code, mask=rmask)


@triton.jit
def _locate_run(cb, rb, bsq_b, rq, bias_ptr, ab_, bb_, rows64, sel, alone, a, h, L, K, scm, scn, srm, srj, sbn, sAm,
                sAk, sBk, sBn, floor_b, rule, lf, near_inf, CORRECT: tl.constexpr,
                USE_ABS: tl.constexpr, HAS_BIAS: tl.constexpr, CALIBRATED: tl.constexpr, FLUSH: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """check_pass's slow path for run h of the rows ``sel``: its sums without extreme elements, the worst value, the
    located single error (an extreme element by value, else d2/d1 - 1 where it is an index; only in a row whose one
    flagged run this is: ``alone``) recomputed exactly from A's row and B's column and written back where the run
    then checks out. Returns (code, column, value) per row: CORRECTED, CONSISTENT, NEED_RECOMPUTE (DETECTED in detect
    mode) for a flagged row; the column the fix went to, else the run's worst element's; the value C held there."""
    off = h * L
    s1f = tl.full([BM], 0, tl.float32)
    s2f = tl.full([BM], 0, tl.float32)
    sqf = tl.full([BM], 0, tl.float32)
    abf = tl.full([BM], 0, tl.float32)
    nx = tl.full([BM], 0, tl.int32)
    xpos = tl.full([BM], -1, tl.int32)
    wkey = tl.full([BM], 0, tl.int32)
    wpos = tl.full([BM], 0, tl.int32)
    for n0 in range(0, L, BN):
        local = n0 + tl.arange(0, BN)
        m2 = sel[:, None] & (local < L)[None, :]
        c = tl.load(cb + rows64[:, None] * scm + (off + local)[None, :].to(tl.int64) * scn, mask=m2, other=0.0)
        c = c.to(tl.float32)
        e = ~(tl.abs(c) <= near_inf) & m2
        cf = tl.where(e, 0.0, c)
        s1f += tl.reduce(cf, 1, _add)
        s2f += tl.reduce(cf * (local + 1).to(tl.float32)[None, :], 1, _add)
        sqf += tl.reduce(cf * cf, 1, _add)
        abf += tl.reduce(tl.abs(cf), 1, _add)
        nx += tl.reduce(e.to(tl.int32), 1, _add)
        xpos = tl.maximum(xpos, tl.reduce(tl.where(e, local[None, :], -1), 1, _max))
        # |x| as its bits: ordered as |x| is, every NaN above INF (the worst value: NaN, INF, then largest).
        key = c.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        kmax = tl.reduce(key, 1, _max)
        kpos = tl.argmax(key, axis=1) + n0
        wpos = tl.where(kmax > wkey, kpos, wpos)
        wkey = tl.maximum(wkey, kmax)
    terms = _ref_norms(_other_terms(bsq_b + off * sbn, sbn, bias_ptr + off, L, floor_b, HAS_BIAS, BN), rq + 2 * h)
    ref1 = tl.load(rb + rows64 * srm + (2 * h) * srj, mask=sel, other=0.0) + terms[6]
    ref2 = tl.load(rb + rows64 * srm + (2 * h + 1) * srj, mask=sel, other=0.0) + terms[7]
    # Locate (abft.repair.locate_and_fix): one extreme element by value, else d2/d1 - 1 where it is an index.
    d1f = ref1 - s1f
    d2f = ref2 - s2f
    single = nx == 1
    pos = d2f / d1f
    rnd = tl.floor(pos + 0.5)
    located = (tl.abs(pos) <= FLT_MAX) & (tl.abs(pos - rnd) <= LOCATE_SLACK) & (rnd >= 1.0) & (rnd <= lf)
    loc = tl.where(single, xpos, tl.where(located, rnd, 1.0).to(tl.int32) - 1)
    fixable = sel & alone & (tl.abs(ref2) <= FLT_MAX) & (single | ((nx == 0) & located))
    loc64 = (off + loc).to(tl.int64)
    old = tl.load(cb + rows64 * scm + loc64 * scn, mask=fixable, other=0.0)
    old_f = old.to(tl.float32)
    # The located element exactly, from A's row and B's column (the CPU ladder's `exact`), fp32 products.
    exact = tl.full([BM], 0, tl.float32)
    if tl.reduce(fixable.to(tl.int32), 0, _add) > 0:
        for k0 in range(0, K, BK):
            ks = (k0 + tl.arange(0, BK)).to(tl.int64)
            mk = fixable[:, None] & (ks < K)[None, :]
            av = tl.load(ab_ + rows64[:, None] * sAm + ks[None, :] * sAk, mask=mk, other=0.0).to(tl.float32)
            bv = tl.load(bb_ + ks[None, :] * sBk + loc64[:, None] * sBn, mask=mk, other=0.0).to(tl.float32)
            exact += tl.reduce(av * bv, 1, _add)
        if HAS_BIAS:
            exact += tl.load(bias_ptr + loc64, mask=fixable, other=0.0).to(tl.float32)
    stored = exact.to(cb.dtype.element_ty)
    new = stored.to(tl.float32)
    # The run after the fix, from its sums without extreme elements; a finite old value leaves them too.
    # (A multiplication by 0 would keep an INF's NaN: the extreme value is left out by where.)
    kept = tl.where(single, 0.0, old_f)
    wl = (loc + 1).to(tl.float32)
    base1 = s1f - kept
    base2 = s2f - wl * kept
    base_sq = sqf - kept * kept
    base_ab = abf - tl.abs(kept)
    e1, e2 = _bound(a, base_sq + new * new, base_ab + tl.abs(new), ref1, ref2, terms, rule, lf, USE_ABS, CALIBRATED,
                    FLUSH)
    fixed_ok = (tl.abs(ref1 - (base1 + new)) <= e1) & (tl.abs(ref2 - (base2 + wl * new)) <= e2)
    # The exact value rounds to what C holds (an fp16 product past 65504 is INF): C is what the GEMM gives, no
    # fault, when the run checks out with the unrounded value (gemm.check._overflowed's case).
    x1, x2 = _bound(a, base_sq + exact * exact, base_ab + tl.abs(exact), ref1, ref2, terms, rule, lf, USE_ABS,
                    CALIBRATED, FLUSH)
    exact_ok = (tl.abs(ref1 - (base1 + exact)) <= x1) & (tl.abs(ref2 - (base2 + wl * exact)) <= x2)
    same = new == old_f
    consistent = fixable & same & exact_ok
    corrected = fixable & ~same & fixed_ok
    if CORRECT:
        code = tl.where(consistent, CONSISTENT, tl.where(corrected, CORRECTED, NEED_RECOMPUTE))
        tl.store(cb + rows64 * scm + loc64 * scn, stored, mask=corrected)
    else:
        code = tl.where(consistent, CONSISTENT, DETECTED)
    col = tl.where(fixable, loc, wpos) + off
    value = tl.load(cb + rows64 * scm + col.to(tl.int64) * scn, mask=sel & ~fixable, other=0.0).to(tl.float32)
    value = tl.where(fixable, old_f, value)
    return code, col, value


@triton.jit
def trip_pass(c_ptr, M, N, nb1, sc0, sc1, scm, scn, bias_ptr, a_ptr, sA0, sA1, sAm, sAk, b_ptr, sB0, sB1, sBk, sBn,
              K, state_ptr, code_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS, fault_ptr, near_inf, c_max,
              CORRECT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
              IS_F32: tl.constexpr, NF: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              RBN: tl.constexpr):
    """Tier 1 of C = A·B (+ bias) in one launch (``_trip_rows``): grid (row blocks of C, matrices)."""
    _trip_rows(tl.program_id(0), tl.program_id(1), c_ptr, M, N, nb1, sc0, sc1, scm, scn, bias_ptr, a_ptr, sA0, sA1,
               sAm, sAk, b_ptr, sB0, sB1, sBk, sBn, K, state_ptr, code_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS,
               fault_ptr, near_inf, c_max, CORRECT, HAS_BIAS, DOT_FP32, IEEE, IS_F32, NF, BM, BN, BK, RBN)


@triton.jit
def trip_pass_pair(c_ptr, M, N, nb1, sc0, sc1, scm, scn, bias_ptr, a_ptr, sA0, sA1, sAm, sAk, b_ptr, sB0, sB1, sBk,
                   sBn, K, state_ptr, code_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, fault_ptr, near_inf, c_max,
                   c2_ptr, M2, N2, nb1_2, sc0_2, sc1_2, scm2, scn2, bias2_ptr, a2_ptr, sA0_2, sA1_2, sAm2, sAk2,
                   b2_ptr, sB0_2, sB1_2, sBk2, sBn2, K2, state2_ptr, code2_ptr, slot2_ptr, slot_i2_ptr, slot_f2_ptr,
                   fault2_ptr, near_inf2, c_max2, SLOTS, G,
                   CORRECT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
                   IS_F32: tl.constexpr, NF: tl.constexpr, HAS_BIAS2: tl.constexpr, DOT_FP32_2: tl.constexpr,
                   IEEE2: tl.constexpr, IS_F32_2: tl.constexpr, NF2: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, RBN: tl.constexpr):
    """Tier 1 of two GEMMs in one launch (a Linear's dX and dW, made together by its backward): a 1-D grid, its
    first G programs the first GEMM's, the rest the second's (``2`` names its arguments), row blocks first.
    Each program is ``trip_pass``'s; a launch saved per Linear backward, no work shared."""
    pid = tl.program_id(0)
    if pid < G:
        mb = tl.cdiv(M, BM)
        _trip_rows(pid % mb, pid // mb, c_ptr, M, N, nb1, sc0, sc1, scm, scn, bias_ptr, a_ptr, sA0, sA1, sAm, sAk,
                   b_ptr, sB0, sB1, sBk, sBn, K, state_ptr, code_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS,
                   fault_ptr, near_inf, c_max, CORRECT, HAS_BIAS, DOT_FP32, IEEE, IS_F32, NF, BM, BN, BK, RBN)
    else:
        mb2 = tl.cdiv(M2, BM)
        _trip_rows((pid - G) % mb2, (pid - G) // mb2, c2_ptr, M2, N2, nb1_2, sc0_2, sc1_2, scm2, scn2, bias2_ptr,
                   a2_ptr, sA0_2, sA1_2, sAm2, sAk2, b2_ptr, sB0_2, sB1_2, sBk2, sBn2, K2, state2_ptr, code2_ptr,
                   slot2_ptr, slot_i2_ptr, slot_f2_ptr, SLOTS, fault2_ptr, near_inf2, c_max2, CORRECT, HAS_BIAS2,
                   DOT_FP32_2, IEEE2, IS_F32_2, NF2, BM, BN, BK, RBN)


@triton.jit
def _trip_rows(pid_m, pid_b, c_ptr, M, N, nb1, sc0, sc1, scm, scn, bias_ptr, a_ptr, sA0, sA1, sAm, sAk, b_ptr, sB0,
               sB1, sBk, sBn, K, state_ptr, code_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS, fault_ptr, near_inf,
               c_max, CORRECT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
               IS_F32: tl.constexpr, NF: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               RBN: tl.constexpr):
    """Tier 1 of C = A·B (+ bias), rows block pid_m of matrix pid_b: count C's extreme elements (INF, NaN,
    |x| > near_inf) into state[S_EXTREME] in one read of C, and in a program whose rows hold one, recompute those rows
    there (``_recompute_tripped``) and keep their summaries (the first SLOTS flagged rows: batch, row, the first
    extreme element's column, outcome; its value, NaN, near_inf). A clean program reads its rows once and writes their
    code. RBN, BK: the recompute's tile width and depth (triton_gemm_check._Blocks: small on a GPU, so that the rarely
    taken recompute does not set the registers of the scan every call runs)."""
    # Matrix pid_b of the (nb0, nb1) leading dims, each with its own strides.
    bi0 = (pid_b // nb1).to(tl.int64)
    bi1 = (pid_b % nb1).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)
    rmask = rows < M
    cb = c_ptr + (bi0 * sc0 + bi1 * sc1)
    ext = tl.full([BM], 0, tl.int32)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        m2 = rmask[:, None] & (cols < N)[None, :]
        c = tl.load(cb + rows64[:, None] * scm + cols[None, :].to(tl.int64) * scn, mask=m2, other=0.0)
        ext += tl.reduce((~(tl.abs(c.to(tl.float32)) <= near_inf)).to(tl.int32), 1, _add)
    rep = rmask & (ext > 0)
    code = tl.full([BM], 0, tl.int32) + CLEAN
    n_ext = tl.reduce(ext, 0, _add)
    if n_ext > 0:
        n_rep = tl.reduce(rep.to(tl.int32), 0, _add)
        tl.atomic_add(state_ptr + S_EXTREME, n_ext)
        # The first extreme element of each such row, as C held it (the recompute below may overwrite it).
        col = tl.full([BM], 0, tl.int32) + N
        for n0 in range(0, N, BN):
            cols = n0 + tl.arange(0, BN)
            m2 = rep[:, None] & (cols < N)[None, :]
            c = tl.load(cb + rows64[:, None] * scm + cols[None, :].to(tl.int64) * scn, mask=m2, other=0.0)
            hit = m2 & ~(tl.abs(c.to(tl.float32)) <= near_inf)
            col = tl.minimum(col, tl.reduce(tl.where(hit, cols[None, :], N), 1, _min))
        col = tl.where(rep, col, 0)
        value = tl.load(cb + rows64 * scm + col.to(tl.int64) * scn, mask=rep, other=0.0).to(tl.float32)
        code = _recompute_tripped(cb, a_ptr + (bi0 * sA0 + bi1 * sA1), b_ptr + (bi0 * sB0 + bi1 * sB1), rows,
                                  rows64, rep, pid_b, N, K, scm, scn, sAm, sAk, sBk, sBn, bias_ptr, state_ptr,
                                  fault_ptr, near_inf, c_max, CORRECT, HAS_BIAS, DOT_FP32, IEEE, IS_F32, NF, BM, RBN,
                                  BK)
        _keep_summaries(state_ptr, slot_ptr, slot_i_ptr, slot_f_ptr, SLOTS, rep, n_rep, pid_b, M, rows, col, code,
                        value, tl.full([BM], float("nan"), tl.float32), tl.full([BM], 0.0, tl.float32) + near_inf)
    tl.store(code_ptr + pid_b.to(tl.int64) * M + rows64, code, mask=rmask)


@triton.jit
def _recompute_tripped(cb, ab_, bb_, rows, rows64, need, pid_b, N, K, scm, scn, sAm, sAk, sBk, sBn, bias_ptr,
                       state_ptr, fault_ptr, near_inf, c_max, CORRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       DOT_FP32: tl.constexpr, IEEE: tl.constexpr, IS_F32: tl.constexpr, NF: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The rows ``need`` of a tier-1 trip (an extreme element each) recomputed, without references: a recomputed row
    holding no extreme element is RECOMPUTED (DETECTED in detect mode), and written back. Else each extreme element
    must be what the operands allow: |C_ij| <= ‖A_i‖‖B_:,j‖ + |bias_j| (Cauchy-Schwarz, 1 % over for the norms'
    rounding), or come from a non-finite operand row or column. Then the row is CONSISTENT (finite values past
    near_inf: diverged training, not a fault) or UPSTREAM (non-finite: it came in with an input), and left as the GEMM
    wrote it; an extreme element the operands cannot give is a fault that came back: UNCORRECTABLE. The outcomes
    are counted into the state. Returns each row's code (CLEAN where not needed)."""
    a_sq = tl.full([BM], 0, tl.float32)
    unexplained = tl.full([BM], 0, tl.int32)
    extreme = tl.full([BM], 0, tl.int32)
    non_finite = tl.full([BM], 0, tl.int32)  # non-finite elements that came in with an operand
    for n0 in range(0, N, BN):
        _cols, _cmask, m2, acc, beta, a_sq, b_sq, fresh = _fresh_tile(
            ab_, bb_, cb, rows, rows64, need, n0, N, K, sAm, sAk, sBk, sBn, bias_ptr, a_sq, pid_b, fault_ptr,
            DOT_FP32, IEEE, HAS_BIAS, True, IS_F32, NF, BM, BN, BK)
        fresh_f = fresh.to(tl.float32)
        ext = m2 & ~(tl.abs(fresh_f) <= near_inf)
        allowed, from_input = _operands_allow(fresh_f, acc, beta, tl.sqrt(a_sq), tl.sqrt(b_sq), c_max)
        unexplained += tl.reduce((ext & ~allowed).to(tl.int32), 1, _add)
        extreme += tl.reduce(ext.to(tl.int32), 1, _add)
        non_finite += tl.reduce((ext & ~(tl.abs(fresh_f) <= FLT_MAX) & from_input).to(tl.int32), 1, _add)
    if CORRECT:
        code = tl.where(extreme > 0, CONSISTENT, RECOMPUTED)
    else:
        code = tl.where(extreme > 0, CONSISTENT, DETECTED)
    code = tl.where(unexplained > 0, UNCORRECTABLE, tl.where(non_finite > 0, UPSTREAM, code))
    code = tl.where(need, code, CLEAN)
    if CORRECT:
        # Written back only where the recomputation is clean: a row the operands explain stays as the GEMM left it,
        # bit for bit. A second recomputation of those rows (a trip is rare; the first kept nothing).
        put = need & (code == RECOMPUTED)
        if tl.reduce(put.to(tl.int32), 0, _add) > 0:
            for n0 in range(0, N, BN):
                cols, _cmask, m2, _acc, _beta, a_sq, _b_sq, fresh = _fresh_tile(
                    ab_, bb_, cb, rows, rows64, put, n0, N, K, sAm, sAk, sBk, sBn, bias_ptr, a_sq, pid_b, fault_ptr,
                    DOT_FP32, IEEE, HAS_BIAS, False, IS_F32, NF, BM, BN, BK)
                tl.store(cb + rows64[:, None] * scm + cols[None, :].to(tl.int64) * scn, fresh, mask=m2)
    _count_outcomes(state_ptr, need, code)
    tl.atomic_add(state_ptr + S_DETECTED, tl.reduce((need & (code == DETECTED)).to(tl.int32), 0, _add))
    tl.atomic_add(state_ptr + S_UPSTREAM, tl.reduce((need & (code == UPSTREAM)).to(tl.int32), 0, _add))
    return code


@triton.jit
def _operands_allow(fresh_f, acc, beta, a_norm, b_norm, c_max):
    """Whether each element of a recomputed (BM, BN) tile is one its operands can give, and whether it came in with
    them: (allowed, from_input). Allowed: within Cauchy-Schwarz (‖A_i‖·‖B_j‖ + |b_j|, 1 % over for the norms'
    rounding); from an operand row or column whose norm is not finite (the input's, not a fault); or a half-precision
    product past its dtype's range (|acc| > c_max), which rounds to INF: what the GEMM gives. fresh_f the tile as C's
    dtype holds it, acc its fp32 product with the bias; a_norm (BM,), b_norm and beta (BN,)."""
    cap = 1.01 * a_norm[:, None] * b_norm[None, :] + tl.abs(beta)[None, :]
    from_input = ~(a_norm <= FLT_MAX)[:, None] | ~(b_norm <= FLT_MAX)[None, :]
    rounded = (tl.abs(acc) > c_max) & (tl.abs(acc) <= cap)
    return (tl.abs(fresh_f) <= cap) | from_input | rounded, from_input


@triton.jit
def _count_outcomes(state_ptr, need, code):
    """The recomputed rows' outcomes added to the check's counts."""
    tl.atomic_add(state_ptr + S_RECOMPUTED, tl.reduce((need & (code == RECOMPUTED)).to(tl.int32), 0, _add))
    tl.atomic_add(state_ptr + S_UNCORRECTABLE, tl.reduce((need & (code == UNCORRECTABLE)).to(tl.int32), 0, _add))
    tl.atomic_add(state_ptr + S_CONSISTENT, tl.reduce((need & (code == CONSISTENT)).to(tl.int32), 0, _add))


@triton.jit
def _emulate(fresh, rows, cols, pid_b, fault_ptr, IS_F32: tl.constexpr, NF: tl.constexpr):
    """attnchecker.inject's faults planned for a recomputation (attempt 1), applied to the recomputed tile in C's dtype:
    fault f is 8 floats (batch, row0, row1, col0, col1, kind, value, -): kind 0 writes value, 1 adds it, 2 flips the
    exponent bit inject.bitflip flips."""
    for f in tl.static_range(NF):
        p = fault_ptr + f * 8
        hit = ((pid_b == tl.load(p).to(tl.int32))
               & ((rows >= tl.load(p + 1).to(tl.int32)) & (rows < tl.load(p + 2).to(tl.int32)))[:, None]
               & ((cols >= tl.load(p + 3).to(tl.int32)) & (cols < tl.load(p + 4).to(tl.int32)))[None, :])
        kind = tl.load(p + 5).to(tl.int32)
        value = tl.load(p + 6)
        small = tl.abs(fresh.to(tl.float32)) < 2.0
        if IS_F32:
            flipped = (fresh.to(tl.int32, bitcast=True) ^ tl.where(small, 1 << 30, 1 << 29)).to(tl.float32,
                                                                                               bitcast=True)
        else:
            flip = tl.where(small, 1 << 14, 1 << 13).to(tl.int16)
            flipped = (fresh.to(tl.int16, bitcast=True) ^ flip).to(fresh.dtype, bitcast=True)
        set_to = (tl.full(fresh.shape, 0.0, tl.float32) + value).to(fresh.dtype)
        added = (fresh.to(tl.float32) + value).to(fresh.dtype)
        corrupt = tl.where(kind == 0, set_to, tl.where(kind == 1, added, flipped))
        fresh = tl.where(hit, corrupt, fresh)
    return fresh


@triton.jit
def _product_tile(ab_, bb_, rows64, need, cols, cmask, K, sAm, sAk, sBk, sBn, bias_ptr, a_sq, first,
                  DOT_FP32: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, NORMS: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One (BM, BN) tile of A·B (+ bias) for the rows in ``need``, fp32: (tile, bias (BN,), a_sq, b_sq). NORMS:
    also B's squared column norms over K (b_sq (BN,)), and A's squared row norms added to a_sq on the ``first``
    column tile."""
    acc = tl.full([BM, BN], 0, tl.float32)
    b_sq = tl.full([BN], 0, tl.float32)
    for k0 in range(0, K, BK):
        ks = (k0 + tl.arange(0, BK)).to(tl.int64)
        at = tl.load(ab_ + rows64[:, None] * sAm + ks[None, :] * sAk, mask=need[:, None] & (ks < K)[None, :],
                     other=0.0)
        bt = tl.load(bb_ + ks[:, None] * sBk + cols[None, :].to(tl.int64) * sBn,
                     mask=(ks < K)[:, None] & cmask[None, :], other=0.0)
        if DOT_FP32:
            at = at.to(tl.float32)
            bt = bt.to(tl.float32)
        if NORMS:
            if first:
                a_sq += tl.reduce(at.to(tl.float32) * at.to(tl.float32), 1, _add)
            b_sq += tl.reduce(bt.to(tl.float32) * bt.to(tl.float32), 0, _add)
        if IEEE:
            acc = tl.dot(at, bt, acc, input_precision="ieee")
        else:
            acc = tl.dot(at, bt, acc)
    beta = tl.full([BN], 0, tl.float32)
    if HAS_BIAS:
        beta = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        acc += beta[None, :]
    return acc, beta, a_sq, b_sq


@triton.jit
def _fresh_tile(ab_, bb_, cb, rows, rows64, need, n0, N, K, sAm, sAk, sBk, sBn, bias_ptr, a_sq, pid_b, fault_ptr,
                DOT_FP32: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, NORMS: tl.constexpr,
                IS_F32: tl.constexpr, NF: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Columns n0 .. n0 + BN of the rows ``need`` recomputed (``_product_tile``), with the planned faults a
    recomputation meets: (cols, which exist, the (BM, BN) mask, the fp32 product with the bias, the bias, a_sq, b_sq,
    the tile in C's dtype)."""
    cols = n0 + tl.arange(0, BN)
    cmask = cols < N
    acc, beta, a_sq, b_sq = _product_tile(ab_, bb_, rows64, need, cols, cmask, K, sAm, sAk, sBk, sBn, bias_ptr, a_sq,
                                          n0 == 0, DOT_FP32, IEEE, HAS_BIAS, NORMS, BM, BN, BK)
    fresh = _emulate(acc.to(cb.dtype.element_ty), rows, cols, pid_b, fault_ptr, IS_F32, NF)
    return cols, cmask, need[:, None] & cmask[None, :], acc, beta, a_sq, b_sq, fresh


@triton.jit
def repair_rows(
    c_ptr, M, _n, nb1, sc0, sc1, scm, scn,
    ref_ptr, sr0, sr1, srm, srj,
    asq_ptr, sa0, sa1, sam,
    bsq_ptr, sb0, sb1, sbn,
    refsq_ptr, srq0, srq1,
    bias_ptr,
    a_ptr, sA0, sA1, sAm, sAk,
    b_ptr, sB0, sB1, sBk, sBn, K,
    state_ptr, code_ptr, slot_ptr, slot_i_ptr, SLOTS,
    fault_ptr,
    floor_a, floor_b, rig_ab, rig_bias, abs_coef, under0, flush, var_b, var_ref, var_bias, sq_coef, tiny_pad, common,
    sigmas, near_inf, sqrt_k, elem_ab, elem_abs, c_max, G, L,
    CORRECT: tl.constexpr, USE_ABS: tl.constexpr, HAS_BIAS: tl.constexpr, CALIBRATED: tl.constexpr,
    FLUSH: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr, IS_F32: tl.constexpr, NF: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Recompute the rows the check pass marked NEED_RECOMPUTE (BM rows of one matrix a program), re-verify them with
    the same rule, write them back, and give each its outcome: RECOMPUTED, UNCORRECTABLE (a fault that came back), or
    CONSISTENT (the recomputation equals the old row to round-off, that row's checksums or the rule's terms overflowed
    or it held INF or NaN, and each extreme element is one the operands can give, as ``_recompute_tripped`` judges it:
    the product as the dtype holds it, not a fault). Each run of L columns verified as check_pass verifies it (G
    runs). Returns at once on a clean call. (A tier-1 trip's rows are recomputed in the tier-1 pass itself:
    ``_recompute_tripped``.)"""
    if tl.load(state_ptr + S_RECOMPUTE) == 0:
        return
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    # Matrix pid_b of the (nb0, nb1) leading dims, each with its own strides.
    bi0 = (pid_b // nb1).to(tl.int64)
    bi1 = (pid_b % nb1).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)
    rmask = rows < M
    need = rmask & (tl.load(code_ptr + pid_b.to(tl.int64) * M + rows64, mask=rmask, other=0) == NEED_RECOMPUTE)
    if tl.reduce(need.to(tl.int32), 0, _add) == 0:
        return
    cb = c_ptr + (bi0 * sc0 + bi1 * sc1)
    ab_ = a_ptr + (bi0 * sA0 + bi1 * sA1)
    bb_ = b_ptr + (bi0 * sB0 + bi1 * sB1)
    bsq_b = bsq_ptr + (bi0 * sb0 + bi1 * sb1)
    a = tl.sqrt(tl.load(asq_ptr + (bi0 * sa0 + bi1 * sa1) + rows64 * sam, mask=need, other=0.0)) + floor_a
    a_sq = tl.full([BM], 0, tl.float32)
    rule = (rig_ab, rig_bias, abs_coef, under0, flush, var_b, var_ref, var_bias, sq_coef, tiny_pad, common, sigmas,
            near_inf, sqrt_k)
    rb = ref_ptr + (bi0 * sr0 + bi1 * sr1)
    rq = refsq_ptr + (bi0 * srq0 + bi1 * srq1)
    lf = L * 1.0
    differs = tl.full([BM], 0, tl.int32)
    # Extreme elements of the recomputation that its operands cannot give: a fault that came back in it, which equals
    # the old row (a fault that recurs where it struck) and must not pass for an overflow the GEMM made.
    unexplained = tl.full([BM], 0, tl.int32)
    all_ok = need
    overflowed = tl.full([BM], 0, tl.int32) > 0
    for h in range(0, G):
        off = h * L
        s1 = tl.full([BM], 0, tl.float32)
        s2 = tl.full([BM], 0, tl.float32)
        sq = tl.full([BM], 0, tl.float32)
        sab = tl.full([BM], 0, tl.float32)
        o1 = tl.full([BM], 0, tl.float32)
        o2 = tl.full([BM], 0, tl.float32)
        for n0 in range(off, off + L, BN):
            cols, cmask, m2, acc, beta, a_sq, _b_sq, fresh = _fresh_tile(
                ab_, bb_, cb, rows, rows64, need, n0, off + L, K, sAm, sAk, sBk, sBn, bias_ptr, a_sq, pid_b,
                fault_ptr, DOT_FP32, IEEE, HAS_BIAS, False, IS_F32, NF, BM, BN, BK)
            fresh_f = fresh.to(tl.float32)
            ptrs = cb + rows64[:, None] * scm + cols[None, :].to(tl.int64) * scn
            old = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
            w = (cols - off + 1).to(tl.float32)
            # Apart by more than two correct computations can be: the old row held a fault. The tolerance from the
            # fresh values only (an INF in the old row must not widen its own test).
            bj = tl.where(cmask, tl.sqrt(tl.load(bsq_b + cols * sbn, mask=cmask, other=0.0)) + floor_b, 0.0)
            tol = elem_ab * (a[:, None] * bj[None, :]) + elem_abs * (2.0 * tl.abs(fresh_f) + tl.abs(beta)[None, :])
            same = (fresh_f == old) | (tl.abs(fresh_f - old) <= tol)
            differs += tl.reduce((m2 & ~same).to(tl.int32), 1, _add)
            # Judged as a tier-1 trip's recompute judges its extreme elements.
            allowed, _ = _operands_allow(fresh_f, acc, beta, a, bj, c_max)
            unexplained += tl.reduce((m2 & ~(tl.abs(fresh_f) <= near_inf) & ~allowed).to(tl.int32), 1, _add)
            o1 += tl.reduce(old, 1, _add)
            o2 += tl.reduce(old * w[None, :], 1, _add)
            s1 += tl.reduce(fresh_f, 1, _add)
            s2 += tl.reduce(fresh_f * w[None, :], 1, _add)
            sq += tl.reduce(fresh_f * fresh_f, 1, _add)
            if USE_ABS:
                sab += tl.reduce(tl.abs(fresh_f), 1, _add)
            if CORRECT:
                tl.store(ptrs, fresh, mask=m2)
        terms = _ref_norms(_other_terms(bsq_b + off * sbn, sbn, bias_ptr + off, L, floor_b, HAS_BIAS, BN), rq + 2 * h)
        ref1 = tl.load(rb + rows64 * srm + (2 * h) * srj, mask=need, other=0.0) + terms[6]
        ref2 = tl.load(rb + rows64 * srm + (2 * h + 1) * srj, mask=need, other=0.0) + terms[7]
        b1, b2 = _bound(a, sq, sab, ref1, ref2, terms, rule, lf, USE_ABS, CALIBRATED, FLUSH)
        all_ok = all_ok & (tl.abs(ref1 - s1) <= b1) & (tl.abs(ref2 - s2) <= b2)
        # The old row's sums, or the rule's own terms (its squares, its bound: rows of ~1e19, where ‖A_i‖² leaves
        # fp32), past fp32's range: the rule cannot judge the row, and a recomputation equal to it is the product.
        overflowed = (overflowed | ~(tl.abs(o1) <= FLT_MAX) | ~(tl.abs(o2) <= FLT_MAX) | ~(sq <= FLT_MAX)
                      | ~(b1 <= FLT_MAX) | ~(b2 <= FLT_MAX))
    consistent = (differs == 0) & overflowed & (unexplained == 0)
    code = tl.where(consistent, CONSISTENT, tl.where(all_ok & (unexplained == 0), RECOMPUTED, UNCORRECTABLE))
    _count_outcomes(state_ptr, need, code)
    tl.store(code_ptr + pid_b.to(tl.int64) * M + rows64, code, mask=need)
    slot = tl.load(slot_ptr + pid_b.to(tl.int64) * M + rows64, mask=need, other=SLOTS)
    tl.store(slot_i_ptr + slot.to(tl.int64) * 4 + 3, code, mask=need & (slot < SLOTS))
