"""The README's attach examples run as they are, as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", ["attach_transformers.py", "attach_plain_pytorch.py"])
def test_example_runs_and_corrects_its_demo_faults(script: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "uncorrectable 0" in proc.stdout, proc.stdout
    assert "detected 0," not in proc.stdout, proc.stdout
    if script == "attach_transformers.py":
        assert "attention implementation after close: sdpa" in proc.stdout
