"""A small real HTTP collector on loopback for the transport tests, until server/ provides one.

It speaks the subset of docs/wire.md the agent uses (register, events:batch, stats, finish, policy with ETag), dedups
by batch id / event id / interval id like the real one, records every request, and can be taken down, made to
answer 503, or made to hang, which is what the transport must survive.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

TOKEN = "agent-token"


class LoopbackCollector:
    def __init__(self, *, max_events_per_batch: int = 1000) -> None:
        self.max_events_per_batch = max_events_per_batch
        self.lock = threading.Lock()
        self.runs: dict[str, dict[str, Any]] = {}  # name -> {"id", "body"}
        self.registrations: list[dict[str, Any]] = []
        self.events: dict[str, dict[str, Any]] = {}
        self.batches: set[str] = set()
        self.duplicates = 0
        self.stats: dict[str, dict[str, Any]] = {}
        self.finishes: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, int | None, dict[str, str]]] = []
        self.policy: dict[str, Any] = {"version": 1, "mode": "correct", "period": 1, "op_periods": {},
                                       "adaptive": True, "min_period": 1, "max_period": 8,
                                       "tolerance": "roundoff", "tolerance_factor": 1.0, "on_uncorrectable": "log",
                                       "source_repair": True, "overhead_budget": 0.05,
                                       "updated_at": "2026-11-29T15:00:00Z", "updated_by": "test"}
        self.mode = "ok"  # ok | fail503 | hang | store_then_hang_once
        self.knows_devices = True  # False: refuse a registration's device field, as collectors before issue 34 do
        self.retry_after: str | None = None  # the Retry-After header of a fail503 answer
        self.release = threading.Event()
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LoopbackCollector:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Take the collector down: the port refuses connections until start() again (same port)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def close(self) -> None:
        self.release.set()
        self.stop()

    def set_policy(self, **changes: Any) -> None:
        with self.lock:
            self.policy = {**self.policy, **changes, "version": self.policy["version"] + 1}

    def event_ids(self) -> set[str]:
        with self.lock:
            return set(self.events)

    def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self.lock:
                if predicate(self):
                    return True
            time.sleep(0.02)
        return False

    # Request handling (runs on the server's handler threads).

    def handle(self, method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any, dict[str, str]]:
        if method == "GET" and path == "/readyz":  # like the real one: no token needed
            return 200, {"status": "ready"}, {}
        if headers.get("authorization") != f"Bearer {TOKEN}":
            return 401, {"detail": "bad token"}, {}
        parts = path.split("?")[0].strip("/").split("/")
        if parts[:2] != ["api", "v1"] or len(parts) < 3 or parts[2] != "runs":
            return 404, {"detail": "not found"}, {}
        with self.lock:
            if method == "POST" and len(parts) == 3:
                return self._register(body)
            run_id = parts[3]
            if run_id not in {r["id"] for r in self.runs.values()}:
                return 404, {"detail": f"run {run_id} not found"}, {}
            tail = parts[4] if len(parts) > 4 else ""
            if method == "POST" and tail == "events:batch":
                return self._events(body)
            if method == "POST" and tail == "stats":
                dup = body["interval_id"] in self.stats
                self.stats.setdefault(body["interval_id"], body)
                return 200, {"interval_id": body["interval_id"], "duplicate": dup}, {}
            if method == "POST" and tail == "finish":
                self.finishes.append(body)
                return 200, {"id": run_id, "status": "finished"}, {}
            if method == "GET" and tail == "policy":
                etag = f'"{self.policy["version"]}"'
                if headers.get("if-none-match") == etag:
                    return 304, None, {"ETag": etag}
                return 200, self.policy, {"ETag": etag}
        return 405, {"detail": "no such route"}, {}

    def _register(self, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        self.registrations.append(body)
        if "device" in body and not self.knows_devices:
            error = {"loc": ["body", "device"], "msg": "Extra inputs are not permitted", "type": "extra_forbidden"}
            return 422, {"detail": [error], "message": "device: Extra inputs are not permitted"}, {}
        run = self.runs.get(body["name"])
        created = run is None
        if created:
            run = self.runs[body["name"]] = {"id": str(uuid.uuid4()), "body": body}
        return (201 if created else 200), {"id": run["id"], "name": body["name"], "created": created,
                                           "status": "running", "policy": self.policy}, {}

    def _events(self, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        events = body["events"]
        if len(events) > self.max_events_per_batch:
            return 413, {"detail": "too many events"}, {}
        if body["batch_id"] in self.batches:
            self.duplicates += len(events)
            return 200, {"batch_id": body["batch_id"], "accepted": 0, "duplicates": len(events)}, {}
        self.batches.add(body["batch_id"])
        accepted = dups = 0
        for e in events:
            if e["id"] in self.events:
                dups += 1
            else:
                self.events[e["id"]] = e
                accepted += 1
        self.duplicates += dups
        return 200, {"batch_id": body["batch_id"], "accepted": accepted, "duplicates": dups}, {}


def _handler(c: LoopbackCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: stop() really cuts every client off

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _serve(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            mode = c.mode
            if mode == "hang":
                c.requests.append((method, self.path, None, headers))
                c.release.wait(60)
                return
            if mode == "fail503":
                status, body = 503, {"detail": [{"msg": "database unavailable"}]}
                extra = {"Retry-After": c.retry_after} if c.retry_after is not None else {}
            else:
                status, body, extra = c.handle(method, self.path, headers, json.loads(raw) if raw else None)
                if mode == "store_then_hang_once" and self.path.endswith("events:batch") and status == 200:
                    c.mode = "ok"
                    c.requests.append((method, self.path, None, headers))
                    c.release.wait(60)  # stored, but the answer never arrives
                    return
            c.requests.append((method, self.path, status, headers))
            out = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            for k, v in extra.items():
                self.send_header(k, v)
            if out:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler


# What the transport tests (test_transport.py, test_transport_redelivery.py) send through it: one valid event and
# one valid stats interval, a loopback collector per test, and a URL that refuses connections.


def event(step: int = 0, **extra: Any) -> dict:
    return {"id": str(uuid.uuid4()), "ts": "2026-11-29T15:32:40.123Z", "step": step, "rank": 0, "layer": 0,
            "op": "scores", "pattern": "0d", "kind": "inf", "action": "corrected",
            "location": {"batch": 0, "head": 0, "row": 1, "col": 2}, "value": "inf", "residual": None,
            "bound": 0.001, "policy_version": 1, **extra}


def stats(step_start: int, step_end: int) -> dict:
    return {"rank": 0, "step_start": step_start, "step_end": step_end, "steps": step_end - step_start + 1,
            "applied_policy_version": 1, "step_seconds": 0.5, "check_seconds": 0.01, "ops": [], "faults": []}


@pytest.fixture
def collector() -> Iterator[LoopbackCollector]:
    c = LoopbackCollector().start()
    yield c
    c.close()


def dead_url() -> str:
    """A loopback port nobody listens on (connections are refused)."""
    c = LoopbackCollector().start()
    url = c.url
    c.close()
    return url


def test_loopback_collector_dedups_batches_and_events():
    c = LoopbackCollector()
    status, reg, _ = c.handle("POST", "/api/v1/runs", {"authorization": f"Bearer {TOKEN}"}, {"name": "r"})
    assert status == 201
    ev = {"id": "e1"}
    path = f"/api/v1/runs/{reg['id']}/events:batch"
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert c.handle("POST", path, auth, {"batch_id": "b1", "events": [ev]})[1]["accepted"] == 1
    assert c.handle("POST", path, auth, {"batch_id": "b1", "events": [ev]})[1]["duplicates"] == 1
    assert c.handle("POST", path, auth, {"batch_id": "b2", "events": [ev]})[1]["duplicates"] == 1
    assert len(c.events) == 1
