"""The Triton attention backward's check bounds at realistic sizes: how close clean round-off comes to them, and how
small a single wrong element they flag, per check (kernels/triton_attention_bwd.py).

The kernels' checks are emulated with torch on the CPU, because Triton's interpreter takes minutes at these sizes.
The emulation takes a fused forward's output and lse (scores kept in fp32, as the Triton forward and FlashAttention
keep them; the PyTorch tile loop's half-precision scores make the two row-sum bounds looser), the same products in
fp32 from the operands as the kernels take them (AP and dS rounded to the inputs' dtype for dV, dK, dQ), the same
vectors (BLOCK-wide tiles of S and dP by rows and by columns; rows of dV, dK, dQ over the head dim, summed over all of
T or S; the row sums of AP and dS), and the same rules (abft.vector_rules, which the kernels evaluate in fp32 and the
tests hold to direction_bounds). On a GPU the kernels' sums run in another order; the rules hold for any order.

Per check: the worst clean |d|/bound over every vector (a flag is > 1), and the median and 99th percentile of the
bound on d1 against the vector's natural scale: for a product, the RMS of its elements (a single wrong element
flags at or below that size; its weighted checksum d2 can flag it earlier); for Σ_j AP_ij, 1 (the bound is the
relative error of a row's AP, e.g. of a wrong lse, that flags); for Σ_j dS_ij, Σ_j |dS_ij| of the row. Causal
attention, q, k, v, dO standard normal; three seeds, median and [min, max] across them.

    python bench/triton_backward_bounds.py [--tiny] [--seeds 3] [--out docs/perf/triton_backward_bounds.json]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import torch

from attnchecker.abft import Tolerance
from attnchecker.abft.vector_rules import (
    product_bound,
    product_rule,
    product_terms,
    softmax_grad_bound,
    softmax_grad_rule,
)
from attnchecker.kernels.triton_attention_bwd import BLOCK as TILE

# (heads, T, head dim): GPT-2-small's head dim at T = 1024 and 2048, a 7B-like head at T = 2048 and 4096.
SHAPES = {"gpt2 T=1024": (2, 1024, 64), "gpt2 T=2048": (2, 2048, 64), "7b T=2048": (2, 2048, 128),
          "7b T=4096": (1, 4096, 128)}
TINY = {"tiny T=128": (2, 128, 32)}
CHECKS = ("S rows", "S cols", "dP rows", "dP cols", "dV", "dK", "dQ", "sum AP", "sum dS")


def _weights(n: int) -> torch.Tensor:
    return torch.stack([torch.ones(n), torch.arange(1, n + 1, dtype=torch.float32)], -1)


def tile_rows(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tol: Tolerance) -> tuple[torch.Tensor, torch.Tensor]:
    """C = A·Bᵀ (R, C) checked by rows within TILE-wide column blocks (the key pass's S and dP; the query pass's
    column checks are this on Cᵀ): (ratio, bound on d1) per (block, row)."""
    r, d = a.shape
    nb = b.shape[0] // TILE
    w = _weights(TILE)
    c_NRt = c.view(r, nb, TILE).transpose(0, 1)
    act = c_NRt @ w
    bbar_N2D = w.T @ b.view(nb, TILE, d)
    ref = a @ bbar_N2D.transpose(-2, -1)
    rule = product_rule(TILE, d, tol)
    bsum, bsq, rn = product_terms(rule, b.norm(dim=-1).view(nb, TILE), bbar_N2D.norm(dim=-1))
    b1, b2 = product_bound(rule, a.norm(dim=-1).expand(nb, r), bsum, bsq, rn, c_NRt.square().sum(-1), ref)
    d = (act - ref).double()
    return torch.maximum(d[..., 0].abs() / b1, d[..., 1].abs() / b2), b1


def full_rows(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tol: Tolerance) -> tuple[torch.Tensor, torch.Tensor]:
    """C = A·B (R, D) checked by rows over D with its reference accumulated over all of A's columns (dV, dK, dQ)."""
    w = _weights(c.shape[-1])
    bw = b @ w
    rule = product_rule(c.shape[-1], a.shape[-1], tol)
    bsum, bsq, rn = product_terms(rule, b.norm(dim=0), bw.norm(dim=0))
    ref = a @ bw
    b1, b2 = product_bound(rule, a.norm(dim=-1), bsum, bsq, rn, c.square().sum(-1), ref)
    d = (c @ w - ref).double()
    return torch.maximum(d[..., 0].abs() / b1, d[..., 1].abs() / b2), b1


def one_head(t: int, d: int, dtype: torch.dtype, seed: int, tol: Tolerance) -> dict[str, tuple[float, list[float]]]:
    """check -> (worst clean ratio, bounds on d1 in RMS of the product's elements) for one causal head."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(t, d, generator=g).to(dtype).float() for _ in range(4))
    scale = 1 / math.sqrt(d)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    z64 = ((q.double() @ k.double().T) * scale).masked_fill(future, -math.inf)
    lse = torch.logsumexp(z64, -1).float()
    out = (torch.softmax(z64, -1) @ v.double()).to(dtype).float()
    delta = (do * out).sum(-1)
    s = q @ k.T
    dp = do @ v.T
    p = torch.exp(s * scale - lse[:, None]).masked_fill(future, 0.0)
    ds = p * (dp - delta[:, None])
    pd_c, ds_c = p.to(dtype).float(), ds.to(dtype).float()
    got: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, (a, b, c) in {"S rows": (q, k, s), "S cols": (k, q, s.T.contiguous()), "dP rows": (do, v, dp),
                            "dP cols": (v, do, dp.T.contiguous())}.items():
        got[name] = (*tile_rows(a, b, c, tol), c)
    for name, (a, b) in {"dV": (pd_c.T, do), "dK": (ds_c.T, q), "dQ": (ds_c, k)}.items():
        c = a @ b
        got[name] = (*full_rows(a, b, c, tol), c)
    rule = softmax_grad_rule(t=t, s=t, d=d, dtype=dtype, tol=tol)
    # The query pass takes the largest key and value norms over the key blocks a query block reads (causal: up to
    # the block's last row).
    k_max, v_max = (torch.stack([x[: min(t, i + TILE)].norm(dim=-1).max() for i in range(0, t, TILE)
                                 for _ in range(min(TILE, t - i))]) for x in (k, v))
    b_ds, b_p = softmax_grad_bound(rule, scale=scale, q_norm_V=q.norm(dim=-1), k_max_V=k_max,
                                   mask_live_V=torch.zeros(t), lse_V=lse, do_norm_V=do.norm(dim=-1), v_max_V=v_max)
    out_: dict[str, tuple[float, list[float]]] = {}
    scaled = {name: (ratio, b1 / float(c.double().square().mean().sqrt())) for name, (ratio, b1, c) in got.items()}
    scaled["sum AP"] = ((p.sum(-1) - 1).abs() / b_p, b_p)
    scaled["sum dS"] = (ds.sum(-1).abs() / b_ds, b_ds / ds.abs().sum(-1).double().clamp_min(1e-30))
    for name, (ratio, rel) in scaled.items():
        rel = rel.reshape(-1).float()
        out_[name] = (float(ratio.max()), [float(rel.median()), float(torch.quantile(rel, 0.99))])
    return out_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="one small shape (a smoke run)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tol = Tolerance()
    rows: list[dict[str, Any]] = []
    for label, (heads, t, d) in (TINY if args.tiny else SHAPES).items():
        for dtype in (torch.float32, torch.bfloat16):
            per_seed = [one_head(t, d, dtype, seed * 100 + h, tol) for seed in range(args.seeds) for h in range(heads)]
            for check in CHECKS:
                worst = [r[check][0] for r in per_seed]
                med = [r[check][1][0] for r in per_seed]
                p99 = [r[check][1][1] for r in per_seed]
                rows.append({"shape": label, "T": t, "D": d, "dtype": str(dtype).removeprefix("torch."),
                             "check": check, "worst_clean_ratio": _common.summary(worst),
                             "bound_scale_median": statistics.median(med), "bound_scale_p99": statistics.median(p99)})
    table = [[r["shape"], r["dtype"], r["check"], r["worst_clean_ratio"]["median"],
              f"[{r['worst_clean_ratio']['min']:.3g}, {r['worst_clean_ratio']['max']:.3g}]",
              r["bound_scale_median"], r["bound_scale_p99"]] for r in rows]
    print(_common.table(table, ["shape", "dtype", "check", "worst clean |d|/bound", "[min, max]",
                                "bound/scale median", "bound/scale p99"]))
    path = _common.write_result("triton_backward_bounds", {"tile": TILE, "seeds": args.seeds, "rows": rows},
                                args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
