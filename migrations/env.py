"""Alembic environment: the URL from the Config (CLI, tests) or from ATTNCHECKER_* settings; batch mode on SQLite."""

from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from attnchecker_server.config import Settings, normalise_database_url
from attnchecker_server.db import make_engine
from attnchecker_server.models import Base, UtcDateTime

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    return normalise_database_url(url) if url else Settings().effective_database_url


def _render_item(type_: str, obj: Any, _autogen_context: Any) -> str | Literal[False]:
    # Scripts must not import the app: UtcDateTime is stored as a plain timestamptz.
    if type_ == "type" and isinstance(obj, UtcDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_item=_render_item,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=True,
        compare_type=True,
        **kwargs,  # type: ignore[arg-type]
    )


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url(), pooled=False)
    try:
        with engine.connect() as connection:
            _configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
