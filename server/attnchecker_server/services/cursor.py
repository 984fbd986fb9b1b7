"""Opaque pagination cursors: the sort key of the last row handed out, base64url-encoded JSON."""

import base64
import binascii
import json
from typing import Any

from ..errors import InvalidRequest

__all__ = ["decode_cursor", "encode_cursor"]


def encode_cursor(key: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, *, length: int) -> list[Any]:
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        key = None
    if not isinstance(key, list) or len(key) != length:
        raise InvalidRequest("cursor: not a cursor this server issued; pass next_cursor back unchanged")
    return key
