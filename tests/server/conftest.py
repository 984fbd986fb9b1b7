"""Every API test runs on SQLite and on the real PostgreSQL (one database per test session, dropped at the end)."""

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from collector_testing import (
    create_postgres_database,
    drop_postgres_database,
    make_settings,
    migrate,
    postgres_available,
)
from server_helpers import Api, make_api  # tests/server is on sys.path (rootdir-relative "prepend" imports)
from sqlalchemy import text

from attnchecker_server.config import Settings
from attnchecker_server.db import make_engine
from attnchecker_server.models import Base

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A migrated database of this session's own, on ATTNCHECKER_TEST_DATABASE_URL's server (127.0.0.1:5432)."""
    if not postgres_available():
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (set ATTNCHECKER_TEST_DATABASE_URL)")
    url = create_postgres_database()
    try:
        migrate(Settings(database_url=url))
        yield url
    finally:
        drop_postgres_database(url)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file that each test copies (cheaper than migrating per test)."""
    directory = tmp_path_factory.mktemp("sqlite-template")
    settings = make_settings("sqlite", directory)
    migrate(settings)
    return directory / "attnchecker.db"


def _truncate_postgres(url: str) -> None:
    engine = make_engine(url, pooled=False)
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_test_settings(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """A factory: settings for this test's backend over a clean, migrated database; overrides go to Settings."""
    if backend == "postgres":
        url = request.getfixturevalue("postgres_url")
        _truncate_postgres(url)
    else:
        shutil.copy(request.getfixturevalue("sqlite_template"), tmp_path / "attnchecker.db")
        url = None

    def factory(**overrides: Any) -> Settings:
        return make_settings(backend, tmp_path, database_url=url, **overrides)  # type: ignore[arg-type]

    return factory


@pytest.fixture
def settings(make_test_settings: Any) -> Settings:
    return make_test_settings()  # type: ignore[no-any-return]


@pytest.fixture
def api(settings: Settings) -> Iterator[Api]:
    yield from make_api(settings)
