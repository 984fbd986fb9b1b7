"""Typed dependencies: the request's Session, its Principal (bearer token + role), the app's state."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from ..auth import Principal, Role, authenticate
from ..config import Settings
from ..metrics import DbCollector, IngestMetrics

__all__ = [
    "AGENT_WRITE",
    "OPERATOR",
    "POLICY_READ",
    "READ",
    "AppState",
    "SessionDep",
    "StateDep",
    "require",
]


@dataclass(frozen=True, slots=True)
class AppState:
    settings: Settings
    session_factory: sessionmaker[Session]
    db_collector: DbCollector
    ingest: IngestMetrics


def get_state(request: Request) -> AppState:
    return request.app.state.collector  # type: ignore[no-any-return]


StateDep = Annotated[AppState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    """A session per request; routes commit explicitly so the response only goes out after the commit."""
    with state.session_factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


# Declared through FastAPI's HTTPBearer so the OpenAPI schema documents the scheme; errors are ours (auto_error off).
BearerDep = Annotated[
    HTTPAuthorizationCredentials | None,
    Depends(HTTPBearer(auto_error=False, description="a token from `attnchecker-server token create`")),
]


def require(*roles: Role, read: bool = False) -> Callable[..., Principal]:
    """A dependency admitting the given roles; read=True routes are open to everyone under open_reads."""

    # The route's own SessionDep: FastAPI caches a dependency per request, so the token lookup and the handler share
    # one session (one pool checkout, one pre-ping) instead of opening a second one for authentication.
    def dependency(state: StateDep, credentials: BearerDep, session: SessionDep) -> Principal:
        token = credentials.credentials.strip() if credentials is not None else ""
        if read and state.settings.open_reads and not token:
            return Principal(name="anonymous", role=None)
        if not token:
            raise HTTPException(
                401,
                "missing bearer token: send 'Authorization: Bearer <token>' (create one with "
                "`attnchecker-server token create --role R --name N`)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        principal = authenticate(session, token)
        if principal is None:
            raise HTTPException(
                401, "unknown, revoked or expired token", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'}
            )
        # Under open_reads anyone may read, so any valid token may too.
        if principal.role not in roles and not (read and state.settings.open_reads):
            raise HTTPException(403, f"role {principal.role!r} may not do this; it needs one of: {', '.join(roles)}")
        return principal

    return dependency


# Who may do what (docs/wire.md "Auth"): operators may do everything.
AGENT_WRITE = Depends(require("agent", "operator"))
READ = Depends(require("viewer", "operator", read=True))
POLICY_READ = Depends(require("agent", "viewer", "operator", read=True))
OPERATOR = Depends(require("operator"))
