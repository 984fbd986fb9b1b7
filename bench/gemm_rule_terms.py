"""Which term sets the GEMM checks' row bound (verify_gemm's rule, which the GEMM checks' Triton path evaluates per
row: abft/gemm_rule.py), with the reference's term from the norm of the vector the reference dots A's rows with,
‖B w‖ (the rule of both paths), and from the triangle bound Σ_j w_j ‖B_j‖ instead (``verify_gemm(ref_norms=False)``,
the rule before ‖B w‖ was passed), √n looser on uncorrelated columns.

On the coverage campaign's projection operands (bench/coverage.py's q: LLM-like activations with outlier channels
against a random weight; out: without outliers), per shape and dtype: the median over rows of each calibrated
variance term for w = ones (the product's rounding, the reference's by either norm, the checksum's forming and the
output's rounding), the median bound over the product's RMS and the worst clean residual over its bound, for each
form, and for the GEMM checks' Triton path, which checks rows of 512 columns and more in runs (gemm/device.py; key
``runs``: verify_gemm(groups=runs), the median over rows of each row's median run bound). A bound many times its
clean residuals lets finite errors under it pass (docs/fault-coverage.md, "Projections on a GPU"). Deterministic:
one run.

    python bench/gemm_rule_terms.py [--shapes gpt2,7b] [--dtypes fp32,bf16,fp16] [--out docs/perf/gemm_rule_terms.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import coverage as campaign
import torch

from attnchecker.abft import Tolerance, direction_bounds
from attnchecker.abft.gemm import verify_gemm
from attnchecker.abft.gemm_rule import gemm_row_rule
from attnchecker.kernels import triton_gemm_check as tg


def terms(op_name: str, shape: str, dtype_name: str) -> dict[str, Any]:
    """One product's rule terms, bound and clean ratios with the reference's norm and with the triangle bound."""
    op = campaign.Op(op_name, campaign.SHAPES[shape], dtype_name, seed=0)
    acc = torch.float32
    x_MK, b_KN, c_MN = op.x[0].to(acc), op.w.to(acc).T, op.c[0].to(acc)
    n, k = c_MN.shape[-1], x_MK.shape[-1]
    tol = Tolerance()
    w_2N = torch.stack([torch.ones(n), torch.arange(1, n + 1, dtype=acc)])
    # References and checksums in float64: the residual a clean check sees, its own sums' rounding aside.
    d_M2 = ((x_MK.double() @ (b_KN.double() @ w_2N.double().T)) - c_MN.double() @ w_2N.double().T).abs()
    ref_M2 = (x_MK.double() @ (b_KN.double() @ w_2N.double().T)).float()
    a_M, b_N = x_MK.norm(dim=1), b_KN.norm(dim=0)
    bw_2 = (b_KN.double() @ w_2N.double().T).norm(dim=0).float()
    use_abs = op.c.dtype != acc
    abs_M, sq_M = c_MN.abs().sum(1), c_MN.square().sum(1)
    out: dict[str, Any] = {"op": op_name, "shape": shape, "dtype": dtype_name, "n": n, "k": k, "rms": op.rms}
    for name, ref_norms in (("triangle", (None, None)), ("ref_norms", (bw_2, None))):
        rule = direction_bounds(("row",), a_M, b_N, k=k, out_dtype=op.c.dtype, tol=tol, use_abs=use_abs,
                                ref_norms=ref_norms)["row"]
        b1, b2 = rule.pair(abs_M if use_abs else None, sq_M, ref_M2)
        out[name] = {"median_bound_over_rms": float(b1.median()) / op.rms,
                     "worst_clean_ratio": max(float((d_M2[:, 0] / b1.double()).max()),
                                              float((d_M2[:, 1] / b2.double()).max()))}
    # The GPU path's rows in runs (gemm/device.py: verify_gemm(groups=runs)): each run's bound, per row the median over
    # its runs, and the worst clean ratio of any run (its residual in the check's own fp32 sums).
    runs = tg.runs(n)
    by_runs = verify_gemm(op.c[0], op.x[0], op.w.T, tol, directions=("row",), groups=runs)["row"]
    assert by_runs.bound2 is not None
    d_V2 = by_runs.diff[0].abs()
    ratio = torch.maximum(d_V2[:, 0] / by_runs.bound[0], d_V2[:, 1] / by_runs.bound2[0])
    out["runs"] = {"runs": runs, "median_bound_over_rms": float(by_runs.bound[0].view(-1, runs).median(1).values
                                                               .median()) / op.rms,
                   "worst_clean_ratio": float(ratio.max())}
    # The calibrated variance's terms for w = ones (abft/gemm_rule.py's scalars), median over rows.
    rule_s = gemm_row_rule(n, k, tol, op.c.dtype, bias=False)
    a2 = a_M.double().square()
    var = {"product": rule_s.var_b * a2 * b_N.double().square().sum(),
           "reference_triangle": rule_s.var_ref * a2 * b_N.double().sum() ** 2,
           "reference_with_norm": rule_s.var_ref * a2 * bw_2[0].double() ** 2,
           "checksum_and_output": rule_s.sq_coef * sq_M.double()}
    out["median_variance_w1"] = {name: float(v.median()) for name, v in var.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="gpt2,7b")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16")
    parser.add_argument("--ops", default="q,out")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape in fp32 and bf16 (the smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes, args.dtypes = "tiny", "fp32,bf16"
    rows = [terms(op, shape, dtype) for shape in args.shapes.split(",") for dtype in args.dtypes.split(",")
            for op in args.ops.split(",")]
    cpu, gpu = "triangle", "ref_norms"
    print(_common.table([[r["shape"], r["dtype"], r["op"], r[cpu]["median_bound_over_rms"],
                          r[gpu]["median_bound_over_rms"], r["runs"]["median_bound_over_rms"], r["runs"]["runs"],
                          r[cpu]["worst_clean_ratio"], r[gpu]["worst_clean_ratio"], r["runs"]["worst_clean_ratio"],
                          max(r["median_variance_w1"], key=r["median_variance_w1"].get)] for r in rows],
                        ["shape", "dtype", "op", "bound/RMS, triangle", "with ||Bw||", "in runs", "runs",
                         "worst clean ratio, triangle", "with ||Bw||", "in runs", "largest term, triangle"]))
    path = _common.write_result("gemm_rule_terms", {"rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
