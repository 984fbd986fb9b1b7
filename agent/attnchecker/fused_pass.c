/* One pass over an fp32 matrix for the checksum fast path (attnchecker/fused_pass.py says when it is used).
 *
 * For each of nb matrices X (rows x cols, row-major, row stride ld, batch stride sx), whose rows are split into
 * `groups` segments of seg = cols / groups consecutive elements, in a single read of X:
 *   xr   (rows x groups x nr)   xr[i][h][j]  = sum_k X[i][h*seg + k] * R[j][k]        R: nr rows of length seg
 *   xr2  (rows x groups x nr2)  xr2[i][h][j] = sum_k X[i][h*seg + k]^2 * R2[j][k]     R2: nr2 rows of length seg
 *   lx   (nl x cols)            lx[j][k]     = sum_i L[j][i] * X[i][k]                L: nl rows of length rows
 *   lx2  (nl2 x cols)           lx2[j][k]    = sum_i L2[j][i] * X[i][k]^2             L2: nl2 rows of length rows
 *   rsq  (rows x groups)        sum of squares of each row segment
 *   csq  (cols)                 sum of squares of each column
 *   rmax (rows), cmax (cols)    max |X| of each row, each column (NaN if the row or column holds one)
 * Factors have a batch stride of their own (0: shared by the batch); outputs are dense, batch after batch. A NULL
 * output is not computed (its factor is then ignored).
 *
 * Each row of X is read from memory once; the loops after the first one over a row find it in L1. Sums over a row
 * run in LANES independent partial sums (the order a vectorised BLAS GEMV uses too). NaN and INF propagate as in any
 * sum and max: no finite-math flag is ever set.
 */
#include <math.h>
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

static float dot(const float *restrict x, const float *restrict y, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[k + l] * y[k + l];
    float t = lane_total(acc);
    for (; k < n; k++) t += x[k] * y[k];
    return t;
}

static float dot_sq(const float *restrict x, const float *restrict y, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[k + l] * x[k + l] * y[k + l];
    float t = lane_total(acc);
    for (; k < n; k++) t += x[k] * x[k] * y[k];
    return t;
}

/* x . r0, x . r1 and x . x in one loop: the checksum pair and the square sum of a row (segment). */
static void pair_and_square(const float *restrict x, const float *restrict r0, const float *restrict r1, int64_t n,
                            float *restrict out) {
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
    out[0] = t0;
    out[1] = t1;
    out[2] = t2;
}

/* max |x| with NaN kept: fmaxf would drop it. */
static float abs_max(const float *restrict x, int64_t n) {
    float m[LANES] = {0};
    int nan = 0;
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = fabsf(x[k + l]);
            m[l] = v > m[l] ? v : m[l];
            nan |= v != v;
        }
    float t = 0.0f;
    for (int l = 0; l < LANES; l++) t = m[l] > t ? m[l] : t;
    for (; k < n; k++) {
        float v = fabsf(x[k]);
        t = v > t ? v : t;
        nan |= v != v;
    }
    return nan ? NAN : t;
}

static void col_update(const float *restrict x, const float *restrict l, int64_t nl, const float *restrict l2,
                       int64_t nl2, int64_t n, float *restrict y, float *restrict y2, float *restrict s,
                       float *restrict m) {
    for (int64_t j = 0; j < nl; j++) {
        const float c = l[j];
        float *restrict yj = y + j * n;
        for (int64_t k = 0; k < n; k++) yj[k] += c * x[k];
    }
    for (int64_t j = 0; j < nl2; j++) {
        const float c = l2[j];
        float *restrict yj = y2 + j * n;
        for (int64_t k = 0; k < n; k++) yj[k] += c * x[k] * x[k];
    }
    if (s)
        for (int64_t k = 0; k < n; k++) s[k] += x[k] * x[k];
    if (m)
        for (int64_t k = 0; k < n; k++) {
            /* NaN sticks: a NaN maximum stays, a NaN element becomes it. */
            float v = fabsf(x[k]), cur = m[k];
            m[k] = cur != cur ? cur : (v > cur || v != v) ? v : cur;
        }
}

void attnchecker_fused_pass(int64_t nb, int64_t rows, int64_t cols, const float *x, int64_t ld, int64_t sx,
                            int64_t groups, const float *r, int64_t nr, int64_t sr, const float *r2, int64_t nr2,
                            int64_t sr2, const float *l, int64_t nl, int64_t sl, const float *l2, int64_t nl2,
                            int64_t sl2, float *xr, float *xr2, float *lx, float *lx2, float *rsq, float *csq,
                            float *rmax, float *cmax) {
    const int64_t seg = cols / groups;
    if (!xr) nr = 0;
    if (!xr2) nr2 = 0;
    if (!lx) nl = 0;
    if (!lx2) nl2 = 0;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * sx;
        const float *rb = nr ? r + b * sr : 0, *r2b = nr2 ? r2 + b * sr2 : 0;
        const float *lb = nl ? l + b * sl : 0, *l2b = nl2 ? l2 + b * sl2 : 0;
        float *xrb = nr ? xr + b * rows * groups * nr : 0, *xr2b = nr2 ? xr2 + b * rows * groups * nr2 : 0;
        float *lxb = nl ? lx + b * nl * cols : 0, *lx2b = nl2 ? lx2 + b * nl2 * cols : 0;
        float *rsqb = rsq ? rsq + b * rows * groups : 0, *csqb = csq ? csq + b * cols : 0;
        float *rmaxb = rmax ? rmax + b * rows : 0, *cmaxb = cmax ? cmax + b * cols : 0;
        if (lxb) memset(lxb, 0, (size_t)(nl * cols) * sizeof(float));
        if (lx2b) memset(lx2b, 0, (size_t)(nl2 * cols) * sizeof(float));
        if (csqb) memset(csqb, 0, (size_t)cols * sizeof(float));
        if (cmaxb) memset(cmaxb, 0, (size_t)cols * sizeof(float));
        for (int64_t i = 0; i < rows; i++) {
            const float *row = xb + i * ld;
            for (int64_t h = 0; h < groups; h++) {
                const float *part = row + h * seg;
                int64_t j = 0;
                if (nr >= 2) {
                    /* The checksum pair and the segment's square sum together. */
                    float out[3];
                    pair_and_square(part, rb, rb + seg, seg, out);
                    xrb[(i * groups + h) * nr] = out[0];
                    xrb[(i * groups + h) * nr + 1] = out[1];
                    if (rsqb) rsqb[i * groups + h] = out[2];
                    j = 2;
                } else if (rsqb) {
                    rsqb[i * groups + h] = dot(part, part, seg);
                }
                for (; j < nr; j++) xrb[(i * groups + h) * nr + j] = dot(part, rb + j * seg, seg);
                for (int64_t j2 = 0; j2 < nr2; j2++)
                    xr2b[(i * groups + h) * nr2 + j2] = dot_sq(part, r2b + j2 * seg, seg);
            }
            if (rmaxb) rmaxb[i] = abs_max(row, cols);
            if (nl || nl2 || csqb || cmaxb) {
                float c[64], c2[64];
                for (int64_t j = 0; j < nl; j++) c[j] = lb[j * rows + i];
                for (int64_t j = 0; j < nl2; j++) c2[j] = l2b[j * rows + i];
                col_update(row, c, nl, c2, nl2, cols, lxb, lx2b, csqb, cmaxb);
            }
        }
    }
}
