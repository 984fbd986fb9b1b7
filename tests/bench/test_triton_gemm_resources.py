"""bench/triton_gemm_resources.py: the GEMM checks' kernels compiled offline for sm_90 at a Llama-7B projection's
launches, as Triton's JIT specialises them on a GPU (no GPU here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_bf16_operand_passes_take_their_products_on_the_tensor_cores_near_their_read_s_time(tmp_path: Path) -> None:
    """A Linear's three operand passes (its weight, x, dY) in bf16, compiled as a GPU would launch them: their scan
    loops hold tensor-core products (the factors' TF32 parts) and no spill, and issue under one warp instruction per
    element they read, about their read's time by the data sheet (the FMA form issued 1.8 to 2.3, three times it)."""
    pytest.importorskip("triton")
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "bench/triton_gemm_resources.py", "--kernels", "operand_pass", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["arch"] == "sm_90" and doc["shape"]["dtype"] == "torch.bfloat16"
    rows = {r["role"]: r for r in doc["rows"]}
    assert set(rows) == {"operand_pass (W)", "operand_pass (x)", "operand_pass (dY)"}
    for row in rows.values():
        loop = row["scan_loop"]
        assert row["constexprs"]["TC"] and row["constexprs"]["JP"] == 16, row["constexprs"]
        assert loop["mix"].get("tensor core", 0) > 0 and loop["mix"].get("local memory (spills)", 0) == 0, loop
        assert loop["warp_instructions_per_element"] < 1.0, loop
