"""Opaque pagination cursors: the sort key of the last row handed out, base64url-encoded JSON."""

import base64
import binascii
import json
from datetime import datetime
from typing import Any

from ..bounds import in_range_utc
from ..errors import InvalidRequest

__all__ = ["cursor_id", "cursor_int", "cursor_time", "decode_cursor", "encode_cursor"]

_NOT_OURS = "cursor: not a cursor this server issued; pass next_cursor back unchanged"


def encode_cursor(key: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, *, length: int) -> list[Any]:
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        key = None
    if not isinstance(key, list) or len(key) != length:
        raise InvalidRequest(_NOT_OURS, field="cursor")
    return key


# A forged cursor must not reach the query: each part is checked against what the server itself could have issued.


def cursor_time(value: Any) -> datetime:
    try:
        return in_range_utc(datetime.fromisoformat(value))
    except (TypeError, ValueError):
        raise InvalidRequest(_NOT_OURS, field="cursor") from None


def cursor_int(value: Any, *, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
        raise InvalidRequest(_NOT_OURS, field="cursor")
    return value


def cursor_id(value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= 36 or not value.isascii():
        raise InvalidRequest(_NOT_OURS, field="cursor")
    return value
