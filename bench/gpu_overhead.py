"""Step time and peak GPU memory of full protection on a CUDA device: unprotected SDPA vs the tiled path vs the
unfused path (issue 12). Prepared without a GPU: run it first thing on one (tests marked `gpu` run it --tiny).

Same model and step as bench/memory.py (GPT-2 stack, 2 layers, n_embd 256, 8 heads, B = 1, vocab 8192), on cuda:0.
Time: the variants are stepped in interleaved, shuffled rounds, each step closed by torch.cuda.synchronize(); the
overhead is the median of per-round ratios against the baseline. Memory: torch.cuda.max_memory_allocated over one
step after a warm-up step (reset_peak_memory_stats in between), per variant in turn (the CUDA caching allocator's
peak counter is exact per process, so no subprocess is needed).

What to expect: the PyTorch backend launches a few dozen kernels per tile, so on a GPU it is bound by launch latency
at these sizes; the numbers are the baseline a fused (Triton) kernel implementing abft/tiled.py's contract must beat.

    python bench/gpu_overhead.py [--seqs 1024,2048,4096] [--mem-seqs 4096,8192,16384] [--rounds 5] [--tiny]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import memory

VARIANTS = ("baseline", "tiled", "unfused")


def _timed_step(built: tuple[Any, Any, Any, Any], variant: str) -> float:
    import torch

    os.environ["ATTNCHECKER_ATTENTION"] = variant if variant != "baseline" else "auto"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    memory._step(*built)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096")
    ap.add_argument("--mem-seqs", default="4096,8192,16384")
    ap.add_argument("--unfused-max", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_overhead: no CUDA device visible (torch.cuda.is_available() is False); run it on a GPU machine",
              file=sys.stderr)
        return 2
    size = memory.SIZES["tiny" if args.tiny else "full"]
    seqs = [64] if args.tiny else [int(s) for s in args.seqs.split(",")]
    mem_seqs = [128] if args.tiny else [int(s) for s in args.mem_seqs.split(",")]
    timing = []
    for seq in seqs:
        built = {v: memory._build(size, seq, v, device="cuda") for v in VARIANTS}
        samples = _common.interleaved({v: (lambda v=v, b=built[v]: _timed_step(b, v)) for v in VARIANTS},
                                      rounds=2 if args.tiny else args.rounds, warmup=1, seed=seq)
        ratios = _common.ratios(samples, "baseline")
        timing.append({"seq": seq, "variants": {v: {"step_s": _common.summary(samples[v]), "samples_s": samples[v],
                                                    "ratio_vs_baseline": ratios[v]} for v in VARIANTS}})
        del built
        torch.cuda.empty_cache()
    peaks = []
    for seq in mem_seqs:
        entry: dict[str, Any] = {"seq": seq, "variants": {}}
        for v in VARIANTS:
            if v == "unfused" and seq > args.unfused_max:
                continue
            try:
                built = memory._build(size, seq, v, device="cuda")
                _timed_step(built, v)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                seconds = _timed_step(built, v)
                entry["variants"][v] = {"peak_mb": torch.cuda.max_memory_allocated() / 2**20,
                                        "step_mb": (torch.cuda.max_memory_allocated() - before) / 2**20,
                                        "step_s": seconds}
            except torch.OutOfMemoryError as exc:
                entry["variants"][v] = {"error": f"out of memory: {exc}"[:300]}
            built = None
            torch.cuda.empty_cache()
        base = entry["variants"].get("baseline", {})
        for e in entry["variants"].values():
            if "step_mb" in e and "step_mb" in base:
                e["step_ratio_vs_baseline"] = e["step_mb"] / base["step_mb"]
        peaks.append(entry)
    print(_common.table([[e["seq"], v, e["variants"][v]["step_s"]["median"],
                          _common.pct(e["variants"][v]["ratio_vs_baseline"]["median"])]
                         for e in timing for v in VARIANTS], ["T", "variant", "step s", "overhead"]))
    print(_common.table([[e["seq"], v, e["variants"][v].get("step_mb", float("nan")),
                          e["variants"][v].get("step_ratio_vs_baseline", float("nan"))]
                         for e in peaks for v in e["variants"]], ["T", "variant", "step MB", "x baseline"]))
    path = _common.write_result("gpu_overhead", {"size": size, "device": torch.cuda.get_device_name(0),
                                                 "time": timing, "memory": peaks}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
