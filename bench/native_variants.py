"""What the wheel's portable native kernels cost against ones built for this CPU (issue 33): the same checked calls
through each build of the kernels (attnchecker/kernels/build.py):

  native      built here at first use with -march=native (a source checkout with a compiler)
  x86-64-v4   the wheel's prebuilt variant for AVX-512 CPUs (what ``load`` takes on this machine from a wheel)
  x86-64-v3   the wheel's prebuilt variant for AVX2/FMA CPUs
  x86-64      the wheel's baseline variant (SSE2 only: any x86-64 CPU)
  off         ATTNCHECKER_NATIVE=0: no kernel, every check on its PyTorch path

Workloads, fp32, one torch thread, every op checked:
  attention   protected_sdpa, causal, B = 1, H = 8, T = 2048, D = 64, no grad: the native attention pass
              (kernels/fused_attention.c and its row checks)
  projection  check_linear of a GPT-2 c_attn output, x (8192, 768) · W (2304, 768): the one-pass checksum kernel
              (fused_pass.c) and the native row verdict (row_verify.c)

Each round runs one process per variant (a kernel is chosen once per process), in a freshly shuffled order; a process
reports the median of its timed calls, in process CPU time (one thread: what the call costs, less exposed than wall
time to the other jobs of a shared machine). Ratios are taken within a round against ``native``, then summarised over
the rounds (bench/_common.py: the machine is shared and drifts between rounds).

    python bench/native_variants.py [--rounds 3] [--calls 15] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, setup_path, summary, table, write_result

VARIANTS = ("native", "x86-64-v4", "x86-64-v3", "x86-64", "off")
WORKLOADS = ("attention", "projection")


def _child(variant: str, prebuilt: str, calls: int) -> dict[str, float]:
    setup_path()
    import torch

    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime
    from attnchecker.kernels import build

    build.PREBUILT_DIR = Path(prebuilt)
    from attnchecker.attention.pipeline import check_linear, protected_sdpa
    from attnchecker.kernels import fused_attention, fused_pass, row_verify

    torch.set_num_threads(1)
    if variant != "off":
        assert fused_attention.available() and fused_pass.available() and row_verify.available(), variant
        want = None if variant == "native" else f"-{variant}.so"
        got = build.loaded_from("fused_attention.c")
        assert got is not None and (want is None or got.name.endswith(want)), (variant, got)
    ctx = LayerContext(layer=0, runtime=Runtime(config=CheckConfig(), stats=OpStats()))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2048, 64, generator=g) for _ in range(3))
    x, w = torch.randn(4, 2048, 768, generator=g), torch.randn(2304, 768, generator=g) / 28
    y = torch.nn.functional.linear(x, w)

    def attention() -> None:
        with torch.no_grad():
            protected_sdpa(q, k, v, ctx=ctx, is_causal=True)

    def projection() -> None:
        check_linear(x, y, w, None, ctx=ctx, splits=(("q", 768), ("k", 768), ("v", 768)))

    out: dict[str, float] = {}
    for name, fn in (("attention", attention), ("projection", projection)):
        fn()
        times = []
        for _ in range(calls):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prebuilt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.prebuilt, args.calls)))
        return
    setup_path()
    from attnchecker.kernels import build

    rng = random.Random(0)
    samples: dict[str, dict[str, list[float]]] = {v: {w: [] for w in WORKLOADS} for v in VARIANTS}
    ratios: dict[str, dict[str, list[float]]] = {v: {w: [] for w in WORKLOADS} for v in VARIANTS}
    with tempfile.TemporaryDirectory() as prebuilt, tempfile.TemporaryDirectory() as cache:
        build.build_prebuilt(Path(prebuilt))
        for _ in range(args.rounds):
            order = list(VARIANTS)
            rng.shuffle(order)
            got = {}
            for variant in order:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNCHECKER_CACHE_DIR": cache,
                       "ATTNCHECKER_NATIVE": {"native": "native", "off": "0"}.get(variant, variant)}
                done = subprocess.run([sys.executable, __file__, "--child", variant, "--prebuilt", prebuilt,
                                       "--calls", str(args.calls)], env=env, capture_output=True, text=True,
                                      check=True, cwd=ROOT)
                got[variant] = json.loads(done.stdout.strip().splitlines()[-1])
            for variant in VARIANTS:
                for w in WORKLOADS:
                    samples[variant][w].append(got[variant][w])
                    ratios[variant][w].append(got[variant][w] / got["native"][w])
    rows = []
    for variant in VARIANTS:
        row: list[object] = [variant]
        for w in WORKLOADS:
            ms, r = summary(samples[variant][w]), summary(ratios[variant][w])
            row += [f"{ms['median']:.2f} ({ms['min']:.2f}-{ms['max']:.2f})",
                    f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"]
        rows.append(row)
    print(table(rows, ["variant", "attention ms", "vs native", "projection ms", "vs native"]))
    path = write_result("native_variants", {
        "rounds": args.rounds, "calls": args.calls,
        "ms": {v: {w: summary(samples[v][w]) for w in WORKLOADS} for v in VARIANTS},
        "ratio_vs_native": {v: {w: summary(ratios[v][w]) for w in WORKLOADS} for v in VARIANTS},
        "samples_ms": samples, "machine": machine()}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
