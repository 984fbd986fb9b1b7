"""The Triton GEMM check (kernels/triton_gemm_check.py) at realistic sizes (issue 32): does its one-pass verdict hold
where the bound matters, and what does it cost next to the GEMM.

- ``detect`` (CPU under Triton's interpreter, or CUDA): a Llama-7B projection's shape (K = N = 4096, M tokens),
  fp32 and bf16. Clean: the worst residual/bound ratio of the Triton pass and of ``abft.gemm.verify_gemm`` with the
  same runs (``groups``) on the same product. Faulty: one error of 1, 2 and 4 × the product's RMS element in each of
  ``--rows`` rows: the share of them each flags. Both evaluate the same rule; the two columns should agree. And the
  rule's tightness there: the least error it flags, in RMS units, with one pair a row and in runs (``thresholds``).
- ``time`` (CUDA only; gpu_suite's ``gemm_check`` section runs the same ``timing``): the GEMM (torch.mm, cuBLAS), the
  check of its output (two operand passes, the check pass, the repair kernel) in runs and with one pair a row, the
  tier-1 pass alone, each timed with CUDA events over ``--reps`` calls, median of ``--rounds`` interleaved rounds;
  the ratio to the GEMM. Not yet run on a GPU.

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
    runs = gemm_device.runs(n, tol)
    c, a, b = _product(m, k, n, dtype, device)
    cpu = verify_gemm(c.cpu(), a.cpu(), b.cpu(), tol, directions=("row",), groups=runs)["row"]
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
        cpu_bad = verify_gemm(bad.cpu(), a.cpu(), b.cpu(), tol, directions=("row",),
                              groups=runs)["row"].bad[0].view(m, runs).any(1)
        tri_bad = gemm_device.check_product(bad, a, b, None, tol, correct=False).code.cpu() != 0
        caught[f"{mag:g}x_rms"] = {"cpu": float(cpu_bad[picked].float().mean()),
                                   "triton": float(tri_bad[picked].float().mean()),
                                   "clean_rows_flagged_cpu": int(cpu_bad.sum() - cpu_bad[picked].sum()),
                                   "clean_rows_flagged_triton": int(tri_bad.sum() - tri_bad[picked].sum())}
    return {"shape": [m, k, n], "dtype": str(dtype).removeprefix("torch."), "runs": runs,
            "clean_worst_ratio_cpu": cpu_ratio,
            "clean_worst_ratio_triton": triton_ratio, "rms": rms, "caught": caught,
            "threshold": thresholds(c.cpu(), a.cpu(), b.cpu(), tol, rms)}


def thresholds(c: Any, a: Any, b: Any, tol: Any, rms: float) -> dict[str, Any]:
    """The smallest error the row rule flags, |e| > min(b1, b2/(j+1)) at place j of its checksum vector, in units of
    the product's RMS (median and p90 over rows and columns), and the clean worst ratio: with one checksum pair per
    row (``whole_rows``) and in the runs the Triton path checks (``runs``: verify_gemm(groups=runs)). Both with the
    reference's term from ‖B w‖."""
    import torch

    from attnchecker.abft.gemm import verify_gemm
    from attnchecker.gemm import device as gemm_device

    m, n = c.shape[-2:]
    out: dict[str, Any] = {}
    for name, groups in (("whole_rows", 1), ("runs", gemm_device.runs(n, tol))):
        chk = verify_gemm(c, a, b, tol, directions=("row",), groups=groups)["row"]
        assert chk.bound2 is not None
        b1, b2 = chk.bound[0].view(m, groups, 1), chk.bound2[0].view(m, groups, 1)
        place = torch.arange(1, n // groups + 1, dtype=torch.float32)
        least = (torch.minimum(b1, b2 / place) / rms).flatten()
        sample = least[:: max(1, least.numel() // 1_000_000)]
        d = chk.diff[0].abs()
        out[name] = {"runs": groups, "least_error_rms_median": float(sample.median()),
                     "least_error_rms_p90": float(sample.quantile(0.9)),
                     "clean_worst_ratio": float(torch.maximum(d[:, 0] / chk.bound[0], d[:, 1] / chk.bound2[0]).max())}
    return out


def timing(m: int, k: int, n: int, dtype: Any, rounds: int, reps: int, device: str = "cuda") -> dict[str, Any]:
    """The GEMM C = A·B (M, K, N) and what checking it costs, each over ``reps`` calls, ``rounds`` interleaved rounds
    (median and spread): ``check`` the full check as a guard runs it (two operand passes, the check pass with its
    rows in runs, the repair kernel), ``check_one_pair`` the same with one checksum pair per row
    (Tolerance(grouped=False): what the runs cost), ``tier1`` the tier-1 pass; and each one's ratio to the GEMM. On
    CUDA timed with CUDA events; on a CPU (Triton's interpreter: gpu_suite's dry run) with the wall clock, which says
    nothing of a GPU's."""
    import time

    import torch

    from attnchecker.abft import Tolerance
    from attnchecker.gemm import device as gemm_device
    from attnchecker.kernels import triton_gemm_check as tg

    c, a, b = _product(m, k, n, dtype, device)
    tol, one_pair = Tolerance(), Tolerance(grouped=False)

    def timed(fn: Any) -> Any:
        def run() -> float:
            if device != "cuda":
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                return (time.perf_counter() - t0) / reps
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / reps

        return run

    fns = {"gemm": timed(lambda: torch.mm(a, b, out=c)),
           "check": timed(lambda: gemm_device.check_product(c, a, b, None, tol)),
           "check_one_pair": timed(lambda: gemm_device.check_product(c, a, b, None, one_pair)),
           "tier1": timed(lambda: gemm_device.trip_product(c, a, b, None, tol))}
    samples = _common.interleaved(fns, rounds=rounds, warmup=2)
    ratio = _common.ratios(samples, "gemm")
    return {"shape": [m, k, n], "dtype": str(dtype).removeprefix("torch."), "device": device, "runs": tg.runs(n),
            "seconds": {name: _common.summary(s) for name, s in samples.items()},
            "ratio_vs_gemm": {name: ratio[name] for name in ("check", "check_one_pair", "tier1")}}


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
    print("the least error the row rule flags, in RMS of the product (median over rows and columns), and its clean "
          "worst ratio: one checksum pair a row, and in the runs the Triton path checks")
    print(_common.table([[r["dtype"], r["threshold"]["whole_rows"]["least_error_rms_median"],
                          r["threshold"]["whole_rows"]["clean_worst_ratio"], r["threshold"]["runs"]["runs"],
                          r["threshold"]["runs"]["least_error_rms_median"],
                          r["threshold"]["runs"]["clean_worst_ratio"]] for r in results],
                        ["dtype", "whole rows: least error / RMS", "clean worst", "runs", "in runs: least error / RMS",
                         "clean worst"]))
    payload: dict[str, Any] = {"device": device, "interpreted": not cuda, "detect": results}
    if cuda:
        big = args.tokens if not args.tiny else 256
        timed = [timing(big, width, width, dtype, args.rounds, args.reps) for dtype in (torch.bfloat16,)]
        payload["time"] = timed
        print(_common.table([[t["dtype"], f"{t['shape']}", t["seconds"]["gemm"]["median"] * 1e3,
                              f"{t['ratio_vs_gemm']['check']['median']:.1%}",
                              f"{t['ratio_vs_gemm']['check_one_pair']['median']:.1%}",
                              f"{t['ratio_vs_gemm']['tier1']['median']:.1%}"] for t in timed],
                            ["dtype", "M, K, N", "GEMM ms", "check / GEMM", "one pair a row", "tier 1 / GEMM"]))
    else:
        print("time: no CUDA device here; this section runs on a GPU")
    path = _common.write_result("triton_gemm_check", payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
