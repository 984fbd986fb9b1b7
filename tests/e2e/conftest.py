"""Fixtures of the end-to-end tests; the helpers live in e2e_helpers.py (importable under either pytest import
mode: this directory goes on sys.path here)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


CHROMIUM = "/usr/bin/chromium"
UI_TIMEOUT_MS = 20_000  # a shared 2-core machine: the page polls every 2 s, the agent every 0.2 s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """The distribution's Chromium under Playwright, for the tests of the collector's page (one per test module)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install the distribution's chromium (scripts/system-deps.sh does)")
    from playwright import sync_api as playwright_api

    with playwright_api.sync_playwright() as p:
        # --no-sandbox: the test may run as root in a container, where Chromium's sandbox cannot start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page (its own context: no token carried over); a script error on it fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    context.set_default_timeout(UI_TIMEOUT_MS)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"the page raised: {errors}"
