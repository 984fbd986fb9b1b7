"""A database that is down or unreachable: every endpoint and /metrics answer 503 with Retry-After and a JSON body
(no traceback); once the database is back, the same app serves again."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from collector_testing import make_settings
from fastapi.testclient import TestClient
from server_helpers import Api, make_batch, make_stats
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool
from test_auth import ENDPOINTS

from attnchecker_server.main import create_app

FAKE_TOKEN = "atk_0123456789ab_not-checked-because-the-database-is-down"


def _body(body: Any) -> Any:
    return make_batch() if body == "batch" else make_stats() if body == "stats" else body


def _assert_unavailable(response: Any, what: str) -> None:
    assert response.status_code == 503, f"{what}: {response.status_code} {response.text[:300]}"
    assert response.headers["Retry-After"].isdigit(), what
    assert "detail" in response.json(), what
    assert "Traceback" not in response.text, what


def _every_endpoint(client: TestClient, headers: dict[str, str], run_id: str = "some-run") -> None:
    for method, path, body, _roles in ENDPOINTS:
        url = path.replace("{run}", run_id)
        _assert_unavailable(client.request(method, url, json=_body(body), headers=headers), f"{method} {url}")
    _assert_unavailable(client.get("/readyz"), "GET /readyz")


@pytest.fixture
def unreachable_settings(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if backend == "postgres":
        request.getfixturevalue("postgres_url")  # skips when there is no PostgreSQL here at all
        # Nothing listens on port 1: connection refused, as for a database host that is down.
        return make_settings("postgres", tmp_path, database_url="postgresql+psycopg://postgres@127.0.0.1:1/gone")
    (tmp_path / "attnchecker.db").mkdir()  # a directory where the file should be: SQLite cannot open it
    return make_settings("sqlite", tmp_path)


@pytest.mark.parametrize("open_reads", [False, True])
def test_unreachable_database_is_503_with_retry_after_everywhere(unreachable_settings: Any, open_reads: bool) -> None:
    settings = unreachable_settings.model_copy(update={"open_reads": open_reads})
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        _every_endpoint(client, {"Authorization": f"Bearer {FAKE_TOKEN}"})
        if open_reads:  # no token: the reads still need the database, so they say it is down
            _assert_unavailable(client.get("/metrics"), "GET /metrics without token")
            _assert_unavailable(client.get("/api/v1/runs"), "GET /api/v1/runs without token")
        assert client.get("/healthz").status_code == 200  # the process itself is up


def _allow_connections(url: str, allow: bool) -> None:
    """ALLOW_CONNECTIONS off and every session on the database terminated: the database is down for the app."""
    name = make_url(url).database
    admin = create_engine(make_url(url).set(database="postgres"), poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {"true" if allow else "false"}'))
        if not allow:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n AND pid <> pg_backend_pid()"),
                {"n": name},
            )
    admin.dispose()


@pytest.fixture
def postgres_down(settings: Any, backend: str) -> Iterator[Any]:
    if backend != "postgres":
        pytest.skip("taking a live database away needs a server (PostgreSQL); SQLite is covered by the unreachable case")
    yield lambda down: _allow_connections(settings.effective_database_url, not down)
    _allow_connections(settings.effective_database_url, True)


def test_database_lost_mid_life_is_503_then_recovers(api: Api, postgres_down: Any) -> None:
    run_id = api.register("outage")["id"]
    agent = api.headers("agent")
    assert api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=make_batch(), headers=agent).status_code == 200
    api.client.app.state.collector.db_collector.invalidate()  # type: ignore[attr-defined]
    postgres_down(True)
    client = TestClient(api.client.app, raise_server_exceptions=False)
    _every_endpoint(client, api.headers("operator"), run_id)
    batch = make_batch()
    _assert_unavailable(client.post(f"/api/v1/runs/{run_id}/events:batch", json=batch, headers=agent), "agent post")
    postgres_down(False)
    # Back: the pool replaces its dead connections (pre-ping) and the retried batch is stored once.
    assert client.post(f"/api/v1/runs/{run_id}/events:batch", json=batch, headers=agent).json()["accepted"] == 3
    assert client.get("/readyz").status_code == 200
    assert client.get("/metrics", headers=api.headers("viewer")).status_code == 200
    events = client.get(f"/api/v1/runs/{run_id}/events", headers=api.headers("viewer")).json()["data"]
    assert len(events) == 6


def test_a_valid_token_is_still_checked_once_the_database_is_back(api: Api, postgres_down: Any) -> None:
    postgres_down(True)
    client = TestClient(api.client.app, raise_server_exceptions=False)
    _assert_unavailable(client.get("/api/v1/runs", headers={"Authorization": f"Bearer {FAKE_TOKEN}"}), "fake token")
    postgres_down(False)
    assert client.get("/api/v1/runs", headers={"Authorization": f"Bearer {FAKE_TOKEN}"}).status_code == 401
    assert client.get("/api/v1/runs", headers=api.headers("viewer")).status_code == 200
