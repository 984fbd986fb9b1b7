"""The dashboard page's server side: the static files at / and /ui/, their headers, and the one API behaviour the
page relies on to decide whether to offer the policy editor (tests/e2e/test_web_ui.py drives the page itself)."""

import re

from server_helpers import Api

from attnchecker_server.webui import STATIC_DIR


def test_the_page_is_served_at_the_root_with_a_strict_content_security_policy(api: Api) -> None:
    r = api.client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"):
        assert directive in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    # The page itself carries no data: that needs a token, as before.
    assert "exp-42" not in r.text
    assert api.client.get("/api/v1/runs").status_code == 401


def test_the_page_loads_only_files_shipped_in_the_package(api: Api) -> None:
    html = (STATIC_DIR / "index.html").read_text()
    refs = [ref for ref in re.findall(r'(?:src|href)="([^"]+)"', html) if not ref.startswith("#")]  # "#/": in-page
    assert refs and all(ref.startswith("/ui/") for ref in refs), refs
    for ref in refs:
        r = api.client.get(ref)
        assert r.status_code == 200, ref
    assert api.client.get("/ui/app.js").headers["content-type"].split(";")[0] in ("text/javascript",
                                                                                  "application/javascript")
    # The scripts are ES modules that import only each other, and no CDN or other origin appears in them: the only
    # absolute URL is the SVG namespace.
    urls: set[str] = set()
    imported: set[str] = set()
    for script in STATIC_DIR.glob("*.js"):
        text = script.read_text()
        urls |= set(re.findall(r"https?://[^\s\"']+", text))
        for module in re.findall(r'^import .* from "([^"]+)";$', text, re.MULTILINE):
            assert module.startswith("./") and (STATIC_DIR / module).is_file(), (script.name, module)
            assert api.client.get(f"/ui/{module[2:]}").status_code == 200
            imported.add(module[2:])
    assert urls == {"http://www.w3.org/2000/svg"}
    # Every other module is reached from app.js, the one the page loads.
    assert imported == {p.name for p in STATIC_DIR.glob("*.js")} - {"app.js"}
    # Only the static folder is reachable under /ui.
    assert api.client.get("/ui/missing.js").status_code == 404
    assert api.client.get("/ui/%2e%2e/main.py").status_code == 404


def test_the_editor_probe_is_answered_by_role_and_never_changes_the_policy(api: Api) -> None:
    run_id = api.register()["id"]
    path = f"/api/v1/runs/{run_id}/policy"
    before = api.client.get(path, headers=api.headers("operator")).json()

    def probe(role: str | None) -> int:
        # What app.js sends: no policy has version 0, so this PATCH can never apply.
        return api.client.patch(path, json={}, headers={"If-Match": '"0"', **api.headers(role)}).status_code

    assert (probe("operator"), probe("viewer"), probe("agent"), probe(None)) == (412, 403, 403, 401)
    assert api.client.get(path, headers=api.headers("operator")).json() == before
    history = api.client.get(f"{path}/history", headers=api.headers("operator")).json()["data"]
    assert [rev["version"] for rev in history] == [before["version"]]
