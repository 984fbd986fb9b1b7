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
 *   cp   (nb x rows x wc)        each row of X copied into a wider row (wc >= cols), the rest of it zeroed: the
 *                               checksum-encoded operands of attention/backward/encoded.py, written while the row is
 *                               in cache. Matrix b of the batch goes to cp + (b / cin) cso + (b % cin) csi, rows ldc
 *                               apart: a (B, T, H, wc) buffer read as (B, H, T, wc) is two batch strides, not one.
 * Factors have a batch stride of their own (0: shared by the batch); outputs are dense, batch after batch. A NULL
 * output is not computed (its factor is then ignored).
 *
 * Each row of X is read from memory once; the loops after the first one over a row find it in cache (L1, or L2 for
 * the column update of RB wide rows). There, the work is bound by the latency of dependent adds and by loads, not by
 * memory, so it is laid out for independent sums and few loads: a row segment's sums are taken up to CHAINS at a time
 * in one loop, each chunk of x (and its square) loaded once for all of them, each sum a reduction that the compiler
 * keeps in a vector register of its own; the column outputs are updated from RB rows at a time, so that each is
 * loaded and stored once per RB rows instead of once a row. Sums thus run in vector lanes (the order a vectorised
 * BLAS uses too), not left to right: -fassociative-math is what lets the compiler vectorise them. NaN and INF
 * propagate as in any sum: no finite-math flag is ever set. Maxima compare the bits of |x| as unsigned integers,
 * which are ordered as |x| is, with every NaN above INF: a NaN wins and then stays with no test of its own, and the
 * max vectorises as an integer max. Built with its multiply-adds fused (build.py): one rounding instead of two,
 * which the bounds' model of a sum's rounding covers. Plain C99, vectorised by the compiler for whatever -march gives
 * it (AVX-512, AVX2 and SSE2 alike).
 */
#include <stdint.h>
#include <string.h>

/* Most weighted sums a block takes (a square sum may join them): each in a register of its own, beside x, x*x and a
 * chunk of a weight, within the 16 vector registers of AVX2 and SSE (AVX-512 has 32); 8 independent adds hide an
 * add's latency (3-4 cycles). A lone sum is not split into several chains: on row segments of a few hundred floats
 * the extra reductions at the end cost more than the latency they would hide (measured). */
#define CHAINS 8
/* Rows of X per column update: RB multiply-adds per load and store of a column output (8 against 4: the column
 * update of a 1024 x 2048 pass with two left factors and the column squares 9-14 % faster). */
#define RB 8
/* Columns per tile of a column update: RB rows of a tile and the outputs' tiles stay in L1 across the outputs. */
#define TILE 512

/* BLOCK: inlined with constant shapes (K, P, SQ, R), so that the compiler unrolls the sums into registers. OUTLINE:
 * kept out of the caller, in whose register allocation gcc otherwise reloaded the chunk of x for each product
 * (measured 10-25 % slower on short blocks). */
#if defined(__GNUC__)
#define BLOCK static inline __attribute__((always_inline))
#define OUTLINE static __attribute__((noinline))
#else
#define BLOCK static inline
#define OUTLINE static
#endif

/* Sums over a row segment x[0..n): t[j] = sum_k v_k * w[j*n + k] for j < K, v = x (P = 1) or x*x (P = 2), and
 * where SQ, *sq = sum_k x_k^2. Written as a loop of K (+ SQ) scalar sums, which the compiler vectorises as that many
 * reductions, each in a vector register of its own: independent chains, each chunk of x loaded once for all. */
BLOCK void block_sums(const float *restrict x, int64_t n, const float *restrict w, const int K, const int P,
                      const int SQ, float *restrict t, float *restrict sq) {
    float s[CHAINS], q = 0.0f;
    for (int j = 0; j < K; j++) s[j] = 0.0f;
    for (int64_t k = 0; k < n; k++) {
        const float e = x[k], v = P == 2 ? e * e : e;
        if (SQ) q += e * e;
        for (int j = 0; j < K; j++) s[j] += v * w[j * n + k];
    }
    for (int j = 0; j < K; j++) t[j] = s[j];
    if (SQ) *sq = q;
}

#define BLOCK_CASE(K)                                                                                                 \
    case K:                                                                                                           \
        if (p == 2)                                                                                                   \
            block_sums(x, n, w, K, 2, 0, t, sq);                                                                      \
        else if (sq)                                                                                                  \
            block_sums(x, n, w, K, 1, 1, t, sq);                                                                      \
        else                                                                                                          \
            block_sums(x, n, w, K, 1, 0, t, sq);                                                                      \
        break;

/* block_sums with k <= CHAINS known at run time; sq only with p = 1 (else NULL). */
OUTLINE void block_sums_of(const float *restrict x, int64_t n, const float *restrict w, int k, int p,
                           float *restrict t, float *restrict sq) {
    switch (k) {
    case 0:
        if (sq) block_sums(x, n, w, 0, 1, 1, t, sq);
        break;
        BLOCK_CASE(1)
        BLOCK_CASE(2)
        BLOCK_CASE(3)
        BLOCK_CASE(4)
        BLOCK_CASE(5)
        BLOCK_CASE(6)
        BLOCK_CASE(7)
        BLOCK_CASE(8)
    }
}

/* A row segment's m sums x^p . w[j] (w[j] the n floats at w + j*n), into out[0..m), and its square sum into *sq
 * where sq is not NULL (p = 1 only): in as few blocks of at most CHAINS sums as there can be, of near equal sizes. */
static void segment_sums(const float *restrict x, int64_t n, int p, const float *restrict w, int64_t m,
                         float *restrict out, float *restrict sq) {
    const int64_t blocks = m ? (m + CHAINS - 1) / CHAINS : 1;
    for (int64_t b = 0, j = 0; b < blocks; b++) {
        const int k = (int)((m - j) / (blocks - b));
        block_sums_of(x, n, w ? w + j * n : 0, k, p, out ? out + j : 0, b == 0 ? sq : 0);
        j += k;
    }
}

/* |x| as the bits of a float, as an unsigned integer: ordered as |x| is, every NaN above INF. */
static inline uint32_t abs_bits(const float *x) {
    uint32_t u;
    memcpy(&u, x, sizeof u);
    return u & 0x7fffffffu;
}

static float abs_max(const float *restrict x, int64_t n) {
    uint32_t m = 0;
    for (int64_t k = 0; k < n; k++) {
        const uint32_t u = abs_bits(x + k);
        m = u > m ? u : m;
    }
    float t;
    memcpy(&t, &m, sizeof t);
    return t;
}

/* y[j][k] += sum_r c[j][r] * x_r[k]^P for the columns k0..k1 of the rows x_r = x[r * ld] (r < R), j < nl. */
BLOCK void col_weighted(const float *restrict x, int64_t ld, const int R, const int P, const float *restrict c,
                        int64_t nl, int64_t n, int64_t k0, int64_t k1, float *restrict y) {
    for (int64_t j = 0; j < nl; j++) {
        float cj[RB];
        for (int r = 0; r < R; r++) cj[r] = c[j * RB + r];
        float *restrict yj = y + j * n;
        for (int64_t k = k0; k < k1; k++) {
            float a = yj[k];
            for (int r = 0; r < R; r++) {
                const float e = x[r * ld + k];
                a += cj[r] * (P == 2 ? e * e : e);
            }
            yj[k] = a;
        }
    }
}

/* Adds rows x[0], x[ld], ..., x[(R-1) ld] (R = 1 or RB) into the column outputs, with coefficients c[j][r], c2[j][r]
 * of output j and row r; m holds the bits of the running column maxima (abs_bits). */
BLOCK void col_update_k(const float *restrict x, int64_t ld, const int R, const float *restrict c, int64_t nl,
                        const float *restrict c2, int64_t nl2, int64_t n, float *restrict y, float *restrict y2,
                        float *restrict s, uint32_t *restrict m) {
    for (int64_t k0 = 0; k0 < n; k0 += TILE) {
        const int64_t k1 = n - k0 < TILE ? n : k0 + TILE;
        col_weighted(x, ld, R, 1, c, nl, n, k0, k1, y);
        col_weighted(x, ld, R, 2, c2, nl2, n, k0, k1, y2);
        if (s)
            for (int64_t k = k0; k < k1; k++) {
                float a = s[k];
                for (int r = 0; r < R; r++) a += x[r * ld + k] * x[r * ld + k];
                s[k] = a;
            }
        if (m)
            for (int64_t k = k0; k < k1; k++) {
                uint32_t a = m[k];
                for (int r = 0; r < R; r++) {
                    const uint32_t u = abs_bits(x + r * ld + k);
                    a = u > a ? u : a;
                }
                m[k] = a;
            }
    }
}

/* Rows per block of the single sweep below: the block's row sums (SW (K + 1)), its left coefficients (SW NL) and
 * the column outputs (NL + 1) stay in vector registers: 31 at K = 4, NL = 2, within AVX-512's 32; under AVX2's 16
 * the compiler keeps the coefficients in memory operands. */
#define SW 4

/* The common shapes of a check's operand pass (no groups, no squared factors, no maxima, no copy: the whole-step
 * GEMMs' x, W and dY) in one sweep over SW rows: each element of x is loaded once for its row sums (K weighted,
 * SQ its squares) and its column updates (NL left factors with coefficients c[j][r], CSQ the squares), where the
 * general path reads the block again from L1 for the columns (half its time in a 1024 x 2048 pass with two left
 * factors). t: SW x K row sums (row stride K), sq: SW row squares; y: NL x n and s: n column outputs, added to. */
BLOCK void sweep_rows_cols(const float *restrict x, int64_t ld, int64_t n, const float *restrict w, const int K,
                           const int SQ, const float *restrict c, const int NL, const int CSQ, float *restrict t,
                           float *restrict sq, float *restrict y, float *restrict s) {
    float acc[SW][4], q[SW], cr[2][SW];
    for (int r = 0; r < SW; r++) {
        q[r] = 0.0f;
        for (int j = 0; j < K; j++) acc[r][j] = 0.0f;
        for (int j = 0; j < NL; j++) cr[j][r] = c[j * SW + r];
    }
    for (int64_t k = 0; k < n; k++) {
        float ya[2], sa = CSQ ? s[k] : 0.0f;
        for (int j = 0; j < NL; j++) ya[j] = y[j * n + k];
        for (int r = 0; r < SW; r++) {
            const float e = x[r * ld + k], e2 = e * e;
            for (int j = 0; j < K; j++) acc[r][j] += e * w[j * n + k];
            if (SQ) q[r] += e2;
            for (int j = 0; j < NL; j++) ya[j] += cr[j][r] * e;
            if (CSQ) sa += e2;
        }
        for (int j = 0; j < NL; j++) y[j * n + k] = ya[j];
        if (CSQ) s[k] = sa;
    }
    for (int r = 0; r < SW; r++) {
        for (int j = 0; j < K; j++) t[r * K + j] = acc[r][j];
        if (SQ) sq[r] = q[r];
    }
}

#define SWEEP_CASE(K, NL, SQ, CSQ)                                                                                    \
    if (k == K && nl == NL && sq_ == SQ && csq_ == CSQ) {                                                             \
        sweep_rows_cols(x, ld, n, w, K, SQ, c, NL, CSQ, t, sq, y, s);                                                 \
        return;                                                                                                       \
    }

/* sweep_rows_cols for the shape at run time: every one the caller's `sweep` admits (K in 0, 2, 4; NL in 0, 2; at
 * least one output) has its case here, and tests/agent/test_fused_pass.py draws them all. */
OUTLINE void sweep_of(const float *restrict x, int64_t ld, int64_t n, const float *restrict w, int k, int sq_,
                     const float *restrict c, int nl, int csq_, float *restrict t, float *restrict sq,
                     float *restrict y, float *restrict s) {
    SWEEP_CASE(0, 2, 0, 0) SWEEP_CASE(0, 2, 1, 0) SWEEP_CASE(0, 2, 0, 1) SWEEP_CASE(0, 2, 1, 1)
    SWEEP_CASE(0, 0, 1, 0) SWEEP_CASE(0, 0, 0, 1) SWEEP_CASE(0, 0, 1, 1)
    SWEEP_CASE(2, 2, 0, 0) SWEEP_CASE(2, 2, 1, 0) SWEEP_CASE(2, 2, 0, 1) SWEEP_CASE(2, 2, 1, 1)
    SWEEP_CASE(2, 0, 0, 0) SWEEP_CASE(2, 0, 1, 0) SWEEP_CASE(2, 0, 0, 1) SWEEP_CASE(2, 0, 1, 1)
    SWEEP_CASE(4, 2, 0, 0) SWEEP_CASE(4, 2, 1, 0) SWEEP_CASE(4, 2, 0, 1) SWEEP_CASE(4, 2, 1, 1)
    SWEEP_CASE(4, 0, 0, 0) SWEEP_CASE(4, 0, 1, 0) SWEEP_CASE(4, 0, 0, 1) SWEEP_CASE(4, 0, 1, 1)
}

void attnchecker_fused_pass(int64_t nb, int64_t rows, int64_t cols, const float *x, int64_t ld, int64_t sx,
                            int64_t groups, const float *r, int64_t nr, int64_t sr, const float *r2, int64_t nr2,
                            int64_t sr2, const float *l, int64_t nl, int64_t sl, const float *l2, int64_t nl2,
                            int64_t sl2, float *xr, float *xr2, float *lx, float *lx2, float *rsq, float *csq,
                            float *rmax, float *cmax, float *cp, int64_t cin, int64_t cso, int64_t csi, int64_t ldc,
                            int64_t wc) {
    const int64_t seg = cols / groups;
    if (!xr) nr = 0;
    if (!xr2) nr2 = 0;
    if (!lx) nl = 0;
    if (!lx2) nl2 = 0;
    /* The shapes sweep_of has a case for, exactly: one sweep per SW rows (the rest, fewer than SW, by the general
     * path). */
    const int sweep = groups == 1 && !nr2 && !nl2 && !rmax && !cmax && !cp && (nr == 0 || nr == 2 || nr == 4)
                      && (nl == 0 || nl == 2) && (nr || nl || rsq || csq);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * sx;
        const float *rb = nr ? r + b * sr : 0, *r2b = nr2 ? r2 + b * sr2 : 0;
        const float *lb = nl ? l + b * sl : 0, *l2b = nl2 ? l2 + b * sl2 : 0;
        float *xrb = nr ? xr + b * rows * groups * nr : 0, *xr2b = nr2 ? xr2 + b * rows * groups * nr2 : 0;
        float *lxb = nl ? lx + b * nl * cols : 0, *lx2b = nl2 ? lx2 + b * nl2 * cols : 0;
        float *rsqb = rsq ? rsq + b * rows * groups : 0, *csqb = csq ? csq + b * cols : 0;
        float *rmaxb = rmax ? rmax + b * rows : 0;
        float *cpb = cp ? cp + (b / cin) * cso + (b % cin) * csi : 0;
        /* The column maxima run as their bits (abs_bits) in the output, whose storage only ever holds them: the
         * bits of the largest |x| are those of the float max, and 0 those of 0.0f. */
        uint32_t *cmaxb = cmax ? (uint32_t *)(void *)(cmax + b * cols) : 0;
        if (lxb) memset(lxb, 0, (size_t)(nl * cols) * sizeof(float));
        if (lx2b) memset(lx2b, 0, (size_t)(nl2 * cols) * sizeof(float));
        if (csqb) memset(csqb, 0, (size_t)cols * sizeof(float));
        if (cmaxb) memset(cmaxb, 0, (size_t)cols * sizeof(uint32_t));
        int64_t i0 = 0;
        if (sweep)
            for (; rows - i0 >= SW; i0 += SW) {
                float c[2 * SW];
                for (int64_t j = 0; j < nl; j++)
                    for (int q = 0; q < SW; q++) c[j * SW + q] = lb[j * rows + i0 + q];
                float t[SW * 4], sq[SW];
                sweep_of(xb + i0 * ld, ld, cols, rb, (int)nr, rsqb != 0, c, (int)nl, csqb != 0, t, sq, lxb, csqb);
                for (int q = 0; q < SW; q++) {
                    for (int64_t j = 0; j < nr; j++) xrb[(i0 + q) * nr + j] = t[q * nr + j];
                    if (rsqb) rsqb[i0 + q] = sq[q];
                }
            }
        for (; i0 < rows;) {
            const int rb_rows = rows - i0 >= RB ? RB : 1;
            for (int64_t i = i0; i < i0 + rb_rows; i++) {
                const float *row = xb + i * ld;
                for (int64_t h = 0; h < groups; h++) {
                    const float *part = row + h * seg;
                    const int64_t v = i * groups + h;
                    if (nr || rsqb) segment_sums(part, seg, 1, rb, nr, nr ? xrb + v * nr : 0, rsqb ? rsqb + v : 0);
                    if (nr2) segment_sums(part, seg, 2, r2b, nr2, xr2b + v * nr2, 0);
                }
                if (rmaxb) rmaxb[i] = abs_max(row, cols);
                if (cpb) {
                    float *dst = cpb + i * ldc;
                    memcpy(dst, row, (size_t)cols * sizeof(float));
                    memset(dst + cols, 0, (size_t)(wc - cols) * sizeof(float));
                }
            }
            if (nl || nl2 || csqb || cmaxb) {
                /* This block's coefficients, c[j][r] = L[j][i0 + r] (nl, nl2 <= 64: fused_pass.py's _WIDEST_LEFT). */
                float c[64 * RB], c2[64 * RB];
                for (int64_t j = 0; j < nl; j++)
                    for (int q = 0; q < rb_rows; q++) c[j * RB + q] = lb[j * rows + i0 + q];
                for (int64_t j = 0; j < nl2; j++)
                    for (int q = 0; q < rb_rows; q++) c2[j * RB + q] = l2b[j * rows + i0 + q];
                const float *row = xb + i0 * ld;
                if (rb_rows == RB)
                    col_update_k(row, ld, RB, c, nl, c2, nl2, cols, lxb, lx2b, csqb, cmaxb);
                else
                    col_update_k(row, ld, 1, c, nl, c2, nl2, cols, lxb, lx2b, csqb, cmaxb);
            }
            i0 += rb_rows;
        }
    }
}
