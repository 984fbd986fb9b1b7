"""Helpers for tests/server: an API client with one token per role, payload factories, table row counts."""

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from collector_testing import make_token
from fastapi.testclient import TestClient
from sqlalchemy import text

from attnchecker_server.config import Settings
from attnchecker_server.db import make_engine
from attnchecker_server.main import create_app
from attnchecker_server.models import Base


@dataclass
class Api:
    """A TestClient plus one token per role."""

    client: TestClient
    settings: Settings
    tokens: dict[str, str]

    def headers(self, role: str | None) -> dict[str, str]:
        return {} if role is None else {"Authorization": f"Bearer {self.tokens[role]}"}

    def register(self, name: str = "exp-42", **fields: Any) -> dict[str, Any]:
        response = self.client.post("/api/v1/runs", json={"name": name, **fields}, headers=self.headers("agent"))
        assert response.status_code in (200, 201), response.text
        return response.json()  # type: ignore[no-any-return]


def make_api(settings: Settings) -> Iterator[Api]:
    names = {"agent": "agent-0", "operator": "alice", "viewer": "grafana"}
    tokens = {role: make_token(settings, role, name) for role, name in names.items()}  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as client:
        yield Api(client=client, settings=settings, tokens=tokens)


def new_id() -> str:
    return str(uuid.uuid4())


def make_event(step: int = 17, **fields: Any) -> dict[str, Any]:
    event = {
        "id": new_id(),
        "ts": "2026-11-29T15:32:40.123Z",
        "step": step,
        "rank": 0,
        "layer": 3,
        "op": "scores",
        "pattern": "0d",
        "kind": "inf",
        "action": "corrected",
        "location": {"batch": 0, "head": 2, "row": 5, "col": None},
        "value": "inf",
        "residual": None,
        "bound": 0.0012,
        "policy_version": 1,
    }
    event.update(fields)
    return event


def make_batch(events: list[dict[str, Any]] | None = None, n: int = 3) -> dict[str, Any]:
    return {"batch_id": new_id(), "events": events if events is not None else [make_event(step=i) for i in range(n)]}


def make_stats(**fields: Any) -> dict[str, Any]:
    stats = {
        "interval_id": new_id(),
        "rank": 0,
        "step_start": 100,
        "step_end": 119,
        "steps": 20,
        "applied_policy_version": 1,
        "step_seconds": 3.25,
        "check_seconds": 0.125,
        "ops": [
            {"op": "scores", "checks": 20, "check_seconds": 0.02, "period": 1},
            {"op": "q", "checks": 10, "check_seconds": 0.01, "period": 2},
        ],
        "faults": [{"op": "scores", "kind": "inf", "detected": 2, "corrected": 1, "uncorrectable": 1}],
        "residual_ratio": {
            "le": [0.001, 0.01, 0.1, 0.5, 1.0, 10.0, 1000.0],
            "counts": [5, 9, 2, 0, 0, 0, 0, 0],
            "sum": 0.91,
            "count": 16,
        },
        "transport": {"sent": 40, "spooled": 3, "dropped": 1},
    }
    stats.update(fields)
    return stats


def table_counts(settings: Settings) -> dict[str, int]:
    """Row count of every table: compared before and after a rejected request."""
    engine = make_engine(settings, pooled=False)
    with engine.connect() as conn:
        counts = {
            t.name: conn.execute(text(f'SELECT count(*) FROM "{t.name}"')).scalar_one()
            for t in Base.metadata.sorted_tables
        }
    engine.dispose()
    return counts
