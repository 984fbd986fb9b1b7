"""Test helpers shared by tests/server, tests/agent, tests/e2e, tests/dashboards and bench/: throwaway databases,
settings, tokens, and a real collector (uvicorn in a subprocess) on a free loopback port.

It lives under tests/ (pytest.ini puts tests/ on sys.path; bench/_common.setup_path does the same), not in the
server package, which ships without it.

Importing this module has no side effects; PostgreSQL is only contacted by the functions that need it.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from attnchecker_server.auth import Role, create_token
from attnchecker_server.config import Settings, normalise_database_url
from attnchecker_server.db import make_engine, make_session_factory, session_scope
from attnchecker_server.migrate import upgrade

__all__ = [
    "DEFAULT_POSTGRES_URL",
    "RunningCollector",
    "create_postgres_database",
    "drop_postgres_database",
    "free_port",
    "make_settings",
    "make_token",
    "migrate",
    "postgres_available",
    "postgres_database",
    "run_collector",
    "settings_env",
    "start_collector",
]

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _admin_url(base_url: str | None) -> str:
    """The maintenance database URL: ATTNCHECKER_TEST_DATABASE_URL, else postgres@127.0.0.1:5432."""
    return normalise_database_url(base_url or os.environ.get("ATTNCHECKER_TEST_DATABASE_URL") or DEFAULT_POSTGRES_URL)


def postgres_available(base_url: str | None = None) -> bool:
    try:
        engine = create_engine(_admin_url(base_url), poolclass=NullPool, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return True
    except Exception:  # any failure means "not usable here"; callers skip with a reason
        return False


def create_postgres_database(base_url: str | None = None, *, prefix: str = "attnchecker_test") -> str:
    """Creates an empty database with a unique name on the server of base_url; returns its psycopg URL."""
    admin = make_url(_admin_url(base_url))
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = create_engine(admin, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return admin.set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(url: str) -> None:
    """Drops the database of url (closing other sessions on it first)."""
    target = make_url(url)
    admin = target.set(database="postgres")
    engine = create_engine(admin, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)'))
    engine.dispose()


@contextmanager
def postgres_database(base_url: str | None = None, *, prefix: str = "attnchecker_test") -> Iterator[str]:
    """A fresh, empty PostgreSQL database for the duration of the block."""
    url = create_postgres_database(base_url, prefix=prefix)
    try:
        yield url
    finally:
        drop_postgres_database(url)


def make_settings(
    backend: Literal["sqlite", "postgres"], tmp_path: Path, *, database_url: str | None = None, **overrides: Any
) -> Settings:
    """Settings for a test: SQLite in tmp_path, or PostgreSQL at database_url (required for "postgres")."""
    if backend == "postgres" and not database_url:
        raise ValueError("backend 'postgres' needs database_url (from create_postgres_database())")
    url = database_url if backend == "postgres" else f"sqlite:///{tmp_path / 'attnchecker.db'}"
    return Settings(data_dir=tmp_path, database_url=url, **overrides)


def migrate(settings: Settings) -> None:
    """Upgrades the settings' database to the Alembic head."""
    upgrade(settings)


def make_token(
    settings: Settings,
    role: Role,
    name: str | None = None,
    *,
    run_name: str | None = None,
    expires_in: timedelta | None = None,
) -> str:
    """Creates a token in the settings' (migrated) database and returns it (run_name binds an agent token)."""
    engine = make_engine(settings, pooled=False)
    try:
        with session_scope(make_session_factory(engine)) as session:
            return create_token(
                session, name=name or f"test-{role}", role=role, run_name=run_name, expires_in=expires_in
            )
    finally:
        engine.dispose()


def settings_env(settings: Settings) -> dict[str, str]:
    """The ATTNCHECKER_* variables that reproduce settings in a child process."""
    env = {
        "ATTNCHECKER_DATA_DIR": str(settings.data_dir),
        "ATTNCHECKER_DATABASE_URL": settings.effective_database_url,
        "ATTNCHECKER_MAX_BODY_BYTES": str(settings.max_body_bytes),
        "ATTNCHECKER_MAX_EVENTS_PER_BATCH": str(settings.max_events_per_batch),
        "ATTNCHECKER_OPEN_READS": "true" if settings.open_reads else "false",
        "ATTNCHECKER_METRICS_RECENT_SECONDS": str(settings.metrics_recent_seconds),
        "ATTNCHECKER_METRICS_CACHE_SECONDS": str(settings.metrics_cache_seconds),
        "ATTNCHECKER_METRICS_MAX_RUNS": str(settings.metrics_max_runs),
    }
    return env


def free_port() -> int:
    """A loopback port free right now (another process may still take it before you bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningCollector:
    """A collector subprocess; url is http://127.0.0.1:<port>."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    settings: Settings
    _stopped: bool = field(default=False, repr=False)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (uvicorn shuts down gracefully), SIGKILL after timeout."""
        if self._stopped:
            return
        self._stopped = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                if os.getpgid(self.process.pid) == self.process.pid:  # --workers: its own group, workers included
                    os.killpg(self.process.pid, signal.SIGKILL)
                else:
                    self.process.kill()
                self.process.wait(timeout)


def start_collector(
    settings: Settings,
    *,
    port: int | None = None,
    migrate_first: bool = True,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 30.0,
    log_path: Path | None = None,
    workers: int = 1,
) -> RunningCollector:
    """Starts `attnchecker-server serve` on 127.0.0.1 in a subprocess and waits until /healthz answers.

    Args:
        settings: what the child runs with (passed as ATTNCHECKER_* variables).
        port: a fixed port, else a free one is picked (retried if another process grabs it first).
        migrate_first: upgrade the database to head in this process before starting.
        env: extra environment variables for the child.
        log_path: where the child's stdout/stderr go (default: <settings.data_dir>/collector-<port>.log).
        workers: `serve --workers` (more than 1 needs PostgreSQL).
    """
    if migrate_first:
        upgrade(settings)
    attempts = 1 if port is not None else 3
    last_log = ""
    for _ in range(attempts):
        chosen = port or free_port()
        path = log_path or Path(settings.data_dir) / f"collector-{chosen}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        child_env = {**os.environ, **settings_env(settings), **(env or {})}
        with path.open("wb") as log_file:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "attnchecker_server.cli",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(chosen),
                    "--no-migrate",
                    "--log-level",
                    "warning",
                    "--workers",
                    str(workers),
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env,
                # Worker processes are children of the supervisor: a group lets stop() kill them all if need be.
                start_new_session=workers > 1,
            )
        collector = RunningCollector(
            url=f"http://127.0.0.1:{chosen}", port=chosen, process=process, log_path=path, settings=settings
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{collector.url}/healthz", timeout=1.0).status_code == 200:
                    return collector
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        collector.stop()
        last_log = collector.log()
    raise RuntimeError(f"the collector did not come up on 127.0.0.1 within {startup_timeout}s; its log:\n{last_log}")


@contextmanager
def run_collector(settings: Settings, **kwargs: Any) -> Iterator[RunningCollector]:
    """start_collector() for the duration of the block; always stopped afterwards."""
    collector = start_collector(settings, **kwargs)
    try:
        yield collector
    finally:
        collector.stop()
