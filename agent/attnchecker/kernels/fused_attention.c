/* The checked attention forward in one pass per query block (attnchecker/fused_attention.py says when it is used):
 * the tile contract of abft/tiled.py with the checksum sums taken while each tile is in cache, for fp32 on the CPU.
 *
 * For each of N (batch x head) matrices, for each block of BQ query rows [r0, r1):
 *   1. AS = Q_blk K[0:kend)^T with the BLAS the caller hands in (sgemm_, Fortran interface): kend = S, or for a
 *      causal call (or a mask that masks every key past some point for the whole block) the end of the checksum
 *      group holding the block's last key (whole groups only, so every group's sums cover the same keys as its
 *      reference);
 *   2. per row i and checksum group h (G keys each, weights 1 and 1..G): s_sums[i][h] = (sum AS, sum j*AS, sum AS^2),
 *      the scores check's row side (its references Q (K_h^T w) are the caller's); groups past kend hold zeros; in
 *      the same read of the row, the softmax's max over its unmasked keys;
 *   3. the softmax: z = scale*AS (+ the additive mask, where the call has one), keys past the row masked (causal),
 *      m = max z, P = exp(z - m) in place, l = sum P;
 *   4. OA = P [V | V e | V w] (one GEMM: CL and its row references, abft.tiled.augment_v; causal: over the keys up
 *      to the block's last row, P being 0 beyond), then per row
 *      c_sums[i] = (sum_d CL, sum_d d*CL, sum_d CL^2, P (V e), P (V w)), the context check's row side;
 *   5. out = CL / l, lse = m + log l, p_sum = l (a row with every key masked: out 0, lse +INF, p_sum 0).
 * The mask (a call with one is not causal): fp32, additive, row j of (batch b, head h) at mask + b*m_sb + h*m_sh +
 * i*m_st (strides 0 where it broadcasts), contiguous along the keys; matrix n of the call is divmod(n_base + n, heads).
 * Each row's sums are verified where they are made (check_vectors): the scores' against their references
 * s_refs = Q_blk [K_h^T e | K_h^T w] (one small GEMM per block on the caller's K_h sums; zeros past a causal block's
 * groups), the context's against the references its own GEMM produced,
 * each under the row rule of abft/tolerance.py (row_terms: the caller's per-group terms, evaluated per row here as
 * Bound.pair does). Out: per matrix and op the rows flagged, per op the worst ratio |d|/bound among the rows not
 * flagged (NaN if one is NaN), as records._worst_ratio makes it.
 * A fault list (tests: a hardware fault inside the kernel, emulated) is applied to AS after its GEMM and to CL after
 * its GEMM, before their sums: the checks see it as they would see a fault of the arithmetic itself.
 *
 * seconds[0], seconds[1]: the time spent in the scores' and the context's checksum passes (each a phase of its own per
 * block, so that the checks' share of the pass is measured, not estimated; the scores' phase also takes the max).
 *
 * Memory: the caller's work buffers, BQ x S for the block's scores and BQ x (D + 2) for its context; no allocation
 * here (lse holds a block's row maxima between its two row passes). NaN and INF
 * propagate: no finite-math flag (fused_pass.py's flags); exp is a polynomial with an explicit NaN path. Rows are
 * independent: a caller may split [0, N) between threads.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c99 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

/* exp(x) for x <= 0 (and NaN, -INF), vectorisable: 2^(x log2 e) split as 2^n 2^f, f in [-1/2, 1/2], 2^f by a
 * degree-6 polynomial (relative error 2e-9 in exact arithmetic, 1e-7 with fp32 Horner steps: about an ulp). Below
 * -87.3 the result is 0 (exp underflows fp32's normal range there); NaN stays NaN. */
static inline float exp_nonpos(float x) {
    const float lo = -87.3f;
    const float t = (x < lo ? lo : x) * 1.44269504088896341f;
    const float n = __builtin_rintf(t);
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t e = (int32_t)n + 127;
    e = e < 1 ? 1 : e; /* n >= -126 above the clamp; keeps the bit pattern a normal float */
    float s;
    const uint32_t bits = (uint32_t)e << 23;
    memcpy(&s, &bits, sizeof s);
    const float r = p * s;
    return x < lo ? 0.0f : (x != x ? x : r);
}

/* The bits of x mapped to a signed integer ordered as x is (-0 just below +0), every NaN with the sign bit clear
 * above +INF and every one with it set below -INF: an integer max over them vectorises where a float max does not
 * (gcc keeps a float max reduction scalar without -ffinite-math-only). */
static inline int32_t ordered_bits(float x) {
    int32_t b;
    memcpy(&b, &x, sizeof b);
    return b ^ ((b >> 31) & 0x7fffffff);
}

/* abft/tolerance.py's RowTerms, one op's: the row rule of a checksum group, per unit of the row's operand norm. */
typedef struct {
    const float *rigorous; /* N x g: sum over the group's columns of (column norm + floor) */
    const double *var;     /* N x g x 2 variance of (d1, d2) per unit (a + a_floor)^2; NULL: not calibrated */
    double a_floor, rig_coef, under, sq_coef1, sq_coef2, sq_pad, sigmas, off2, n;
} row_rule;

/* NaN if either is NaN (torch.minimum), else the smaller. */
static inline float min_nan(float a, float b) { return (a != a || b != b) ? NAN : (a < b ? a : b); }

/* tolerance._clamp: an undefined bound (NaN, +INF) reads NEAR_INF, so an extreme residual still flags. */
static inline float clamp_bound(float b) { return (b != b || b == INFINITY) ? 1e10f : b; }

/* The verification of `count` vectors (checksum.verify_direction with Bound.pair's rule, records._ratio): vector e
 * has operand norm a[e * a_step], its rule's group terms at index nh0 + e * t_step, its sums (s1, s2, sum of squares)
 * at sums + e * s_step and its reference (r1, r2) at refs + e * r_step. Adds the vectors flagged to *bad and takes the
 * worst ratio of the unflagged ones into *worst (NaN-sticky). No branch in the loop, so that it runs in vector lanes:
 * one such call per scores row (its groups) and one per block of context rows. */
static void check_vectors(const row_rule *rule, int64_t nh0, int64_t t_step, const float *a, int64_t a_step,
                          const float *sums, int64_t s_step, const float *refs, int64_t r_step, int64_t count,
                          int64_t *bad, float *worst) {
    const float floor = (float)rule->a_floor, coef = (float)rule->rig_coef, under = (float)rule->under;
    const float n = (float)rule->n;
    const double *var = rule->var;
    int64_t flagged = 0;
    int32_t nan = 0;
    float w = 0.0f;
    for (int64_t e = 0; e < count; e++) {
        const int64_t nh = nh0 + e * t_step;
        const float *sm = sums + e * s_step, *rf = refs + e * r_step;
        const float a_eff = a[e * a_step] + floor;
        float b1 = a_eff * rule->rigorous[nh] * coef + under;
        float b2 = b1 * n;
        if (var) {
            const double a2 = (double)a_eff * (double)a_eff, sqd = (double)sm[2] + rule->sq_pad;
            const float c1 = (float)(rule->sigmas * sqrt(a2 * var[2 * nh] + rule->sq_coef1 * sqd) + rule->under);
            const float c2 = (float)(rule->sigmas * sqrt(a2 * var[2 * nh + 1] + rule->sq_coef2 * sqd) + rule->off2);
            b1 = min_nan(b1, c1);
            b2 = min_nan(b2, c2);
        }
        b1 = clamp_bound(b1);
        b2 = clamp_bound(b2);
        const float d1 = fabsf(rf[0] - sm[0]), d2 = fabsf(rf[1] - sm[1]);
        const int32_t ok = (d1 <= b1) & (d2 <= b2); /* 0 for a NaN residual */
        const int32_t is_bad = !ok & (fabsf(rf[0]) <= 3.402823466e38f); /* a non-finite reference: not this op's */
        flagged += is_bad;
        const float x1 = d1 / (b1 > 1e-30f ? b1 : 1e-30f), x2 = d2 / (b2 > 1e-30f ? b2 : 1e-30f);
        const float ratio = x1 > x2 ? x1 : x2;
        nan |= !is_bad & ((x1 != x1) | (x2 != x2));
        const float r = is_bad ? 0.0f : ratio;
        w = r > w ? r : w;
    }
    *bad += flagged;
    if (nan || *worst != *worst)
        *worst = NAN;
    else if (w > *worst)
        *worst = w;
}

/* acc[0..3) += (sum x_j, sum (j+1) x_j, sum x_j^2) over j in [j0, j1): a checksum group's sums, weights 1 and 1..G. */
static inline void add_sums(const float *restrict x, int32_t j0, int32_t j1, float *restrict acc) {
    float s1 = acc[0], s2 = acc[1], sq = acc[2];
    /* 32-bit indices: their conversion to float is one instruction per vector (64-bit ones took three). */
    for (int32_t j = j0; j < j1; j++) {
        const float e = x[j];
        s1 += e;
        s2 += (float)(j + 1) * e;
        sq += e * e;
    }
    acc[0] = s1;
    acc[1] = s2;
    acc[2] = sq;
}

/* Row i's pass over its scores x[0..kend): per checksum group of G keys its sums (add_sums), and over the first
 * `live` keys their maximum, NaN if one is NaN (the softmax's max, of AS before scaling: scale > 0 keeps the order).
 * One read of the row for both (the live part's loop is add_sums' with the max beside it). */
static float sums_and_max(const float *restrict x, int64_t groups_done, int64_t G, int64_t live,
                          float *restrict sums) {
    int32_t m = ordered_bits(-INFINITY), nan = 0;
    for (int64_t h = 0; h < groups_done; h++) {
        const float *restrict g = x + h * G;
        const int64_t left = live - h * G;
        const int32_t lv = (int32_t)(left < 0 ? 0 : (left > G ? G : left));
        float s1 = 0.0f, s2 = 0.0f, sq = 0.0f;
        for (int32_t j = 0; j < lv; j++) {
            const float e = g[j];
            s1 += e;
            s2 += (float)(j + 1) * e;
            sq += e * e;
            const int32_t o = ordered_bits(e);
            m = o > m ? o : m;
            int32_t b;
            memcpy(&b, &e, sizeof b);
            nan |= (b & 0x7fffffff) > 0x7f800000;
        }
        float *acc = sums + 3 * h;
        acc[0] = s1;
        acc[1] = s2;
        acc[2] = sq;
        add_sums(g, lv, (int32_t)G, acc); /* the group's masked keys: in its checksums, not in the softmax */
    }
    if (nan) return NAN;
    const int32_t b = m ^ ((m >> 31) & 0x7fffffff);
    float r;
    memcpy(&r, &b, sizeof r);
    return r;
}

/* x[j] = exp(x[j] * scale - m) in place; returns their sum. */
static float exp_scaled(float *restrict x, int64_t n, float scale, float m) {
    for (int64_t j = 0; j < n; j++) x[j] = exp_nonpos(x[j] * scale - m);
    /* A loop of its own: gcc does not vectorise a sum of the select above (a conditional reduction). */
    float l = 0.0f;
    for (int64_t j = 0; j < n; j++) l += x[j];
    return l;
}

/* The softmax of a row under an additive mask: z_j = x[j] * scale + mask[j] in place, m = max z (NaN if one is),
 * x[j] = exp(z_j - m); returns their sum and m. A row with every key masked (m = -INF) gets P = 0 and sum 0. */
static float exp_masked(float *restrict x, int64_t n, float scale, const float *restrict mask, float *m_out) {
    int32_t mb = ordered_bits(-INFINITY), nan = 0;
    for (int64_t j = 0; j < n; j++) {
        const float z = x[j] * scale + mask[j];
        x[j] = z;
        const int32_t o = ordered_bits(z);
        mb = o > mb ? o : mb;
        int32_t b;
        memcpy(&b, &z, sizeof b);
        nan |= (b & 0x7fffffff) > 0x7f800000;
    }
    const int32_t b = mb ^ ((mb >> 31) & 0x7fffffff);
    float m;
    memcpy(&m, &b, sizeof m);
    if (nan) m = NAN;
    *m_out = m;
    if (m == -INFINITY) {
        for (int64_t j = 0; j < n; j++) x[j] = 0.0f;
        return 0.0f;
    }
    for (int64_t j = 0; j < n; j++) x[j] = exp_nonpos(x[j] - m);
    float l = 0.0f;
    for (int64_t j = 0; j < n; j++) l += x[j];
    return l;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void apply_faults(int64_t op, int64_t n, int64_t r0, int64_t r1, int64_t c1, float *tile, int64_t ld,
                         const int64_t *where, const float *value, int64_t count) {
    for (int64_t f = 0; f < count; f++) {
        const int64_t *w = where + 4 * f;
        if (w[0] == op && w[1] == n && w[2] >= r0 && w[2] < r1 && w[3] >= 0 && w[3] < c1)
            tile[(w[2] - r0) * ld + w[3]] = value[f];
    }
}

int64_t attnchecker_fused_attention(void *sgemm, int64_t N, int64_t T, int64_t S, int64_t D, const float *q,
                                    const float *k, const float *va, float scale, int64_t causal, int64_t BQ,
                                    int64_t G, float *work, float *oa, float *out, float *lse, float *p_sum,
                                    float *s_sums, float *c_sums, const int64_t *fault_at, const float *fault_value,
                                    int64_t n_faults, double *seconds, const float *kbar, const float *q_norm,
                                    const row_rule *rules, float *s_refs, int64_t *bad, float *worst,
                                    const float *mask, int64_t heads, int64_t m_sb, int64_t m_sh, int64_t m_st,
                                    int64_t n_base) {
    const sgemm_fn gemm = (sgemm_fn)sgemm;
    const int64_t DA = D + 2, groups = S / G;
    if (BQ < 1 || G < 1 || S % G || BQ * S >= (int64_t)1 << 31 || D > (int64_t)1 << 20 || heads < 1
        || (mask && causal))
        return -1;
    const float one = 1.0f, zero = 0.0f;
    const row_rule *s_rule = rules, *c_rule = rules + 1;
    worst[0] = worst[1] = 0.0f;
    for (int64_t n = 0; n < N; n++) {
        const float *qn = q + n * T * D, *kn = k + n * S * D, *van = va + n * S * DA;
        int64_t *bad_n = bad + 2 * n;
        /* Matrix n of the call is (batch, head) = divmod(n_base + n, heads) of the mask's (broadcast) layout. */
        const float *mask_n = mask ? mask + ((n_base + n) / heads) * m_sb + ((n_base + n) % heads) * m_sh : 0;
        bad_n[0] = bad_n[1] = 0;
        /* The scores' row references, (T x 2g) row-major = Q_n (T x D) [K_h^T e | K_h^T w] (D x 2g, row-major): in
         * column-major terms (2g x T) = Kbar^T Q_n^T. One GEMM per matrix (per block, its calls cost more than its
         * flops at T = 256); a causal block then zeroes the groups it does not compute. */
        {
            const double t_ref = now();
            const int m = (int)(2 * groups), nn = (int)T, kk = (int)D, lda = (int)(2 * groups), ldb = (int)D,
                      ldc = (int)(2 * groups);
            gemm("N", "N", &m, &nn, &kk, &one, kbar + n * D * 2 * groups, &lda, qn, &ldb, &zero,
                 s_refs + n * T * 2 * groups, &ldc);
            seconds[0] += now() - t_ref;
        }
        for (int64_t r0 = 0; r0 < T; r0 += BQ) {
            const int64_t r1 = r0 + BQ < T ? r0 + BQ : T, rows = r1 - r0;
            int64_t kend = S;
            if (causal) {
                const int64_t last = r1 - 1 < S - 1 ? r1 - 1 : S - 1; /* the block's last unmasked key */
                kend = (last / G + 1) * G;
            } else if (mask_n) {
                /* The same for a mask: keys past the block's last key that some row keeps (a causal mask folded
                 * into the mask, as transformers does for a padded batch, or trailing padding) are masked for every
                 * row, so the GEMMs stop at the end of its group. At least one group (BLAS sizes of 0 are not
                 * portable); a block with every key masked then computes that group and masks it all. */
                int64_t last = -1;
                for (int64_t i = r0; i < r1; i++) {
                    const float *mr = mask_n + i * m_st;
                    int64_t j = S - 1;
                    while (j > last && mr[j] == -INFINITY) j--;
                    last = j > last ? j : last;
                }
                kend = ((last < 0 ? 0 : last / G) + 1) * G;
            }
            const int64_t done = kend / G; /* groups computed */
            /* Keys the block's softmax can reach: the second GEMM stops there (P is 0 beyond: causal, or masked). */
            const int64_t pend = causal && r1 < kend ? r1 : kend;
            /* AS (rows x kend, row-major, ld kend) = Q_blk K^T: column-major (kend x rows) = K (kend x D) Q^T. */
            {
                const int m = (int)kend, nn = (int)rows, kk = (int)D, lda = (int)D, ldb = (int)D, ldc = (int)kend;
                gemm("T", "N", &m, &nn, &kk, &one, kn, &lda, qn + r0 * D, &ldb, &zero, work, &ldc);
            }
            if (n_faults) apply_faults(0, n, r0, r1, kend, work, kend, fault_at, fault_value, n_faults);
            /* The checks' sums ride in the softmax's max pass: the pass is timed as the checks' (the max is one
             * compare a key beside three multiply-adds). The row maxima wait in lse. */
            double t0 = now();
            float *refs = s_refs + (n * T + r0) * 2 * groups;
            for (int64_t i = r0; i < r1; i++) {
                const float *row = work + (i - r0) * kend;
                float *sums = s_sums + (n * T + i) * groups * 3;
                const int64_t live = causal ? (i + 1 < kend ? i + 1 : kend) : kend;
                lse[n * T + i] = sums_and_max(row, done, G, live, sums);
                /* Groups past the block's last key are zero on both sides: nothing to verify. */
                float *ref = refs + (i - r0) * 2 * groups;
                for (int64_t h = done; h < groups; h++) {
                    sums[3 * h] = sums[3 * h + 1] = sums[3 * h + 2] = 0.0f;
                    ref[2 * h] = ref[2 * h + 1] = 0.0f;
                }
                check_vectors(s_rule, n * groups, 1, q_norm + n * T + i, 0, sums, 3, ref, 2, done, bad_n, worst);
            }
            seconds[0] += now() - t0;
            for (int64_t i = r0; i < r1; i++) {
                float *row = work + (i - r0) * kend;
                /* Keys past the row (causal) do not take part in the softmax. */
                const int64_t live = causal ? (i + 1 < kend ? i + 1 : kend) : kend;
                if (mask_n) {
                    /* The max of the masked scores, not of AS: taken here, in the pass that adds the mask. A row
                     * with every key masked: out 0 and lse +INF, as abft.tiled.finish (SDPA's safe softmax). */
                    float m;
                    const float l = exp_masked(row, kend, scale, mask_n + i * m_st, &m);
                    lse[n * T + i] = l == 0.0f ? INFINITY : m + logf(l);
                    p_sum[n * T + i] = l;
                    continue;
                }
                const float m = lse[n * T + i] * scale;
                const float l = exp_scaled(row, live, scale, m);
                for (int64_t j = live; j < pend; j++) row[j] = 0.0f;
                lse[n * T + i] = m + logf(l);
                p_sum[n * T + i] = l;
            }
            /* OA (rows x DA, row-major) = P (rows x pend) VA[0:pend]: column-major (DA x rows) = VA^T P^T. */
            {
                const int m = (int)DA, nn = (int)rows, kk = (int)pend, lda = (int)DA, ldb = (int)kend, ldc = (int)DA;
                gemm("N", "N", &m, &nn, &kk, &one, van, &lda, work, &ldb, &zero, oa, &ldc);
            }
            if (n_faults) apply_faults(1, n, r0, r1, D, oa, DA, fault_at, fault_value, n_faults);
            t0 = now();
            float *p_norm = work; /* the context rows' operand norms, where the block's P is no longer needed */
            for (int64_t i = r0; i < r1; i++) {
                const float *o = oa + (i - r0) * DA;
                float *cs = c_sums + (n * T + i) * 5;
                cs[0] = cs[1] = cs[2] = 0.0f;
                add_sums(o, 0, (int32_t)D, cs);
                cs[3] = o[D];
                cs[4] = o[D + 1];
                /* The row's norm bound: 0 <= P <= 1, so ||P_i||_2 <= sqrt(sum_j P_ij) (1.01: its rounding). */
                p_norm[i - r0] = sqrtf(p_sum[n * T + i]) * 1.01f;
            }
            check_vectors(c_rule, n, 0, p_norm, 1, c_sums + (n * T + r0) * 5, 5, c_sums + (n * T + r0) * 5 + 3, 5,
                          rows, bad_n + 1, worst + 1);
            seconds[1] += now() - t0;
            for (int64_t i = r0; i < r1; i++) {
                const float *o = oa + (i - r0) * DA;
                const float l = p_sum[n * T + i];
                const float inv = l != 0.0f ? 1.0f / l : 0.0f; /* 0: every key masked; NaN stays NaN */
                float *dst = out + (n * T + i) * D;
                for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
            }
        }
    }
    return 0;
}
