"""The collector's HTTP endpoints as the agent uses them (docs/wire.md), and how their failures are classified.

Used only off the training thread: by the sender thread and by ``attnchecker sync``. Never raises for network
trouble; every call returns a :class:`Reply` that says whether to go on, retry later, or give the payload up.
"""
from __future__ import annotations

import json
import logging
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import httpx

log = logging.getLogger(__name__)

API = "/api/v1"


def encode(obj: Any) -> bytes:
    """Compact JSON. JSON has no INF/NaN: a non-finite float is a caller bug, raised here (ValueError) rather than
    sent, because the collector would reject the whole batch it sits in."""
    return json.dumps(obj, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode()


def registration_body(run_name: str, run_info: Mapping[str, Any] | None) -> tuple[bytes, dict[str, Any]]:
    """The ``POST /runs`` body (encoded, and as a dict): ``run_info`` plus the name and defaults for rank, world size,
    host and agent version. ValueError naming the argument when it cannot be sent."""
    if not run_name:
        raise ValueError("transport.run_name must be a non-empty string")
    info = dict(run_info or {})
    info["name"] = run_name
    info.setdefault("rank", 0)
    info.setdefault("world_size", 1)
    info.setdefault("host", socket.gethostname())
    info.setdefault("agent_version", _agent_version())
    try:
        return encode(info), info
    except (TypeError, ValueError) as e:
        raise ValueError(f"transport.run_info must be JSON-serialisable without INF/NaN: {e}") from None


def _agent_version() -> str:
    try:
        return metadata.version("attnchecker")
    except metadata.PackageNotFoundError:
        return "0.0.0"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int | None
    """HTTP status, or None when no response came (connection refused, timeout, ...)."""
    body: Any = None
    etag: str | None = None
    error: str = ""
    retry_after_s: float | None = None
    """The collector's ``Retry-After`` (seconds) on a 503 or 429: do not come back sooner."""
    policy_scope: str | None = None
    """``X-Policy-Scope`` of a policy GET with ``?rank``: "run", or "device" (the rank's device is under suspicion)."""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def transient(self) -> bool:
        """Worth retrying later: no answer, the server is overloaded or failing (503 with ``Retry-After`` while its
        database is down), or it does not know the run (a wiped database: register again). 401/403 count too: a token
        can be fixed, and the data stays spooled."""
        return self.status is None or self.status >= 500 or self.status in (401, 403, 404, 408, 429)

    @property
    def too_large(self) -> bool:
        return self.status == 413


class CollectorClient:
    """A thin httpx wrapper with short timeouts. One per thread that talks to the collector."""

    def __init__(self, url: str, token: str | None, *, connect_timeout_s: float = 1.0, read_timeout_s: float = 2.0):
        headers = {"Content-Type": "application/json", "User-Agent": "attnchecker-agent"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=self._timeout(None))

    def _timeout(self, budget_s: float | None) -> httpx.Timeout:
        connect, read = self.connect_timeout_s, self.read_timeout_s
        if budget_s is not None:
            # Connect and read are sequential phases; halve the budget so their sum stays within it.
            connect, read = min(connect, budget_s / 2), min(read, budget_s / 2)
        return httpx.Timeout(connect=connect, read=read, write=read, pool=connect)

    def close(self) -> None:
        self._http.close()

    def request(
        self, method: str, path: str, *, body: bytes | None = None, etag: str | None = None,
        budget_s: float | None = None, prefix: str = API, params: Mapping[str, Any] | None = None,
    ) -> Reply:
        if budget_s is not None and budget_s < 0.05:
            return Reply(None, error="deadline reached before the request")
        headers = {"If-None-Match": etag} if etag else None
        try:
            r = self._http.request(method, prefix + path, content=body, headers=headers, params=params,
                                   timeout=self._timeout(budget_s))
        except httpx.HTTPError as e:
            return Reply(None, error=f"{type(e).__name__}: {e}")
        try:
            data = r.json() if r.content else None
        except ValueError:
            data = None
        error = "" if r.is_success or r.status_code == 304 else f"HTTP {r.status_code}: {r.text[:300]}"
        return Reply(r.status_code, data, r.headers.get("ETag"), error, _retry_after_s(r.headers.get("Retry-After")),
                     r.headers.get("X-Policy-Scope"))

    def ready(self, *, budget_s: float | None = None) -> Reply:
        """``GET /readyz``: 200 once the collector and its database answer. Cheap; probed while backing off."""
        return self.request("GET", "/readyz", budget_s=budget_s, prefix="")

    def register(self, run_body: bytes, *, budget_s: float | None = None) -> Reply:
        return self.request("POST", "/runs", body=run_body, budget_s=budget_s)

    def post(self, kind: str, run_id: str, body: bytes, *, budget_s: float | None = None) -> Reply:
        """``kind`` is a spool record kind: events, stats or finish."""
        return self.request("POST", f"/runs/{run_id}/{_ENDPOINT[kind]}", body=body, budget_s=budget_s)

    def get_policy(self, run_id: str, etag: str | None, *, rank: int | None = None,
                   budget_s: float | None = None) -> Reply:
        """The policy ``rank`` follows (the run's, or the suspect-device policy while its device is under suspicion;
        ``Reply.policy_scope`` says which). A collector from before devices ignores ``rank``."""
        params = {"rank": rank} if rank is not None else None
        return self.request("GET", f"/runs/{run_id}/policy", etag=etag, budget_s=budget_s, params=params)

    def device_status(self, uuid: str, *, budget_s: float | None = None) -> Reply:
        """``GET /devices/{uuid}/status``: the status an operator set on this rank's device (404: never seen)."""
        return self.request("GET", f"/devices/{uuid}/status", budget_s=budget_s)


def _retry_after_s(value: str | None) -> float | None:
    """Delta-seconds only: the HTTP-date form needs a clock shared with the server, and collectors send seconds."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 86_400 else None


_ENDPOINT = {"events": "events:batch", "stats": "stats", "finish": "finish"}


def events_body(chunk: list[bytes]) -> bytes:
    """An ``events:batch`` body around already encoded events, with a fresh batch id."""
    return b'{"batch_id":"%s","events":[%s]}' % (str(uuid.uuid4()).encode(), b",".join(chunk))


@dataclass(slots=True)
class EventsOutcome:
    sent: int = 0
    duplicates: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    failed: Reply | None = None
    """The transient failure that stopped the upload, if any."""
    unsent: list[tuple[bytes, int]] = field(default_factory=list)
    """(body, events) not delivered because of ``failed``: the failed request's exact body (same batch id, so a
    retry of a batch the collector did store is a duplicate there), then the parts never tried."""


def send_events(
    client: CollectorClient, run_id: str, chunk: list[bytes], *, body: bytes | None = None,
    budget_s: Callable[[], float | None] = lambda: None,
) -> EventsOutcome:
    """Post encoded events as one batch. A batch the collector refuses as too large (413) or invalid (422) is split
    in halves until it fits, so one bad event costs only itself and a smaller ``max_events_per_batch`` on the
    collector costs a few extra requests, not the data. ``body``: the exact body to send first (a replayed batch)."""
    out = EventsOutcome()
    _send_events(client, run_id, chunk, body, budget_s, out)
    return out


def _send_events(
    client: CollectorClient, run_id: str, chunk: list[bytes], body: bytes | None,
    budget_s: Callable[[], float | None], out: EventsOutcome,
) -> None:
    if out.failed is not None:
        out.unsent.append((body or events_body(chunk), len(chunk)))
        return
    body = body or events_body(chunk)
    r = client.post("events", run_id, body, budget_s=budget_s())
    if r.ok:
        out.sent += len(chunk)
        if isinstance(r.body, dict):
            out.duplicates += int(r.body.get("duplicates", 0) or 0)
        return
    if r.transient:
        out.failed = r
        out.unsent.append((body, len(chunk)))
        return
    if (r.too_large or r.status == 422) and len(chunk) > 1:
        half = len(chunk) // 2
        _send_events(client, run_id, chunk[:half], None, budget_s, out)
        _send_events(client, run_id, chunk[half:], None, budget_s, out)
        return
    out.rejected += len(chunk)
    out.errors.append(r.error)
