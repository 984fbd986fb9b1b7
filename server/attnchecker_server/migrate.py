"""Alembic plumbing shared by the CLI, /readyz and tests: where the scripts are, upgrade, and the head check."""

import os
from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

from .config import Settings

__all__ = ["alembic_config", "current_revisions", "head_revisions", "migrations_dir", "upgrade"]


def migrations_dir() -> Path:
    """The Alembic scripts: ATTNCHECKER_MIGRATIONS_DIR, else ./migrations (an install next to alembic.ini, as in
    deploy/collector.Dockerfile), else migrations/ at the repository root of an editable install."""
    override = os.environ.get("ATTNCHECKER_MIGRATIONS_DIR")
    candidates = (
        [Path(override)]
        if override
        else [Path.cwd() / "migrations", Path(__file__).resolve().parents[2] / "migrations"]
    )
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    raise FileNotFoundError(
        f"no Alembic scripts (env.py) in {', '.join(map(str, candidates))}: run from the directory holding "
        "migrations/, install attnchecker-server editable (pip install -e server), or set "
        "ATTNCHECKER_MIGRATIONS_DIR"
    )


def alembic_config(settings: Settings | str) -> Config:
    url = settings if isinstance(settings, str) else settings.effective_database_url
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation would eat the % of URL-encoded passwords.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(settings: Settings | str, revision: str = "head") -> None:
    command.upgrade(alembic_config(settings), revision)


@lru_cache(maxsize=1)
def head_revisions() -> frozenset[str]:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    return frozenset(ScriptDirectory.from_config(config).get_heads())


def current_revisions(connection: Connection) -> frozenset[str]:
    return frozenset(MigrationContext.configure(connection).get_current_heads())
