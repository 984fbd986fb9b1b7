"""The attnchecker-server CLI, /readyz against the migration head, and a real uvicorn collector."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from collector_testing import free_port, make_settings, make_token, run_collector
from fastapi.testclient import TestClient
from server_helpers import make_batch
from sqlalchemy import select

from attnchecker_server.cli import main
from attnchecker_server.db import make_engine, make_session_factory
from attnchecker_server.main import create_app
from attnchecker_server.models import ApiToken


@pytest.fixture
def env_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ATTNCHECKER_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCHECKER_DATABASE_URL", raising=False)
    return make_settings("sqlite", tmp_path)


def test_cli_migrate_then_token_create_list_revoke(env_settings: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate"]) == 0
    assert main(["token", "create", "--role", "operator", "--name", "bob"]) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert token.startswith("atk_")
    engine = make_engine(env_settings, pooled=False)
    with make_session_factory(engine)() as session:
        [row] = session.scalars(select(ApiToken)).all()
        assert row.name == "bob"
        assert row.role == "operator"
        assert token.split("_")[1] == row.prefix
        assert token not in row.secret_sha256
    engine.dispose()
    assert main(["token", "list"]) == 0
    listing = capsys.readouterr().out
    assert "bob" in listing
    assert "operator" in listing
    assert "active" in listing
    assert token not in listing
    assert main(["token", "revoke", "--name", "bob"]) == 0
    assert "revoked 1" in capsys.readouterr().out
    assert main(["token", "revoke", "--name", "bob"]) == 1
    with pytest.raises(SystemExit):
        main(["token", "create", "--role", "admin", "--name", "x"])


def test_readyz_is_503_until_migrated(env_settings: Any) -> None:
    with TestClient(create_app(env_settings)) as client:
        response = client.get("/readyz")
        assert response.status_code == 503
        assert "attnchecker-server migrate" in response.json()["detail"]
        assert main(["migrate"]) == 0
        assert client.get("/readyz").status_code == 200
        assert main(["migrate", "--downgrade", "--revision", "base"]) == 0
        assert client.get("/readyz").status_code == 503


def test_serve_real_uvicorn_dedupes_concurrent_posts(make_test_settings: Any) -> None:
    settings = make_test_settings()
    token = make_token(settings, "agent", "agent-0")
    headers = {"Authorization": f"Bearer {token}"}
    with run_collector(settings) as collector:
        assert httpx.get(f"{collector.url}/readyz").status_code == 200
        assert httpx.get(f"{collector.url}/metrics", follow_redirects=False).status_code == 401
        run_id = httpx.post(f"{collector.url}/api/v1/runs", json={"name": "uv"}, headers=headers).json()["id"]
        batch = make_batch(n=20)
        barrier = threading.Barrier(8)
        results: list[dict[str, int]] = []

        def post() -> None:
            barrier.wait()
            response = httpx.post(
                f"{collector.url}/api/v1/runs/{run_id}/events:batch", json=batch, headers=headers, timeout=30
            )
            results.append(response.json())

        threads = [threading.Thread(target=post) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sum(r["accepted"] for r in results) == 20
        assert len(results) == 8
    assert collector.process.returncode is not None


def test_serve_comes_up_on_sqlite_with_no_configuration(tmp_path: Path) -> None:
    # No ATTNCHECKER_* at all: serve creates ./data/attnchecker.db and migrates it (the SQLite default).
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNCHECKER_")}
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "attnchecker_server.cli", "serve", "--port", str(port), "--log-level", "warning"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code
                if status == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert status == 200
        assert (tmp_path / "data" / "attnchecker.db").exists()
    finally:
        process.terminate()
        process.wait(10)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.postgres
def test_serve_workers_runs_several_processes_that_share_postgres(make_test_settings: Any, backend: str) -> None:
    if backend != "postgres":
        pytest.skip("--workers is for PostgreSQL; the SQLite refusal has its own test")
    settings = make_test_settings()
    headers = {"Authorization": f"Bearer {make_token(settings, 'agent', 'agent-0')}"}
    viewer = {"Authorization": f"Bearer {make_token(settings, 'viewer', 'grafana')}"}
    with run_collector(settings, workers=2) as collector:
        deadline = time.monotonic() + 30
        while len(_children(collector.process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_children(collector.process.pid)) >= 2, collector.log()  # uvicorn's supervisor and 2 workers
        run_id = httpx.post(f"{collector.url}/api/v1/runs", json={"name": "workers"}, headers=headers).json()["id"]
        batches = [make_batch(n=10) for _ in range(6)]
        results: list[dict[str, int]] = []

        def post(batch: dict[str, Any]) -> None:
            # Every batch twice, concurrently: whichever workers answer, each event is stored once.
            for _ in range(2):
                url = f"{collector.url}/api/v1/runs/{run_id}/events:batch"
                results.append(httpx.post(url, json=batch, headers=headers, timeout=30).json())

        threads = [threading.Thread(target=post, args=(batch,)) for batch in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sum(r["accepted"] for r in results) == 60
        assert sum(r["duplicates"] for r in results) == 60
        events = httpx.get(f"{collector.url}/api/v1/runs/{run_id}/events?limit=1000", headers=viewer).json()["data"]
        assert len(events) == 60
        for _ in range(4):  # any worker answers the run metrics from the database
            assert 'run="workers"' in httpx.get(f"{collector.url}/metrics", headers=viewer).text
    assert collector.process.returncode is not None


def test_serve_workers_refuses_sqlite(env_settings: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--workers", "2", "--port", str(free_port())]) == 2
    assert "needs PostgreSQL" in capsys.readouterr().err
    assert main(["serve", "--workers", "0", "--port", str(free_port())]) == 2
