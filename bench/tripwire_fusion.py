"""Tier 1 where the compiler can fuse it (issue 32, item 2): a Linear + GELU, compiled by torch.compile (inductor) with
and without the tripwire's extreme-value test on the Linear's output (``attnchecker.tripwire.extreme``, plain
traceable ops), against the same two eagerly. Eagerly the test is a pass over the output of its own; compiled,
inductor can fold its sum into the loop that applies GELU to the same values.

Sizes: GPT-2's MLP up projection at bench/overhead.py's width (x (B·T = 1024, 512), W (2048, 512), fp32, one torch
thread). Time: CPU process time of ``--calls`` calls per variant per round, the variants interleaved in shuffled
rounds; the figure is the median of the per-round ratios tripwire / plain, for eager and for compiled, with the IQR.
The kernels: inductor's generated code for each compiled variant, its kernel count and whether the tripwire's
reduction shares GELU's kernel.

    python bench/tripwire_fusion.py [--rounds 30] [--calls 5] [--seed 0] [--tiny] [--out PATH]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

SIZES = {"full": (1024, 512, 2048), "tiny": (64, 32, 128)}
"""(tokens, in features, out features)."""


def _variants(m: int, i: int, o: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[..., Any]], tuple]:
    import torch
    import torch.nn.functional as F

    from attnchecker.tripwire import extreme

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g) / i**0.5, torch.randn(o, generator=g)

    def plain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(x, w, b))

    def tripwire(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.linear(x, w, b)
        return F.gelu(y), extreme(y)

    fns = {"eager": plain, "eager_tripwire": tripwire, "compiled": torch.compile(plain),
           "compiled_tripwire": torch.compile(tripwire)}
    return {name: (lambda f=f: f(x, w, b)) for name, f in fns.items()}, fns, (x, w, b)


def _kernels(fn: Callable[..., Any], args: tuple) -> dict[str, Any]:
    """Inductor's generated code for ``fn``: its kernels (C++ on the CPU), and whether the one that applies GELU (erf)
    also holds a reduction."""
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(fn, *args)
    code = "\n".join(codes)
    names = sorted(set(re.findall(r"\b(cpp_fused_\w+|triton_\w+_fused_\w+)\b", code)))
    gelu = [n for n in names if "erf" in n or "gelu" in n]
    fused = [n for n in gelu if any(r in n for r in ("sum", "abs", "le", "all", "logical"))]
    return {"kernels": names, "gelu_kernels": gelu, "reduction_in_gelu_kernel": bool(fused)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    m, i, o = SIZES["tiny" if args.tiny else "full"]
    calls, fns, inputs = _variants(m, i, o)
    kernels = {name: _kernels(fns[name], inputs) for name in ("compiled", "compiled_tripwire")}

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.process_time()
            for _ in range(args.calls):
                fn()
            return (time.process_time() - t0) / args.calls

        return run

    rounds = 3 if args.tiny else args.rounds
    samples = _common.interleaved({n: timed(f) for n, f in calls.items()}, rounds=rounds, warmup=2, seed=args.seed)
    per_call = {n: _common.summary(s) for n, s in samples.items()}
    eager = _common.ratios({"plain": samples["eager"], "tripwire": samples["eager_tripwire"]}, "plain")["tripwire"]
    compiled = _common.ratios({"plain": samples["compiled"], "tripwire": samples["compiled_tripwire"]},
                              "plain")["tripwire"]
    rows = [
        ["eager", per_call["eager"]["median"] * 1e3, per_call["eager_tripwire"]["median"] * 1e3,
         _common.pct(eager["median"]), f"[{_common.pct(eager['p25'])}, {_common.pct(eager['p75'])}]", "-"],
        ["compiled", per_call["compiled"]["median"] * 1e3, per_call["compiled_tripwire"]["median"] * 1e3,
         _common.pct(compiled["median"]), f"[{_common.pct(compiled['p25'])}, {_common.pct(compiled['p75'])}]",
         f"{len(kernels['compiled']['kernels'])} -> {len(kernels['compiled_tripwire']['kernels'])}"],
    ]
    print(f"Linear + GELU, x ({m}, {i}) W ({o}, {i}), fp32, {args.threads} thread(s), {rounds} rounds x {args.calls}")
    print(_common.table(rows, ["mode", "plain ms", "with tripwire ms", "tripwire cost", "IQR", "kernels"]))
    print(f"compiled with the tripwire: kernels {kernels['compiled_tripwire']['kernels']}; the reduction in the GELU "
          f"kernel: {kernels['compiled_tripwire']['reduction_in_gelu_kernel']}")
    path = _common.write_result("tripwire_fusion", {
        "sizes": {"tokens": m, "in_features": i, "out_features": o, "dtype": "float32"},
        "rounds": rounds, "calls": args.calls, "seed": args.seed, "threads": args.threads,
        "per_call_s": per_call, "ratio_eager": eager, "ratio_compiled": compiled, "kernels": kernels,
        "samples_s": samples,
    }, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
