"""The error responses each route documents in OpenAPI, with the bodies errors.py really sends."""

from typing import Any

from pydantic import BaseModel

__all__ = ["ErrorOut", "ValidationErrorOut", "errors"]


class ErrorOut(BaseModel):
    detail: str
    """What was wrong and what to do."""


class ValidationErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorOut(BaseModel):
    detail: list[ValidationErrorItem]
    message: str
    """The errors in one line: "field.path: what is wrong; ..."."""


_DESCRIPTIONS = {
    401: "missing, unknown, revoked or expired bearer token",
    403: "the token's role may not do this, or an agent token may not write to this run",
    404: "no run (or device) with this id",
    412: "If-Match names a version that is no longer current (or is not an ETag)",
    413: "request body larger than ATTNCHECKER_MAX_BODY_BYTES",
    422: "invalid request: the field and the problem are in detail[].loc / msg and in message",
    429: "the token's quota of live runs is full: retry after the Retry-After seconds (docs/collector.md, Quotas)",
    503: "database down or unreachable: retry after the Retry-After seconds; nothing was applied",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """responses= for a route: the given codes, plus 401, 422 and 503, which every /api/v1 route can answer."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted({401, 422, 503, *codes}):
        entry: dict[str, Any] = {
            "model": ValidationErrorOut if code == 422 else ErrorOut,
            "description": _DESCRIPTIONS[code],
        }
        if code in (429, 503):
            entry["headers"] = {
                "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
            }
        if code == 401:
            entry["headers"] = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}
        out[code] = entry
    return out
