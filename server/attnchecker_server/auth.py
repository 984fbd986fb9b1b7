"""Bearer tokens: "atk_<prefix>_<secret>", stored as the prefix (lookup key) and sha256 of the whole token."""

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from .models import ApiToken, utcnow

__all__ = [
    "ROLES",
    "Principal",
    "Role",
    "authenticate",
    "create_token",
    "list_tokens",
    "parse_duration",
    "revoke_tokens",
]

Role = Literal["agent", "operator", "viewer"]
ROLES: tuple[Role, ...] = ("agent", "operator", "viewer")
TOKEN_PREFIX = "atk"


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: Role | None
    """None when the request was let in by open_reads without a token."""
    token_id: int | None = None
    """The token's row id: the owner recorded on the runs it creates."""
    run_name: str | None = None
    """Set for a token bound to one run (`token create --run NAME`)."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """'90d', '12h', '30m', '45s', '2w' or plain seconds; at least one second."""
    match = _DURATION.match(text)
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration: give a positive number with s, m, h, d or w, e.g. 90d")
    return timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def create_token(
    session: Session,
    *,
    name: str,
    role: Role,
    run_name: str | None = None,
    expires_in: timedelta | None = None,
) -> str:
    """Returns the token; only its hash is stored, so this is the one time it can be shown.

    run_name binds an agent token to one run (created by whoever registers first); expires_in limits its life.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if not name or len(name) > 100:
        raise ValueError("name must be 1 to 100 characters (it is the actor recorded in policy history)")
    if run_name is not None and role != "agent":
        raise ValueError("--run binds agent tokens only: operators may write to every run, viewers to none")
    if run_name is not None and not 1 <= len(run_name) <= 200:
        raise ValueError("the run name must be 1 to 200 characters, as in registration")
    if expires_in is not None and expires_in.total_seconds() <= 0:
        raise ValueError("expires_in must be positive")
    prefix = secrets.token_hex(6)
    token = f"{TOKEN_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    now = utcnow()
    session.add(
        ApiToken(
            name=name,
            role=role,
            prefix=prefix,
            secret_sha256=_digest(token),
            created_at=now,
            run_name=run_name,
            expires_at=now + expires_in if expires_in is not None else None,
        )
    )
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    """The token's principal; None when it is malformed, unknown, revoked or expired."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        return None
    row = session.scalar(select(ApiToken).where(ApiToken.prefix == parts[1], ApiToken.revoked_at.is_(None)))
    if row is None or not hmac.compare_digest(row.secret_sha256, _digest(token)):
        return None
    if row.expires_at is not None and row.expires_at <= utcnow():
        return None
    return Principal(name=row.name, role=row.role, token_id=row.id, run_name=row.run_name)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class TokenInfo:
    name: str
    role: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None = None
    run_name: str | None = None


def list_tokens(session: Session) -> list[TokenInfo]:
    rows = session.scalars(select(ApiToken).order_by(ApiToken.created_at, ApiToken.id))
    return [TokenInfo(r.name, r.role, r.prefix, r.created_at, r.revoked_at, r.expires_at, r.run_name) for r in rows]


def revoke_tokens(session: Session, *, name: str | None = None, prefix: str | None = None) -> int:
    """Revokes the live tokens matching name or prefix; returns how many."""
    if not name and not prefix:
        raise ValueError("give a token name or a prefix to revoke")
    stmt = update(ApiToken).where(ApiToken.revoked_at.is_(None)).values(revoked_at=utcnow())
    stmt = stmt.where(ApiToken.name == name) if name else stmt.where(ApiToken.prefix == prefix)
    return cast(CursorResult[Any], session.execute(stmt)).rowcount or 0
