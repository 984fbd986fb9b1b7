"""Domain errors raised by services, and the handlers that turn them (and 422s) into JSON with a readable message."""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import DataError

__all__ = [
    "CollectorError",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "PreconditionFailed",
    "install_error_handlers",
    "validation_message",
]


class CollectorError(Exception):
    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Forbidden(CollectorError):
    status_code = 403


class NotFound(CollectorError):
    status_code = 404


class PreconditionFailed(CollectorError):
    status_code = 412


class InvalidRequest(CollectorError):
    status_code = 422


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    # FastAPI prefixes "body"/"query"; what the user typed is the rest of the path.
    parts = [str(part) for part in loc if part not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def validation_message(errors: list[dict[str, Any]]) -> str:
    return "; ".join(f"{_field(error.get('loc', ()))}: {error.get('msg', 'invalid')}" for error in errors)


def _jsonable(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # ctx may hold the raw exception; keep what a client can use.
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(CollectorError)
    async def _collector_error(_request: Request, exc: CollectorError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return JSONResponse({"detail": _jsonable(errors), "message": validation_message(errors)}, status_code=422)

    @app.exception_handler(DataError)
    async def _unstorable(_request: Request, exc: DataError) -> JSONResponse:
        # e.g. a NUL character, which PostgreSQL text and JSONB cannot hold: the client's value, not our fault.
        reason = str(exc.orig).splitlines()[0] if exc.orig is not None else "invalid value"
        return JSONResponse({"detail": f"a value in the request cannot be stored: {reason}"}, status_code=422)

    @app.exception_handler(ValidationError)
    async def _model_invalid(_request: Request, exc: ValidationError) -> JSONResponse:
        # Raised when a merged policy (PATCH) fails validation as a whole.
        errors = [dict(e) for e in exc.errors()]
        return JSONResponse({"detail": _jsonable(errors), "message": validation_message(errors)}, status_code=422)
