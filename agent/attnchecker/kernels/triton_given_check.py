"""The full check over a forward another kernel computed (abft/given_forward.py): two launches per call, for CUDA; on
CPU tensors under Triton's interpreter (tests).

1. ``_value_sums``, one program per key tile of a (batch, key head): v_j·e and v_j·w (w = 1..D) per key, fp32,
   (B·Hk, 2, S rounded up to whole key tiles), and their largest magnitudes per key head. Every query block reads
   them instead of V: 8 bytes a key where V's tile is 2·D.
2. ``_check_given``, one program per block of BLOCK_M queries of a (batch, head), over the key tiles the block sees:
   the scores again (tl.dot, as our forward computes them), P' = 2^(log2(e)·(scale·S − lse)) against the vendor's
   lse (no running max: lse is the row's), and per row Σ_j P', Σ_j P'(v_j·c) and Σ_j P'²(v_j·c)² for c = e, w.
   After the loop, identities A and B with their bounds (abft/given_forward.py), in fp32.
   A flagged row writes the block's record as our forward's first pass does (kernels/triton_attention.FIELDS: A's in
   "scores", B's in "context"), and the call's status: any flag per op, and the worst clean ratio per op. A single
   wrong output element is placed by its two residuals (d_w / d_e = its column + 1, abft.repair's rule), or by being
   the row's only non-finite element; else the record says a row.

The repair launch that follows (triton_attention.forward) recomputes every flagged block in our own kernel, with its
full checks, into the vendor's out and lse, on the device. No host-device sync.

Where the attention backward is checked in full this step, ``_check_given`` also normalises the vendor's lse in place
(``NORMALISE_LSE``): each row within A's bound gets lse + ln Σ_j P'. The backward's identities take the forward's lse
as exact to fp32's roundings of the row's exp-sum (abft/vector_rules.softmax_grad_rule), as our forward's is; a
vendor's lse within A's bound may be off by more (the CPU's flash kernel by about 6·10⁻⁵ in bf16 and fp16, three
times the backward's allowance): with it the backward's checks flagged clean blocks. After the correction the row's
probabilities sum to 1 to the rounding of this kernel's own sum, which is what our forward's lse gives.

Compared with our checked forward on a clean call: no P·V product, no running max or rescaling, no checksum tallies
over score or context tiles; one tile GEMM (the scores), one exp2 and five row sums a score.
Legend: B batch, H query heads, Hk key/value heads, T queries, S keys, D head dim; n = batch·H + head.
"""
from __future__ import annotations

from typing import Any

from . import triton_checks as tc
from .triton_common import device_function, triton

if triton is not None:
    import triton.language as tl

    from .triton_attention_tiles import dot, operand, publish, query_block, rows

__all__: list[str] = []

if triton is not None:
    _jit: Any = device_function

    @triton.jit
    def _value_sums(
        V, VC, VCMax, svb, svh, svs, svd, HK, S, S_PAD, D,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """VC (B·Hk, 2, S_PAD) fp32: per key j, v_j·e and v_j·w, w = 1..D, 0 past S (S_PAD: S rounded up to whole
        key tiles, so the check's loop loads them unmasked and contiguous); VCMax (B·Hk, 2), zeroed before: their
        largest magnitudes over the key head's keys (the bound's accumulation term: an upper bound for every row,
        without a reduction across the block in the check's loop)."""
        pid_s = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_n = pid_s * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        key_ok = offs_n < S
        d_ok = offs_d < D
        v_at = V + (pid_n // HK).to(tl.int64) * svb + (pid_n % HK).to(tl.int64) * svh
        v = tl.load(v_at + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=key_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        w_d = tl.where(d_ok, tc.weights(BLOCK_D), 0.0)
        at = VC + pid_n.to(tl.int64) * S_PAD * 2 + offs_n
        vc_e = tc.rsum(v, 1)
        vc_w = tc.rsum(v * w_d[None, :], 1)
        tl.store(at, vc_e)
        tl.store(at + S_PAD, vc_w)
        # A NaN value makes its key's sums NaN, and the identities flag every row that sees it; the max skips it.
        tl.atomic_max(VCMax + pid_n.to(tl.int64) * 2, tc.rmax(tl.where(key_ok, tl.abs(vc_e), 0.0), 0))
        tl.atomic_max(VCMax + pid_n.to(tl.int64) * 2 + 1, tc.rmax(tl.where(key_ok, tl.abs(vc_w), 0.0), 0))

    @_jit
    def _place(o, d_e, d_w, bad_b, D, near_inf):
        """(n_cols, col, value) of a flagged output row: its one extreme element (NaN, INF, past near_inf) where it
        has only one; else the column its residuals point at (d_w / d_e = col + 1) where that is a column; else
        (2, -1, the row's most extreme element): a row (abft.repair.pattern_of)."""
        n: tl.constexpr = o.shape[1]
        cols = tl.arange(0, n)
        bad_el = ((tl.abs(o) <= near_inf) == 0) & (cols[None, :] < D)
        n_bad = tc.rsum(bad_el.to(tl.int32), 1)
        first_bad = tc.rmin(tl.where(bad_el, cols[None, :], n), 1)
        ratio = d_w / tl.where(d_e == 0.0, 1.0, d_e)
        at = tl.floor(ratio + 0.5).to(tl.int32) - 1
        finite = (tl.abs(d_e) <= 3.4028234663852886e38) & (tl.abs(d_w) <= 3.4028234663852886e38) & (d_e != 0.0)
        near = tl.abs(ratio - (at + 1).to(tl.float32)) <= 0.3
        placed = finite & near & (at >= 0) & (at < D)
        col = tl.where(n_bad == 1, first_bad, tl.where((n_bad == 0) & placed, at, -1))
        one = col >= 0
        value = tl.where(one, tc.rsum(tl.where(cols[None, :] == col[:, None], o, 0.0), 1), tc.extreme_of(o))
        row = tc.first(bad_b)
        return (tl.where(tc.pick(one.to(tl.int32), row) != 0, 1.0, 2.0), tc.pick(col, row).to(tl.float32),
                tc.pick(value, row))

    @_jit
    def _record(bad, residual, bound, value, n_cols, col, r0):
        """A block's record (FIELDS) of one op from its flagged rows (bad): the first one's row, residual, bound."""
        fi = tl.arange(0, 16)
        row = tc.first(bad)
        rec = tl.where(fi == 0, 1.0, 0.0)
        rec = tl.where(fi == 1, tc.rsum(bad.to(tl.int32), 0).to(tl.float32), rec)
        rec = tl.where(fi == 2, (r0 + row).to(tl.float32), rec)
        rec = tl.where(fi == 3, n_cols, rec)
        rec = tl.where(fi == 4, col, rec)
        rec = tl.where(fi == 5, value, rec)
        r = tc.pick(residual, row)
        rec = tl.where(fi == 6, tl.where(r <= 3.4028234663852886e38, r, float("nan")), rec)
        rec = tl.where(fi == 7, tc.pick(bound, row), rec)
        return tl.where(row >= 0, rec, 0.0)

    @triton.jit
    def _check_given(
        Q, K, Out, Lse, VC, VCMax, KMax, Status, Records,
        sqb, sqh, sqt, sqd, skb, skh, sks, skd, sob, soh, sot, sod, skmb, skmh,
        H, GROUP, T, S, S_PAD, D, N_BLOCKS, scale, tau_u, kappa_u32, kappa_a_u32, a_floor_u, near_inf,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
        DOT: tl.constexpr, NORMALISE_LSE: tl.constexpr,
    ):
        """Identities A and B of one query block over the vendor's out and lse (module doc); NORMALISE_LSE: each row
        within A's bound gets lse + ln Σ_j P' in place (module doc)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        b, h, hk, offs_m, offs_d, row_ok, d_ok = query_block(pid_m, pid_n, H, GROUP, T, D, BLOCK_M, BLOCK_D)
        q = rows(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, sqd, row_ok, d_ok)
        q_op = operand(q, DOT)
        qf = q.to(tl.float32)
        q_norm = tl.sqrt(tc.rsum(qf * qf, 1))
        lse = tl.load(Lse + pid_n.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
        lse2 = lse * tc.LOG2E
        k_at = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        vc_at = VC + (b * (H // GROUP) + hk).to(tl.int64) * S_PAD * 2
        a = tl.full([BLOCK_M], 0, tl.float32)
        ref_e = tl.full([BLOCK_M], 0, tl.float32)
        ref_w = tl.full([BLOCK_M], 0, tl.float32)
        sq_e = tl.full([BLOCK_M], 0, tl.float32)
        sq_w = tl.full([BLOCK_M], 0, tl.float32)
        hi = S
        if IS_CAUSAL:
            hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_ok = offs_n < S
            k = tl.load(k_at + offs_n[:, None] * sks + offs_d[None, :] * skd, mask=key_ok[:, None] & d_ok[None, :],
                        other=0.0)
            s = dot(q_op, tl.trans(operand(k, DOT)), DOT)
            p = tl.math.exp2(s * (scale * tc.LOG2E) - lse2[:, None])
            # The per-element mask only on a tile that may hold a masked key (tc.holds_masked).
            if tc.holds_masked(pid_m * BLOCK_M, start_n, T, S, 0, BLOCK_M, BLOCK_N, IS_CAUSAL, False):
                valid = key_ok[None, :] & row_ok[:, None]
                if IS_CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None])
                p = tl.where(valid, p, 0.0)
            vc_e = tl.load(vc_at + offs_n)
            vc_w = tl.load(vc_at + S_PAD + offs_n)
            pe = p * vc_e[None, :]
            pw = p * vc_w[None, :]
            a += tc.rsum(p, 1)
            ref_e += tc.rsum(pe, 1)
            ref_w += tc.rsum(pw, 1)
            sq_e += tc.rsum(pe * pe, 1)
            sq_w += tc.rsum(pw * pw, 1)

        # The bounds' per-row terms (abft/given_forward.py): n keys seen, sigma the largest score allowed, the key
        # head's largest |v·c| (over all its keys: an upper bound of the row's).
        kv = (b * (H // GROUP) + hk).to(tl.int64) * 2
        vc_max_e = tl.load(VCMax + kv)
        vc_max_w = tl.load(VCMax + kv + 1)
        n_keys = tl.full([BLOCK_M], S, tl.int32)
        if IS_CAUSAL:
            n_keys = tl.minimum(offs_m + 1, S)
        n_f = n_keys.to(tl.float32)
        seen = tl.minimum(S, tl.cdiv(hi, BLOCK_N) * BLOCK_N)
        k_max = tl.load(KMax + b.to(tl.int64) * skmb + hk.to(tl.int64) * skmh + tl.maximum(seen - 1, 0),
                        mask=seen > 0, other=0.0)
        sigma = tl.abs(scale) * q_norm * k_max
        # The vendor's output rows only now: held through the loop they would take a register per element a thread.
        o = rows(Out, b, h, offs_m, offs_d, sob, soh, sot, sod, row_ok, d_ok).to(tl.float32)
        w_d = tl.where(d_ok, tc.weights(BLOCK_D), 0.0)
        oa = tl.abs(o)
        d_e = a * tc.rsum(o, 1) - ref_e
        d_w = a * tc.rsum(o * w_d[None, :], 1) - ref_w
        walk = kappa_u32 * (tl.sqrt(n_f) + tl.sqrt(D * 1.0) * sigma) * a
        b_e = tau_u * (tl.sqrt(sq_e) + a * tc.rsum(oa, 1)) + walk * vc_max_e
        b_w = tau_u * (tl.sqrt(sq_w) + a * tc.rsum(oa * w_d[None, :], 1)) + walk * vc_max_w
        r_a = tl.abs(a - 1.0)
        b_a = a_floor_u + kappa_a_u32 * (n_f + D * 1.0 * sigma)
        # NaN-safe: a NaN or INF residual is "not within its bound".
        ok_a = r_a <= b_a
        # An INF output makes its own bound INF (a·Σ|O_d|): a residual past fp32's range is never within one.
        ok_e = (tl.abs(d_e) <= b_e) & (tl.abs(d_e) <= 3.4028234663852886e38)
        ok_w = (tl.abs(d_w) <= b_w) & (tl.abs(d_w) <= 3.4028234663852886e38)
        bad_a = (ok_a == 0) & row_ok
        bad_b = ((ok_e & ok_w) == 0) & row_ok
        ratio_e = tl.abs(d_e) / tl.maximum(b_e, 1e-30)
        ratio_w = tl.abs(d_w) / tl.maximum(b_w, 1e-30)
        ratio_b = tl.maximum(ratio_e, ratio_w)
        # The report's residual and bound: the weights' whose ratio is worse (e where either is NaN).
        by_w = ratio_w > ratio_e
        worst_b = tl.where(by_w, tl.abs(d_w), tl.abs(d_e))
        bound_b = tl.where(by_w, b_w, b_e)
        r0 = pid_m * BLOCK_M
        rec_s = _record(bad_a, r_a, b_a, tc.pick(lse, tc.first(bad_a)), 2.0, -1.0, r0)
        n_cols, col, value = _place(o, d_e, d_w, bad_b, D, near_inf)
        rec_c = _record(bad_b, worst_b, bound_b, value, n_cols, col, r0)
        publish(Records + (pid_n * N_BLOCKS + pid_m).to(tl.int64) * (2 * 16), rec_s, rec_c, Status)
        # The worst clean ratio per op (the step's histogram), as the first pass publishes it.
        clean_a = tc.rmax(tl.where(row_ok & ok_a, r_a / tl.maximum(b_a, 1e-30), 0.0), 0)
        clean_b = tc.rmax(tl.where(row_ok & ok_e & ok_w, ratio_b, 0.0), 0)
        tl.atomic_max(Status + 2, clean_a)
        tl.atomic_max(Status + 3, clean_b)
        if NORMALISE_LSE:
            # Only this program reads these rows' lse, and it has: the rows' own, now Σ_j P' = 1 to fp32's rounding
            # of this sum. A flagged row keeps the vendor's; the repair launch rewrites its block.
            tl.store(Lse + pid_n.to(tl.int64) * T + offs_m, lse + tl.log(a), mask=row_ok & ok_a)
