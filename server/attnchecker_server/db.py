"""Engine and session factory; SQLite gets WAL and a busy timeout so scrapes and several writers can share it."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from .config import Settings

__all__ = ["make_engine", "make_session_factory", "session_scope"]

SQLITE_BUSY_TIMEOUT_MS = 30_000


def _on_sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    # WAL lets /metrics and GETs read while an ingest transaction writes; NORMAL is durable enough under WAL.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()


def make_engine(settings: Settings | str, *, pooled: bool = True) -> Engine:
    """pooled=False (NullPool) for one-shot users such as migrations and the CLI, so nothing stays connected."""
    url = settings if isinstance(settings, str) else settings.effective_database_url
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            **({} if pooled else {"poolclass": NullPool}),
        )
        event.listen(engine, "connect", _on_sqlite_connect)
        return engine
    if not pooled:
        return create_engine(url, poolclass=NullPool)
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: committed on success, rolled back on any exception."""
    with factory() as session, session.begin():
        yield session
