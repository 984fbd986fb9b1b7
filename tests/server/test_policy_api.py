"""Policy: ETag / If-None-Match / If-Match, revisions with actors, validation naming the field, the default."""

from typing import Any

import pytest
from server_helpers import Api


def _url(run_id: str | None) -> str:
    return "/api/v1/policy/default" if run_id is None else f"/api/v1/runs/{run_id}/policy"


@pytest.fixture(params=["run", "default"])
def policy_url(request: pytest.FixtureRequest, api: Api) -> str:
    return _url(api.register()["id"] if request.param == "run" else None)


def test_policy_get_sends_etag_and_honours_if_none_match(api: Api, policy_url: str) -> None:
    response = api.client.get(policy_url, headers=api.headers("operator"))
    assert response.status_code == 200
    assert response.headers["etag"] == f'"{response.json()["version"]}"'
    cached = api.client.get(policy_url, headers={**api.headers("operator"), "If-None-Match": response.headers["etag"]})
    assert cached.status_code == 304
    assert cached.content == b""
    stale = api.client.get(policy_url, headers={**api.headers("operator"), "If-None-Match": '"999"'})
    assert stale.status_code == 200


def test_policy_put_replaces_and_patch_merges(api: Api, policy_url: str) -> None:
    put = api.client.put(policy_url, json={"mode": "detect", "period": 4}, headers=api.headers("operator"))
    assert put.status_code == 200, put.text
    assert put.json()["mode"] == "detect"
    assert put.json()["period"] == 4
    assert put.json()["op_periods"] == {}
    patch = api.client.patch(policy_url, json={"op_periods": {"scores": 2}}, headers=api.headers("operator"))
    assert patch.status_code == 200, patch.text
    body = patch.json()
    assert body["mode"] == "detect"
    assert body["period"] == 4
    assert body["op_periods"] == {"scores": 2}
    assert body["version"] == put.json()["version"] + 1
    assert body["updated_by"] == "alice"
    assert patch.headers["etag"] == f'"{body["version"]}"'


def test_policy_stale_if_match_is_412_and_changes_nothing(api: Api, policy_url: str) -> None:
    etag = api.client.get(policy_url, headers=api.headers("operator")).headers["etag"]
    ok = api.client.patch(policy_url, json={"period": 2}, headers={**api.headers("operator"), "If-Match": etag})
    assert ok.status_code == 200
    for method in ("patch", "put"):
        stale = getattr(api.client, method)(
            policy_url, json={"period": 3}, headers={**api.headers("operator"), "If-Match": etag}
        )
        assert stale.status_code == 412
        assert "stale" in stale.json()["detail"]
    assert api.client.get(policy_url, headers=api.headers("operator")).json()["period"] == 2
    current = ok.headers["etag"]
    fresh = api.client.put(policy_url, json={"period": 3}, headers={**api.headers("operator"), "If-Match": current})
    assert fresh.status_code == 200


def test_policy_history_keeps_every_revision_with_actor_and_time(api: Api) -> None:
    run = api.register()
    url = _url(run["id"])
    for period in (2, 3, 4):
        assert api.client.patch(url, json={"period": period}, headers=api.headers("operator")).status_code == 200
    history = api.client.get(f"{url}/history", headers=api.headers("viewer")).json()["data"]
    assert [h["version"] for h in history] == [1, 2, 3, 4]
    assert [h["policy"]["period"] for h in history] == [1, 2, 3, 4]
    assert [h["actor"] for h in history] == ["agent-0", "alice", "alice", "alice"]
    assert all(h["changed_at"].endswith("Z") or "+00:00" in h["changed_at"] for h in history)
    default_history = api.client.get("/api/v1/policy/default/history", headers=api.headers("viewer")).json()["data"]
    assert default_history[0]["version"] == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"period": 0}, "period"),
        ({"period": -3}, "period"),
        ({"period": "4"}, "period"),
        ({"period": 1.5}, "period"),
        ({"op_periods": {"attn": 2}}, "op_periods.attn"),
        ({"op_periods": {"scores": 0}}, "op_periods.scores"),
        ({"mode": "fix"}, "mode"),
        ({"adaptive": "yes"}, "adaptive"),
        ({"tolerance": "loose"}, "tolerance"),
        ({"on_uncorrectable": "panic"}, "on_uncorrectable"),
        ({"overhead_budget": 0}, "overhead_budget"),
        ({"overhead_budget": 1.5}, "overhead_budget"),
        ({"tripwire": 1}, "tripwire"),
        ({"min_period": 9, "max_period": 4}, "min_period"),
        ({"check_every": 3}, "check_every"),
        ({"period": None}, "period"),
    ],
)
def test_policy_bad_values_are_422_naming_the_field(
    api: Api, policy_url: str, body: dict[str, Any], field: str
) -> None:
    before = api.client.get(policy_url, headers=api.headers("operator")).json()
    for method in ("put", "patch"):
        if method == "put" and body == {"period": None}:
            continue
        response = getattr(api.client, method)(policy_url, json=body, headers=api.headers("operator"))
        assert response.status_code == 422, (method, response.text)
        assert field in response.json()["message"], response.json()
    assert api.client.get(policy_url, headers=api.headers("operator")).json() == before


def test_policy_patch_checked_against_stored_values(api: Api, policy_url: str) -> None:
    # max_period is 8 by default: a PATCH of min_period alone must still respect it.
    response = api.client.patch(policy_url, json={"min_period": 20}, headers=api.headers("operator"))
    assert response.status_code == 422
    assert "min_period" in response.json()["message"]


def test_policy_default_is_copied_into_new_runs_only(api: Api) -> None:
    old = api.register("old-run")
    changed = api.client.patch(
        "/api/v1/policy/default", json={"mode": "detect", "op_periods": {"q": 3}}, headers=api.headers("operator")
    )
    assert changed.status_code == 200
    new = api.register("new-run")
    assert new["policy"]["mode"] == "detect"
    assert new["policy"]["op_periods"] == {"q": 3}
    assert new["policy"]["version"] == 1
    assert api.client.get(_url(old["id"]), headers=api.headers("agent")).json()["mode"] == "correct"


def test_policy_unknown_run_is_404(api: Api) -> None:
    response = api.client.get(_url("nope"), headers=api.headers("operator"))
    assert response.status_code == 404


def test_policy_requested_version_follows_changes(api: Api) -> None:
    run = api.register()
    api.client.patch(_url(run["id"]), json={"period": 2}, headers=api.headers("operator"))
    got = api.client.get(f"/api/v1/runs/{run['id']}", headers=api.headers("viewer")).json()
    assert got["requested_policy_version"] == 2
