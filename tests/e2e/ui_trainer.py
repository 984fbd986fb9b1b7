"""A protected training process for the dashboard's browser test (tests/e2e/test_web_ui.py): the tiny model of
e2e_helpers under attnchecker.protect(), streaming to a collector, with faults on a few early steps (one of them
persistent, so recompute cannot fix it: an uncorrectable fault for the page to highlight). It trains until the stop
file appears (or the test process goes away), slowly, so that it stays cheap while a browser looks at it; each policy version the agent applies is
printed as it happens.

    python ui_trainer.py URL AGENT_TOKEN RUN_NAME SPOOL_DIR STOP_FILE
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from e2e_helpers import FAST, protect_streaming, tiny_model, train

from attnchecker import Fault, FaultPlan, Policy

# (step, op, layer, kind): what the page must show. The persistent 2D block at step 7 stays wrong after recompute.
FAULTS = [(1, "scores", 0, "inf"), (2, "q", 1, "nan"), (3, "context", 0, "near_inf"), (4, "v", 1, "neg_inf"),
          (5, "out", 0, "inf")]
UNCORRECTABLE_STEP = 7
MAX_STEPS = 20_000
STEP_PAUSE_S = 0.1


def main(url: str, token: str, run: str, spool_dir: str, stop_file: str) -> None:
    torch.set_num_threads(1)
    faults = [Fault(op=op, layer=layer, step=step, kind=kind, seed=step) for step, op, layer, kind in FAULTS]
    faults.append(Fault(op="scores", layer=1, step=UNCORRECTABLE_STEP, kind="add", pattern="2d", value=1.0,
                        persistent=True, seed=UNCORRECTABLE_STEP))
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Every op checked every step, not adaptive: each planned fault is seen at its step.
    guard = protect_streaming(model, opt, url, token, run, Path(spool_dir), policy=Policy(period=1, adaptive=False),
                              faults=FaultPlan(faults), transport_options={**FAST, "poll_interval_s": 0.2})
    applied = guard.policy.version
    print(f"training run {run}; policy v{applied}", flush=True)
    parent = os.getppid()
    for _ in range(MAX_STEPS):
        # The stop file, or the test process is gone (killed, crashed): either way, stop.
        if Path(stop_file).exists() or os.getppid() != parent:
            break
        train(model, opt, 1, before_step=None)
        if guard.policy.version != applied:
            applied = guard.policy.version
            print(f"[agent] policy v{applied} applied (period {guard.policy.period})", flush=True)
        time.sleep(STEP_PAUSE_S)
    guard.close(flush_timeout_s=10.0)


if __name__ == "__main__":
    main(*sys.argv[1:6])
