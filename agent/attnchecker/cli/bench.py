"""`attnchecker bench overhead|recovery|ingest|reconnect|setups|memory|coverage|clean|... [...]`: run the
repository's bench/ scripts (docs/performance.md).

The benchmarks live in the checkout, not in the installed package; without a checkout this module raises
ImportError and the `bench` command is simply absent.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
if not (BENCH_DIR / "_common.py").is_file():
    raise ImportError(f"no bench/ directory at {BENCH_DIR} (attnchecker bench needs a repository checkout)")

SCRIPTS = {
    "overhead": "training-step overhead per protection variant (GPT-2, Llama)",
    "recovery": "in-line correction vs checkpoint/restore",
    "ingest": "collector events/s and latency, enqueue cost, transport step cost",
    "coverage": "fault coverage: detection vs error magnitude and vs flipped bit, clean false positives",
    "clean": "false positives on real training (stdlib text, GPT-2/BERT, masks, massive activations) per dtype",
    "reconnect": "how long after a killed collector is back the agent resumes sending",
    "setups": "LoRA projection check, fp16 scores in fp32, learned-bias backward (issue 11)",
    "memory": "peak memory of a protected training step per T (tiled vs unfused vs unprotected), and step time",
    "gemm_coverage": "share of a training step's GEMM FLOPs each protect() scope verifies",
    "tiled_profile": "where one protected attention layer's time goes on the tiled path, against fused SDPA",
}


FILES = {"clean": "clean_campaign"}
"""Benchmarks whose script is named otherwise (bench/<file>.py)."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run a benchmark from bench/ (prints a table, writes bench/results/*.json)",
                       description="Run a benchmark script from the repository's bench/ directory. Arguments after "
                                   "the benchmark name go to the script (try `attnchecker bench overhead --help`).")
    p.add_argument("benchmark", choices=sorted(SCRIPTS), help="; ".join(f"{k}: {v}" for k, v in SCRIPTS.items()))
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    script = BENCH_DIR / f"{FILES.get(args.benchmark, args.benchmark)}.py"
    # A child process: each benchmark sets torch's thread count and imports transformers on its own terms.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.call([sys.executable, str(script), *args.args], cwd=BENCH_DIR.parent, env=env)
