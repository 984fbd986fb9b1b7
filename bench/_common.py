"""Shared helpers for the benchmarks in bench/: interleaved timing, robust summaries, the machine record, tables and
the JSON every benchmark writes under bench/results/.

Why interleaved: the dev machines are shared and noisy. A variant timed in its own block sees a different machine
than the next one; timing every variant once per round, in a rotated order, and comparing within the round (a ratio
per round, then the median of the ratios) cancels most of the drift. Nothing here asserts on a time.
"""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCHEMA_VERSION = 1


def machine() -> dict[str, Any]:
    """What the numbers were measured on. No GPU is assumed: ``cuda`` says whether one was visible."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # glibc's allocator settings from the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, ...): they
        # decide how many page faults a step takes (docs/performance.md, "Page faults").
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"},
    }
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(), cuda=torch.cuda.is_available(),
                    copy_gb_s=copy_bandwidth_gb_s(), gemm_gflop_s=gemm_gflop_s())
    except ImportError:
        pass
    # A copy of the tree on a lent GPU machine carries git metadata that need not be this tree's (its field read
    # 0a0ac5b for 5c97468 on the H100 run): the caller, who knows the commit, says it there.
    given = os.environ.get("ATTNCHECKER_GIT_COMMIT")
    try:
        info["git_commit"] = given or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                     capture_output=True, text=True, check=False).stdout.strip() or None
    except OSError:
        info["git_commit"] = None
    return info


def copy_bandwidth_gb_s(mib: int = 128, repeats: int = 5) -> float:
    """GB/s of a ``mib`` MiB fp32 tensor copy (bytes read + written, best of ``repeats``, torch's threads as set).

    The phase of this shared machine, recorded beside each result: the checks are passes over memory, the GEMMs they
    check are not, so a run taken while the host's memory bandwidth is contended prices protection higher for the
    same code (docs/performance.md, "Two harnesses"). A load average does not show it; this does."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return round(2 * src.numel() * 4 / best / 1e9, 2)


def gemm_gflop_s(m: int = 1024, k: int = 512, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an fp32 GEMM (m, k) x (k, n) (best of ``repeats``, torch's threads as set): the bench model's MLP
    GEMM at its size (1024 tokens, hidden 512, 2048).

    The other half of the machine's phase, beside ``copy_bandwidth_gb_s``: a step's time is mostly GEMMs, its checks
    mostly passes over memory, so the overhead moves with the ratio of the two rates, for the same code."""
    import torch

    a, b = torch.ones(m, k), torch.ones(k, n)
    a @ b  # the first call allocates and warms the BLAS
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return round(2 * m * k * n / best / 1e9, 1)


def summary(xs: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max, and the p25/p75 quartiles) of a sample."""
    s = sorted(xs)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) >= 2 else [s[0], s[0], s[0]]
    return {"median": statistics.median(s), "p25": q[0], "p75": q[2], "min": s[0], "max": s[-1], "n": len(s)}


def interleaved(
    fns: Mapping[str, Callable[[], float | None]], *, rounds: int, warmup: int = 1, seed: int = 0
) -> dict[str, list[float]]:
    """Run every function once per round, in a freshly shuffled order, ``warmup`` untimed rounds first.

    A function may return its own measured seconds (to exclude its setup); None means "time the whole call".
    Returns name -> seconds per round, in round order (so per-round ratios pair up).
    """
    rng = random.Random(seed)
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[:]
        rng.shuffle(order)
        for n in order:
            t0 = time.perf_counter()
            got = fns[n]()
            dt = time.perf_counter() - t0 if got is None else got
            if r >= warmup:
                out[n].append(dt)
    return out


def ratios(samples: Mapping[str, Sequence[float]], base: str) -> dict[str, dict[str, float]]:
    """Per variant: the summary of its per-round time / the baseline's time in the same round."""
    b = samples[base]
    return {n: summary([x / y for x, y in zip(xs, b, strict=True)]) for n, xs in samples.items()}


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%"


def write_result(name: str, payload: Mapping[str, Any], out: str | os.PathLike[str] | None = None) -> Path:
    """Write bench/results/<name>.json (or ``out``) with the schema version, the command and the machine."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": name,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return path


def setup_path() -> None:
    """Make the repository's agent/ and server/ (and tests/, for the collector harness collector_testing)
    importable when a script runs from a checkout without installs."""
    for sub in ("agent", "server", "tests"):
        p = str(ROOT / sub)
        if p not in sys.path:
            sys.path.insert(0, p)
