"""bench/gemm_coverage.py at its tiny size: the FLOP bookkeeping behind the per-scope coverage figures in
docs/fault-coverage.md. Each dense Linear GEMM's backward (dX and dW) costs exactly twice its forward, and the
attention core's backward (four products) twice its forward (two), so the classes must come out in those ratios."""
from __future__ import annotations

import pytest
from test_bench_smoke import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_gemm_coverage_counts_every_class_and_orders_the_scopes(tmp_path):
    doc = run_bench("gemm_coverage", tmp_path)
    assert [m["model"] for m in doc["models"]] == ["gpt2", "llama"]
    for m in doc["models"]:
        g = m["gflops"]
        for cls in ("projection", "other_linear"):
            assert g[f"backward/{cls}"] == pytest.approx(2 * g[f"forward/{cls}"], rel=1e-9)
        assert g["forward/projection"] > 0 and g["forward/other_linear"] > 0 and g["forward/attention_core"] > 0
        assert sum(g.values()) == pytest.approx(m["total_gflops"], rel=1e-9)
        share = m["covered_share"]
        assert share["attention"] == pytest.approx(
            (g["forward/projection"] + g["forward/attention_core"]) / m["total_gflops"], rel=1e-9)
        other = g["forward/other"] + g["backward/other"]
        assert share["attention"] < share["all"] == pytest.approx(1 - other / m["total_gflops"], rel=1e-9)
