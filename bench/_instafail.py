"""A pytest plugin for bench/gpu_suite.py's tests section: a failing test's report is written out the moment it fails,
flushed, not at the session's end. The section runs pytest under a time budget, and a run that the budget stops never
reaches the end, where pytest prints its failures: the H100 run lost the tracebacks of two failures that way
(docs/performance.md §9). Loaded with ``-p _instafail`` (bench/ on PYTHONPATH)."""
from __future__ import annotations

import sys
from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    if report.failed:
        sys.stdout.write(f"\n_instafail: {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n")
        sys.stdout.flush()
