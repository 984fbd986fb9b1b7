"""Device functions the checked attention backward's passes (kernels/triton_attention_bwd.py) share with the check
over a vendor's backward (kernels/triton_given_backward_check.py): the tile product, the finiteness tests of what a
flagged program read, and a program's status word and summary (triton_attention_bwd.FIELDS). One home, so that both
write what the passes' repair launches and the step boundary read.
"""
from __future__ import annotations

from .triton_common import device_function, triton

if triton is not None:
    import triton.language as tl

__all__: list[str] = []

if triton is not None:

    @device_function
    def _dot(a, b, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
        # The interpreter's tl.dot mishandles bf16 operands: fp32 there (bf16 and fp16 products are exact in fp32,
        # as a tensor core's are).
        if INTERPRET:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            c = tl.dot(a, b, input_precision=PRECISION)
        return c

    @device_function
    def _nonfinite(x):
        """1 where some element of x is INF or NaN."""
        x = x.to(tl.float32)
        return tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32))

    @device_function
    def _rows_nonfinite(q, do, delta, lse):
        """1 where a query block's inputs hold INF or NaN (lse: NaN or -INF; +INF is a row with every key masked)."""
        return tl.maximum(tl.maximum(_nonfinite(q), _nonfinite(do)), tl.maximum(
            _nonfinite(delta), tl.max(((lse != lse) | (lse == float("-inf"))).to(tl.int32))))

    @device_function
    def _keys_nonfinite(K, V, bb, hk, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, lo, hi, S, feats, feat_in,
                        BLOCK_N: tl.constexpr):
        """1 where a key or value row in [lo, hi) of KV head hk holds INF or NaN: what a query program that flagged
        reads again (its dQ is then its inputs' doing)."""
        bad = tl.full((), 0, tl.int32)
        for start_k in range(lo, hi, BLOCK_N):
            keys = start_k + tl.arange(0, BLOCK_N)
            io = (keys < S)[:, None] & feat_in[None, :]
            k = tl.load(K + bb * sk_b + hk * sk_h + keys[:, None] * sk_s + feats[None, :] * sk_d, mask=io, other=0.0)
            v = tl.load(V + bb * sv_b + hk * sv_h + keys[:, None] * sv_s + feats[None, :] * sv_d, mask=io, other=0.0)
            bad = tl.maximum(bad, tl.maximum(_nonfinite(k), _nonfinite(v)))
        return bad

    @device_function
    def _keys_top(K, V, bb, hk, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, lo, hi, S, feats, feat_in,
                  BLOCK_N: tl.constexpr):
        """(max ‖K_j‖, max ‖V_j‖) over the key rows in [lo, hi) of KV head hk: what a query program whose repair
        tripped again reads again, for what its inputs can give dQ (read after the loop, not in it: the loop's
        registers stay the first pass's)."""
        k_top = tl.full((), 0.0, tl.float32)
        v_top = tl.full((), 0.0, tl.float32)
        for start_k in range(lo, hi, BLOCK_N):
            keys = start_k + tl.arange(0, BLOCK_N)
            io = (keys < S)[:, None] & feat_in[None, :]
            k = tl.load(K + bb * sk_b + hk * sk_h + keys[:, None] * sk_s + feats[None, :] * sk_d, mask=io, other=0.0)
            v = tl.load(V + bb * sv_b + hk * sv_h + keys[:, None] * sv_s + feats[None, :] * sv_d, mask=io, other=0.0)
            k_top = tl.maximum(k_top, tl.max(_row_norms(k), 0))
            v_top = tl.maximum(v_top, tl.max(_row_norms(v), 0))
        return k_top, v_top

    @device_function
    def _queries_top(Q, DO, LSE, DELTA, bb, hk, group, H, T, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d,
                     sl_b, sl_h, sl_t, lo, hi, feats, feat_in, BLOCK_M: tl.constexpr):
        """(max ‖Q_i‖, max ‖dO_i‖, max |δ_i|) over the query rows in [lo, hi) of KV head hk's group: what a key
        program whose repair tripped again reads again, for what its inputs can give dK and dV."""
        q_top = tl.full((), 0.0, tl.float32)
        do_top = tl.full((), 0.0, tl.float32)
        delta_top = tl.full((), 0.0, tl.float32)
        for g in range(0, group):
            hh = hk * group + g
            for start_m in range(lo, hi, BLOCK_M):
                _, _, q, do, _, delta = _query_block(
                    Q, DO, LSE, DELTA, bb, hh, H, T, start_m, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d,
                    sl_b, sl_h, sl_t, feats, feat_in, BLOCK_M)
                q_top = tl.maximum(q_top, tl.max(_row_norms(q), 0))
                do_top = tl.maximum(do_top, tl.max(_row_norms(do), 0))
                delta_top = tl.maximum(delta_top, tl.max(tl.abs(delta), 0))
        return q_top, do_top, delta_top

    @device_function
    def _queries_nonfinite(Q, DO, LSE, DELTA, bb, hk, group, H, T, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t,
                           sdo_d, sl_b, sl_h, sl_t, lo, hi, feats, feat_in, BLOCK_M: tl.constexpr, OUT=None, so_b=0,
                           so_h=0, so_t=0, so_d=0, O_FOR_DELTA: tl.constexpr = False):
        """1 where a query row in [lo, hi) of any query head of KV head hk's group has non-finite inputs (q, dO, δ,
        the lse: ``_rows_nonfinite``): what a key program that flagged reads again. O_FOR_DELTA: O (OUT, its
        strides) in place of δ, where δ is being made in the same launch (``_trip_given``)."""
        bad = tl.full((), 0, tl.int32)
        for g in range(0, group):
            hh = hk * group + g
            for start_m in range(lo, hi, BLOCK_M):
                rows, row_in, q, do, lse, delta = _query_block(
                    Q, DO, LSE, DELTA, bb, hh, H, T, start_m, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d,
                    sl_b, sl_h, sl_t, feats, feat_in, BLOCK_M, not O_FOR_DELTA)
                if O_FOR_DELTA:  # O's finiteness stands for δ's (δ = rowsum(dO ∘ O); dO is tested already)
                    io = row_in[:, None] & feat_in[None, :]
                    delta = tl.load(OUT + bb * so_b + hh * so_h + rows[:, None] * so_t + feats[None, :] * so_d,
                                    mask=io, other=0.0)
                bad = tl.maximum(bad, _rows_nonfinite(q, do, delta, lse))
        return bad

    @device_function
    def _query_block(Q, DO, LSE, DELTA, bb, hh, H, T, start_m, sq_b, sq_h, sq_t, sq_d, sdo_b, sdo_h, sdo_t, sdo_d,
                     sl_b, sl_h, sl_t, feats, feat_in, BLOCK_M: tl.constexpr, READ_DELTA: tl.constexpr = True):
        """The query block at start_m of head hh as a key program streams it: (rows, which exist, q and dO as
        stored, lse and δ in fp32; δ zeros without READ_DELTA)."""
        rows = start_m + tl.arange(0, BLOCK_M)
        row_in = rows < T
        io = row_in[:, None] & feat_in[None, :]
        q = tl.load(Q + bb * sq_b + hh * sq_h + rows[:, None] * sq_t + feats[None, :] * sq_d, mask=io, other=0.0)
        do = tl.load(DO + bb * sdo_b + hh * sdo_h + rows[:, None] * sdo_t + feats[None, :] * sdo_d, mask=io,
                     other=0.0)
        lse = tl.load(LSE + bb * sl_b + hh * sl_h + rows * sl_t, mask=row_in, other=0.0).to(tl.float32)
        delta = tl.zeros((BLOCK_M,), tl.float32)
        if READ_DELTA:
            delta = tl.load(DELTA + (bb * H + hh) * T + rows, mask=row_in, other=0.0)
        return rows, row_in, q, do, lse, delta

    @device_function
    def _key_block(K, V, bb, hk, start_n, S, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, feats, feat_in,
                   BLOCK_N: tl.constexpr):
        """The key block at start_n of KV head hk: (keys, which exist, which (key, feature) exist, k and v as
        stored)."""
        keys = start_n + tl.arange(0, BLOCK_N)
        key_in = keys < S
        kv_io = key_in[:, None] & feat_in[None, :]
        k = tl.load(K + bb * sk_b + hk * sk_h + keys[:, None] * sk_s + feats[None, :] * sk_d, mask=kv_io, other=0.0)
        v = tl.load(V + bb * sv_b + hk * sv_h + keys[:, None] * sv_s + feats[None, :] * sv_d, mask=kv_io, other=0.0)
        return keys, key_in, kv_io, k, v

    @device_function
    def _clear_summary(SUMMARY, slot):
        """A first run's summary starts at 0 for every op (a pass checks some of them only)."""
        for o in range(5):
            for f in range(6):
                tl.store(SUMMARY + (slot + o) * 6 + f, 0.0)

    @device_function
    def _store_status(STATUS, pid, flags, bad_in, REPAIR: tl.constexpr, spilled=0, beyond=0):
        """The program's status word: the flagged ops' bits (first run), or 1 clean / 2 flagged again / 3 the dtype's
        range (repair, tier 1: ``spilled``, Launch.repaired_P; GradScaler's overflow steps make INF from finite
        inputs) / 4 flagged again past what the inputs can give (repair, tier 1: ``beyond``, ``_beyond``). Nothing is
        flagged for non-finite inputs (bad_in): their producer's check reports them."""
        flags = tl.where(bad_in > 0, 0, flags)
        if REPAIR:
            flags = tl.where(spilled > 0, 3, tl.where(flags != 0, tl.where(beyond > 0, 4, 2), 1))
        tl.store(STATUS + pid, flags)

    @device_function
    def _row_norms(x):
        """‖x_i‖ per row of a block, in fp32."""
        xf = x.to(tl.float32)
        return tl.sqrt(tl.sum(xf * xf, 1))

    @device_function
    def _beyond(x, valid, bound_R):
        """1 where a valid element of x (a recomputed gradient block, rows R) is past 2·bound_R of its row, or not
        finite where that is finite: a value its finite inputs cannot give, so a fault that came back in the
        recompute. 0 where the bound overflowed (inputs of diverged training can give anything)."""
        mag = tl.where(valid, tl.abs(x), 0.0)
        top_R = tl.max(tl.where(mag == mag, mag, float("inf")), 1)
        past = (top_R > 2.0 * bound_R) & (bound_R < float("inf"))
        return tl.max(past.to(tl.int32), 0)

    @device_function
    def _keep_worst(best, ratio_V, index_V, error_V, bound_V, valid_V, head, COLUMN: tl.constexpr, SUMMARY, slot,
                    WRITE: tl.constexpr, SECONDARY: tl.constexpr = False):
        """Fold one set of vectors into an op's worst: written to SUMMARY[slot] (FIELDS) when it is worse. Returns
        the new worst ratio. SECONDARY: an identity downstream of the op's products (Σ_j AP_ij, Σ_j dS_ij), whose
        vector is reported only where no product check of the op flagged: a fault's own product locates it best."""
        r = tl.where(valid_V, ratio_V, 0.0)
        top = tl.max(r, 0)
        if WRITE:
            worse = top > best
            if SECONDARY:
                worse = worse & (best <= 1.0)
            if worse:
                at = tl.min(tl.where(valid_V & (r == top), index_V, 2147483647), 0)
                pick = index_V == at
                tl.store(SUMMARY + slot * 6, top)
                tl.store(SUMMARY + slot * 6 + 1, tl.sum(tl.where(pick, head, 0), 0).to(tl.float32))
                tl.store(SUMMARY + slot * 6 + 2, at.to(tl.float32))
                tl.store(SUMMARY + slot * 6 + 3, tl.sum(tl.where(pick, error_V, 0.0), 0))
                tl.store(SUMMARY + slot * 6 + 4, tl.sum(tl.where(pick, bound_V, 0.0), 0))
                tl.store(SUMMARY + slot * 6 + 5, COLUMN * 1.0)
        return tl.maximum(best, top)
