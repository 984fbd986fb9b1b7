"""bench/triton_compile_matrix.py: the Triton launches the tests make under the interpreter, compiled for sm_90 as a
GPU launches them, offline (Triton's compiler and its bundled ptxas; no GPU).

The interpreter never compiles a kernel, so a configuration the compiler rejects passes every other test here. The
attention's repair kernel with a bool mask or dropout was one (bf16, head dim 64, Triton 3.9: a 1-bit tile through
shared memory); the GPU would have failed on the first such call.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_repair_launches_of_a_bool_mask_and_of_dropout_compile_for_sm90(tmp_path: Path) -> None:
    """The bf16 calls with a bool mask, with and without dropout, in both check modes (each launches the first pass
    and the repair kernel), recorded and compiled at the GPU's tiles (64 × 64 on 8 warps), operand mode (bf16 as it
    is) and head dim 64: every configuration compiles, the repair kernel's among them."""
    pytest.importorskip("triton")
    out = tmp_path / "matrix.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "bench/triton_compile_matrix.py", "--head-dims", "64", "--jobs", "1", "--out", str(out),
         "tests/agent/test_triton_attention.py", "-k", "each_mask_kind and bool and bfloat16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["arch"] == "sm_90" and report["failed"] == 0 and report["pytest"].startswith("4 passed")
    attention = [r for r in report["rows"] if r["kernel"] == "_attention"]
    repairs = {(r["constexprs"]["MODE"], r["constexprs"]["DROPOUT"]) for r in attention if r["constexprs"]["REPAIR"]}
    assert repairs == {(2, False), (2, True)}
    for r in attention:
        assert r["ok"] and r["reg"] > 0
        assert r["constexprs"]["MASK_KIND"] == 1 and r["constexprs"]["DOT"] == 0
        assert (r["constexprs"]["BLOCK_M"], r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_D"]) == (64, 64, 64)
        assert r["options"] == {"num_warps": 8, "num_stages": 2}
