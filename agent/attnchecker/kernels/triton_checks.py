"""Device functions of the tile contract (abft/tiled.py) for the Triton attention kernel (triton_attention.py): one
direction's checksums of a tile against references made from the operand tiles in registers, the bound of
abft/tile_terms.py evaluated per vector, the verdict, where a flagged vector's fault lies, and its repair.

``@triton.jit`` functions, inlined where the kernel calls them. Each works on the vectors along axis 1 of a tile x (the
rows; the kernel passes ``tl.trans(x)`` for the columns). Legend: R vectors, C elements per vector, D head dim.
Importable without triton (the functions then do not exist; ``triton_attention.available()`` says so).
"""
from __future__ import annotations

from typing import Any

from .triton_common import device_function, triton

if triton is not None:
    import triton.language as tl

__all__ = ["SPLIT_COLUMNS"]

SPLIT_COLUMNS = 8
"""Columns of a tile's ``split3`` parts as stored by ``store_parts``: six used, rows of 16 bytes in bf16 and fp16;
``refs_by_dot`` reads them as the 16 columns of a tl.dot operand."""

if triton is not None:
    _jit: Any = device_function
    # The combine functions of tl.sum/max/min: tl.reduce with them is what those compile to, and what the
    # interpreter runs on numpy directly (tl.sum itself is a @jit function of Triton's library, patched per call).
    _SUM = tl.standard._sum_combine
    _MAX = tl.standard._elementwise_max
    _MIN = tl.standard._elementwise_min

    @_jit
    def rsum(x, axis):
        """tl.sum of an fp32, fp64 or int32 x."""
        return tl.reduce(x, axis, _SUM)

    @_jit
    def rmax(x, axis):
        """tl.max of an fp32 or int32 x (a NaN is skipped, as on the GPU)."""
        return tl.reduce(x, axis, _MAX)

    @_jit
    def rmin(x, axis):
        return tl.reduce(x, axis, _MIN)

    @_jit
    def weights(n: tl.constexpr):
        """(n,) fp32: the checksum weights 1..n (the plain sum's are ones)."""
        return (tl.arange(0, n) + 1).to(tl.float32)

    @_jit
    def other_side(b, valid, floor):
        """What every vector's bound takes from the other operand's per-element norms b (C,) (valid: elements that
        exist), b' = b + floor (tolerance.direction_bounds): (Σ_j b'_j, ‖b'‖, ‖j·b'‖) fp32, j = 1..C. The norms are
        scaled by the largest b' before squaring, so that no square under- or overflows fp32."""
        bf = tl.where(valid, b + floor, 0.0)
        j = (tl.arange(0, b.shape[0]) + 1).to(tl.float32)
        big = rmax(bf, 0)
        inv = 1.0 / tl.where((big > 0.0) & (big < float("inf")), big, 1.0)
        x = bf * inv
        return rsum(bf, 0), _scaled(big, tl.sqrt(rsum(x * x, 0))), _scaled(big, tl.sqrt(rsum(x * x * j * j, 0)))

    @_jit
    def _scaled(big, root):
        """big·root, where root is a norm of values divided by big (INF and NaN stay what big is)."""
        return tl.where((big > 0.0) & (big < float("inf")), big * root, big)

    @_jit
    def ref_norm(x, floor):
        """‖x‖ + floor: the norm of a reference's weight vector (B w), floored as direction_bounds floors it."""
        return tl.sqrt(rsum(x * x, 0)) + floor

    @_jit
    def norm3(x, y, z):
        """√(x² + y² + z²) of three fp32 tensors >= 0 (one shape), scaled by a power of 2 near their largest
        (``pow2_scale``: multiplies, no division) so that no square under- or overflows fp32 (an INF stays INF, a NaN
        stays NaN)."""
        m = tl.maximum(tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL), z, propagate_nan=tl.PropagateNan.ALL)
        inv, scale = pow2_scale(m)
        xs = x * inv
        ys = y * inv
        zs = z * inv
        return scale * tl.sqrt(xs * xs + ys * ys + zs * zs)

    @_jit
    def bound(a, b_sum, b_norm1, b_norm2, r1, r2, sq, ref1, ref2, mom1, mom2, terms, CALIBRATED: tl.constexpr):
        """(R,) bounds on |d1| and |d2| of R vectors with operand norms a (R,), ΣC² sq (R,), references ref1, ref2 (R,)
        and operand-rounding moments mom1, mom2 (R,) (zeros without them); the other operand's terms per tile:
        b_sum = Σ b', b_norm1 = ‖b'‖, b_norm2 = ‖j·b'‖ (``other_side``), r1, r2 the reference weights' norms
        (``ref_norm``). abft/tile_terms.py's rule, term by term (``TileTerms.pair`` is the same in torch, in fp64).
        terms: ``TileTerms.as_tuple()``.

        All fp32: the variance's squares (u²·a²·b², below 1e-52 at norms of 1e-10) leave fp32's range, so the
        standard deviation is made as a norm of norms (``norm3``), each term a product of roots (√c_b·‖b'‖,
        √c_sq·√ΣC², ...). fp64, which ``TileTerms.pair`` uses for the same reason, runs at 1/64 of fp32's rate on
        the 99 KB GPUs (sm_86, sm_89) and at half of it on an H100."""
        floor = terms[0]
        n = terms[7]
        a_f = a + floor
        # The paper's threshold (rig_coef 0) is E whatever the norms: a NaN norm must not make it NaN·0.
        rig1 = tl.where(terms[1] == 0.0, 0.0, a_f * b_sum * terms[1]) + terms[2]
        rig2 = rig1 * n
        if CALIBRATED:
            zero = tl.zeros_like(b_norm1)
            # Per tile (scalars): √(c_b·‖b'‖² + c_r·r²) for each weight vector (ones, 1..n).
            k1 = norm3(b_norm1 * terms[12], r1 * terms[13], zero)
            k2 = norm3(b_norm2 * terms[12], r2 * terms[13], zero)
            # Per vector: √(c_sq·(ΣC² + n·tiny)) and √(mom·M).
            s1 = tl.sqrt(sq + n * terms[11]) * terms[14]
            std1 = norm3(a_f * k1, s1, tl.sqrt(mom1) * terms[15])
            std2 = norm3(a_f * k2, s1 * n, tl.sqrt(mom2) * terms[15])
            # A non-finite reference adds nothing to the truncation term (it is never flagged anyway).
            ref1_abs = tl.where(tl.abs(ref1) <= 3.4028234663852886e38, tl.abs(ref1), 0.0)
            ref2_abs = tl.where(tl.abs(ref2) <= 3.4028234663852886e38, tl.abs(ref2), 0.0)
            cal1 = std1 * terms[8] + ref1_abs * terms[9] + terms[2]
            cal2 = std2 * terms[8] + ref2_abs * terms[9] + terms[6]
            rig1 = tl.minimum(rig1, cal1, propagate_nan=tl.PropagateNan.ALL)
            rig2 = tl.minimum(rig2, cal2, propagate_nan=tl.PropagateNan.ALL)
        # tolerance._clamp: an undefined bound (NaN, +INF) reads NEAR_INF, so an extreme residual still flags.
        b1 = tl.where((rig1 != rig1) | (rig1 == float("inf")), 1e10, rig1)
        b2 = tl.where((rig2 != rig2) | (rig2 == float("inf")), 1e10, rig2)
        return b1, b2

    @_jit
    def verdict(sum1, sum2, ref1, ref2, b1, b2):
        """checksum.verify_direction per vector: (bad (R,), d1 (R,), ratio (R,)). A vector is bad when its reference
        is finite and |d1| or |d2| exceeds its bound (or is NaN: `<=` is False for it); a non-finite reference is an
        upstream fault, not this product's. ratio: max(|d1|/b1, |d2|/b2), records._ratio."""
        d1 = ref1 - sum1
        d2 = ref2 - sum2
        ok = (tl.abs(d1) <= b1) & (tl.abs(d2) <= b2)
        bad = (tl.abs(ref1) <= 3.4028234663852886e38) & (ok == 0)
        x1 = tl.abs(d1) / tl.maximum(b1, 1e-30)
        x2 = tl.abs(d2) / tl.maximum(b2, 1e-30)
        return bad, d1, tl.maximum(x1, x2, propagate_nan=tl.PropagateNan.ALL)

    @_jit
    def check(x, ref1, ref2, a, b_sum, b_norm1, b_norm2, r1, r2, mom1, mom2, terms, CALIBRATED: tl.constexpr):
        """The vectors along axis 1 of a tile x (R, C) fp32 against their references: (bad, d1, b1, ratio) (R,)."""
        w = weights(x.shape[1])
        sum1 = rsum(x, 1)
        sum2 = rsum(x * w[None, :], 1)
        sq = rsum(x * x, 1)
        b1, b2 = bound(a, b_sum, b_norm1, b_norm2, r1, r2, sq, ref1, ref2, mom1, mom2, terms, CALIBRATED)
        bad, d1, ratio = verdict(sum1, sum2, ref1, ref2, b1, b2)
        return bad, d1, b1, ratio

    @_jit
    def refs(a_op, bw_e, bw_w):
        """(R,) references (A·(B e), A·(B w)) of a tile A·B, from A (R, K) and B's weighted sums (K,) in fp32."""
        return rsum(a_op * bw_e[None, :], 1), rsum(a_op * bw_w[None, :], 1)

    PARTS: Any = tl.constexpr(SPLIT_COLUMNS)
    # The softmax in base 2 (a GPU's exp is ex2 of its argument times log2(e)): the kernels fold log2(e) into the
    # scale, and take the log-sum-exp back to base e with ln(2).
    LOG2E: Any = tl.constexpr(1.4426950408889634)
    LN2: Any = tl.constexpr(0.6931471805599453)

    @_jit
    def holds_masked(r0, c0, T, S, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOWED: tl.constexpr):
        """Whether the scores tile of rows [r0, r0 + BLOCK_M) and keys [c0, c0 + BLOCK_N) may hold an element the
        softmax must not see: past the last row or key, above the causal diagonal, or at a window's edge. One scalar
        test per tile, so the attention kernels mask element by element only where it answers True (a bool mask's
        tiles are the caller's to add): on 4 warps the per-element test is a third of the unchecked forward loop
        (bench/triton_resources.py --mix)."""
        edge = (r0 + BLOCK_M > T) | (c0 + BLOCK_N > S)
        if CAUSAL:
            edge = edge | (c0 + BLOCK_N - 1 > r0)
        if WINDOWED:
            edge = edge | (r0 + BLOCK_M - 1 - c0 >= window)
        return edge

    @_jit
    def pow2_scale(big):
        """(inv, scale) for big ≥ 0 (fp32, any shape): powers of 2 with inv·scale = 1 that take big into [1, 2) (into
        [1, 4) past 2^126; big ≤ 2^-126 goes to at most 1), made from big's exponent bits: a multiply by inv scales
        exactly and without a division. INF and NaN get inv = 2^-126."""
        exp = (big.to(tl.int32, bitcast=True) >> 23) & 255
        inv_exp = tl.minimum(tl.maximum(254 - exp, 1), 253)
        return (inv_exp << 23).to(tl.float32, bitcast=True), ((254 - inv_exp) << 23).to(tl.float32, bitcast=True)

    @_jit
    def split3(x, dtype: tl.constexpr):
        """x (L,) fp32 as scale·(p1 + p2 + p3), each part a value of dtype (bf16, fp16) held in fp32, to within
        2⁻²⁵ of the largest |x| (tests/agent/test_triton_refs_by_dot.py). scale is the power of 2 that takes that
        element into [1, 2), where fp16 holds every part; it clamps at 2^±126 for subnormal and huge x. So the
        parts' products with a tile of dtype are exact in fp32, and one tensor-core product carries an fp32 vector.
        An INF or NaN in x stays non-finite in the parts' sum. Returns (p1, p2, p3, scale)."""
        inv, scale = pow2_scale(rmax(tl.abs(x), 0))
        y = x * inv
        p1 = y.to(dtype).to(tl.float32)
        rest = y - p1  # exact: p1 is y rounded to fewer bits
        p2 = rest.to(dtype).to(tl.float32)
        p3 = (rest - p2).to(dtype).to(tl.float32)
        return p1, p2, p3, scale

    @_jit
    def parts_of(e, w, dtype: tl.constexpr, COLUMNS: tl.constexpr):
        """Two weighted sums e, w (L,) fp32 as ``split3`` parts: (L, COLUMNS) of dtype, columns [e's three, w's
        three, zeros], and the two scales."""
        e1, e2, e3, scale_e = split3(e, dtype)
        w1, w2, w3, scale_w = split3(w, dtype)
        col = tl.arange(0, COLUMNS)[None, :]
        parts = (tl.where(col == 0, e1[:, None], 0.0) + tl.where(col == 1, e2[:, None], 0.0)
                 + tl.where(col == 2, e3[:, None], 0.0) + tl.where(col == 3, w1[:, None], 0.0)
                 + tl.where(col == 4, w2[:, None], 0.0) + tl.where(col == 5, w3[:, None], 0.0))
        return parts.to(dtype), scale_e, scale_w

    @_jit
    def store_parts(Parts, e, w, dtype: tl.constexpr):
        """A tile's two weighted sums e, w (L,) fp32 as ``parts_of``, stored: Parts (L, PARTS) of dtype. Returns the
        two scales."""
        parts, scale_e, scale_w = parts_of(e, w, dtype, PARTS)
        tl.store(Parts + tl.arange(0, e.shape[0])[:, None] * PARTS + tl.arange(0, PARTS)[None, :], parts)
        return scale_e, scale_w

    @_jit
    def fold_parts(r, scale_e, scale_w):
        """The references from a product r (R, C) of a tile with ``parts_of`` columns: (R,) each, its part columns
        added back and scaled."""
        col = tl.arange(0, r.shape[1])[None, :]
        return (rsum(tl.where(col < 3, r, 0.0), 1) * scale_e,
                rsum(tl.where((col >= 3) & (col < 6), r, 0.0), 1) * scale_w)

    @_jit
    def fold_rows(r, scale_e, scale_w):
        """``fold_parts`` of a product made the other way round, r (16, C) = partsᵀ·B: the references (C,) each, its
        part rows added back and scaled. Its vectors lie along r's columns, as the column sums of a tile with the same
        B do, so the two meet in one layout."""
        row = tl.arange(0, r.shape[0])[:, None]
        return (rsum(tl.where(row < 3, r, 0.0), 0) * scale_e,
                rsum(tl.where((row >= 3) & (row < 6), r, 0.0), 0) * scale_w)

    @_jit
    def refs_by_dot(a, Parts, scale_e, scale_w):
        """``refs`` on the tensor cores: (R,) references (A·(B e), A·(B w)) of a tile A·B from A (R, K) as its GEMM
        takes it (bf16 or fp16; fp32 holding bf16 values under the interpreter) and B's weighted sums stored as
        ``store_parts`` (K, PARTS) with their scales. One small tl.dot (K × 16, the columns past PARTS zeros), its
        columns added back, in place of 2·R·K fp32 products reduced along K across the lanes: a quarter of the full
        checks' key-tile loop (bench/triton_resources.py --mix)."""
        col = tl.arange(0, 16)[None, :]
        parts = tl.load(Parts + tl.arange(0, a.shape[1])[:, None] * PARTS + col, mask=col < PARTS, other=0.0)
        return fold_parts(tl.dot(a, parts.to(a.dtype), input_precision="ieee"), scale_e, scale_w)

    @_jit
    def locate(x, ref1, ref2, near_inf):
        """abft.repair.locate_and_fix's location per vector of x (R, C): (col (R,) int32, locatable (R,), extreme
        count (R,), the vector's sum of its finite elements (R,), d1 (R,)). An extreme element (INF, NaN, |x| >
        near_inf) is found by value (one per vector at most); else d2/d1 - 1 when that is nearly an integer in range."""
        n: tl.constexpr = x.shape[1]
        cols = tl.arange(0, n)
        ext = (x != x) | (tl.abs(x) > near_inf)
        n_ext = rsum(ext.to(tl.int32), 1)
        finite = tl.where(ext, 0.0, x)
        w = weights(n)
        g1 = rsum(finite, 1)
        d1 = ref1 - g1
        pos = (ref2 - rsum(finite * w[None, :], 1)) / d1
        rnd = tl.floor(pos + 0.5)
        at = rnd - 1.0
        located = (tl.abs(pos - rnd) <= 0.3) & (at >= 0.0) & (at < n)  # False for NaN and INF positions
        at_ext = rmin(tl.where(ext, cols[None, :], n), 1)
        col = tl.where(n_ext == 1, at_ext, tl.where(located, at, 0.0).to(tl.int32))
        ok = (tl.abs(ref1) <= 3.4028234663852886e38) & (tl.abs(ref2) <= 3.4028234663852886e38)
        locatable = ok & ((n_ext == 1) | ((n_ext == 0) & located))
        return col, locatable, n_ext, g1, d1

    @_jit
    def fix(x, ref1, ref2, bad, near_inf, fix_threshold):
        """Correct each bad, locatable vector of x (R, C) at its one faulty element (abft.repair.locate_and_fix): an
        extreme element, or a difference above fix_threshold, is rebuilt as the checksum minus the healthy elements;
        a smaller difference is added back. Returns (x fixed, (R, C) mask of the elements changed)."""
        col, locatable, n_ext, g1, d1 = locate(x, ref1, ref2, near_inf)
        at = tl.arange(0, x.shape[1])[None, :] == col[:, None]
        old = rsum(tl.where(at, x, 0.0), 1)
        healthy = g1 - tl.where(n_ext == 1, 0.0, old)
        rebuilt = ref1 - healthy
        new = tl.where((n_ext == 1) | (tl.abs(d1) > fix_threshold), rebuilt, old + d1)
        hit = at & (bad & locatable)[:, None]
        return tl.where(hit, new[:, None], x), hit

    @_jit
    def extreme_of(x):
        """(R,) the most extreme element of each vector of x (R, C): NaN first, then the largest magnitude (signed),
        as abft.repair._worst_value picks the value a report shows."""
        n: tl.constexpr = x.shape[1]
        cols = tl.arange(0, n)
        has_nan = rsum((x != x).to(tl.int32), 1) > 0
        mag = tl.where(x != x, -1.0, tl.abs(x))
        big = rmax(mag, 1)
        at = rmin(tl.where(mag == big[:, None], cols[None, :], n), 1)
        value = rsum(tl.where(cols[None, :] == at[:, None], x, 0.0), 1)
        return tl.where(has_nan, float("nan"), value)

    @_jit
    def pick(x, i):
        """x[i] of a 1-D x as a scalar (i a scalar index; 0 when out of range)."""
        return rsum(tl.where(tl.arange(0, x.shape[0]) == i, x, 0), 0)

    @_jit
    def pick2(x, r, c):
        """x[r, c] of a 2-D x as a scalar (NaN and INF kept: every other element contributes an exact 0)."""
        at = (tl.arange(0, x.shape[0])[:, None] == r) & (tl.arange(0, x.shape[1])[None, :] == c)
        return rsum(tl.where(at, x, 0.0), None)

    @_jit
    def first(mask):
        """The first index where a 1-D mask is set, -1 if none."""
        n: tl.constexpr = mask.shape[0]
        at = rmin(tl.where(mask, tl.arange(0, n), n), 0)
        return tl.where(at == n, -1, at)

    @_jit
    def worst_flagged(bad, d1, b1, ratio):
        """(ratio, |d1| (NaN when not finite), bound) of the worst flagged vector (a non-finite residual counts as
        infinitely bad), ratio -1 if none: what a report shows as residual and bound (abft.repair._residual)."""
        finite = (tl.abs(d1) <= 3.4028234663852886e38) & (ratio == ratio)
        r = tl.where(bad, tl.where(finite, ratio, float("inf")), -1.0)
        best = rmax(r, 0)
        at = first(r == best)
        d = tl.abs(pick(d1, at))
        return best, tl.where(d <= 3.4028234663852886e38, d, float("nan")), pick(b1, at)

    @_jit
    def max_nan(a, b):
        """max(a, b), NaN if either is NaN (torch.amax, which the clean-ratio histogram takes)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
