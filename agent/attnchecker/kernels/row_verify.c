/* The clean check's verdict on a product's rows, for fp32 products checked by rows (attnchecker/row_verify.py says
 * when): the row rule of tolerance.direction_bounds evaluated per row vector and compared with the residuals, in one
 * call, instead of some fifty small tensor ops per check in Python.
 *
 * Vectors: nb matrices of `rows` rows, each row split into `groups` checksum groups; vector v = i * groups + h
 * (abft/checksum.py's grouped layout). Per vector: ref, got (v, 2) the reference and the computed checksums (weights
 * ones and 1..n), sq the sum of squares of the vector's n elements, and where the random-walk model runs, mom (v, 4)
 * its second moments. Per row: a = ||A_i||_2, amax = ||A_i||_inf. Per group h, what the rule takes from the other
 * operand: b = ||B_j|| over its n columns, bias |b_j|, b_ref = ||B w|| and, for the random-walk model, bmax =
 * ||B_j||_inf and b_refmax = ||B w||_inf (each optional but b); the scalars in `s` (S_*, tolerance.RowRule).
 *
 * Out, per vector: diff = ref - got, bound and bound2 the tolerances on |d1| and |d2|, bad = the vector is flagged;
 * and over all of them, worst = the largest residual/bound ratio of the vectors not flagged (records._ratio, NaN if
 * one is), any_bad = whether one is flagged: what the clean path reads of a check, without a tensor op of its own.
 * Every formula below is one of tolerance.py's (Bound.pair, _calibrated_var, direction_bounds), in the same order:
 * the tests hold the two to the same verdicts (tests/agent/test_row_verify.py). The rigorous part is fp32, as there;
 * the variances are double, as there. Plain C99; NaN and INF propagate (no finite-math flag is ever set).
 */
#include <math.h>
#include <stdint.h>

/* The scalars (tolerance.RowRule.scalars). */
enum {
    S_FLOOR,      /* added to each norm: its underflow floor */
    S_RIG_COEF,   /* the rigorous part per unit of a * sum_j ||B_j|| */
    S_BIAS_COEF,  /* the rigorous part per unit of sum_j |b_j| */
    S_UNDER,      /* underflow slack, added to both parts of d1 */
    S_CALIBRATED, /* 0: the rigorous part alone */
    S_WALK,       /* 1: the random-walk model (amax, and mom where given) */
    S_SIGMAS,
    S_SQ_COEF,    /* variance of d1 per unit of the vector's sum of squares (d2: times n^2) */
    S_N,          /* elements per vector */
    S_K,          /* the reduction length */
    S_U2,         /* u^2 / 3 */
    S_DRIFT,      /* variance per unit of reference^2 (walk) */
    S_WALK_PROD,  /* RANDOM_WALK k u^2/3 + u^2/3: per unit of the product's second moment */
    S_WALK_REF,   /* RANDOM_WALK k u^2/3: per unit of the reference's */
    S_TINY,       /* FLT_MIN */
    S_RANDOM_WALK,
    S_DRIFT_SHARE,
    S_NEAR_INF,
    S_COUNT
};

/* torch.minimum: NaN if either is. */
static inline double min_nan(double x, double y) { return (x != x || y != y) ? NAN : (x < y ? x : y); }
static inline float min_nanf(float x, float y) { return (x != x || y != y) ? NAN : (x < y ? x : y); }

/* tolerance._clamp: NaN and +INF read NEAR_INF. */
static inline float clamp(float b, float near_inf) { return (b != b || b == INFINITY) ? near_inf : b; }

/* nan_to_num(nan=0, posinf=0, neginf=0), as Bound._drift reads a reference. */
static inline double finite_or_zero(double x) { return isfinite(x) ? x : 0.0; }

/* Per group, made from the other operand's column norms at the start of a call (group_terms). */
enum {
    C_BSQ = 0,      /* sum_j w_j^2 ||B_j||^2, for w = ones and 1..n */
    C_BMAX = 2,     /* sum_j w_j^2 ||B_j||_inf^2 */
    C_REF_SQ = 4,   /* ||B w||^2 */
    C_REF_MAX = 6,  /* ||B w||_inf^2 (the smaller of its bounds) */
    C_FLOOR = 8,    /* 4: what fp32 squares below FLT_MIN can drop from the moments */
    C_BIAS = 12,    /* the bias's share of the reference's variance */
    C_PLAIN = 14,   /* Cauchy-Schwarz model: the variance per unit of a^2 */
    C_RIG = 16,     /* sum_j ||B_j|| (floored) */
    C_RIG_BIAS = 17, /* the bias's rigorous term */
    C_COUNT = 18
};

/* One group's terms from its n columns (direction_bounds and _calibrated_var: the sums over j there). b: ||B_j||
 * (fp32, not floored); bias: |b_j| or NULL; ref, refmax: ||B w||, ||B w||_inf (2 each) or NULL; bmax: ||B_j||_inf or
 * NULL (walk). Sums in double (the eager rule sums fp32 norms in fp32 for the rigorous part: an ulp or two apart). */
static void group_terms(const double *s, int64_t n, const float *b, const float *bias, const float *ref,
                        const float *bmax, const float *refmax, double *c) {
    const float floor_b = (float)s[S_FLOOR];
    const int walk = s[S_WALK] != 0.0;
    double sum = 0.0, wsum = 0.0, sq = 0.0, wsq = 0.0, msum = 0.0, mwsum = 0.0, msq = 0.0, mwsq = 0.0;
    double babs = 0.0, bsq = 0.0, bwsq = 0.0;
    for (int64_t j = 0; j < n; j++) {
        const double w = (double)(j + 1), bj = (double)(b[j] + floor_b);
        sum += bj;
        wsum += w * bj;
        sq += bj * bj;
        wsq += w * w * bj * bj;
        if (walk) {
            const double m = bmax ? (double)bmax[j] : bj;
            msum += m;
            mwsum += w * m;
            msq += m * m;
            mwsq += w * w * m * m;
        }
        if (bias) {
            const double a = (double)bias[j];
            babs += a;
            bsq += a * a;
            bwsq += w * w * a * a;
        }
    }
    const double k = s[S_K], u2 = s[S_U2], nn = (double)n;
    c[C_RIG] = sum;
    c[C_RIG_BIAS] = bias ? s[S_BIAS_COEF] * babs : 0.0;
    c[C_BSQ] = sq;
    c[C_BSQ + 1] = wsq;
    for (int w = 0; w < 2; w++) {
        const double r = ref ? (double)(ref[w] + floor_b) : (w == 0 ? sum : wsum);
        c[C_REF_SQ + w] = r * r;
        c[C_BIAS + w] = bias ? (nn * u2) * (w == 0 ? bsq : bwsq) : 0.0;
        c[C_PLAIN + w] = c[C_BSQ + w] * (k * u2 + nn * u2) + c[C_REF_SQ + w] * (k * u2);
        c[C_BMAX + w] = w == 0 ? msq : mwsq;
        const double ms = w == 0 ? msum : mwsum;
        double rm = min_nan(ms * ms, c[C_REF_SQ + w]);
        if (refmax) rm = min_nan((double)refmax[w] * (double)refmax[w], rm);
        c[C_REF_MAX + w] = rm;
        c[C_FLOOR + w] = s[S_TINY] * (c[C_BSQ + w] + k);
        c[C_FLOOR + 2 + w] = s[S_TINY] * (c[C_REF_SQ + w] + k);
    }
}

/* The modelled variance of (d1, d2) of one vector (tolerance._calibrated_var and the bias term of direction_bounds). */
static void variance(const double *s, const double *c, double a2, double am2, const float *mom, double *var) {
    const double nu2 = s[S_N] * s[S_U2];
    for (int w = 0; w < 2; w++) {
        if (s[S_WALK] == 0.0) {
            var[w] = a2 * c[C_PLAIN + w] + c[C_BIAS + w];
            continue;
        }
        double holder = min_nan(a2 * c[C_BMAX + w], am2 * c[C_BSQ + w]);
        double ref = min_nan(a2 * c[C_REF_MAX + w], am2 * c[C_REF_SQ + w]);
        double forming = a2 * ((s[S_RANDOM_WALK] * c[C_BMAX + w] + s[S_DRIFT_SHARE] * c[C_REF_MAX + w]) * nu2);
        if (mom) {
            /* The exact moments (1.01 covers the skinny GEMM's rounding), floored by what fp32 flushed; per unit a^2,
             * the flushed squares of B weigh sum_j w_j^2 (n, or sum_j j^2), those of B w one. */
            const double n = s[S_N], per_a = w == 0 ? n : n * (n + 1.0) * (2.0 * n + 1.0) / 6.0;
            const double m = 1.01 * (double)mom[w] + c[C_FLOOR + w] + s[S_TINY] * a2 * per_a;
            const double mr = 1.01 * (double)mom[2 + w] + c[C_FLOOR + 2 + w] + s[S_TINY] * a2;
            holder = min_nan(holder, m);
            ref = min_nan(ref, mr);
            forming = min_nan(forming, (s[S_RANDOM_WALK] * m + s[S_DRIFT_SHARE] * mr) * nu2);
        }
        var[w] = holder * s[S_WALK_PROD] + ref * s[S_WALK_REF] + forming + c[C_BIAS + w];
    }
}

/* terms: groups x C_COUNT doubles of scratch for the group terms. */
void attnchecker_verify_rows(int64_t nb, int64_t rows, int64_t groups, const float *ref, const float *got,
                             const float *sq, const float *a, const float *amax, const float *mom, const float *b,
                             const float *bias, const float *b_ref, const float *bmax, const float *b_refmax,
                             const double *s, double *terms, float *diff, float *bound, float *bound2, uint8_t *bad,
                             float *worst, uint8_t *any_bad) {
    const int64_t n = (int64_t)s[S_N];
    for (int64_t h = 0; h < groups; h++)
        group_terms(s, n, b + h * n, bias ? bias + h * n : 0, b_ref ? b_ref + 2 * h : 0, bmax ? bmax + h * n : 0,
                    b_refmax ? b_refmax + 2 * h : 0, terms + C_COUNT * h);
    const float floor_a = (float)s[S_FLOOR], rig_coef = (float)s[S_RIG_COEF], under = (float)s[S_UNDER];
    const float near_inf = (float)s[S_NEAR_INF];
    const double off2 = s[S_UNDER] * ((double)(n + 1) / 2.0);
    float top = 0.0f;
    int top_nan = 0, flagged = 0;
    for (int64_t bi = 0; bi < nb; bi++)
        for (int64_t i = 0; i < rows; i++) {
            const int64_t r = bi * rows + i;
            const float af = a[r] + floor_a;
            const double a2 = (double)af * (double)af;
            const double am = amax ? (double)amax[r] : (double)af;
            for (int64_t h = 0; h < groups; h++) {
                const int64_t v = r * groups + h;
                const double *c = terms + C_COUNT * h;
                /* direction_bounds' rigorous part: a' sum_j ||B_j||' times its coefficient, the bias's, the slack */
                const float rig1 = (af * (float)c[C_RIG]) * rig_coef + (float)c[C_RIG_BIAS] + under;
                const float rig2 = rig1 * (float)n;
                float b1 = rig1, b2 = rig2;
                if (s[S_CALIBRATED] != 0.0) {
                    double var[2];
                    variance(s, c, a2, am * am, mom ? mom + 4 * v : 0, var);
                    const double sqv = (double)sq[v] + (double)n * s[S_TINY];
                    double var1 = var[0] + s[S_SQ_COEF] * sqv;
                    double var2 = var[1] + s[S_SQ_COEF] * (double)n * (double)n * sqv;
                    if (s[S_DRIFT] != 0.0) {
                        const double r1 = finite_or_zero((double)ref[2 * v]), r2 = finite_or_zero((double)ref[2 * v + 1]);
                        var1 += r1 * r1 * s[S_DRIFT];
                        var2 += r2 * r2 * s[S_DRIFT];
                    }
                    const double cal1 = s[S_SIGMAS] * sqrt(var1) + s[S_UNDER];
                    const double cal2 = s[S_SIGMAS] * sqrt(var2) + off2;
                    b1 = min_nanf(rig1, (float)cal1);
                    b2 = min_nanf(rig2, (float)cal2);
                }
                b1 = clamp(b1, near_inf);
                b2 = clamp(b2, near_inf);
                const float d1 = ref[2 * v] - got[2 * v], d2 = ref[2 * v + 1] - got[2 * v + 1];
                diff[2 * v] = d1;
                diff[2 * v + 1] = d2;
                bound[v] = b1;
                bound2[v] = b2;
                /* `<=` is False for NaN: a NaN residual flags. A non-finite reference never does (an upstream fault). */
                const int ok = fabsf(d1) <= b1 && fabsf(d2) <= b2;
                bad[v] = (uint8_t)(isfinite(ref[2 * v]) && !ok);
                if (bad[v]) {
                    flagged = 1;
                } else {
                    /* records._ratio: |d| / bound.clamp_min(1e-30) in fp32, the larger of d1's and d2's */
                    const float r1 = fabsf(d1) / (b1 > 1e-30f ? b1 : 1e-30f);
                    const float r2 = fabsf(d2) / (b2 > 1e-30f ? b2 : 1e-30f);
                    if (r1 != r1 || r2 != r2)
                        top_nan = 1;
                    else if (r1 > top || r2 > top)
                        top = r1 > r2 ? r1 : r2;
                }
            }
        }
    *worst = top_nan ? NAN : top;
    *any_bad = (uint8_t)flagged;
}
