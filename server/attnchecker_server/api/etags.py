"""ETag / If-Match / If-None-Match as the versioned resources (policies, device status) use them: the ETag is the
version in quotes ("4"); If-Match is one such ETag (W/"4" and 4 read the same) or *."""

from typing import Annotated

from fastapi import Header

from ..errors import PreconditionFailed

__all__ = ["IfMatch", "IfNoneMatch", "etag_versions", "if_match_version"]


def etag_versions(header: str) -> list[str]:
    return [part.strip().removeprefix("W/").strip('"') for part in header.split(",") if part.strip()]


def if_match_version(header: str | None) -> int | None:
    """The version If-Match names; None when it is absent or *. 412 when it is not one ETag of ours."""
    if header is None or "*" in etag_versions(header):
        return None
    versions = etag_versions(header)
    try:
        return int(versions[0]) if len(versions) == 1 else None
    except ValueError:
        pass
    raise PreconditionFailed(f'If-Match must be one ETag from GET, like "4"; got {header!r}')


IfNoneMatch = Annotated[str | None, Header()]
# One ETag as GET sends it ("4"; W/"4" and 4 are read the same) or *.
# Typed str (not str | None, whose OpenAPI form lets clients send the text "null"); absent means None.
IfMatch = Annotated[str, Header(pattern=r'^(\*|(W/)?"?[0-9]{1,10}"?)$')]
