"""The Triton GEMM check (kernels/triton_gemm_check.py) at realistic sizes (issue 32): does its one-pass verdict hold
where the bound matters, and what does it cost next to the GEMM.

- ``detect`` (CPU under Triton's interpreter, or CUDA): a Llama-7B projection's shape (K = N = 4096, M tokens),
  fp32 and bf16. Clean: the worst residual/bound ratio of the Triton pass and of ``abft.gemm.verify_gemm`` (the CPU
  path's rule) on the same product. Faulty: one error of 1, 2 and 4 × the product's RMS element in each of ``--rows``
  rows: the share of them each path flags. Both evaluate the same rule; the two columns should agree. And the
  rule's tightness there: the least error it flags, in RMS units, as it is and with ‖B w‖ in place of its triangle
  bound (``thresholds``).
- ``time`` (CUDA only): the GEMM (torch.mm, cuBLAS), the check of its output (two operand passes, the check pass, the
  repair kernel), the tier-1 pass alone, each timed with CUDA events over ``--reps`` calls, median of ``--rounds``
  interleaved rounds; the ratio to the GEMM. Prepared without a GPU: this section did not run here.

    TRITON_INTERPRET=1 python bench/triton_gemm_check.py [--tokens 1024] [--rows 64] [--tiny] [--out PATH]
    python bench/triton_gemm_check.py --tokens 8192 --rounds 5        # on a GPU: both sections
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

SIZES = {"full": 4096, "tiny": 128}
MAGNITUDES = (1.0, 2.0, 4.0)


def _product(m: int, k: int, n: int, dtype: Any, device: str) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(k, n, generator=g) / k**0.5).to(dtype)
    c = (a.float() @ b.float()).to(dtype)
    return c.to(device), a.to(device), b.to(device)


def detect(m: int, k: int, n: int, dtype: Any, device: str, rows: int, magnitudes: tuple[float, ...] = MAGNITUDES
           ) -> dict[str, Any]:
    import torch

    from attnchecker.abft import Tolerance
    from attnchecker.abft.gemm import verify_gemm
    from attnchecker.gemm import device as gemm_device
    from attnchecker.kernels import triton_gemm_check as tg

    tol = Tolerance()
    c, a, b = _product(m, k, n, dtype, device)
    cpu = verify_gemm(c.cpu(), a.cpu(), b.cpu(), tol, directions=("row",))["row"]
    assert cpu.bound2 is not None
    cpu_ratio = float(torch.maximum(cpu.diff[0, :, 0].abs() / cpu.bound[0], cpu.diff[0, :, 1].abs() / cpu.bound2[0])
                      .max())
    chk = gemm_device.check_product(c.clone(), a, b, None, tol, correct=False)
    triton_ratio = float(chk.state[tg.STATE["worst"] : tg.STATE["worst"] + 1].view(torch.float32))
    rms = float(c.float().square().mean().sqrt())
    g = torch.Generator().manual_seed(1)
    picked = torch.randperm(m, generator=g)[:rows]
    cols = torch.randint(n, (rows,), generator=g)
    caught: dict[str, dict[str, float]] = {}
    for mag in magnitudes:
        bad = c.clone()
        bad[picked.to(device), cols.to(device)] = (bad[picked.to(device), cols.to(device)].float()
                                                   + mag * rms).to(dtype)
        cpu_bad = verify_gemm(bad.cpu(), a.cpu(), b.cpu(), tol, directions=("row",))["row"].bad[0]
        tri_bad = gemm_device.check_product(bad, a, b, None, tol, correct=False).code.cpu() != 0
        caught[f"{mag:g}x_rms"] = {"cpu": float(cpu_bad[picked].float().mean()),
                                   "triton": float(tri_bad[picked].float().mean()),
                                   "clean_rows_flagged_cpu": int(cpu_bad.sum() - cpu_bad[picked].sum()),
                                   "clean_rows_flagged_triton": int(tri_bad.sum() - tri_bad[picked].sum())}
    return {"shape": [m, k, n], "dtype": str(dtype).removeprefix("torch."), "clean_worst_ratio_cpu": cpu_ratio,
            "clean_worst_ratio_triton": triton_ratio, "rms": rms, "caught": caught,
            "threshold": thresholds(c.cpu(), a.cpu(), b.cpu(), tol, rms)}


def thresholds(c: Any, a: Any, b: Any, tol: Any, rms: float) -> dict[str, Any]:
    """The smallest error each row rule flags, |e| > min(b1, b2/(j+1)) at column j, in units of the product's RMS
    (median and p90 over rows and columns), and the clean worst ratio: for the rule the checks use (the reference's
    norm bounded by the triangle inequality, Σ_j w_j ‖B_j‖) and with ‖B w‖ itself, which the operand pass has at
    hand (``direction_bounds(ref_norms=...)``, as the attention projections take it). Not a rule in use: what the
    second would give."""
    import torch

    from attnchecker.abft.checksum import checksum_weights
    from attnchecker.abft.tolerance import direction_bounds

    cf, af, bf = c.float(), a.float(), b.float()
    n = cf.shape[-1]
    w = checksum_weights(n, cf.device, torch.float32)
    bw = bf @ w
    ref, got = af @ bw, cf @ w
    use_abs = c.dtype != torch.float32
    out: dict[str, Any] = {}
    for name, extra in (("rule", {}), ("with_ref_norm", {"ref_norms": (bw.norm(dim=0), None)})):
        rule = direction_bounds(("row",), af.norm(dim=1), bf.norm(dim=0), k=af.shape[-1], out_dtype=c.dtype, tol=tol,
                                use_abs=use_abs, **extra)["row"]
        b1, b2 = rule.pair(cf.abs().sum(1) if use_abs else None, cf.square().sum(1), ref)
        least = torch.minimum(b1[:, None], b2[:, None] / torch.arange(1, n + 1, dtype=torch.float32)[None, :]) / rms
        sample = least.flatten()[:: max(1, least.numel() // 1_000_000)]
        d = (ref - got).abs()
        out[name] = {"least_error_rms_median": float(sample.median()),
                     "least_error_rms_p90": float(sample.quantile(0.9)),
                     "clean_worst_ratio": float(torch.maximum(d[:, 0] / b1, d[:, 1] / b2).max())}
    return out


def timing(m: int, k: int, n: int, dtype: Any, rounds: int, reps: int) -> dict[str, Any]:
    import torch

    from attnchecker.abft import Tolerance
    from attnchecker.gemm import device as gemm_device

    c, a, b = _product(m, k, n, dtype, "cuda")
    tol = Tolerance()

    def cuda_timed(fn: Any) -> Any:
        def run() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / reps

        return run

    fns = {"gemm": cuda_timed(lambda: torch.mm(a, b, out=c)),
           "check": cuda_timed(lambda: gemm_device.check_product(c, a, b, None, tol)),
           "tier1": cuda_timed(lambda: gemm_device.trip_product(c, a, b, None, tol))}
    samples = _common.interleaved(fns, rounds=rounds, warmup=2)
    ratio = _common.ratios(samples, "gemm")
    return {"shape": [m, k, n], "dtype": str(dtype).removeprefix("torch."),
            "seconds": {name: _common.summary(s) for name, s in samples.items()},
            "ratio_vs_gemm": {name: ratio[name] for name in ("check", "tier1")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from attnchecker.kernels import triton_gemm_check as tg

    if not (tg.available() and (cuda or tg.interpreted())):
        print("triton_gemm_check: needs triton, and TRITON_INTERPRET=1 set before triton is imported where there is "
              "no CUDA device", file=sys.stderr)
        return 2
    width = SIZES["tiny" if args.tiny else "full"]
    m = min(args.tokens, 32) if args.tiny else args.tokens
    device = "cuda" if cuda else "cpu"
    mags = (2.0,) if args.tiny else MAGNITUDES
    results = [detect(m, width, width, dtype, device, min(args.rows, m), mags)
               for dtype in (torch.float32, torch.bfloat16)]
    rows = [[r["dtype"], f"{r['shape']}", r["clean_worst_ratio_cpu"], r["clean_worst_ratio_triton"],
             *(f"{r['caught'][key]['cpu']:.0%} / {r['caught'][key]['triton']:.0%}" for key in r["caught"])]
            for r in results]
    print(f"detect ({device}{', Triton interpreter' if not cuda else ''}), {min(args.rows, m)} faulty rows a check")
    print(_common.table(rows, ["dtype", "M, K, N", "clean worst ratio (CPU rule)", "(Triton pass)",
                               *(f"{mag:g}x RMS caught CPU / Triton" for mag in mags)]))
    print("the least error each row rule flags, in RMS of the product (median over rows and columns), and its clean "
          "worst ratio: the rule in use, and with ‖B w‖ in place of its triangle bound")
    print(_common.table([[r["dtype"], r["threshold"]["rule"]["least_error_rms_median"],
                          r["threshold"]["rule"]["clean_worst_ratio"],
                          r["threshold"]["with_ref_norm"]["least_error_rms_median"],
                          r["threshold"]["with_ref_norm"]["clean_worst_ratio"]] for r in results],
                        ["dtype", "rule: least error / RMS", "clean worst", "with ‖Bw‖: least error / RMS",
                         "clean worst"]))
    payload: dict[str, Any] = {"device": device, "interpreted": not cuda, "detect": results}
    if cuda:
        big = args.tokens if not args.tiny else 256
        timed = [timing(big, width, width, dtype, args.rounds, args.reps) for dtype in (torch.bfloat16,)]
        payload["time"] = timed
        print(_common.table([[t["dtype"], f"{t['shape']}", t["seconds"]["gemm"]["median"] * 1e3,
                              f"{t['ratio_vs_gemm']['check']['median']:.1%}",
                              f"{t['ratio_vs_gemm']['tier1']['median']:.1%}"] for t in timed],
                            ["dtype", "M, K, N", "GEMM ms", "check / GEMM", "tier 1 / GEMM"]))
    else:
        print("time: no CUDA device here; this section runs on a GPU")
    path = _common.write_result("triton_gemm_check", payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
