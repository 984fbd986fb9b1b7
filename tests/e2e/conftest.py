"""Fixtures of the end-to-end tests; the helpers live in e2e_helpers.py (importable under either pytest import
mode: this directory goes on sys.path here)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_helpers import Collector, running_collector


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    """A collector of this test's own on SQLite (it may be killed and restarted)."""
    with running_collector("sqlite", tmp_path / "collector") as c:
        yield c


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread for the tiny models: on a small shared machine, more only adds contention (and noise to
    the step times the outage test measures)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
