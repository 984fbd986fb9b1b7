"""The full check over an attention backward another kernel computed (the vendor's: FlashAttention's, the CPU flash
kernel's), from its gradients: abft/given_backward.py's identities and bounds, in one Triton launch, for CUDA; on CPU
tensors under Triton's interpreter (tests).

``_check_given_bwd`` takes the place of our checked backward's two passes in kernels/triton_attention_bwd.run
(``check="abft"`` with ``given``), one program per block of the passes' layout, so that their repair launches
recompute exactly the blocks it flags, into the vendor's gradients, with their own full checks:

- a key program (BLOCK_N keys of a batch and key head) loops over the query blocks that see its keys, of every
  query head of its group: S = Q Kᵀ and dP = dO Vᵀ again (tl.dot, as our backward computes them), P from the stored
  lse, dS = P ∘ (dP − δ), and per key the sums of identities V (Σ_i P_ij (dO_i·c)) and K (scale·Σ_i dS_ij (q_i·c))
  with their bounds' terms, for c = e and w. Then it reads its rows of dV and dK once and compares;
- a query program (BLOCK_M queries of a batch and head) loops over the key blocks its queries see: identity Q
  (scale·Σ_j dS_ij (k_j·c)), then its rows of dQ.

The per-token factors (q·c, dO·c, k·c and the norms) are the ones ``_delta`` and ``_key_terms`` make once per call
for the passes' own checks (QROWS, KROWS), and ‖O_i‖ (ONORM) for δ's term. A program writes the status word and the
summary the passes write (triton_attention_bwd.FIELDS), under ops grad_v (bit 2), grad_k (3) and grad_q (4): a fault
inside the vendor's S or dP shows in the gradients made from it, so it is reported as theirs. What the bounds allow
for the vendor's own rounding of its sums (``q_block``, ``k_block``: abft/given_backward.GradientAccumulation, 0 for
fp32 to the end) is set per vendor by the caller.

Compared with our checked backward's passes: two tile GEMMs (S, dP) of the five, one exp per score, no dS·K, dSᵀ·Q
or Pᵀ·dO product, and each key program's sums against vectors in place of the products' checksum tallies.
Legend: B batch, H query heads, HK key/value heads (G = H/HK), T queries, S keys, D head dim; n = batch·H + head,
nk = batch·HK + key head.
"""
from __future__ import annotations

from .triton_common import device_function, triton

if triton is not None:
    import triton.language as tl

    from . import triton_attention_bwd_parts as bwd

__all__: list[str] = []

if triton is not None:
    LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _check_given_bwd(Q, K, V, DO, LSE, DELTA, ONORM, QROWS, KROWS, DQ, DK, DV, STATUS, SUMMARY,
                         sdq_b, sdq_h, sdq_t, sdq_d, sdk_b, sdk_h, sdk_s, sdk_d, sdv_b, sdv_h, sdv_s, sdv_d,
                         sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                         sdo_b, sdo_h, sdo_t, sdo_d, sl_b, sl_h, sl_t,
                         H, HK, T, S, D, scale, n_kb, n_qb, p_keys, tau_u, kappa_u32, tau_tiny, q_block, k_block,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                         INTERPRET: tl.constexpr):
        """Program p checks the gradients program p of the passes writes (module doc). dq (B, H, T, D), dk, dv
        (B, HK, S, D) in any layout (their strides); DELTA, ONORM (B·H, T); QROWS (B·H, 6, T): ‖q‖, q·e, q·w,
        ‖dO‖, dO·e, dO·w; KROWS (B·HK, 4, S): ‖k‖, k·e, k·w, ‖v‖. tau_u, kappa_u32, tau_tiny: the rule's scalars
        (abft/given_backward.GivenBackwardRule)."""
        pid = tl.program_id(0)
        feats = tl.arange(0, BLOCK_D)
        feat_in = feats < D
        w_d = tl.where(feat_in, (feats + 1).to(tl.float32), 0.0)
        sum_e = D * 1.0
        sum_w = D * (D + 1) * 0.5
        root_d = tl.sqrt(D * 1.0)
        abs_scale = tl.abs(scale)
        slot = pid * 5
        bwd._clear_summary(SUMMARY, slot)
        flags = tl.full((), 0, tl.int32)
        bad_in = tl.full((), 0, tl.int32)
        group = H // HK
        if pid < p_keys:
            nk = pid // n_kb
            bb, hk = nk // HK, nk % HK
            start_n = (pid % n_kb) * BLOCK_N
            keys, key_in, kv_io, k, v = bwd._key_block(K, V, bb, hk, start_n, S, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h,
                                                       sv_s, sv_d, feats, feat_in, BLOCK_N)
            k_norm = tl.load(KROWS + nk * 4 * S + keys, mask=key_in, other=0.0)
            v_norm = tl.load(KROWS + (nk * 4 + 3) * S + keys, mask=key_in, other=0.0)
            # Per key, the sums over its queries as products with per-query factors (``_factors``), on the dot
            # rather than a reduction across the tile's lanes per sum: Pᵀ·[dO·e, dO·w, |dO·e|, |dO·w|, δ's two terms
            # for c = e, w] (V's sums, their magnitudes, δ's term), (P²)ᵀ·[(dO·c)²] (V's squares), dSᵀ·[q·c] (K's
            # sums), (dS²)ᵀ·[(q·c)²] and |dS|ᵀ·[|q·c|] (its squares and magnitudes).
            acc = tl.zeros((BLOCK_N, 16), tl.float32)
            acc_p, acc_p2, acc_ds, acc_ds2, acc_ads = acc, acc, acc, acc, acc
            # Scalars over every query read (a superset of each key's live ones, as the bound's reference takes
            # them): the largest |dO_i·c|, |q_i·c| and ‖q_i‖.
            vxe, vxw, kxe, kxw, q_max = (tl.full((), 0.0, tl.float32), tl.full((), 0.0, tl.float32),
                                         tl.full((), 0.0, tl.float32), tl.full((), 0.0, tl.float32),
                                         tl.full((), 0.0, tl.float32))
            lo = 0
            if CAUSAL:
                lo = start_n // BLOCK_M * BLOCK_M
            for g in range(0, group):
                hh = hk * group + g
                n = bb * H + hh
                for start_m in range(lo, T, BLOCK_M):
                    rows, row_in, q, do, lse, delta = bwd._query_block(
                        Q, DO, LSE, DELTA, bb, hh, H, T, start_m, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d,
                        sl_b, sl_h, sl_t, feats, feat_in, BLOCK_M)
                    at = QROWS + n * 6 * T + rows
                    q_n = tl.load(at, mask=row_in, other=0.0)
                    q_e = tl.load(at + T, mask=row_in, other=0.0)
                    q_w = tl.load(at + 2 * T, mask=row_in, other=0.0)
                    do_n = tl.load(at + 3 * T, mask=row_in, other=0.0)
                    do_e = tl.load(at + 4 * T, mask=row_in, other=0.0)
                    do_w = tl.load(at + 5 * T, mask=row_in, other=0.0)
                    o_n = tl.load(ONORM + n * T + rows, mask=row_in, other=0.0)
                    p, ds = _probs(q, k, v, do, lse, delta, rows, row_in, keys, key_in, scale, CAUSAL, INTERPRET)
                    # δ's fp32 dot product over D: P_ij·‖dO_i‖(‖v_j‖ + ‖O_i‖)·|q_i·c| per term, as ‖v_j‖ times the
                    # sum of P_ij·‖dO_i‖·|q_i·c|, plus the sum of P_ij·‖dO_i‖·‖O_i‖·|q_i·c|.
                    dq_e, dq_w = do_n * tl.abs(q_e), do_n * tl.abs(q_w)
                    p_t, ds_t = tl.trans(p), tl.trans(ds)
                    acc_p += bwd._dot(p_t, _factors(do_e, do_w, tl.abs(do_e), tl.abs(do_w), dq_e, dq_w, dq_e * o_n,
                                                    dq_w * o_n), "ieee", INTERPRET)
                    acc_p2 += bwd._dot(p_t * p_t, _factors2(do_e * do_e, do_w * do_w), "ieee", INTERPRET)
                    acc_ds += bwd._dot(ds_t, _factors2(q_e, q_w), "ieee", INTERPRET)
                    acc_ds2 += bwd._dot(ds_t * ds_t, _factors2(q_e * q_e, q_w * q_w), "ieee", INTERPRET)
                    acc_ads += bwd._dot(tl.abs(ds_t), _factors2(tl.abs(q_e), tl.abs(q_w)), "ieee", INTERPRET)
                    # (Rows past T were loaded as 0.)
                    vxe = tl.maximum(vxe, tl.max(tl.abs(do_e), 0))
                    vxw = tl.maximum(vxw, tl.max(tl.abs(do_w), 0))
                    kxe = tl.maximum(kxe, tl.max(tl.abs(q_e), 0))
                    kxw = tl.maximum(kxw, tl.max(tl.abs(q_w), 0))
                    q_max = tl.maximum(q_max, tl.max(q_n, 0))
            v1e, v1w, vae, vaw = _column(acc_p, 0), _column(acc_p, 1), _column(acc_p, 2), _column(acc_p, 3)
            kde = v_norm * _column(acc_p, 4) + _column(acc_p, 6)
            kdw = v_norm * _column(acc_p, 5) + _column(acc_p, 7)
            v2e, v2w = _column(acc_p2, 0), _column(acc_p2, 1)
            k1e, k1w, k2e, k2w = _column(acc_ds, 0), _column(acc_ds, 1), _column(acc_ds2, 0), _column(acc_ds2, 1)
            kae, kaw = _column(acc_ads, 0), _column(acc_ads, 1)
            # The vendor's roundings of each key's running sums (GradientAccumulation.key_rounds).
            blocks = tl.full((BLOCK_N,), 1, tl.int32)
            if q_block > 0:
                first = tl.zeros((BLOCK_N,), tl.int32)
                if CAUSAL:
                    first = keys // q_block
                blocks = tl.maximum((T + q_block - 1) // q_block - first, 1)
            rounds = group * blocks.to(tl.float32) + tl.where(group > 1, 1.0, 0.0)
            # The live (query, key) pairs of each key, over the group's heads: causal, the queries at or after it.
            count = tl.zeros((BLOCK_N,), tl.float32) + group * T * 1.0
            if CAUSAL:
                count = group * tl.maximum(T - keys, 0).to(tl.float32)
            root_r = tl.sqrt(rounds)
            root_partial = tl.sqrt(rounds - 1.0)
            root_n = tl.sqrt(count)
            walk = kappa_u32 * (root_n + root_d * abs_scale * k_norm * q_max)
            dv = tl.load(DV + bb * sdv_b + hk * sdv_h + keys[:, None] * sdv_s + feats[None, :] * sdv_d, mask=kv_io,
                         other=0.0).to(tl.float32)
            dk = tl.load(DK + bb * sdk_b + hk * sdk_h + keys[:, None] * sdk_s + feats[None, :] * sdk_d, mask=kv_io,
                         other=0.0).to(tl.float32)
            rows_at = (walk, root_n, root_r, root_partial, tau_u, tau_tiny)
            d_ve, b_ve = _bounded(dv, v1e, 1.0, v2e, vae, 0.0, vxe, sum_e, *rows_at)
            d_vw, b_vw = _bounded(dv * w_d[None, :], v1w, 1.0, v2w, vaw, 0.0, vxw, sum_w, *rows_at)
            fp32_dp = kappa_u32 * root_d * abs_scale
            d_ke, b_ke = _bounded(dk, k1e, scale, k2e, kae, fp32_dp * kde, kxe, sum_e, *rows_at)
            d_kw, b_kw = _bounded(dk * w_d[None, :], k1w, scale, k2w, kaw, fp32_dp * kdw, kxw, sum_w, *rows_at)
            worst_v = bwd._keep_worst(tl.full((), 0.0, tl.float32), _ratio(d_ve, b_ve, d_vw, b_vw), keys, d_ve,
                                      b_ve, key_in, hk, 0, SUMMARY, slot + 2, True)
            worst_k = bwd._keep_worst(tl.full((), 0.0, tl.float32), _ratio(d_ke, b_ke, d_kw, b_kw), keys, d_ke,
                                      b_ke, key_in, hk, 0, SUMMARY, slot + 3, True)
            flags = ((worst_v > 1.0).to(tl.int32) << 2) | ((worst_k > 1.0).to(tl.int32) << 3)
            if flags != 0:
                # As the passes: a program that flagged asks whether what it read was finite (its producer's check
                # reports what was not).
                bad_in = tl.maximum(bwd._nonfinite(k), bwd._nonfinite(v))
                bad_in = tl.maximum(bad_in, bwd._queries_nonfinite(
                    Q, DO, LSE, DELTA, bb, hk, group, H, T, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d, sl_b,
                    sl_h, sl_t, lo, T, feats, feat_in, BLOCK_M))
        else:
            n = (pid - p_keys) // n_qb
            bb, hh = n // H, n % H
            hk = hh // group
            nk = bb * HK + hk
            start_m = ((pid - p_keys) % n_qb) * BLOCK_M
            rows, row_in, q, do, lse, delta = bwd._query_block(
                Q, DO, LSE, DELTA, bb, hh, H, T, start_m, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d, sl_b,
                sl_h, sl_t, feats, feat_in, BLOCK_M)
            io = row_in[:, None] & feat_in[None, :]
            q_n = tl.load(QROWS + n * 6 * T + rows, mask=row_in, other=0.0)
            do_n = tl.load(QROWS + (n * 6 + 3) * T + rows, mask=row_in, other=0.0)
            o_n = tl.load(ONORM + n * T + rows, mask=row_in, other=0.0)
            # Per query, its sums over keys on the dot, as the key programs' (above): P·[‖v_j‖·|k_j·c|, |k_j·c|]
            # (δ's term), dS·[k·c], dS²·[(k·c)²], |dS|·[|k·c|].
            acc = tl.zeros((BLOCK_M, 16), tl.float32)
            acc_p, acc_ds, acc_ds2, acc_ads = acc, acc, acc, acc
            # Scalars over every key read: the largest |k_j·c| and ‖k_j‖.
            qxe, qxw, k_max = tl.full((), 0.0, tl.float32), tl.full((), 0.0, tl.float32), tl.full((), 0.0, tl.float32)
            hi = S
            if CAUSAL:
                hi = tl.minimum(S, start_m + BLOCK_M)
            for start_n in range(0, hi, BLOCK_N):
                keys, key_in, _kv_io, k, v = bwd._key_block(K, V, bb, hk, start_n, S, sk_b, sk_h, sk_s, sk_d, sv_b,
                                                            sv_h, sv_s, sv_d, feats, feat_in, BLOCK_N)
                at = KROWS + nk * 4 * S + keys
                k_n = tl.load(at, mask=key_in, other=0.0)
                k_e = tl.load(at + S, mask=key_in, other=0.0)
                k_w = tl.load(at + 2 * S, mask=key_in, other=0.0)
                v_n = tl.load(at + 3 * S, mask=key_in, other=0.0)
                p, ds = _probs(q, k, v, do, lse, delta, rows, row_in, keys, key_in, scale, CAUSAL, INTERPRET)
                ak_e, ak_w = tl.abs(k_e), tl.abs(k_w)
                zero_n = tl.zeros((BLOCK_N,), tl.float32)
                acc_p += bwd._dot(p, _factors(v_n * ak_e, v_n * ak_w, ak_e, ak_w, zero_n, zero_n, zero_n, zero_n),
                                  "ieee", INTERPRET)
                acc_ds += bwd._dot(ds, _factors2(k_e, k_w), "ieee", INTERPRET)
                acc_ds2 += bwd._dot(ds * ds, _factors2(k_e * k_e, k_w * k_w), "ieee", INTERPRET)
                acc_ads += bwd._dot(tl.abs(ds), _factors2(ak_e, ak_w), "ieee", INTERPRET)
                qxe = tl.maximum(qxe, tl.max(tl.abs(k_e), 0))
                qxw = tl.maximum(qxw, tl.max(tl.abs(k_w), 0))
                k_max = tl.maximum(k_max, tl.max(k_n, 0))
            qde = _column(acc_p, 0) + o_n * _column(acc_p, 2)
            qdw = _column(acc_p, 1) + o_n * _column(acc_p, 3)
            q1e, q1w, q2e, q2w = _column(acc_ds, 0), _column(acc_ds, 1), _column(acc_ds2, 0), _column(acc_ds2, 1)
            qae, qaw = _column(acc_ads, 0), _column(acc_ads, 1)
            # The vendor's roundings of each query's running dQ (GradientAccumulation.query_rounds).
            blocks = tl.full((BLOCK_M,), 1, tl.int32)
            if k_block > 0:
                if CAUSAL:
                    blocks = tl.minimum(rows, S - 1) // k_block + 1
                else:
                    blocks = blocks * ((S + k_block - 1) // k_block)
            root_r = tl.sqrt(blocks.to(tl.float32))
            root_partial = tl.sqrt(blocks.to(tl.float32) - 1.0)
            # The keys each query sees: causal, those up to its own.
            count = tl.zeros((BLOCK_M,), tl.float32) + S * 1.0
            if CAUSAL:
                count = tl.minimum(rows + 1, S).to(tl.float32)
            root_n = tl.sqrt(count)
            walk = kappa_u32 * (root_n + root_d * abs_scale * q_n * k_max)
            # (Per query: δ's term carries the row's own ‖dO_i‖.)
            fp32_dq = kappa_u32 * root_d * abs_scale * do_n
            dq = tl.load(DQ + bb * sdq_b + hh * sdq_h + rows[:, None] * sdq_t + feats[None, :] * sdq_d, mask=io,
                         other=0.0).to(tl.float32)
            rows_at = (walk, root_n, root_r, root_partial, tau_u, tau_tiny)
            d_qe, b_qe = _bounded(dq, q1e, scale, q2e, qae, fp32_dq * qde, qxe, sum_e, *rows_at)
            d_qw, b_qw = _bounded(dq * w_d[None, :], q1w, scale, q2w, qaw, fp32_dq * qdw, qxw, sum_w, *rows_at)
            worst_q = bwd._keep_worst(tl.full((), 0.0, tl.float32), _ratio(d_qe, b_qe, d_qw, b_qw), rows, d_qe,
                                      b_qe, row_in, hh, 0, SUMMARY, slot + 4, True)
            flags = (worst_q > 1.0).to(tl.int32) << 4
            if flags != 0:
                bad_in = bwd._rows_nonfinite(q, do, delta, lse)
                bad_in = tl.maximum(bad_in, bwd._keys_nonfinite(K, V, bb, hk, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h,
                                                                sv_s, sv_d, 0, hi, S, feats, feat_in, BLOCK_N))
        bwd._store_status(STATUS, pid, flags, bad_in, False)

    @device_function
    def _probs(q, k, v, do, lse, delta, rows, row_in, keys, key_in, scale, CAUSAL: tl.constexpr,
               INTERPRET: tl.constexpr):
        """One tile, recomputed from the inputs as stored: (P from the stored lse, 0 where the key is not seen,
        dS = P ∘ (dO Vᵀ − δ)), fp32. S and dP on the tensor cores, as our backward computes them; P in base 2, as a
        GPU's exp is."""
        live = row_in[:, None] & key_in[None, :]
        if CAUSAL:
            live = live & (keys[None, :] <= rows[:, None])
        s = bwd._dot(q, tl.trans(k), "ieee", INTERPRET)
        p = tl.where(live, tl.exp2(s * (scale * LOG2E) - lse[:, None] * LOG2E), 0.0)
        ds = p * (bwd._dot(do, tl.trans(v), "ieee", INTERPRET) - delta[:, None])
        return p, ds

    @device_function
    def _factors(x0, x1, x2, x3, x4, x5, x6, x7):
        """(len, 16) fp32: eight per-token vectors as its first columns, zeros after: the right side of a tile's sums
        on the dot (16: the fewest columns tl.dot takes)."""
        cols = tl.arange(0, 16)[None, :]
        f = tl.where(cols == 0, x0[:, None], 0.0)
        f = tl.where(cols == 1, x1[:, None], f)
        f = tl.where(cols == 2, x2[:, None], f)
        f = tl.where(cols == 3, x3[:, None], f)
        f = tl.where(cols == 4, x4[:, None], f)
        f = tl.where(cols == 5, x5[:, None], f)
        f = tl.where(cols == 6, x6[:, None], f)
        return tl.where(cols == 7, x7[:, None], f)

    @device_function
    def _factors2(x0, x1):
        """``_factors`` of two vectors."""
        cols = tl.arange(0, 16)[None, :]
        return tl.where(cols == 0, x0[:, None], tl.where(cols == 1, x1[:, None], 0.0))

    @device_function
    def _column(acc, j: tl.constexpr):
        """Column j of a (rows, 16) accumulator, per row."""
        return tl.sum(tl.where(tl.arange(0, 16)[None, :] == j, acc, 0.0), 1)

    @device_function
    def _bounded(xc, ref, f, sq, mag, fp32_term, x_max, sum_c, walk, root_n, root_r, root_partial, tau_u, tau_tiny):
        """One identity for one weighting c, per gradient row (abft/given_backward.py): (X·c − f·ref, its bound).
        xc: the row's elements times c; ref, sq, mag: the sums of the terms (the factor f = 1 or scale aside), of their
        squares and of their magnitudes; fp32_term: δ's (0 for V); x_max: the largest per-token factor |x·c|."""
        g = tl.abs(f)
        bound = (tau_u * (g * tl.sqrt(sq) + _rounded(xc, root_partial)) + walk * g * mag + fp32_term
                 + tau_tiny * (g * root_n * x_max + root_r * sum_c))
        return tl.sum(xc, 1) - f * ref, bound

    @device_function
    def _rounded(xc, root_partial):
        """Per gradient row (xc: its elements times c), what the vendor's roundings of it allow, in units of u: the
        last one at its worst, Σ_d |X_d c_d|, and the r − 1 of the running sums before it as a walk,
        √(r − 1)·‖X ∘ c‖ (abft/given_backward.py). The norm scaled by the row's largest element: a bf16 gradient
        element past 2⁶⁴ (an exponent flip) would square to INF and make the bound INF, and the row pass."""
        mag = tl.abs(xc)
        top = tl.max(mag, 1)
        unit = tl.where(top > 0, top, 1.0)
        scaled = mag / unit[:, None]
        return tl.sum(mag, 1) + root_partial * top * tl.sqrt(tl.sum(scaled * scaled, 1))

    @device_function
    def _ratio(d_e, b_e, d_w, b_w):
        """Per row, the larger of |d|/bound over c = e, w; INF where either residual is NaN (or INF)."""
        r = tl.maximum(tl.abs(d_e) / b_e, tl.abs(d_w) / b_w)
        finite = (tl.abs(d_e) < float("inf")) & (tl.abs(d_w) < float("inf"))
        return tl.where(finite & (r == r), r, float("inf"))
