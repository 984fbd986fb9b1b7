"""bench/clean_campaign.py at its tiny size: real text, real training through protect(), every check the engine makes
counted per dtype, and nothing flagged on clean data; the same harness with one GEMM output corrupted below autograd
(an injector that knows nothing of attnchecker) does count a flag, so the counter is not always zero."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for sub in ("bench", "tests/agent"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

import clean_campaign as cc  # noqa: E402
from gemm_injector import GemmInjector, is_model_gemm  # noqa: E402
from test_bench_smoke import run_bench  # noqa: E402


@pytest.fixture(scope="module")
def corpus():
    return cc.stdlib_corpus(max_bytes=1 << 18)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_clean_campaign_counts_checks_per_dtype_and_flags_nothing(tmp_path):
    doc = run_bench("clean_campaign", tmp_path, "--checks", "200")
    assert set(doc["totals"]) == set(cc.DTYPES)
    for dtype, t in doc["totals"].items():
        assert t["short"]["checks"] >= 200, dtype
        assert t["long"]["checks"] > 0, dtype
        assert t["short"]["flags"] == t["long"]["flags"] == 0, (dtype, [r["detections"][:1] for r in doc["results"]])
    for r in doc["results"]:
        # Forward attention ops and the whole-step GEMMs (scope="all"), forward and backward, all counted.
        assert {"q", "k", "v", "scores", "context", "out", "linear", "linear_dx", "linear_dw"} <= set(r["checks_by_op"])
        assert 0 < r["worst_ratio"] <= 1
        assert r["max_abs_activation"] > 0
    # The planted massive channels (LayerNorm weights x50-300) show in the activations the checks saw.
    planted = min(r["max_abs_activation"] for r in doc["results"] if r["variant"] == "outliers")
    plain = max(r["max_abs_activation"] for r in doc["results"] if r["variant"] == "grow")
    assert planted > 5 * plain


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_short_runs_take_the_path_asked_for(tmp_path):
    # --path unfused: the T=64 runs on the path a GPU takes at short sequences, where a CPU's fp32 default takes the
    # native pass; named and recorded as such, and still clean.
    doc = run_bench("clean_campaign", tmp_path, "--checks", "100", "--dtypes", "tf32", "--path", "unfused",
                    "--long-steps", "0")
    assert doc["path"] == "unfused"
    assert {r["path"] for r in doc["results"]} == {"unfused"}
    assert all(r["run"].endswith("/unfused") for r in doc["results"])
    assert doc["totals"]["tf32"]["short"]["flags"] == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_gemm_fault_planted_below_autograd_is_counted_as_a_flag(corpus, dtype):
    run = cc.Run("gpt2", "causal+pad", "grow")
    # The clean run records every GEMM of the first step (corrupting none): the fault run hits the first of the
    # model's own (not a checksum's skinny product), one element set to 3e20.
    recorder = GemmInjector(target=None)
    clean = cc.train(run, dtype, size=cc.SIZES["tiny"], corpus=corpus, checks=10**9, max_steps=1, seed=0,
                     fault=lambda _model: recorder)
    assert clean["checks"] > 0 and clean["flags"] == 0
    target = next(c.index for c in recorder.calls if is_model_gemm(c))
    injector = GemmInjector(target=target, kind="near_inf")
    hit = cc.train(run, dtype, size=cc.SIZES["tiny"], corpus=corpus, checks=10**9, max_steps=1, seed=0,
                   fault=lambda _model: injector)
    assert injector.hit is not None
    assert hit["checks"] == clean["checks"]
    assert hit["flags"] >= 1
    assert hit["detections"][0]["kind"] == "near_inf"
    assert all(d["action"] in ("corrected", "recomputed") for d in hit["detections"])
