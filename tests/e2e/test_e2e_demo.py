"""`attnchecker demo` end to end, as a user runs it: it starts its own collector (SQLite, in the background), trains
with injected faults while streaming, changes the policy halfway over REST and shows the agent applying it, and ends
with a summary whose numbers the collector confirms."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("attnchecker_server")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """The demo's data dir; the collector the demo leaves running there is killed afterwards (pid in collector.json)."""
    d = tmp_path / "demo"
    yield d
    state = d / "collector.json"
    if state.exists():
        pid = json.loads(state.read_text())["pid"]
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _number(out: str, label: str) -> int:
    m = re.search(rf"^{re.escape(label)}\s+(\d+)", out, re.MULTILINE)
    assert m, f"no '{label}' line in the demo's output:\n{out}"
    return int(m.group(1))


def test_demo_streams_to_its_own_collector_and_applies_a_policy_change(data_dir: Path) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "attnchecker.cli", "demo", "--steps", "16", "--no-compare", "--data-dir", str(data_dir),
           "--port", str(port), "--layers", "2", "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "2",
           "--fault-rate", "0.4", "--change-policy-at", "1"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=200,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}"

    state = json.loads((data_dir / "collector.json").read_text())
    url = f"http://127.0.0.1:{port}"
    assert state["url"] == url
    injected = _number(out, "faults injected")
    assert injected > 0
    assert _number(out, "detected") == injected and _number(out, "corrected") == injected
    assert _number(out, "uncorrectable") == 0
    assert re.search(r"^events streamed\s+sent (\d+), spooled 0, dropped 0", out, re.MULTILINE).group(1) == str(injected)

    # The URLs it printed are the real ones: the run's id, the API, /metrics.
    run_id = re.search(rf"^collector API  {re.escape(url)}/api/v1/runs/([0-9a-f-]{{36}})", out, re.MULTILINE).group(1)
    assert f"curl -X PATCH {url}/api/v1/runs/{run_id}/policy" in out
    # The first URL it prints is the collector's own dashboard page, opened on the run; the collector serves it.
    first = next(line for line in out.splitlines() if url in line)
    assert first.startswith(f"dashboard page {url}/#/runs/{run_id} "), first
    page = httpx.get(f"{url}/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    headers = {"Authorization": f"Bearer {state['operator_token']}"}
    run = httpx.get(f"{url}/api/v1/runs/{run_id}", headers=headers, timeout=10).json()
    events = httpx.get(f"{url}/api/v1/runs/{run_id}/events", params={"limit": 500}, headers=headers, timeout=10).json()
    assert len(events["data"]) == injected
    assert run["status"] == "finished" and run["totals"]["detected"] == injected
    # The operator's PATCH (v2 on top of the demo's v1) was applied by the running agent, and the collector knows.
    assert "[operator] PATCH policy → v2" in out
    assert re.search(r"^\[agent\] policy v2 applied at the boundary of step \d+", out, re.MULTILINE), out
    assert run["requested_policy_version"] == 2 and run["applied_policy_version"] == 2
    assert f"collector holds          {injected} events; run finished, policy requested v2 applied v2" in out
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r'^attnchecker_policy_applied_version\{run="[^"]+"\} 2\.0$', metrics, re.MULTILINE), metrics
