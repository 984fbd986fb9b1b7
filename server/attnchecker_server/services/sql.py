"""Dialect helpers: ON CONFLICT inserts and GREATEST exist on both backends, under different names."""

from typing import Any

from sqlalchemy import ColumnElement, case, func, literal
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

__all__ = ["greatest", "saturating_add", "upsert_insert"]


def upsert_insert(session: Session, table: Any) -> Any:
    """An INSERT that supports on_conflict_do_nothing/do_update on the session's backend."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise RuntimeError(f"unsupported database backend {name!r}: use SQLite or PostgreSQL")


def greatest(session: Session, a: Any, b: Any) -> ColumnElement[Any]:
    """NULL-tolerant maximum of two SQL expressions."""
    if session.get_bind().dialect.name == "sqlite":
        # SQLite's two-argument max() returns NULL if either is NULL.
        return func.max(func.coalesce(a, b), func.coalesce(b, a))
    return func.greatest(a, b)


def saturating_add(column: Any, delta: int, ceiling: int) -> ColumnElement[Any]:
    """column + delta, held at ceiling: totals summed across runs (a device's) have no per-run headroom check, and an
    overflowing BIGINT would fail every later interval of every run on the device."""
    if delta <= 0:
        return column  # type: ignore[no-any-return]
    return case((column > literal(ceiling - delta), literal(ceiling)), else_=column + delta)
