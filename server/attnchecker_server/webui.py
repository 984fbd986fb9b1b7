"""The collector's own dashboard page: static files shipped in the package, served at / (the page) and /ui/ (its
script and style). The page reads only the JSON API and /metrics, with the viewer's own token, so it grants nothing
the API does not already grant."""

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

__all__ = ["STATIC_DIR", "install_web_ui"]

STATIC_DIR = Path(__file__).resolve().parent / "static"

# Everything comes from this origin and nothing runs inline, so an injected run name can never become script; the
# token lives in sessionStorage and goes out only as a Bearer header to this origin (connect-src 'self').
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page is small; never serve a stale one after an upgrade.
    "Cache-Control": "no-cache",
}


def install_web_ui(app: FastAPI) -> None:
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_HEADERS)

    app.include_router(router)
    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")
