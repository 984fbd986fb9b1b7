"""Contract test of `attnchecker_server.grafana.push` against a fake Grafana on loopback.

The fake implements only the endpoints grafana-client calls for a push and records every request, so the tests pin
the exact HTTP conversation: version probe, datasource upsert by uid, folder, dashboard upsert with overwrite.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

grafana = pytest.importorskip("attnchecker_server.grafana")
from grafana_client.client import GrafanaUnauthorizedError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards" / "json"
PROVISIONING = REPO / "dashboards" / "provisioning"
TOKEN = "glsa_test_token"
DS_UID = "attnchecker-prometheus"
DASH_UID = "attnchecker-overview"
# Every committed dashboard, by uid, in the order push() sends them (file names, sorted).
COMMITTED = {d["uid"]: d for d in (json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json")))}


@dataclass
class FakeGrafana:
    """State and request log of the fake; `prefix` is the sub-path Grafana is served under ("" or "/grafana")."""

    prefix: str = ""
    datasources: dict[str, dict[str, Any]] = field(default_factory=dict)
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None, Any]] = field(default_factory=list)
    url: str = ""

    def calls(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path, _, _ in self.requests]

    def bodies(self, method: str, path: str) -> list[Any]:
        return [body for m, p, _, body in self.requests if (m, p) == (method, path)]


def _handler(fake: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            path = self.path.removeprefix(fake.prefix)
            fake.requests.append((self.command, path, self.headers.get("Authorization"), body))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._answer(401, {"message": "Unauthorized"})
            route = (self.command, path)
            if route == ("GET", "/api/frontend/settings"):
                return self._answer(200, {"buildInfo": {"version": "12.4.0", "commit": "fake"}})
            if path.startswith("/api/datasources/uid/"):
                uid = path.rsplit("/", 1)[1]
                if uid not in fake.datasources:
                    return self._answer(404, {"message": "Data source not found"})
                if self.command == "GET":
                    return self._answer(200, fake.datasources[uid])
                if self.command == "PUT":
                    fake.datasources[uid] = {**fake.datasources[uid], **body}
                    return self._answer(200, {"message": "Datasource updated", "datasource": fake.datasources[uid]})
            if route == ("POST", "/api/datasources"):
                if body["uid"] in fake.datasources:
                    return self._answer(409, {"message": "data source with the same uid already exists"})
                fake.datasources[body["uid"]] = {"id": len(fake.datasources) + 1, **body}
                return self._answer(200, {"message": "Datasource added", "datasource": fake.datasources[body["uid"]]})
            if self.command == "GET" and path.startswith("/api/folders/"):
                uid = path.rsplit("/", 1)[1]
                if uid not in fake.folders:
                    return self._answer(404, {"message": "folder not found"})
                return self._answer(200, fake.folders[uid])
            if route == ("POST", "/api/folders"):
                fake.folders[body["uid"]] = {"id": 7, **body}
                return self._answer(200, fake.folders[body["uid"]])
            if route == ("POST", "/api/dashboards/db"):
                dashboard = body["dashboard"]
                if body.get("folderUid") not in fake.folders:
                    return self._answer(400, {"message": "folder not found"})
                previous = fake.dashboards.get(dashboard["uid"])
                if previous is not None and not body.get("overwrite"):
                    return self._answer(412, {"status": "version-mismatch"})
                version = previous["version"] + 1 if previous else 1
                fake.dashboards[dashboard["uid"]] = {"version": version, **body}
                url = f"{fake.prefix}/d/{dashboard['uid']}/{dashboard['uid']}"
                return self._answer(
                    200, {"status": "success", "uid": dashboard["uid"], "url": url, "version": version, "id": 3}
                )
            return self._answer(404, {"message": f"fake Grafana has no {self.command} {path}"})

        do_GET = do_POST = do_PUT = _handle

    return Handler


@pytest.fixture(params=["", "/grafana"], ids=["root", "sub-path"])
def fake_grafana(request: pytest.FixtureRequest) -> Iterator[FakeGrafana]:
    fake = FakeGrafana(prefix=request.param)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}{fake.prefix}"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _provisioned_datasource() -> dict[str, Any]:
    return yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"][0]


def test_push_creates_datasource_folder_and_dashboard_on_an_empty_grafana(fake_grafana: FakeGrafana) -> None:
    result = grafana.push(fake_grafana.url, TOKEN, DASHBOARDS, PROVISIONING)

    assert fake_grafana.calls() == [
        ("GET", "/api/frontend/settings"),
        ("GET", f"/api/datasources/uid/{DS_UID}"),
        ("POST", "/api/datasources"),
        ("GET", "/api/folders/attnchecker"),
        ("POST", "/api/folders"),
        *[("POST", "/api/dashboards/db")] * len(COMMITTED),
    ]
    assert {auth for _, _, auth, _ in fake_grafana.requests} == {f"Bearer {TOKEN}"}

    [datasource] = fake_grafana.bodies("POST", "/api/datasources")
    provisioned = _provisioned_datasource()
    assert datasource == {k: v for k, v in provisioned.items() if k != "editable"}
    assert datasource["uid"] == DS_UID
    assert datasource["url"] == "http://prometheus:9090"

    assert fake_grafana.bodies("POST", "/api/folders") == [{"title": "ATTNChecker", "uid": "attnchecker"}]

    upserts = fake_grafana.bodies("POST", "/api/dashboards/db")
    assert [u["dashboard"] for u in upserts] == [{**committed, "id": None} for committed in COMMITTED.values()]
    assert {(u["overwrite"], u["folderUid"]) for u in upserts} == {(True, "attnchecker")}

    assert result == {
        "grafana_version": "12.4.0",
        "datasources": {DS_UID: "created"},
        "folder": {"uid": "attnchecker", "title": "ATTNChecker", "created": True},
        "dashboards": {uid: {"url": f"{fake_grafana.prefix}/d/{uid}/{uid}", "version": 1} for uid in COMMITTED},
    }


def test_push_updates_existing_datasource_by_uid_and_overwrites_dashboard(fake_grafana: FakeGrafana) -> None:
    grafana.push(fake_grafana.url, TOKEN, DASHBOARDS, PROVISIONING)
    fake_grafana.datasources[DS_UID]["url"] = "http://stale:9090"
    fake_grafana.requests.clear()

    result = grafana.push(fake_grafana.url, TOKEN, DASHBOARDS, PROVISIONING)

    assert fake_grafana.calls() == [
        ("GET", "/api/frontend/settings"),
        ("GET", f"/api/datasources/uid/{DS_UID}"),
        ("PUT", f"/api/datasources/uid/{DS_UID}"),
        ("GET", "/api/folders/attnchecker"),
        *[("POST", "/api/dashboards/db")] * len(COMMITTED),
    ]
    [update] = fake_grafana.bodies("PUT", f"/api/datasources/uid/{DS_UID}")
    assert update["uid"] == DS_UID
    assert update["url"] == "http://prometheus:9090"
    assert fake_grafana.datasources[DS_UID]["url"] == "http://prometheus:9090"
    assert result["datasources"] == {DS_UID: "updated"}
    assert result["folder"]["created"] is False
    assert result["dashboards"][DASH_UID]["version"] == 2


def test_push_with_a_bad_token_fails_before_changing_anything(fake_grafana: FakeGrafana) -> None:
    with pytest.raises(GrafanaUnauthorizedError):
        grafana.push(fake_grafana.url, "wrong", DASHBOARDS, PROVISIONING)

    assert fake_grafana.calls() == [("GET", "/api/frontend/settings")]
    assert not fake_grafana.datasources
    assert not fake_grafana.dashboards


def test_push_rejects_a_dashboard_without_uid(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"title": "no uid", "panels": []}))

    with pytest.raises(ValueError, match=r"bad\.json: a dashboard needs a stable uid"):
        grafana.push("http://127.0.0.1:9", TOKEN, tmp_path, PROVISIONING)
