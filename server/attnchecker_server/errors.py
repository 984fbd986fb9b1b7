"""Domain errors raised by services, and the handlers that turn them (and 422s, and database outages) into JSON.

Every error body has the shape the OpenAPI document gives it (api/responses.py): a 422 is
{"detail": [{"loc", "msg", "type"}], "message"}; any other error {"detail": "what was wrong and what to do"}.
A database that is down or unreachable is a 503 with Retry-After, never a traceback.
"""

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

__all__ = [
    "RETRY_AFTER_SECONDS",
    "CollectorError",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "PreconditionFailed",
    "TooManyRequests",
    "install_error_handlers",
    "unavailable_response",
    "validation_message",
]

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
"""What a 503 tells clients to wait; the agent's backoff treats 503 as retryable."""


class CollectorError(Exception):
    status_code = 400

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class Forbidden(CollectorError):
    status_code = 403


class NotFound(CollectorError):
    status_code = 404


class PreconditionFailed(CollectorError):
    status_code = 412


class InvalidRequest(CollectorError):
    status_code = 422


class TooManyRequests(CollectorError):
    """A quota is full (429): retry after ``retry_after_s`` seconds, once something has made room."""

    status_code = 429

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    # FastAPI prefixes "body"/"query"; what the user typed is the rest of the path.
    parts = [str(part) for part in loc if part not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def validation_message(errors: list[dict[str, Any]]) -> str:
    return "; ".join(f"{_field(error.get('loc', ()))}: {error.get('msg', 'invalid')}" for error in errors)


def _jsonable(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # ctx may hold the raw exception; keep what a client can use.
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]


def _invalid(loc: list[str], msg: str, kind: str = "value_error") -> JSONResponse:
    """A 422 of one error in the shape of every other 422."""
    errors = [{"loc": loc, "msg": msg, "type": kind}]
    return JSONResponse({"detail": errors, "message": validation_message(errors)}, status_code=422)


def unavailable_response(reason: str) -> JSONResponse:
    return JSONResponse(
        {"detail": f"database unavailable ({reason}): retry in {RETRY_AFTER_SECONDS} s"},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(CollectorError)
    async def _collector_error(_request: Request, exc: CollectorError) -> JSONResponse:
        if exc.status_code == 422:
            where = exc.field or "body"
            msg = exc.message.removeprefix(f"{where}: ")
            return _invalid(["query" if where == "cursor" else "body", *where.split(".")], msg)
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, TooManyRequests) else None
        return JSONResponse({"detail": exc.message}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return JSONResponse({"detail": _jsonable(errors), "message": validation_message(errors)}, status_code=422)

    @app.exception_handler(DataError)
    async def _unstorable(_request: Request, exc: DataError) -> JSONResponse:
        # e.g. a NUL character, which PostgreSQL text and JSONB cannot hold: the client's value, not our fault.
        reason = str(exc.orig).splitlines()[0] if exc.orig is not None else "invalid value"
        return _invalid(["body"], f"a value in the request cannot be stored: {reason}")

    @app.exception_handler(UnicodeEncodeError)
    async def _not_unicode(_request: Request, _exc: UnicodeEncodeError) -> JSONResponse:
        # A lone surrogate in a path or query parameter: it cannot even be sent to the database.
        return _invalid(["path"], "text must be valid Unicode (no lone UTF-16 surrogates)")

    @app.exception_handler(ValidationError)
    async def _model_invalid(_request: Request, exc: ValidationError) -> JSONResponse:
        # Raised when a merged policy (PATCH) fails validation as a whole.
        errors = [dict(e) for e in exc.errors()]
        return JSONResponse({"detail": _jsonable(errors), "message": validation_message(errors)}, status_code=422)

    async def _unavailable(_request: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return unavailable_response(type(exc).__name__)

    # Connection refused or lost, a server shutting down, a pool with no free connection, SQLite's "database is
    # locked" past its busy timeout: all transient, all "retry later" rather than a 500.
    for outage in (OperationalError, InterfaceError, PoolTimeoutError):
        app.add_exception_handler(outage, _unavailable)

    @app.exception_handler(DBAPIError)
    async def _database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            return await _unavailable(request, exc)
        log.error("database error", exc_info=exc)
        return JSONResponse({"detail": "internal database error; it has been logged"}, status_code=500)
