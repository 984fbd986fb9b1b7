"""`attnchecker bench coverage --tiny` runs end to end through the CLI and writes the documented JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_coverage_bench_writes_rates_per_op_dtype_magnitude_and_bit(tmp_path):
    out = tmp_path / "coverage.json"
    proc = subprocess.run([sys.executable, "-m", "attnchecker.cli", "bench", "coverage", "--tiny", "--dtypes",
                           "fp32,bf16", "--clean-checks", "600", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "|" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "coverage"
    assert {(r["dtype"], r["op"]) for r in doc["results"]} == {
        (d, op) for d in ("fp32", "bf16") for op in ("q", "out", "scores", "context")}
    for r in doc["results"]:
        assert set(r["magnitude"]["calibrated"]) == {str(m) for m in doc["magnitudes"]}
        assert len(r["bits"]) == (32 if r["dtype"] == "fp32" else 16)
        # Tiny shapes: every error of 2x RMS or more is caught, and no clean vector is flagged.
        assert all(r["magnitude"]["calibrated"][str(m)] == 1.0 for m in doc["magnitudes"] if m >= 2)
        assert r["clean"]["flagged_vectors"] == 0
        assert 0 <= r["summary"]["exponent_bits"] <= 1
    for d in ("fp32", "bf16"):
        assert doc["clean"][d]["total_checks"] >= 600
        assert doc["clean"][d]["false_positives"] == 0


def attention_paths_run(tmp_path: Path, path: str, dtypes: str) -> subprocess.CompletedProcess[str]:
    """bench/coverage.py's fault sweeps of scores and context at the GPT-2 shape, 32 trials, on one attention path."""
    return subprocess.run([sys.executable, "bench/coverage.py", "--shapes", "gpt2", "--dtypes", dtypes, "--ops",
                           "scores,context", "--path", path, "--trials", "32", "--parts", "faults", "--out",
                           str(tmp_path / f"coverage_{path}.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)


def test_coverage_bench_drives_the_tiled_path(tmp_path):
    """--path tiled: scores and context checked tile by tile (GPT-2 shape: 4 query blocks of 256 rows over 1024
    keys, 4 key groups per scores row), grouped and ungrouped in one run; every 2x RMS error is caught and no clean
    vector flags."""
    proc = attention_paths_run(tmp_path, "tiled", "fp32,bf16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "coverage_tiled.json").read_text())
    assert doc["path"] == "tiled"
    assert {(r["dtype"], r["op"], r["path"]) for r in doc["results"]} == {
        (d, op, "tiled") for d in ("fp32", "bf16") for op in ("scores", "context")}
    for r in doc["results"]:
        for tol in ("calibrated", "calibrated_ungrouped"):
            assert all(r["magnitude"][tol][str(m)] == 1.0 for m in doc["magnitudes"] if m >= 2), (r["op"], tol)
        assert r["clean"]["flagged_vectors"] == 0 and r["clean_ungrouped"]["flagged_vectors"] == 0


def test_coverage_bench_writes_its_errors_inside_the_native_attention_pass(tmp_path):
    """--path kernel: scores and context errors written inside the native pass (GPT-2 shape, 4 key groups per scores
    row), its rows' verdict read; every 2x RMS error is caught, no clean row flags, and half-precision dtypes, which
    the kernel does not take, are refused with a message that says so."""
    from attnchecker.kernels import fused_attention

    if not fused_attention.available():
        pytest.skip("no C compiler or no BLAS sgemm_ here")
    proc = attention_paths_run(tmp_path, "kernel", "fp32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "coverage_kernel.json").read_text())
    assert {(r["op"], r["path"]) for r in doc["results"]} == {("scores", "kernel"), ("context", "kernel")}
    for r in doc["results"]:
        assert all(r["magnitude"]["calibrated"][str(m)] == 1.0 for m in doc["magnitudes"] if m >= 2), r["op"]
        assert r["clean"]["flagged_vectors"] == 0
        assert r["bits"]["30"]["rate"] == 1.0  # the top exponent bit: INF or a huge value
    bad = attention_paths_run(tmp_path, "kernel", "bf16")
    assert bad.returncode != 0 and "--path kernel covers fp32 scores and context" in bad.stderr


def test_coverage_bench_checks_the_projections_as_the_gpu_path_does(tmp_path):
    """--path triton: q and out through the GEMM checks' Triton path (its kernels under Triton's interpreter), by
    rows: every 2x RMS error is caught and no clean row flags, in bf16 and fp32; the attention's scores, which that path
    does not check, are refused with a message that says so."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}

    def run(ops: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "bench/coverage.py", "--tiny", "--dtypes", "fp32,bf16", "--ops", ops,
                               "--path", "triton", "--parts", "faults", "--out", str(tmp_path / "coverage.json")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)

    proc = run("q,out")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "coverage.json").read_text())
    assert {(r["dtype"], r["op"], r["path"]) for r in doc["results"]} == {
        (d, op, "triton") for d in ("fp32", "bf16") for op in ("q", "out")}
    for r in doc["results"]:
        assert all(r["magnitude"]["calibrated"][str(m)] == 1.0 for m in doc["magnitudes"] if m >= 2), r["op"]
        assert r["clean"]["flagged_vectors"] == 0 and 0 < r["clean"]["worst_d1_over_bound"] < 1
    bad = run("scores")
    assert bad.returncode != 0 and "--path triton covers the projections q and out" in bad.stderr
