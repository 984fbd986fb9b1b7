"""bench/triton_compile_matrix.py: the Triton launches the tests make under the interpreter, compiled for sm_90 as a
GPU launches them, offline (Triton's compiler and its bundled ptxas; no GPU).

The interpreter never compiles a kernel, so a configuration the compiler rejects passes every other test here. The
attention's repair kernel with a bool mask or dropout was one (bf16, head dim 64, Triton 3.9: a 1-bit tile through
shared memory); the GPU would have failed on the first such call. Where one fails, the report keeps the compiler's own
error lines, which MLIR prints below Python.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compile_matrix(out: Path, *args: str) -> dict:
    """bench/triton_compile_matrix.py with these arguments, its report written to ``out``: the report, after the tool
    exited 0 (every configuration compiled and fit)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "bench/triton_compile_matrix.py", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=840, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report: dict = json.loads(out.read_text())
    return report

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_repair_launches_of_a_bool_mask_and_of_dropout_compile_for_sm90(tmp_path: Path) -> None:
    """The bf16 calls with a bool mask, with and without dropout, in both check modes, recorded; the repair kernel's
    launches with the mask and dropout (after a full check, and after a tier-1 trip) compiled at the GPU's tiles
    (64 × 64 on 8 warps), operand mode (bf16 as it is) and head dim 64: both compile. That kernel carried the 1-bit
    tile the compiler rejected; the others are in the matrices of docs/perf (one to three minutes a repair
    configuration on one core, so this test compiles no more)."""
    pytest.importorskip("triton")
    report = compile_matrix(tmp_path / "matrix.json", "--head-dims", "64", "--jobs", "1",
                            "--only", "kernel=_attention,REPAIR=true,DROPOUT=true",
                            "tests/agent/test_triton_attention.py", "-k", "each_mask_kind and bool and bfloat16")
    assert report["arch"] == "sm_90" and report["failed"] == 0 and report["pytest"].startswith("4 passed")
    assert report["left_out_by_only"] > 0
    rows = report["rows"]
    assert {(r["constexprs"]["KEY_TILES"], r["constexprs"]["K_MAX_GIVEN"]) for r in rows} == {(True, False),
                                                                                               (False, True)}
    for r in rows:
        assert r["ok"] and r["reg"] > 0 and 0 < r["smem"] <= 232448
        assert r["kernel"] == "_attention" and r["constexprs"]["MODE"] == 2 and r["constexprs"]["REPAIR"]
        assert r["constexprs"]["MASK_KIND"] == 1 and r["constexprs"]["DOT"] == 0 and r["constexprs"]["DROPOUT"]
        assert (r["constexprs"]["BLOCK_M"], r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_D"]) == (64, 64, 64)
        assert r["options"] == {"num_warps": 8, "num_stages": 2}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_at_head_dim_128_a_99_kb_gpu_gets_key_tiles_that_fit(tmp_path: Path) -> None:
    """sm_89 (L4, L40S, RTX 40; sm_86 alike) gives a block at most 99 KB of shared memory. At head dim 128 the
    forward's 64 × 64 tiles needed up to 132 KB there, and a launch that needs more fails on the GPU. The same bf16
    bool-mask calls, their repair launches compiled for sm_89 with the tiles the launcher picks for such a GPU:
    64 × 32, within 99 KB (the tool fails a row that is not). The repair kernel needs the most of the forward's
    launches (90 KB after a tier-1 trip, against 33 KB for the first pass: docs/perf/triton_compile_matrix_sm89_*)."""
    pytest.importorskip("triton")
    report = compile_matrix(tmp_path / "matrix.json", "--arch", "89", "--head-dims", "128", "--jobs", "1",
                            "--only", "kernel=_attention,REPAIR=true,DROPOUT=false",
                            "tests/agent/test_triton_attention.py", "-k", "each_mask_kind and bool and bfloat16")
    assert report["arch"] == "sm_89" and report["failed"] == 0
    rows = report["rows"]
    assert len(rows) == 2 and all(r["kernel"] == "_attention" and r["constexprs"]["REPAIR"] for r in rows)
    for r in rows:
        assert (r["constexprs"]["BLOCK_M"], r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_D"]) == (64, 32, 128)
        assert 0 < r["smem"] <= 101376


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_on_a_99_kb_gpu_the_backwards_passes_get_tiles_that_fit_at_head_dims_128_and_256(tmp_path: Path) -> None:
    """The backward's key and query passes, on Triton's 3 stages of 32 × 32 tiles, needed 104 and 100 KB at head dim
    128 and 201 and 196 KB at 256: none could launch on sm_86 or sm_89 (99 KB a block). The launcher's tiles for such
    a GPU: 2 stages at 128, 16 × 16 on 2 at 256. The checked fp32 causal call whose lse is off in a row, recorded;
    its repair launches of both passes (full checks and the recompute: the most shared memory either pass needs),
    compiled for sm_89 at both head dims: every configuration fits (the tool fails a row that does not)."""
    pytest.importorskip("triton")
    report = compile_matrix(tmp_path / "matrix.json", "--arch", "89", "--head-dims", "128,256", "--jobs", "2",
                            "--only", "REPAIR=true",
                            "tests/agent/test_triton_attention_backward.py", "-k", "wrong_log_sum_exp")
    assert report["arch"] == "sm_89" and report["failed"] == 0
    passes = {(r["kernel"], r["constexprs"]["BLOCK_D"], r["constexprs"]["REPAIR"]): r for r in report["rows"]
              if r["kernel"] in ("_query_pass", "_key_pass")}
    assert len(passes) == 4 == len(report["rows"]), sorted(passes)
    for (_, d, _), r in passes.items():
        assert r["constexprs"]["CHECK"] == 2 and r["constexprs"]["CAUSAL"] and r["operand_dtype"] == "fp32"
        assert (r["constexprs"]["BLOCK_M"], r["options"]["num_stages"]) == ((32, 2) if d == 128 else (16, 2))
        assert 0 < r["smem"] <= 101376


def test_the_launcher_keeps_full_tiles_where_they_fit() -> None:
    """The 32-key tiles are for GPUs of under 160 KB a block past head dim 64 (and every GPU past 128); an A100 (163
    KB) and an H100 (227 KB) keep the 64 × 64 tiles they were compiled and timed with, and so does head dim 64. Past
    head dim 128 every GPU under 168 KB takes 16 × 16 tiles (64 × 32 needed up to 168 KB, 32 × 32 on one stage 116
    KB); an H100 keeps 64 × 32."""
    from attnchecker.kernels import triton_attention as ta

    assert [ta.gpu_blocks(128, limit).n for limit in (101376, 166912, 232448, None)] == [32, 64, 64, 64]
    assert [ta.gpu_blocks(64, limit).n for limit in (101376, None)] == [64, 64]
    assert [(b.m, b.n, b.stages) for b in (ta.gpu_blocks(256, limit) for limit in (101376, 166912, 232448))] \
        == [(16, 16, 2), (16, 16, 2), (64, 32, 2)]


def test_the_forward_takes_one_warpgroup_a_tile_where_two_programs_fit_an_sm() -> None:
    """4 warps a 64-row tile in bf16 and fp16 where two such programs' pipelined shared memory fits an SM (head dim
    64 on an A100, an H100; 128 on an H100 without the full checks, whose programs need 127 KB and more there), 8
    elsewhere: the 99 KB GPUs, fp32 inputs and head dim 256 (4 warps spill there), unknown limits."""
    import torch

    from attnchecker.kernels import triton_attention as ta

    h100, a100, small = 232448, 166912, 101376
    bf16 = torch.bfloat16
    assert [ta.gpu_blocks(64, limit, bf16).warps for limit in (h100, a100, small, None)] == [4, 4, 8, 8]
    assert [ta.gpu_blocks(64, h100, dtype).warps for dtype in (torch.float16, torch.float32)] == [4, 8]
    assert [ta.gpu_blocks(128, h100, bf16, full=full).warps for full in (False, True)] == [4, 8]
    assert [ta.gpu_blocks(128, a100, bf16, full=False).warps, ta.gpu_blocks(256, h100, bf16, full=False).warps] \
        == [8, 8]


def _tool() -> object:
    sys.path.insert(0, str(ROOT / "bench"))
    import triton_compile_matrix

    return triton_compile_matrix


def test_a_failed_compile_keeps_the_compiler_s_own_error_lines() -> None:
    """MLIR's passes print why they failed to fd 2 and Triton raises "PassManager::run failed": the row keeps the
    compiler's error lines first (here those the tool printed for the repair kernel before 0d5e9f6)."""
    tool = _tool()
    stderr = ("<unknown>:0: error: shared-memory element type bit width must be a multiple of 8; got 1\n"
              "<unknown>:0: note: see current operation: %0 = ttg.local_alloc\n"
              "agent/attnchecker/kernels/triton_attention.py:851:5: error: Failures have been detected while "
              "processing an MLIR pass pipeline\n")
    got = tool.diagnostics("PassManager::run failed", stderr)
    assert got == ["<unknown>:0: error: shared-memory element type bit width must be a multiple of 8; got 1",
                   "agent/attnchecker/kernels/triton_attention.py:851:5: error: Failures have been detected while "
                   "processing an MLIR pass pipeline"]
    assert tool.diagnostics("PassManager::run failed\nmore", "") == ["PassManager::run failed"]
    assert tool.diagnostics("PassManager::run failed", "knobs.py:504: UserWarning: TRITON_DEFAULT_FP_FUSION is unset\n"
                            ) == ["PassManager::run failed"]
    many = "".join(f"x.py:{i}:1: error: e{i}\n" for i in range(9))
    assert len(tool.diagnostics("", many)) == tool.DIAGNOSTICS


def test_fd2_is_captured_below_python_and_given_back(tmp_path: Path) -> None:
    """What a C++ pass writes to fd 2 (os.write, below sys.stderr) lands in the file, and fd 2 is the process's
    own again afterwards, also when the block raises."""
    tool = _tool()
    before = os.fstat(2)
    log = tmp_path / "stderr"

    def failing_pass() -> None:
        with tool.fd2_into(log):
            os.write(2, b"x.py:1:1: error: from below Python\n")
            raise RuntimeError("PassManager::run failed")

    with pytest.raises(RuntimeError, match="PassManager"):
        failing_pass()
    assert log.read_text() == "x.py:1:1: error: from below Python\n"
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)


def test_only_keeps_the_configurations_with_every_value_and_refuses_a_bare_key() -> None:
    """``--only kernel=_attention,REPAIR=true``: the kernel by name, a constexpr by its JSON value; a constexpr the
    kernel lacks matches nothing; a pair without ``=`` is refused with what to write instead."""
    import argparse

    tool = _tool()
    wanted = tool.only_filter("kernel=_attention, REPAIR=true,BLOCK_D=128")
    assert wanted == {"kernel": "_attention", "REPAIR": True, "BLOCK_D": 128}
    repair = {"kernel": "_attention", "constexprs": {"REPAIR": True, "BLOCK_D": 128}}
    first = {"kernel": "_attention", "constexprs": {"REPAIR": False, "BLOCK_D": 128}}
    tiles = {"kernel": "_kv_tiles", "constexprs": {"BLOCK_D": 128}}
    assert [tool.matches(c, wanted) for c in (repair, first, tiles)] == [True, False, False]
    assert [tool.matches(c, tool.only_filter("BLOCK_D=128")) for c in (repair, first, tiles)] == [True] * 3
    assert all(tool.matches(c, {}) for c in (repair, first, tiles))
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        tool.only_filter("REPAIR")


def test_a_gpu_takes_the_references_on_the_tensor_cores_on_tiles_of_64_rows_only() -> None:
    """Under the interpreter bf16 and fp16 calls take BY_DOT on their 16 × 16 tiles, so the suite runs it; the GPU
    configuration keeps it where its tiles have 64 query rows (an H100 at head dims 64 to 256, a 99 KB GPU to 128) and
    drops it on the 16 × 16 tiles of head dim 256 on a 99 KB GPU, where it made the loop longer (kernels/
    triton_attention.refs_by_dot)."""
    import torch

    from attnchecker.kernels import triton_attention as ta

    tool = _tool()
    assert [ta.refs_by_dot(dtype, 16) for dtype in (torch.bfloat16, torch.float16, torch.float32)] \
        == [ta.interpreting()] * 2 + [False]
    assert ta.refs_by_dot(torch.bfloat16, 64) and not ta.refs_by_dot(torch.float32, 64)
    launch = {"module": "attnchecker.kernels.triton_attention", "kernel": "_attention", "options": {"num_warps": 4},
              "constexprs": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 16, "DOT": 2, "BY_DOT": True}}
    by_dot = {(d, arch): tool.gpu_configs(launch, (d,), arch)[0]["constexprs"]["BY_DOT"]
              for d in (64, 128, 256) for arch in (89, 90)}
    assert by_dot == {(64, 89): True, (64, 90): True, (128, 89): True, (128, 90): True, (256, 89): False,
                      (256, 90): True}
    fp32 = {**launch, "constexprs": {**launch["constexprs"], "DOT": 0, "BY_DOT": False}}
    assert not tool.gpu_configs(fp32, (64,), 90)[0]["constexprs"]["BY_DOT"]
