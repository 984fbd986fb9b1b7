"""Live check of the dashboard and alerts: a real Prometheus 2.42 (Debian's, on loopback) scrapes a real collector
(uvicorn on SQLite) while training statistics and fault events arrive; every dashboard query, with Grafana's macros
substituted, must return data through Prometheus's HTTP API, and the uncorrectable-fault alert must fire.

Two sources of traffic, each its own test:
- AGENT-FED: `AgentTraining` trains a tiny GPT-2 under the real agent (protect(collector=...) + its transport) with
  injected faults, transient ones and one that recompute cannot fix.
- API-FED: `ApiFedAgent` posts payloads built exactly per docs/wire.md over the collector's real HTTP API (register,
  stats, events:batch): deterministic, independent of the agent's timing, and the traffic of the /metrics names check.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

testing = pytest.importorskip("collector_testing")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("dashboard_queries", REPO / "tests/dashboards/dashboard_queries.py")
dq = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(dq)  # type: ignore[union-attr]

SCRAPE_SECONDS = 1
# What Grafana sends for $__rate_interval: max(4 x scrape interval, $__interval + scrape interval).
RATE_INTERVAL = f"{4 * SCRAPE_SECONDS}s"
RUN_NAME = "live-dashboard-check"
DEADLINE_SECONDS = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(
    what: str, probe: Callable[[], Any], until: Callable[[Any], bool] = bool, timeout: float = DEADLINE_SECONDS
) -> Any:
    """Polls probe() until `until` holds for its answer; fails naming `what` and the last answer after timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except httpx.HTTPError as error:
            last = error
        if not isinstance(last, Exception) and until(last):
            return last
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last answer: {last!r}")


class ApiFedAgent:
    """Plays an agent over the collector's real HTTP API, per docs/wire.md: registers the run, then posts one stats
    interval every `period` seconds (checks, corrected faults, residual histogram, transport counts) until stopped.
    `inject_uncorrectable()` sends what an agent sends after an uncorrectable fault: the event and its count."""

    LE = (0.001, 0.01, 0.1, 0.5, 1.0, 10.0, 1000.0)

    def __init__(self, url: str, token: str, period: float = 0.25) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=5)
        self.period = period
        self.step = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="api-fed-agent", daemon=True)
        answer = self.client.post(
            "/api/v1/runs",
            json={
                "name": RUN_NAME,
                "model": "GPT2LMHeadModel",
                "world_size": 1,
                "rank": 0,
                "host": "ci",
                "agent_version": "api-fed",
                # Who the rank is: the Fleet dashboard's per-device series come from it.
                "device": {"uuid": "GPU-00000000-0000-4000-8000-0000000000f1", "hostname": "ci", "kind": "cuda"},
                # The coverage map a real agent registers (attnchecker.coverage, compact form): the coverage panel.
                "config": {"source": "tests/e2e/test_prometheus_live.py",
                           "coverage": {"protected": 12, "unprotected": 0,
                                        "layers": ["0-1 q,k,v,out:hook scores,context:transformers"], "gaps": []}},
            },
        )
        answer.raise_for_status()
        self.run_id = answer.json()["id"]
        self.policy_version = answer.json()["policy"]["version"]

    def __enter__(self) -> ApiFedAgent:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()

    def _post(self, path: str, body: dict[str, Any]) -> None:
        answer = self.client.post(f"/api/v1/runs/{self.run_id}/{path}", json=body)
        if answer.status_code != 200:
            self.errors.append(f"{path}: {answer.status_code} {answer.text}")

    def _event(self, op: str, kind: str, action: str, value: str) -> dict[str, Any]:
        return {
            "id": str(uuid.uuid4()),
            "ts": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "step": self.step,
            "rank": 0,
            "layer": 1,
            "op": op,
            "pattern": "0d",
            "kind": kind,
            "action": action,
            "location": {"batch": 0, "head": 2, "row": 5, "col": 7},
            "value": value,
            "residual": None,
            "bound": 0.0012,
            "policy_version": self.policy_version,
        }

    def _stats(self, faults: list[dict[str, Any]], steps: int = 5) -> dict[str, Any]:
        start, self.step = self.step, self.step + steps
        ops = [
            {"op": op, "checks": steps * 2, "check_seconds": 0.002, "period": 1 if op == "scores" else 2}
            for op in ("q", "k", "v", "scores", "context", "out")
        ]
        # A whole-step op of protect(scope="all"), full and tier 1: the backward half of "Checks by phase".
        ops.append({"op": "linear_dw", "checks": steps, "check_seconds": 0.004, "period": 2, "tripwire_checks": steps})
        return {
            "interval_id": str(uuid.uuid4()),
            "rank": 0,
            "step_start": start,
            "step_end": self.step - 1,
            "steps": steps,
            "applied_policy_version": self.policy_version,
            "step_seconds": 0.2,
            "check_seconds": 0.012,
            "ops": ops,
            "faults": faults,
            "residual_ratio": {"le": list(self.LE), "counts": [20, 30, 8, 2, 0, 0, 0, 0], "sum": 2.4, "count": 60},
            "transport": {"sent": len(faults), "spooled": 1, "dropped": 0},
        }

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            event = self._event("scores", "inf", "corrected", "inf")
            self._post("events:batch", {"batch_id": str(uuid.uuid4()), "events": [event]})
            self._post("stats", self._stats([{"op": "scores", "kind": "inf", "detected": 1, "corrected": 1}]))

    def inject_uncorrectable(self) -> None:
        event = self._event("context", "nan", "uncorrectable", "nan")
        self._post("events:batch", {"batch_id": str(uuid.uuid4()), "events": [event]})
        self._post("stats", self._stats([{"op": "context", "kind": "nan", "detected": 1, "uncorrectable": 1}], 1))


class Prometheus:
    def __init__(self, base: Path, collector_port: int, token: str) -> None:
        base.mkdir()
        (base / "token").write_text(token)
        # deploy/alerts.yml as it ships: the uncorrectable-fault alert has no `for`, so nothing needs shortening.
        shutil.copy(REPO / "deploy" / "alerts.yml", base / "alerts.yml")
        config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s", evaluation_interval=f"{SCRAPE_SECONDS}s")
        [job] = [j for j in config["scrape_configs"] if j["job_name"] == "attnchecker-collector"]
        job.update(scrape_timeout=f"{SCRAPE_SECONDS}s", static_configs=[{"targets": [f"127.0.0.1:{collector_port}"]}])
        job["authorization"]["credentials_file"] = str(base / "token")
        config["scrape_configs"] = [job]
        (base / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={base / 'prometheus.yml'}",
                    f"--storage.tsdb.path={base / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: Any) -> Any:
        answer = httpx.get(f"{self.url}{path}", params=params, timeout=5)
        answer.raise_for_status()
        return answer.json()

    def query(self, promql: str) -> list[dict[str, Any]]:
        body = self.get("/api/v1/query", query=promql)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        alerts = self.get("/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == alertname and a["state"] == "firing"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Any]:
    settings = testing.make_settings("sqlite", tmp_path, metrics_cache_seconds=0)
    with testing.run_collector(settings) as running:
        yield running


@pytest.fixture
def prometheus(tmp_path: Path, collector: Any) -> Iterator[Prometheus]:
    if shutil.which("prometheus") is None:
        pytest.skip("needs Debian's prometheus: `make system-deps`")
    viewer = testing.make_token(collector.settings, "viewer", name="prometheus")
    server = Prometheus(tmp_path / "prometheus", collector.port, viewer)
    try:
        ready = _wait_for(
            "Prometheus /-/ready",
            lambda: (
                server.process.poll() is not None or httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200
            ),
            timeout=30,
        )
        assert ready
        assert server.process.poll() is None, f"Prometheus exited:\n{server.log_path.read_text()}"
        yield server
    finally:
        server.stop()


def _dashboard_queries() -> list[tuple[str, str, str]]:
    """Every panel query, except the Fleet dashboard's joins with dcgm-exporter's series: those fill only where
    Prometheus scrapes a dcgm-exporter too (their PromQL is parsed and checked statically)."""
    queries = []
    for _, dashboard in dq.load_dashboards():
        variables = dq.variable_values(dashboard)
        for panel, target in dq.iter_queries(dashboard):
            promql = dq.substitute(target["expr"], variables, rate_interval=RATE_INTERVAL)
            if dq.metric_names(promql) & dq.DCGM_SERIES:
                continue
            queries.append((f"{panel['title']} [{target['refId']}]", target["expr"], promql))
    return queries


def _panels_fill_then_uncorrectable_alert_fires(
    prometheus: Prometheus, queries: list[tuple[str, str, str]], *, trigger: Any, healthy: Any = lambda: None
) -> dict[str, Any]:
    """Wait until every panel query returns data and check the alert is quiet, then `trigger()` the uncorrectable
    fault and return the alert once it fires. `healthy()` runs on every poll, so a dead feeder fails fast."""

    def empty_panels() -> list[str]:
        healthy()
        return [title for title, _, promql in queries if not prometheus.query(promql)]

    _wait_for(
        "every panel query to return data (last answer: the panels still empty)",
        empty_panels,
        until=lambda empty: not empty,
    )
    assert not prometheus.firing("AttncheckerUncorrectableFault"), "fired before any uncorrectable fault"
    trigger()
    [alert] = _wait_for(
        "AttncheckerUncorrectableFault firing", lambda: prometheus.firing("AttncheckerUncorrectableFault")
    )
    return alert


def test_api_fed_traffic_fills_every_dashboard_query_and_fires_the_uncorrectable_alert(
    collector: Any, prometheus: Prometheus
) -> None:
    agent_token = testing.make_token(collector.settings, "agent", name="api-fed-agent")
    queries = _dashboard_queries()

    with ApiFedAgent(collector.url, agent_token) as agent:
        _wait_for("the collector scraped as up", lambda: prometheus.query('up{job="attnchecker-collector"} == 1'))
        alert = _panels_fill_then_uncorrectable_alert_fires(prometheus, queries, trigger=agent.inject_uncorrectable)
        assert not agent.errors, agent.errors

    assert alert["labels"] == {
        "alertname": "AttncheckerUncorrectableFault",
        "run": RUN_NAME,
        "op": "context",
        "kind": "nan",
        "severity": "critical",
    }
    [stat] = [promql for title, _, promql in queries if title.startswith("Uncorrectable faults")]
    assert float(prometheus.query(stat)[0]["value"][1]) == 1.0


def test_collector_exports_every_metric_the_dashboard_names(collector: Any) -> None:
    """The real /metrics (after one interval of traffic) against the series every panel selects."""
    agent_token = testing.make_token(collector.settings, "agent", name="api-fed-agent")
    viewer_token = testing.make_token(collector.settings, "viewer", name="metrics-reader")
    with ApiFedAgent(collector.url, agent_token, period=0.05) as agent:
        _wait_for("one stats interval stored", lambda: agent.step > 0, timeout=15)
        agent.inject_uncorrectable()
        assert not agent.errors, agent.errors
    text = httpx.get(f"{collector.url}/metrics", headers={"Authorization": f"Bearer {viewer_token}"}).text

    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    selected = set().union(*(dq.metric_names(promql) for _, _, promql in _dashboard_queries()))
    assert selected <= exported, f"dashboard selects series the collector does not export: {selected - exported}"
    assert dq.series_names(dq.wire_metrics()) <= exported


class AgentTraining:
    """A real agent: a tiny GPT-2 trained on CPU under protect(), streaming to the collector, with seeded transient
    faults (corrected) and, once released by `release_uncorrectable()`, a persistent 2d fault in the scores that is
    still wrong after recompute (uncorrectable; the policy skips that optimizer step)."""

    UNCORRECTABLE_STEP = 12  # the run holds there until released: a low step keeps the test short

    def __init__(self, url: str, token: str, spool_dir: Path) -> None:
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        attnchecker = pytest.importorskip("attnchecker")
        from attnchecker.inject import Fault, FaultPlan

        self.torch = torch
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        transient = [
            Fault(op=op, layer=step % 2, step=step, kind=kind, seed=step)
            for step, (op, kind) in zip(
                range(1, self.UNCORRECTABLE_STEP, 2),
                [("scores", "inf"), ("context", "nan"), ("q", "near_inf"), ("out", "neg_inf")] * 3,
                strict=False,
            )
        ]
        uncorrectable = Fault(
            op="scores", layer=0, step=self.UNCORRECTABLE_STEP, kind="nan", pattern="2d", persistent=True, seed=7
        )
        # The policy given to protect() is the new run's starting policy on the collector (docs/streaming.md):
        # every op is checked every step (the planned faults are all seen) and the uncorrectable step is skipped
        # instead of training on NaN.
        wanted = {"period": 1, "adaptive": False, "on_uncorrectable": "skip_step"}
        self.guard = attnchecker.protect(
            self.model,
            policy=attnchecker.Policy(**wanted),
            optimizer=self.optimizer,
            run=RUN_NAME,
            collector=url,
            token=token,
            spool_dir=spool_dir,
            faults=FaultPlan([*transient, uncorrectable]),
            # The whole step, as a user who wants the MLP and the backward checked runs it: the dashboard's backward
            # series come from the agent too.
            scope="all",
            # Every step closes a stats interval: the run holds before its uncorrectable step, and faults counted in
            # an interval still open at the hold would never reach the collector (fault counters come from stats).
            stats_interval_steps=1,
        )
        self.batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        self.steps = 0
        self.failure: BaseException | None = None
        self._release = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, name="agent-training", daemon=True)

    def __enter__(self) -> AgentTraining:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._release.set()
        self._thread.join(timeout=DEADLINE_SECONDS)
        self.guard.close()  # flushes the transport with a deadline

    def release_uncorrectable(self) -> None:
        self._release.set()

    def _train(self) -> None:
        try:
            while not self._stop.is_set():
                # hold before the uncorrectable step until the test has checked that nothing fired without it
                if self.steps == self.UNCORRECTABLE_STEP and not self._release.wait(DEADLINE_SECONDS):
                    return
                loss = self.model(self.batch, labels=self.batch).loss
                loss.backward()
                self.optimizer.step()  # the guard's step hook runs here: stats, policy, skip_step
                self.optimizer.zero_grad(set_to_none=True)
                self.steps += 1
                self._stop.wait(0.05)  # spreads the run over many 1 s scrapes, so rate() has samples
        except BaseException as error:  # reported by the test, not lost in the thread
            self.failure = error


def test_agent_run_fills_every_dashboard_query_and_fires_the_uncorrectable_alert(
    collector: Any, prometheus: Prometheus, tmp_path: Path
) -> None:
    agent_token = testing.make_token(collector.settings, "agent", name="live-agent")
    queries = _dashboard_queries()

    with AgentTraining(collector.url, agent_token, tmp_path / "spool") as training:

        def healthy() -> None:
            assert training.failure is None, f"training failed: {training.failure!r}"

        alert = _panels_fill_then_uncorrectable_alert_fires(
            prometheus, queries, trigger=training.release_uncorrectable, healthy=healthy
        )
        healthy()

    assert alert["labels"] == {
        "alertname": "AttncheckerUncorrectableFault",
        "run": RUN_NAME,
        "op": "scores",
        "kind": "nan",
        "severity": "critical",
    }
    corrected = prometheus.query(f'sum(attnchecker_faults_corrected_total{{run="{RUN_NAME}"}})')
    assert float(corrected[0]["value"][1]) >= 1, "the transient faults the agent corrected never reached Prometheus"
