"""Every benchmark runs end to end at its tiny size and writes JSON of the documented shape (docs/performance.md).

No timing assertions: the numbers on a shared CI machine mean nothing; only that they exist, are finite and
positive, and that the faults the recovery benchmark injects were really corrected.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_bench(name: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--tiny", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "|" in proc.stdout  # a table was printed
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1
    assert doc["benchmark"] == name
    assert {"cpu", "logical_cpus", "torch"} <= set(doc["machine"])
    return doc


def test_overhead_bench_prices_the_experts_eager_loop_on_mixtral(tmp_path):
    """--models mixtral: the variant with the expert banks on transformers' eager loop, and scope="all" over them."""
    doc = run_bench("overhead", tmp_path, "--rounds", "2", "--models", "mixtral", "--variants",
                    "baseline,baseline_eager_experts,all_tier1")
    (m,) = doc["models"]
    assert m["model"] == "mixtral"
    assert set(m["variants"]) == {"baseline", "baseline_eager_experts", "all_tier1"}
    for v in m["variants"].values():
        assert positive(v["step_s"]["median"]) and positive(v["ratio_vs_baseline"]["median"])


def positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_summary(s: dict) -> None:
    assert {"median", "p25", "p75", "min", "max", "n"} <= set(s)
    assert s["min"] <= s["median"] <= s["max"]


def test_overhead_bench_writes_every_variant(tmp_path):
    doc = run_bench("overhead", tmp_path, "--rounds", "2")
    assert [m["model"] for m in doc["models"]] == ["gpt2", "llama"]
    for m in doc["models"]:
        assert set(m["variants"]) == {"baseline", "baseline_copy", "full", "adaptive", "tier1", "paper", "skip",
                                      "finite", "dmr", "floor", "all_full", "all_adaptive", "all_tier1",
                                      "all_full_eager", "all_full_rules", "all_full_products", "full_unfused",
                                      "all_full_unfused", "full_softmax_ops", "all_tier1_sdpa"}
        for v in m["variants"].values():
            check_summary(v["step_s"])
            assert positive(v["step_s"]["median"])
            assert len(v["samples_s"]) == 2
            assert positive(v["ratio_vs_baseline"]["median"])
            # Each step's page faults and system time: counts of this process, one per timed step.
            assert len(v["minor_faults_samples"]) == 2 and all(f >= 0 for f in v["minor_faults_samples"])
            assert v["sys_s_per_step"]["min"] >= 0.0
        assert m["variants"]["baseline"]["ratio_vs_baseline"]["median"] == 1.0
        full = m["variants"]["full"]
        assert full["checked_step_fraction"] == 1.0
        assert set(full["check_s_per_step"]) == {"q", "k", "v", "scores", "context", "out"}
        assert m["variants"]["skip"]["checked_step_fraction"] == 0.0
        assert m["variants"]["skip"]["tier1_checks_per_step"] == 0.0  # mode off: no tier either
        tier1 = m["variants"]["tier1"]
        assert tier1["checked_step_fraction"] == 0.0
        assert tier1["tier1_checks_per_step"] > 0  # the tripwire ran on every timed step, nothing else did
        # scope="all" checks the Linear GEMMs forward and backward as well.
        # (with the one-pass kernel, and without it: the eager path the kernel is priced against; the same for the
        # native row verdict)
        for name in ("all_full", "all_full_eager", "all_full_rules", "all_full_products", "all_full_unfused"):
            assert m["variants"][name]["checked_step_fraction"] == 1.0
            assert {"linear", "linear_dx", "linear_dw"} <= set(m["variants"][name]["check_s_per_step"])
        # The attention backward: the encoded kernel's checks (scores_bwd is a product of the checked path only).
        assert m["variants"]["all_full"]["check_s_per_step"].get("scores_bwd", 0.0) == 0.0
        assert m["variants"]["all_full_products"]["check_s_per_step"]["scores_bwd"] > 0
        # ...and on its unchecked steps gives them tier 1: more tripwire checks per step than the attention scope's.
        all_tier1 = m["variants"]["all_tier1"]
        assert all_tier1["checked_step_fraction"] == 0.0
        assert all_tier1["tier1_checks_per_step"] > tier1["tier1_checks_per_step"]


def test_ab_whole_step_bench_times_both_check_paths(tmp_path):
    # HEAD as the other revision: any checkout has it; the A/B machinery is what is exercised.
    doc = run_bench("ab_whole_step", tmp_path, "HEAD", "--rounds", "2")
    (m,) = doc["models"]
    assert set(m["variants"]) == {"baseline", "all_full_old", "all_full_new"}
    for name, v in m["variants"].items():
        check_summary(v["step_s"])
        assert len(v["samples_s"]) == 2 and all(positive(x) for x in v["samples_s"])
        if name != "baseline":
            # Both paths really checked the whole step: the Linear GEMMs and the attention backward.
            assert {"linear", "linear_dx", "linear_dw", "grad_q"} <= set(v["check_s_per_step"])


def test_encoded_backward_bench_times_every_path_and_finds_every_threshold(tmp_path):
    doc = run_bench("encoded_backward", tmp_path)
    assert set(doc["timing"]["ms"]) == {"fused", "encoded", "encoded_unpadded", "products"}
    assert all(positive(x) for x in doc["timing"]["ms"].values())
    (fp32, bf16) = doc["sensitivity"]
    for row in (fp32, bf16):
        assert row["clean_flags"] == 0 and row["worst_clean_ratio"] < 1
        # A finite error is flagged within the sweep (up to 4096× RMS) on every output at this size.
        assert all(row[f"{op}_min_rms"] is not None for op in ("grad_q", "grad_k", "grad_v"))


def test_recovery_bench_corrects_every_injected_fault(tmp_path):
    doc = run_bench("recovery", tmp_path, "--rounds", "2")
    assert doc["checkpoint"]["bytes"] > 0
    check_summary(doc["checkpoint"]["save_file_s"])
    assert set(doc["scenarios"]) == {"scores_inf_0d", "context_nan_1d", "q_near_inf_0d", "scores_inf_2d"}
    for s in doc["scenarios"].values():
        # warm-up round + 2 timed rounds, one fault each
        assert s["corrected"] == 3 and s["uncorrectable"] == 0
        assert s["losses_finite"]
        assert set(s["intervals"]) == {"10", "100"}
        check_summary(s["step_extra_s"])


def test_ingest_bench_reports_throughput_and_enqueue_cost(tmp_path):
    doc = run_bench("ingest", tmp_path, "--backends", "sqlite", "--agents", "1,2")
    (backend,) = doc["backends"]
    assert backend["backend"] == "sqlite"
    assert [lv["agents"] for lv in backend["levels"]] == [1, 2]
    for lv in backend["levels"]:
        assert lv["error_count"] == 0
        assert positive(lv["events_per_s"]) and lv["latency_p50_s"] <= lv["latency_p99_s"]
    for side in ("up", "down"):
        assert positive(doc["enqueue"][side]["us_per_event"]["median"])
        assert doc["enqueue"][side]["dropped"] == 0
    assert set(doc["step"]["step_s"]) == {"none", "up", "down"}


def test_memory_bench_measures_every_variant_in_its_own_process(tmp_path):
    doc = run_bench("memory", tmp_path, "--repeats", "1", "--time")
    assert [e["seq"] for e in doc["memory"]] == [64]
    for entry in doc["memory"]:
        assert set(entry["variants"]) == {"baseline", "tiled", "tiled_torch", "unfused", "tiled_all"}
        for v in entry["variants"].values():
            check_summary(v["step_mb"])
            assert positive(v["process_mb"]["median"]) and v["step_mb"]["n"] == 1
            assert positive(v["step_ratio_vs_baseline"])
    for entry in doc["time"]:
        for v in entry["variants"].values():
            check_summary(v["step_s"])
            assert positive(v["ratio_vs_baseline"]["median"])


def test_memory_bench_times_a_padded_batch(tmp_path):
    doc = run_bench("memory", tmp_path, "--time-only", "--padded", "--variants", "tiled,tiled_torch")
    assert doc["memory"] == []
    for entry in doc["time"]:
        assert entry["padded"] is True
        assert set(entry["variants"]) == {"baseline", "tiled", "tiled_torch"}
        for v in entry["variants"].values():
            check_summary(v["step_s"])
            assert positive(v["ratio_vs_baseline"]["median"])


@pytest.mark.postgres
def test_fleet_bench_keeps_every_total_through_prune_and_the_quota_holds(tmp_path):
    testing = pytest.importorskip("collector_testing")
    if not testing.postgres_available():
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (set ATTNCHECKER_TEST_DATABASE_URL)")
    doc = run_bench("fleet", tmp_path)
    [history] = doc["history"]
    assert history["run_totals_unchanged"] and history["device_totals_unchanged"]
    assert history["runs_compared"] == 300
    assert sum(history["left_older_than_cutoff"].values()) == 0 and history["left"]["fault_event"] > 0
    assert history["first_device"] == history["history"]["bad_device"]
    for name in ("devices_list_s", "device_detail_s", "metrics_s"):
        assert all(positive(x) for x in history[name])
    [suspicion] = doc["suspicion"]
    assert all(0 <= v <= 1 for v in suspicion["null"].values())
    [quota] = doc["quota"]
    assert quota["statuses"] == {"201": 100, "429": 10} and quota["metrics_runs"] == 100


def test_tripwire_fusion_bench_times_both_modes_and_reads_the_kernels(tmp_path):
    doc = run_bench("tripwire_fusion", tmp_path)
    assert set(doc["per_call_s"]) == {"eager", "eager_tripwire", "compiled", "compiled_tripwire"}
    for name in ("ratio_eager", "ratio_compiled"):
        check_summary(doc[name])
        assert positive(doc[name]["median"])
    # inductor folds the tripwire's reduction into the loop that applies GELU (docs/performance.md): one kernel
    assert len(doc["kernels"]["compiled_tripwire"]["kernels"]) == len(doc["kernels"]["compiled"]["kernels"])
    assert doc["kernels"]["compiled_tripwire"]["reduction_in_gelu_kernel"]


def test_triton_gemm_check_bench_compares_the_two_rules(tmp_path):
    pytest.importorskip("triton")
    doc = run_bench("triton_gemm_check", tmp_path)
    assert [r["dtype"] for r in doc["detect"]] == ["float32", "bfloat16"]
    for r in doc["detect"]:
        assert 0 <= r["clean_worst_ratio_triton"] < 1 and 0 <= r["clean_worst_ratio_cpu"] < 1
        for caught in r["caught"].values():
            assert caught["clean_rows_flagged_cpu"] == caught["clean_rows_flagged_triton"] == 0
            assert 0 <= caught["triton"] <= 1


def test_gpu_suite_dry_run_runs_every_section_on_the_cpu(tmp_path: Path) -> None:
    """bench/gpu_suite.py --dry-run: every section end to end on a CPU (Triton's interpreter, tiny sizes), so the
    device script's first run on a GPU does not die on a typo. The gpu-marked tests section is left out here (it runs
    pytest, and they skip without a GPU)."""
    out = tmp_path / "gpu_suite.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_suite.py"), "--dry-run", "--skip-tests", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["dry_run"] and doc["device"] == "cpu"
    for section in ("steps", "kernel", "vendor_residuals", "backward_kernel", "gemm_check", "attribution",
                    "coverage", "tiles"):
        assert "error" not in doc[section] and "skipped" not in doc[section], (section, doc[section])
    assert [r["backend"] for r in doc["vendor_residuals"]["rows"] if "error" not in r] == ["cpu_flash"] * 12
    backward = doc["vendor_residuals"]["backward"]["rows"]
    assert [r["backend"] for r in backward if "error" not in r] == ["cpu_flash"] * 12
    steps = {(r["model"], r["seq"]): r for r in doc["steps"]}
    assert set(steps) == {("gpt2_small", 32), ("llama_7b", 32)}
    for row in steps.values():
        assert set(row["variants"]) == {"baseline", "full", "default", "all_full", "all_default"}
        assert all(positive(v["step_s"]["median"]) for v in row["variants"].values())
        assert row["variants"]["full"]["backends"], "a protected row names the backend that ran"
        # The guard's own overhead ratio beside the measured one (on a CPU its host time inside the checks).
        assert row["variants"]["full"]["guard_overhead_ratio"]["median"] > 0
        assert "guard_overhead_ratio" not in row["variants"]["baseline"]
    for section in ("kernel", "backward_kernel"):
        for row in doc[section]["rows"]:
            assert all(positive(x) for x in row.values() if isinstance(x, float)), row
    for row in doc["coverage"]["rows"]:
        assert 0 < row["attention_core_share"] < 1
    # The GEMM checks timed beside their GEMM, with the rows in runs and with one pair a row (2 runs at 512 columns).
    gemm_rows = {tuple(r["shape"]): r for r in doc["gemm_check"]["rows"]}
    assert gemm_rows[(64, 64, 512)]["runs"] == 2 and gemm_rows[(64, 64, 64)]["runs"] == 1
    for row in gemm_rows.values():
        assert set(row["ratio_vs_gemm"]) == {"check", "check_one_pair", "tier1"}
        assert all(positive(s["median"]) for s in row["seconds"].values())
    # Each GPU class's tiles timed side by side, a 99 KB GPU's smallest among them.
    tiles = {(r["kernel"], tuple(r["tiles"]), r["stages"]): r for r in doc["tiles"]["rows"]}
    assert {("forward", (16, 16), 2), ("backward", (16, 16), 2), ("backward", (32, 32), 2)} <= set(tiles)
    # And the 128-row forward tiles, the launcher's choice nowhere yet (gpu_suite.FORWARD_TILES_TRIED).
    assert {("forward", (128, 64), 3), ("forward", (128, 128), 2)} <= set(tiles)
    # The backward at its chosen warps and at the other count, side by side (kernels.warps_for).
    warps = {(tuple(r["tiles"]), r["stages"], r["warps"]) for r in doc["tiles"]["rows"] if r["kernel"] == "backward"}
    assert {((32, 32), 2, 4), ((32, 32), 2, 8)} <= warps
    assert all(positive(r["off_ms"]) for r in tiles.values())
    # Each choice in the forms of TILE_FORMS only: the kernel, tier 1, the full checks.
    for r in tiles.values():
        timed = {key[:-3] for key in r if key.endswith("_ms")}
        assert timed == ({"off", "tier1", "full"} if r["kernel"] == "forward" else {"off", "tripwire", "abft"}), r
    # Where a step's time goes: every variant profiled, against the unprotected step; and what a call costs the host.
    assert all(positive(v) for v in doc["attribution"]["host_us_per_call"].values())
    assert set(doc["attribution"]["host_us_per_call"]) == {"gemm_tier1", "aten_add"}
    for row in doc["attribution"]["rows"]:
        assert set(row["variants"]) == {"baseline", "default", "all_default", "all_full"}
        for entry in row["variants"].values():
            assert positive(entry["wall_ms_per_step"]) and positive(entry["host_ms_per_step"])
            assert set(entry["over_baseline"]) == {"wall_ms_per_step", "device_ms_per_step", "kernels_per_step",
                                                   "host_ms_per_step"}
    # Nsight Compute runs on a GPU machine only; here the section says why it did not.
    assert doc["profile"] == {"skipped": "--dry-run"} or "ncu not on the PATH" in doc["profile"]["skipped"]
    # The forward kernel's split of its checks' cost, SDPA beside it, and tier 1 over the vendor's forward.
    assert {"full_scores_ms", "full_context_ms", "full_no_repair_ms", "full_fp32_refs_ms", "full_fp32_refs_over_off",
            "sdpa_ms", "vendor_ms", "tier1_given_ms", "tier1_given_over_vendor", "tier1_given_over_sdpa"} \
        <= set(doc["kernel"]["rows"][0])
    assert set(doc["kernel"]["rows"][0]["warps_by_form"]) == {"off", "full"}  # what each ran on (block_sizes)
    # The full checks over the vendor's forward, timed beside the vendor's, SDPA's and the kernel's full checks.
    assert {"full_given_ms", "full_given_over_vendor", "full_given_over_sdpa", "full_given_over_full"} \
        <= set(doc["kernel"]["rows"][0])
    # A clean call with either form of the row references, or over the vendor's forward, flags nothing, and its
    # worst ratio sits under the bound.
    for form in ("full", "full_fp32_refs", "full_given"):
        assert doc["kernel"]["rows"][0][f"{form}_flagged"] is False
        assert 0.0 < doc["kernel"]["rows"][0][f"{form}_worst_ratio"] < 1.0
    # The backward's two forms of the references, timed side by side (run(refs_by_dot=False)).
    assert {"sdpa_ms", "tripwire_given_ms", "tripwire_given_over_sdpa", "abft_over_off",
            "abft_fp32_refs_over_off"} <= set(doc["backward_kernel"]["rows"][0])


def test_gpu_suite_reads_nsight_computes_raw_csv() -> None:
    """The profile section's parse of `ncu --csv --page raw`: the program's own lines and ncu's notes before the
    header, a units line after it, one line per profiled launch. In a fresh process: importing bench/ scripts puts
    bench/ first on sys.path, where bench/coverage.py would shadow the coverage package."""
    text = "\n".join([
        "==PROF== Connected to process 1234",
        "some output of the profiled program",
        '"ID","Process ID","Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum"',
        '"","","","usecond","inst"',
        '"0","1234","_attention","4176.2","9170000"',
        '"1","1234","_attention","7.1","1200"',
        "==PROF== Disconnected from process 1234",
    ])
    code = ("import json, sys; sys.path.insert(0, 'bench'); import gpu_suite\n"
            "print(json.dumps([gpu_suite._ncu_rows(sys.stdin.read()), gpu_suite._ncu_rows('==ERROR== no counters')]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input=text, capture_output=True, text=True,
                          timeout=120, check=True)
    rows, none = json.loads(proc.stdout)
    assert [r["Kernel Name"] for r in rows] == ["_attention", "_attention"]
    assert rows[0]["gpu__time_duration.sum"] == "4176.2" and rows[1]["smsp__inst_executed.sum"] == "1200"
    assert none == []


def test_attached_bench_without_the_second_copy_runs_two_models_in_rotation(tmp_path: Path) -> None:
    """--no-plain-again (issue 32's harness gap): plain and protected only, in the timed rounds and the bare control."""
    doc = run_bench("attached_overhead", tmp_path, "--rounds", "2", "--policy", "default", "--bare-control",
                    "--no-plain-again")
    assert doc["plain_again"] is False
    assert set(doc["variants"]) == {"plain", "protected"}
    assert set(doc["bare_control"]["variants"]) == {"plain", "protected_bare"}
    assert positive(doc["variants"]["protected"]["cpu"]["ratio_vs_plain"]["median"])


def test_harness_gap_bench_steps_both_designs_in_one_rotation_and_pools_their_rounds(tmp_path: Path) -> None:
    """bench/harness_gap.py (issue 32's harness gap): the six jobs in one run, each protected job with its checks'
    share and what it adds outside them; --pool pairs the rounds of two runs, so a comparison has both runs' rounds
    and one median per run."""
    runs = []
    for seed in (1, 2):
        doc = run_bench("harness_gap", tmp_path / str(seed), "--rounds", "2", "--seed", str(seed))
        assert set(doc["variants"]) == {"orig_plain", "orig_per_step", "orig2_once", "copy_plain", "copy_per_step",
                                        "copy_once"}
        for name, v in doc["variants"].items():
            check_summary(v["step_s"])
            assert len(v["samples_s"]) == 2 and all(positive(x) for x in v["samples_s"])
            assert ("check_share" in v) == name.endswith(("_once", "_per_step"))
        assert all(positive(v["check_share"]) for n, v in doc["variants"].items() if "check_share" in v)
        runs.append(tmp_path / str(seed) / "harness_gap.json")
    out = tmp_path / "pool.json"
    proc = subprocess.run([sys.executable, str(BENCH / "harness_gap.py"), "--pool", *map(str, runs), "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pooled = json.loads(out.read_text())
    for c in pooled["comparisons"]:
        assert c["ratio"]["n"] == 4 and len(c["run_medians"]) == 2
        assert c["ratio"]["min"] <= min(c["run_medians"]) <= max(c["run_medians"]) <= c["ratio"]["max"]


def test_harness_gap_code_path_finds_a_guard_left_on_running_the_same_calls_as_a_fresh_one(tmp_path: Path) -> None:
    """--code-path (docs/performance.md, "Both designs in one rotation"): a step under a guard left on past its
    warm-up calls the same functions, as often, as one under a guard attached just before it, and what a live guard
    keeps between steps is the engine's cached tensors, no step's memory. Either failing means the two harness
    designs no longer time the same work."""
    out = tmp_path / "code_path.json"
    proc = subprocess.run([sys.executable, str(BENCH / "harness_gap.py"), "--code-path", "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "harness_gap_code_path"
    assert doc["functions"] == doc["functions_fresh"] > 100
    assert doc["call_counts_differ"] == []
    # One storage per cache entry (checksum weights, bound weights, histogram edges): nothing else outlives a step.
    assert doc["tensors_held_between_steps"] == doc["engine_cache_entries"] > 0


def test_attached_bench_measures_the_protected_copy_against_its_own_bare_control(tmp_path: Path) -> None:
    doc = run_bench("attached_overhead", tmp_path, "--rounds", "2", "--policy", "default", "--bare-control")
    assert (doc["scope"], doc["policy"], doc["detections"]) == ("all", "default", 0)
    assert set(doc["variants"]) == {"plain", "plain_again", "protected"}
    for v in doc["variants"].values():
        check_summary(v["cpu"]["step_s"])
        assert positive(v["cpu"]["ratio_vs_plain"]["median"])
    assert positive(doc["check_s_per_step"]["median"])  # the tripwire ran on the protected job's timed steps
    bare = doc["bare_control"]
    assert set(bare["variants"]) == {"plain", "plain_again", "protected_bare"}
    assert all(bare["variants"][n][clock]["step_s"]["n"] == 2 for n in bare["variants"] for clock in ("cpu", "wall"))
    # corrected = measured / bare, both medians of per-round ratios to plain
    measured = doc["variants"]["protected"]["cpu"]["ratio_vs_plain"]["median"]
    own = bare["variants"]["protected_bare"]["cpu"]["ratio_vs_plain"]["median"]
    assert bare["corrected_ratio"]["cpu"] == pytest.approx(measured / own)


def test_triton_resources_counts_the_key_tile_loop_of_an_offline_sm90_build(tmp_path: Path) -> None:
    """bench/triton_resources.py's --mix (docs/performance.md §7, §9): the loop it counts is the key-tile loop, the one
    holding the tile products on the tensor cores, and a variant that checks more issues more there. Compiled
    offline as an H100's JIT specialises the launch (Triton's compiler, its bundled ptxas and cuobjdump), no GPU; in
    a fresh process, outside the interpreter the agent tests switch on. And what the launcher's tiles rest on: on
    one warpgroup a 64-row tile issues fewer instructions per score than on two (which compute QKᵀ and the softmax
    twice, or reduce each row across the warpgroups), and a tile with no masked element skips the mask's, in the
    forward and in the backward's query pass. And the loop by source line (loop_lines), which must account for every
    instruction of it, read from this checkout's files: Triton's shared cache (here an empty one) is neither read nor
    written, since a cubin in it may name another checkout's files."""
    code = (
        "import json, sys, dataclasses; sys.path.insert(0, 'bench'); import torch, triton, triton_resources as tr\n"
        "from triton.backends.compiler import GPUTarget\n"
        "blk = tr.ta.gpu_blocks(64, 232448, torch.bfloat16)\n"
        "def mix(kernel=None, blocks=blk, **kw):\n"
        "    c = triton.compile(tr.source('bf16', blocks, kernel, **kw), target=GPUTarget('cuda', 90, 32),\n"
        "                       options={'num_warps': blocks.warps, 'num_stages': blocks.stages})\n"
        "    return {**tr._per_scores(tr.loop_mix(c.asm['cubin']), blocks), **tr.loop_lines(c.asm['cubin'], 10**4)}\n"
        "eight = dataclasses.replace(blk, warps=8)\n"
        "print(json.dumps({'warps': blk.warps, 'plain': mix(MODE=0), 'tier1': mix(MODE=1, K_MAX_GIVEN=True),\n"
        "                  'full': mix(MODE=2), 'clean': mix(tr.clean_path_kernel(), MODE=2),\n"
        "                  'interior': mix(tr.interior_kernel(), MODE=0),\n"
        "                  'interior8': mix(tr.interior_kernel(), blocks=eight, MODE=0),\n"
        "                  'clean_interior': mix(tr.interior_kernel(clean=True), MODE=2),\n"
        "                  'clean_interior8': mix(tr.interior_kernel(clean=True), blocks=eight, MODE=2),\n"
        "                  'backward': {k: v for k, v in __import__('triton_kernels').compile_one(\n"
        "                      __import__('triton_kernels').kernels._query_pass, d=64, check=0, block=32, warps=4,\n"
        "                      mix=True).items() if k in ('loop_instructions', 'loop_special', 'interior')}}))\n"
    )
    shared = tmp_path / "triton-cache"
    shared.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "TRITON_CACHE_DIR": str(shared)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=540,
                          check=False, env=env)
    if proc.returncode != 0 and "No module named 'triton'" in proc.stderr:
        pytest.skip("triton is not installed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(shared.iterdir())
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, tier1 = got["plain"], got["tier1"]
    assert got["warps"] == 4  # bf16 at head dim 64 on an H100: one warpgroup a tile
    # QKᵀ and P̃V on the tensor cores, inside the loop; nothing spilled without checks.
    assert plain["loop_mix"]["tensor core"] > 0
    assert "local memory (spills)" not in plain["loop_mix"]
    assert 0 < plain["loop_instructions"] < plain["instructions"]
    # Its special-function unit does the softmax's ex2 only (a root or a reciprocal per tile is a check's).
    assert set(plain["loop_special"]) == {"EX2"} == set(got["backward"]["loop_special"])
    assert {"SQRT", "RCP"} <= set(got["full"]["loop_special"])
    # Tier 1 takes its key norms' running max from forward(), once per call: its loop is the plain one's within a
    # tenth (with every key's norm in it, it was half as long again).
    assert plain["loop_instructions"] <= tier1["loop_instructions"] <= 1.1 * plain["loop_instructions"]
    # The clean path (the flag-only branches made never-taken; the edit raises if the kernel's source moved on):
    # the same tile products, fewer instructions than the whole full-check loop, more than no checks.
    full, clean = got["full"], got["clean"]
    assert clean["loop_mix"]["tensor core"] == full["loop_mix"]["tensor core"] == plain["loop_mix"]["tensor core"]
    assert plain["loop_instructions"] < clean["loop_instructions"] < full["loop_instructions"]
    # The checks reduce along both tile axes: reductions across lanes the plain loop does not have.
    assert clean["loop_mix"]["shuffle (reduction across lanes)"] > plain["loop_mix"]["shuffle (reduction across lanes)"]
    # A flag costs the first pass a kept row only (locating and the columns' check are the repair kernel's): its whole
    # loop is within half its clean path again. With them in it, it was 5.2 times the clean path and spilled 1.7 KB.
    assert full["loop_instructions"] <= 1.5 * clean["loop_instructions"]
    # A tile below the diagonal skips the per-element mask: under a fifth of the loop at least (584 -> 388).
    assert got["interior"]["loop_instructions"] < 0.8 * plain["loop_instructions"]
    assert got["clean_interior"]["loop_instructions"] < clean["loop_instructions"]
    # There, per score, one warpgroup a tile issues under three quarters of what two do, with and without the checks.
    assert got["interior"]["per_1k_scores"] < 0.75 * got["interior8"]["per_1k_scores"]
    assert got["clean_interior"]["per_1k_scores"] < 0.75 * got["clean_interior8"]["per_1k_scores"]
    # The backward's query pass skips it too on such a tile (225 -> 158 per warp, unchecked, D = 64).
    backward = got["backward"]
    assert 0 < backward["interior"]["loop_instructions"] < 0.85 * backward["loop_instructions"]
    # By source line (--lines): every instruction of the loop is counted once, all but a few (a function's closing
    # line) on a line of the kernels' source, read back (the edited kernels' too); what the full checks add over the
    # plain loop is on the checks' own lines, the device functions of kernels/triton_checks.py.
    def on_checks(m: dict) -> int:
        return sum(x["instructions"] for x in m["loop_lines"] if x["at"].startswith("triton_checks.py:"))

    for m in (plain, full, clean, got["interior"], got["clean_interior"]):
        assert sum(x["instructions"] for x in m["loop_lines"]) + m["loop_lines_rest"] == m["loop_instructions"]
        assert sum(x["instructions"] for x in m["loop_lines"] if x["source"]) >= 0.99 * m["loop_instructions"]
    assert on_checks(clean) - on_checks(plain) > 0.5 * (clean["loop_instructions"] - plain["loop_instructions"])
    assert any("tl.dot(" in x["source"] for x in plain["loop_lines"])


def test_host_ops_bench_counts_a_protected_step_on_the_gpu_route_against_the_unprotected_one(tmp_path: Path) -> None:
    """bench/host_ops.py: what a step asks of the host on a GPU's route (Triton's interpreter here). The unprotected
    step launches no Triton kernel and waits for nothing; each protected one launches its checks as Triton kernels,
    waits only at the step boundary (the deferred outcomes and the gradients' finiteness: one read), and dispatches
    fewer than 30 aten ops beyond the unprotected step's on a step between full checks, fewer than 40 on a full-check
    step (2,237 more for full checks when the projections' full check ran as PyTorch ops; 56 for scope="all" before
    the checks' zeroed memory came from the guard's arena, checks/zeroed.py). The optimizer net's
    norms of every gradient are one foreach op, as CUDA runs them, not the CPU fallback's copy and norm per
    gradient."""
    pytest.importorskip("triton")
    doc = run_bench("host_ops", tmp_path)
    (model,) = doc["models"]
    steps = model["steps"]
    assert set(steps) == {"baseline", "full", "default_tier1", "all_full", "all_default_tier1"}
    assert steps["baseline"]["triton_launches"] == 0 and steps["baseline"]["syncs"] == 0
    assert steps["full"]["triton_by_kernel"]["check_pass"] > 0 and steps["full"]["triton_by_kernel"]["_attention"] > 0
    assert steps["all_full"]["triton_by_kernel"]["_query_pass"] > 0
    assert steps["default_tier1"]["triton_by_kernel"]["trip_pass"] > 0
    for name, step in steps.items():
        if name != "baseline":
            assert step["syncs_by_call"] == {"tolist": 1}, (name, step["syncs_by_call"])
            assert step["foreach_ops"] == {"_foreach_norm": 1}, (name, step["foreach_ops"])
            limit = 30 if name.endswith("_tier1") else 40
            assert 0 < step["over_baseline"]["aten_ops_launching"] < limit, (name, step["top_ops"])
    assert steps["baseline"]["foreach_ops"] == {}
    assert set(doc["host_us_per_call"]) == {"gemm_tier1", "gemm_full_check", "aten_add"}
    assert all(positive(us) for us in doc["host_us_per_call"].values())


def test_host_time_bench_times_a_replayed_step_on_the_gpu_route_against_the_unprotected_one(tmp_path: Path) -> None:
    """bench/host_time.py: the host's time a step on the GPU route spends outside its kernels. Each variant's launches
    are recorded once under the interpreter and replayed in the timed steps, which the bench checks are the recorded
    ones (the same launches in order, a finite loss, no detection: it exits non-zero otherwise). The unprotected step
    launches nothing and binds nothing; each protected one binds every launch it recorded, kernel by kernel. The
    profile times the step's functions where the engine calls them, each call seen."""
    pytest.importorskip("triton")
    doc = run_bench("host_time", tmp_path, "--profile", "default_tier1")
    assert doc["replay_target"] == ["cuda", 90, 32]
    (model,) = doc["models"]
    steps = model["steps"]
    assert set(steps) == {"baseline", "full", "default_tier1", "all_full", "all_default_tier1"}
    assert steps["baseline"]["triton_launches"] == 0 and steps["baseline"]["by_kernel"] == {}
    assert steps["baseline"]["triton_binding_us"]["max"] == 0
    for name, step in steps.items():
        check_summary(step["host_us"])
        assert positive(step["host_us"]["median"])
        if name != "baseline":
            kernels = step["by_kernel"]
            assert sum(k["launches"] for k in kernels.values()) == step["triton_launches"] > 0
            assert all(positive(k["binding_us"]) for k in kernels.values()), (name, kernels)
            assert positive(step["triton_binding_us"]["median"])
    assert {"trip_pass", "_trip_given"} <= set(steps["default_tier1"]["by_kernel"])
    assert {"check_pass", "repair_rows", "_query_pass"} <= set(steps["all_full"]["by_kernel"])
    prof = model["profile"]
    assert prof["variant"] == "default_tier1" and positive(prof["step_us"])
    sections = prof["sections"]
    # Two layers: one checked attention forward and backward each, and the GEMM checks' tier 1 on their projections.
    assert sections["kernels.triton_attention.forward"]["calls"] == 2
    assert sections["attention.backends.triton._KernelBackward.backward"]["calls"] == 2
    assert sections["gemm.device._trip"]["calls"] > 0 and "rest" in sections


def test_gemm_rule_terms_bench_weighs_both_forms_of_the_rule_on_clean_products(tmp_path: Path) -> None:
    """bench/gemm_rule_terms.py: per op and dtype the rule's bound on the same clean product with the reference's norm
    and with the triangle bound, neither flagging it (worst clean ratio under 1), the first never looser (‖B w‖ is at
    most the triangle bound), and each calibrated term named."""
    doc = run_bench("gemm_rule_terms", tmp_path)
    assert {(r["dtype"], r["op"]) for r in doc["rows"]} == {(d, op) for d in ("fp32", "bf16") for op in ("q", "out")}
    for r in doc["rows"]:
        tri, nrm = r["triangle"], r["ref_norms"]
        assert 0 < nrm["worst_clean_ratio"] < 1 and 0 < tri["worst_clean_ratio"] < 1
        assert 0 < nrm["median_bound_over_rms"] <= tri["median_bound_over_rms"] * (1 + 1e-6)
        assert set(r["median_variance_w1"]) == {"product", "reference_triangle", "reference_with_norm",
                                                "checksum_and_output"}


def test_the_kernel_benches_refuse_a_form_they_cannot_time_before_timing_anything() -> None:
    """bench_checks(forms=...) of either kernel: a name not in its BENCH_FORMS, or the vendor's forms without a
    vendor, is a ValueError that names what to choose from, raised before any kernel runs."""
    import torch

    from attnchecker.kernels import triton_attention, triton_attention_bwd

    shape = {"b": 1, "h": 1, "t": 16, "d": 16, "device": "cpu", "reps": 1}
    with pytest.raises(ValueError, match="choose from") as forward:
        triton_attention.bench_checks(**shape, forms=("off", "abft"))  # the backward's name
    assert "'abft'" in str(forward.value)
    with pytest.raises(ValueError, match="need vendor="):
        triton_attention.bench_checks(**shape, forms=("tier1_given",))
    with pytest.raises(ValueError, match="full_given bf16 or fp16"):
        triton_attention.bench_checks(**shape, forms=("full_given",), dtype=torch.float32,
                                      vendor=lambda *_a, **_k: None)
    with pytest.raises(ValueError, match="choose from") as backward:
        triton_attention_bwd.bench_checks(**shape, forms=("full",))  # the forward's name
    assert "'full'" in str(backward.value)


def test_vendor_residuals_measures_a_clean_vendor_forward_and_sees_one_wrong_output_element(tmp_path: Path) -> None:
    """bench/vendor_residuals.py on the CPU's flash kernel: every configuration measured, the context identity's
    residual under both forms of its bound on every clean row (what any bound of a full check over the vendor's
    forward must allow), the random-walk form catching smaller errors than the rigorous one. The same measurement
    with one output element moved by 5 times the output's RMS puts that row far past the bound: the measure is of O.
    The check as built (abft/given_forward.py) holds every clean row under its bounds and flags the moved one."""
    out = tmp_path / "vendor_residuals.json"
    proc = subprocess.run([sys.executable, str(BENCH / "vendor_residuals.py"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 12 and all("error" not in r for r in rows)
    for r in rows:
        for form in ("rB_ones_over_worst", "rB_ones_over_walk", "rB_ramp_over_worst", "rB_ramp_over_walk",
                     "given_a_ratio", "given_b_ratio"):
            assert 0 <= r[form]["p100"] < 1, (form, r)
        assert r["catches_walks_rms"]["p50"] <= r["catches_walk_rms"]["p50"] <= r["catches_worst_rms"]["p50"]
    sys.path.insert(0, str(BENCH))
    import torch
    import vendor_residuals as vr

    q, k, v = vr.inputs("randn", 1, 2, 96, 32, torch.bfloat16, "cpu", seed=0)
    o, lse = vr.vendor_forward("cpu_flash", q, k, v, is_causal=True, scale=32 ** -0.5)
    rows_R = torch.tensor([40])
    clean = vr.measure(q, k, v, o, lse, is_causal=True, scale=32 ** -0.5, rows=rows_R, heads=(0,))
    bad = o.clone()
    bad[0, 0, 40, 7] += 5 * float(o[0, 0, 40].float().pow(2).mean().sqrt())
    hit = vr.measure(q, k, v, bad, lse, is_causal=True, scale=32 ** -0.5, rows=rows_R, heads=(0,))
    assert clean["rB_ones_over_walk"]["p100"] < 1 < 5 < hit["rB_ones_over_walk"]["p100"]
    assert hit["rA"] == clean["rA"]  # the log-sum-exp's identity does not read O
    # The check as built flags that row too, by B alone.
    assert clean["given_b_ratio"]["p100"] < 1 < 5 < hit["given_b_ratio"]["p100"]
    assert hit["given_a_ratio"] == clean["given_a_ratio"]


def test_vendor_backward_residuals_measures_a_clean_vendor_backward_and_sees_one_wrong_gradient(tmp_path: Path
                                                                                                  ) -> None:
    """bench/vendor_backward_residuals.py on the CPU's flash kernel: every configuration measured, every clean row of
    the three identities (abft/given_backward.py) under its bound and none flagged, the catches reported. The same
    measurement with one dK element moved by 5 times its row's RMS puts that key far past the bound in K alone."""
    out = tmp_path / "vendor_backward_residuals.json"
    proc = subprocess.run([sys.executable, str(BENCH / "vendor_backward_residuals.py"), "--dry-run", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12 and all("error" not in r for r in rows)
    for r in rows:
        for name in "vkq":
            assert 0 <= r[f"{name}_ratio"]["p100"] < 1 and r[f"{name}_flagged"] == 0, (name, r)
            assert 0 < r[f"{name}_catches_rms"]["p50"] < 1, (name, r)
    sys.path.insert(0, str(BENCH))
    import torch
    import vendor_backward_residuals as vbr
    import vendor_residuals as vr

    q, k, v = vr.inputs("randn", 1, 2, 96, 32, torch.bfloat16, "cpu", seed=0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = vbr.vendor_backward("cpu_flash", q, k, v, do, is_causal=True, scale=32 ** -0.5)
    rows_R = torch.tensor([40])
    acc = vbr.accumulation_for("cpu_flash", 96)
    clean = vbr.measure(q, k, v, do, got, is_causal=True, scale=32 ** -0.5, rows=rows_R, heads=(0,), accumulation=acc)
    dk = got[3].clone()
    dk[0, 0, 40, 7] += 5 * float(dk[0, 0, 40].float().pow(2).mean().sqrt())
    hit = vbr.measure(q, k, v, do, (*got[:3], dk, got[4]), is_causal=True, scale=32 ** -0.5, rows=rows_R,
                      heads=(0,), accumulation=acc)
    assert clean["k_ratio"]["p100"] < 1 < 5 < hit["k_ratio"]["p100"] and hit["k_flagged"] == 1
    assert hit["v_ratio"] == clean["v_ratio"] and hit["q_ratio"] == clean["q_ratio"]


def test_the_device_scripts_tests_section_keeps_a_failures_traceback_when_its_budget_stops_it(tmp_path: Path) -> None:
    """gpu_suite's tests section runs pytest under a time budget; the H100 run lost two failures' tracebacks when the
    budget stopped it before pytest's summary. A gpu-marked test that fails, then one that outlasts the budget: the
    section reports the stop, and what pytest printed before it holds the failure's traceback (bench/_instafail.py).
    8 s: under the per-test limit the section sets (10 s at least), so the section's budget is what stops it."""
    tests = tmp_path / "test_device_like.py"
    tests.write_text(
        "import time\n"
        "import pytest\n\n"
        "@pytest.mark.gpu\n"
        "def test_fails_first():\n"
        "    assert 1 + 1 == 3, 'the arithmetic of a broken kernel'\n\n"
        "@pytest.mark.gpu\n"
        "def test_outlasts_the_budget():\n"
        "    time.sleep(60)\n")
    code = ("import json, sys; sys.path.insert(0, 'bench'); import gpu_suite\n"
            f"print(json.dumps(gpu_suite.marked_tests_section(8.0, files=[{str(tests)!r}])))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["timed_out_after_s"] == 8.0
    assert "_instafail: " in got["output_tail"] and "test_fails_first failed (call)" in got["output_tail"]
    assert "the arithmetic of a broken kernel" in got["output_tail"]
