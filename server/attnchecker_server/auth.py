"""Bearer tokens: "atk_<prefix>_<secret>", stored as the prefix (lookup key) and sha256 of the whole token."""

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from .models import ApiToken, utcnow

__all__ = ["ROLES", "Principal", "Role", "authenticate", "create_token", "list_tokens", "revoke_tokens"]

Role = Literal["agent", "operator", "viewer"]
ROLES: tuple[Role, ...] = ("agent", "operator", "viewer")
TOKEN_PREFIX = "atk"


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: Role | None
    """None when the request was let in by open_reads without a token."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, *, name: str, role: Role) -> str:
    """Returns the token; only its hash is stored, so this is the one time it can be shown."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if not name or len(name) > 100:
        raise ValueError("name must be 1 to 100 characters (it is the actor recorded in policy history)")
    prefix = secrets.token_hex(6)
    token = f"{TOKEN_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    session.add(ApiToken(name=name, role=role, prefix=prefix, secret_sha256=_digest(token), created_at=utcnow()))
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        return None
    row = session.scalar(select(ApiToken).where(ApiToken.prefix == parts[1], ApiToken.revoked_at.is_(None)))
    if row is None or not hmac.compare_digest(row.secret_sha256, _digest(token)):
        return None
    return Principal(name=row.name, role=row.role)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class TokenInfo:
    name: str
    role: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


def list_tokens(session: Session) -> list[TokenInfo]:
    rows = session.scalars(select(ApiToken).order_by(ApiToken.created_at, ApiToken.id))
    return [TokenInfo(r.name, r.role, r.prefix, r.created_at, r.revoked_at) for r in rows]


def revoke_tokens(session: Session, *, name: str | None = None, prefix: str | None = None) -> int:
    """Revokes the live tokens matching name or prefix; returns how many."""
    if not name and not prefix:
        raise ValueError("give a token name or a prefix to revoke")
    stmt = update(ApiToken).where(ApiToken.revoked_at.is_(None)).values(revoked_at=utcnow())
    stmt = stmt.where(ApiToken.name == name) if name else stmt.where(ApiToken.prefix == prefix)
    return cast(CursorResult[Any], session.execute(stmt)).rowcount or 0
