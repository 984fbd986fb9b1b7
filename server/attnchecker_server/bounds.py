"""Limits on stored values, so that no accepted value can break a later read or overflow a column.

Each check raises ValueError with the field's problem and what to send instead; pydantic turns that into a 422
naming the field. Used by schemas (at the edge) and services (cursors, counters against stored totals).
"""

import json
import math
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "BIGINT_MAX",
    "CONFIG_MAX_BYTES",
    "CONFIG_MAX_DEPTH",
    "TS_MAX",
    "TS_MIN",
    "TS_PATTERN",
    "bounded_json",
    "in_range_utc",
    "valid_text",
]

BIGINT_MAX = 2**63 - 1
"""Every run total is a 64-bit column (BIGINT on PostgreSQL, INTEGER on SQLite)."""
CONFIG_MAX_DEPTH = 32
CONFIG_MAX_BYTES = 64 * 1024
TS_MIN = datetime(2000, 1, 1, tzinfo=UTC)
TS_MAX = datetime(2200, 1, 1, tzinfo=UTC)
TS_PATTERN = r"^2[01][0-9]{2}-"
"""The same range for the OpenAPI document: an RFC 3339 time whose year is 2000 to 2199."""


def _is_surrogate(text: str) -> bool:
    # A lone surrogate ("\udfff") parses from JSON but cannot be encoded as UTF-8: stored, it breaks every read.
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def valid_text(value: str) -> str:
    if _is_surrogate(value):
        raise ValueError("text must be valid Unicode: it holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
    if "\x00" in value:
        raise ValueError("text must not contain NUL (\\u0000), which the database cannot store")
    return value


def _walk(value: Any, depth: int) -> None:
    if depth > CONFIG_MAX_DEPTH:
        raise ValueError(f"nested deeper than {CONFIG_MAX_DEPTH} levels: flatten it")
    if isinstance(value, str):
        valid_text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            valid_text(key)
            _walk(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _walk(item, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        # Python's JSON parser accepts NaN/Infinity; stored, they make the run's JSON unreadable.
        raise ValueError("JSON has no INF or NaN: send the value as a string")


def bounded_json(value: dict[str, Any]) -> dict[str, Any]:
    """A free-form JSON object: at most CONFIG_MAX_DEPTH levels and CONFIG_MAX_BYTES serialised, valid text."""
    _walk(value, 1)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > CONFIG_MAX_BYTES:
        raise ValueError(f"is {size} bytes as JSON; the limit is {CONFIG_MAX_BYTES}: keep the run's config small")
    return value


def in_range_utc(value: datetime) -> datetime:
    """A zoned time written in the years 2000 to 2199, converted to UTC. Checked as written (the OpenAPI pattern
    says the same), so that the conversion cannot overflow: an offset applied at year 1 or 9999 would."""
    if value.tzinfo is None:
        raise ValueError("needs a zone (RFC 3339, e.g. 2026-11-29T15:32:40.123Z)")
    if not TS_MIN.year <= value.year < TS_MAX.year:
        raise ValueError(
            f"{value.isoformat()} is outside the years {TS_MIN.year} to {TS_MAX.year - 1}: check the sender's clock"
        )
    return value.astimezone(UTC)
