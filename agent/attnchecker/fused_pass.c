/* One pass over an fp32 matrix for the checksum fast path (attnchecker/abft/fused_pass.py says when it is used).
 *
 * For each of nb matrices X (rows x cols, row-major, row stride ld, batch stride sx), in a single read of X:
 *   xr  = X R      (rows x nr)  R given transposed: nr rows of length cols, row stride cols, batch stride sr
 *   lx  = L^T X    (nl x cols)  L given transposed: nl rows of length rows, row stride rows, batch stride sl
 *   rsq = sum_k X_rk^2 (rows)
 *   csq = sum_r X_rk^2 (cols)
 * Outputs are dense, batch after batch; a NULL output is not computed (its inputs are then ignored).
 *
 * Each row of X is read from memory once; the loops after the first one over a row find it in L1. Sums over a row
 * are reassociated into vector lanes by the compiler (-fassociative-math): the order a BLAS GEMV uses too. NaN and
 * INF propagate as in any sum: no finite-math flag is ever set.
 */
#include <stdint.h>
#include <string.h>

/* Lanes per accumulator: independent sums the compiler keeps in vector registers (two AVX2 registers, one AVX-512),
 * so a row's sums are not one long dependent chain of adds. */
#define LANES 16

static float lane_total(const float *lanes) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += lanes[l];
    return s;
}

/* out[j] = x . r_j for j < nr, and (sq) out[nr] = x . x: one loop over x for nr <= 2, the checksum pair. */
static void row_sums(const float *restrict x, const float *restrict r, int64_t nr, int64_t n, int sq,
                     float *restrict out) {
    const int64_t sq_at = nr;
    if (nr > 2) {
        for (int64_t j = 0; j < nr; j++) {
            float acc[LANES] = {0};
            int64_t k = 0;
            for (; k + LANES <= n; k += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += x[k + l] * r[j * n + k + l];
            float t = lane_total(acc);
            for (; k < n; k++) t += x[k] * r[j * n + k];
            out[j] = t;
        }
        nr = 0;
    }
    const float *r0 = nr > 0 ? r : x, *r1 = nr > 1 ? r + n : x;
    float a0[LANES] = {0}, a1[LANES] = {0}, a2[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = x[k + l];
            a0[l] += v * r0[k + l];
            a1[l] += v * r1[k + l];
            a2[l] += v * v;
        }
    float t0 = lane_total(a0), t1 = lane_total(a1), t2 = lane_total(a2);
    for (; k < n; k++) {
        t0 += x[k] * r0[k];
        t1 += x[k] * r1[k];
        t2 += x[k] * x[k];
    }
    if (nr > 0) out[0] = t0;
    if (nr > 1) out[1] = t1;
    if (sq) out[sq_at] = t2;
}

/* y_j += c_j x for j < nl (y_j = y + j n), and (sq) s += x∘x: one loop over x for nl <= 2. */
static void col_sums(const float *restrict x, const float *restrict c, int64_t nl, int64_t n, float *restrict y,
                     float *restrict s) {
    if (nl > 2) {
        for (int64_t j = 0; j < nl; j++)
            for (int64_t k = 0; k < n; k++) y[j * n + k] += c[j] * x[k];
        nl = 0;
    }
    if (nl == 2 && s) {
        for (int64_t k = 0; k < n; k++) {
            float v = x[k];
            y[k] += c[0] * v;
            y[n + k] += c[1] * v;
            s[k] += v * v;
        }
        return;
    }
    for (int64_t j = 0; j < nl; j++)
        for (int64_t k = 0; k < n; k++) y[j * n + k] += c[j] * x[k];
    if (s)
        for (int64_t k = 0; k < n; k++) s[k] += x[k] * x[k];
}

void attnchecker_fused_pass(int64_t nb, int64_t rows, int64_t cols, const float *x, int64_t ld, int64_t sx,
                            const float *r, int64_t nr, int64_t sr, const float *l, int64_t nl, int64_t sl,
                            float *xr, float *lx, float *rsq, float *csq) {
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * sx;
        const float *rb = r ? r + b * sr : 0;
        const float *lb = l ? l + b * sl : 0;
        float *xrb = xr ? xr + b * rows * nr : 0;
        float *lxb = lx ? lx + b * nl * cols : 0;
        float *rsqb = rsq ? rsq + b * rows : 0;
        float *csqb = csq ? csq + b * cols : 0;
        int64_t nr_b = xrb ? nr : 0, nl_b = lxb ? nl : 0;
        if (lxb) memset(lxb, 0, (size_t)(nl * cols) * sizeof(float));
        if (csqb) memset(csqb, 0, (size_t)cols * sizeof(float));
        for (int64_t i = 0; i < rows; i++) {
            const float *row = xb + i * ld;
            if (nr_b || rsqb) {
                float out[9];
                row_sums(row, rb, nr_b, cols, rsqb != 0, out);
                for (int64_t j = 0; j < nr_b; j++) xrb[i * nr + j] = out[j];
                if (rsqb) rsqb[i] = out[nr_b];
            }
            if (nl_b || csqb) {
                float c[8];
                for (int64_t j = 0; j < nl_b; j++) c[j] = lb[j * rows + i];
                col_sums(row, c, nl_b, cols, lxb, csqb);
            }
        }
    }
}
