"""Every endpoint by {no token, wrong role, right role}; tokens are stored hashed; open_reads opens reads only."""

from typing import Any

import pytest
from server_helpers import Api, make_api, make_batch, make_stats
from sqlalchemy import text

from attnchecker_server.auth import revoke_tokens
from attnchecker_server.db import make_engine, make_session_factory, session_scope
from attnchecker_server.models import Base

RUN = "{run}"

# (method, path, body, roles allowed). Bodies are valid, so "right role" gets a 2xx.
ENDPOINTS: list[tuple[str, str, Any, set[str]]] = [
    ("POST", "/api/v1/runs", {"name": "auth-run"}, {"agent", "operator"}),
    ("GET", "/api/v1/runs", None, {"viewer", "operator"}),
    ("GET", f"/api/v1/runs/{RUN}", None, {"viewer", "operator"}),
    ("POST", f"/api/v1/runs/{RUN}/finish", {"rank": 0}, {"agent", "operator"}),
    ("POST", f"/api/v1/runs/{RUN}/events:batch", "batch", {"agent", "operator"}),
    ("GET", f"/api/v1/runs/{RUN}/events", None, {"viewer", "operator"}),
    ("POST", f"/api/v1/runs/{RUN}/stats", "stats", {"agent", "operator"}),
    ("GET", f"/api/v1/runs/{RUN}/policy", None, {"agent", "viewer", "operator"}),
    ("PUT", f"/api/v1/runs/{RUN}/policy", {"period": 2}, {"operator"}),
    ("PATCH", f"/api/v1/runs/{RUN}/policy", {"period": 3}, {"operator"}),
    ("GET", f"/api/v1/runs/{RUN}/policy/history", None, {"viewer", "operator"}),
    ("GET", "/api/v1/policy/default", None, {"agent", "viewer", "operator"}),
    ("PUT", "/api/v1/policy/default", {"period": 2}, {"operator"}),
    ("PATCH", "/api/v1/policy/default", {"period": 3}, {"operator"}),
    ("GET", "/api/v1/policy/default/history", None, {"viewer", "operator"}),
    ("GET", "/metrics", None, {"viewer", "operator"}),
]
ROLES = ("agent", "operator", "viewer")


def _request(api: Api, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
    run_id = api.register("existing-run")["id"]
    if body == "batch":
        body = make_batch()
    elif body == "stats":
        body = make_stats()
    return api.client.request(method, path.replace(RUN, run_id), json=body, headers=headers)


def _cases() -> list[Any]:
    cases = []
    for method, path, body, allowed in ENDPOINTS:
        wrong = sorted(set(ROLES) - allowed)
        cases.append(pytest.param(method, path, body, None, 401, id=f"{method} {path} no-token"))
        if wrong:
            cases.append(pytest.param(method, path, body, wrong[0], 403, id=f"{method} {path} {wrong[0]}"))
        for role in sorted(allowed):
            cases.append(pytest.param(method, path, body, role, 200, id=f"{method} {path} {role}"))
    return cases


@pytest.mark.parametrize(("method", "path", "body", "role", "expected"), _cases())
def test_endpoint_auth(api: Api, method: str, path: str, body: Any, role: str | None, expected: int) -> None:
    response = _request(api, method, path, body, api.headers(role))
    if expected == 200:
        assert 200 <= response.status_code < 300, response.text
    else:
        assert response.status_code == expected, response.text
        if expected == 401:
            assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("header", ["Bearer atk_0000_nope", "Bearer garbage", "Basic dXNlcjpwYXNz", "Bearer "])
def test_invalid_tokens_are_401(api: Api, header: str) -> None:
    response = api.client.get("/api/v1/runs", headers={"Authorization": header})
    assert response.status_code == 401


def test_revoked_token_is_401(api: Api) -> None:
    assert api.client.get("/api/v1/runs", headers=api.headers("viewer")).status_code == 200
    engine = make_engine(api.settings, pooled=False)
    with session_scope(make_session_factory(engine)) as session:
        assert revoke_tokens(session, name="grafana") == 1
    engine.dispose()
    assert api.client.get("/api/v1/runs", headers=api.headers("viewer")).status_code == 401


def test_health_endpoints_need_no_token(api: Api) -> None:
    assert api.client.get("/healthz").status_code == 200
    assert api.client.get("/readyz").status_code == 200


def test_tokens_are_never_stored_in_clear(api: Api) -> None:
    engine = make_engine(api.settings, pooled=False)
    with engine.connect() as conn:
        dump = " ".join(
            str(row)
            for table in Base.metadata.sorted_tables
            for row in conn.execute(text(f'SELECT * FROM "{table.name}"'))
        )
    engine.dispose()
    for token in api.tokens.values():
        # atk_<prefix>_<secret>: the secret is url-safe base64 and may itself contain "_"
        secret = token.split("_", 2)[2]
        assert token not in dump
        assert secret not in dump


def test_open_reads_opens_gets_and_metrics_but_not_writes(make_test_settings: Any) -> None:
    for api in make_api(make_test_settings(open_reads=True)):
        run_id = api.register()["id"]
        for path in ("/api/v1/runs", f"/api/v1/runs/{run_id}", f"/api/v1/runs/{run_id}/policy", "/metrics"):
            assert api.client.get(path).status_code == 200, path
        # an agent token reads too under open_reads
        assert api.client.get("/api/v1/runs", headers=api.headers("agent")).status_code == 200
        assert api.client.patch(f"/api/v1/runs/{run_id}/policy", json={"period": 2}).status_code == 401
        assert api.client.post("/api/v1/runs", json={"name": "x"}).status_code == 401


def test_authentication_and_the_handler_share_one_database_session(api: Api) -> None:
    """One pool checkout per authenticated request: the token lookup uses the route's session, not a second one."""
    from sqlalchemy import event

    run_id = api.register("one-session")["id"]
    engine = api.client.app.state.engine  # type: ignore[attr-defined]
    checkouts: list[int] = []

    def count(*_args: Any) -> None:
        checkouts.append(1)

    event.listen(engine, "checkout", count)
    try:
        for method, path, body, role in [
            ("GET", f"/api/v1/runs/{run_id}", None, "viewer"),
            ("POST", f"/api/v1/runs/{run_id}/events:batch", make_batch(), "agent"),
            ("POST", f"/api/v1/runs/{run_id}/stats", make_stats(), "agent"),
            ("PATCH", f"/api/v1/runs/{run_id}/policy", {"period": 2}, "operator"),
        ]:
            checkouts.clear()
            response = api.client.request(method, path, json=body, headers=api.headers(role))
            assert response.status_code == 200, response.text
            assert len(checkouts) == 1, f"{method} {path}: {len(checkouts)} pool checkouts"
        checkouts.clear()
        assert api.client.get("/api/v1/runs", headers={"Authorization": "Bearer atk_x_y"}).status_code == 401
        assert len(checkouts) == 1
    finally:
        event.remove(engine, "checkout", count)
