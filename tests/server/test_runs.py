"""Runs: register/resume, finish, list with status filter and cursor, get."""

from server_helpers import Api, make_stats


def test_register_creates_then_resumes(api: Api) -> None:
    headers = api.headers("agent")
    first = api.client.post("/api/v1/runs", json={"name": "exp", "model": "GPT2", "world_size": 2}, headers=headers)
    assert first.status_code == 201
    assert first.json()["created"] is True
    assert first.json()["status"] == "running"
    assert first.json()["policy"]["version"] == 1
    second = api.client.post("/api/v1/runs", json={"name": "exp", "rank": 1, "host": "node-2"}, headers=headers)
    assert second.status_code == 200
    assert second.json()["created"] is False
    assert second.json()["id"] == first.json()["id"]
    run = api.client.get(f"/api/v1/runs/{first.json()['id']}", headers=api.headers("viewer")).json()
    # rank 1 does not overwrite what rank 0 said about the job
    assert run["model"] == "GPT2"
    assert run["world_size"] == 2
    assert run["host"] is None


def test_finish_then_register_resumes_running(api: Api) -> None:
    run_id = api.register("exp")["id"]
    finished = api.client.post(
        f"/api/v1/runs/{run_id}/finish", json={"rank": 0, "last_step": 1234}, headers=api.headers("agent")
    )
    assert finished.status_code == 200, finished.text
    assert finished.json()["status"] == "finished"
    assert finished.json()["last_step"] == 1234
    again = api.client.post("/api/v1/runs", json={"name": "exp"}, headers=api.headers("agent"))
    assert again.status_code == 200
    assert again.json()["status"] == "running"


def test_get_run_reports_totals_and_versions(api: Api) -> None:
    run_id = api.register()["id"]
    api.client.post(f"/api/v1/runs/{run_id}/stats", json=make_stats(), headers=api.headers("agent"))
    run = api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()
    assert run["totals"] == {"checks": 30, "detected": 2, "corrected": 1, "uncorrectable": 1}
    assert run["requested_policy_version"] == 1
    assert run["applied_policy_version"] == 1
    assert run["last_step"] == 119


def test_list_runs_filters_and_pages(api: Api) -> None:
    ids = [api.register(f"run-{i}")["id"] for i in range(5)]
    api.client.post(f"/api/v1/runs/{ids[0]}/finish", json={}, headers=api.headers("agent"))
    seen, cursor = [], None
    while True:
        query = "limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = api.client.get(f"/api/v1/runs?{query}", headers=api.headers("viewer")).json()
        seen += [r["id"] for r in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids)
    assert len(seen) == 5
    running = api.client.get("/api/v1/runs?status=running", headers=api.headers("viewer")).json()["data"]
    assert {r["id"] for r in running} == set(ids[1:])
    finished = api.client.get("/api/v1/runs?status=finished", headers=api.headers("viewer")).json()["data"]
    assert [r["id"] for r in finished] == [ids[0]]


def test_register_validates_the_body(api: Api) -> None:
    response = api.client.post("/api/v1/runs", json={"name": ""}, headers=api.headers("agent"))
    assert response.status_code == 422
    assert "name" in response.json()["message"]
    response = api.client.post("/api/v1/runs", json={"name": "x", "world_size": 0}, headers=api.headers("agent"))
    assert response.status_code == 422
    assert "world_size" in response.json()["message"]


def test_get_unknown_run_is_404(api: Api) -> None:
    assert api.client.get("/api/v1/runs/nope", headers=api.headers("viewer")).status_code == 404
    finish = api.client.post("/api/v1/runs/nope/finish", json={}, headers=api.headers("agent"))
    assert finish.status_code == 404


def test_register_rejects_control_characters_in_the_name(api: Api) -> None:
    response = api.client.post("/api/v1/runs", json={"name": "exp\x00"}, headers=api.headers("agent"))
    assert response.status_code == 422
    assert "name" in response.json()["message"]


def test_unstorable_values_are_422_not_500(api: Api) -> None:
    # PostgreSQL text cannot hold NUL; SQLite can. Either way the client gets no 5xx.
    response = api.client.post("/api/v1/runs", json={"name": "ok", "host": "node\x00"}, headers=api.headers("agent"))
    assert response.status_code in (201, 422), response.text


REGISTERED_POLICY = {
    "mode": "detect",
    "period": 4,
    "op_periods": {"scores": 2},
    "adaptive": False,
    "min_period": 2,
    "max_period": 16,
    "tolerance": "extreme",
    "tolerance_factor": 2.5,
    "on_uncorrectable": "skip_step",
    "source_repair": False,
    "overhead_budget": 0.1,
    "tripwire": False,
}


def _run_policy(api: Api, run_id: str) -> dict:
    policy = api.client.get(f"/api/v1/runs/{run_id}/policy", headers=api.headers("viewer")).json()
    return {k: v for k, v in policy.items() if k not in ("version", "updated_at", "updated_by")} | {
        "version": policy["version"]
    }


def test_register_with_policy_starts_the_run_with_it(api: Api) -> None:
    created = api.client.post(
        "/api/v1/runs", json={"name": "mine", "policy": REGISTERED_POLICY}, headers=api.headers("agent")
    )
    assert created.status_code == 201, created.text
    assert created.json()["policy"]["version"] == 1
    assert created.json()["policy"]["period"] == 4
    run_id = created.json()["id"]
    assert _run_policy(api, run_id) == {**REGISTERED_POLICY, "version": 1}
    history = api.client.get(f"/api/v1/runs/{run_id}/policy/history", headers=api.headers("viewer")).json()["data"]
    assert [(h["version"], h["actor"]) for h in history] == [(1, "agent-0")]
    assert history[0]["policy"] == REGISTERED_POLICY
    # the default is untouched
    default = api.client.get("/api/v1/policy/default", headers=api.headers("viewer")).json()
    assert default["period"] == 1
    assert default["mode"] == "correct"


def test_register_with_a_partial_policy_fills_the_rest_like_put(api: Api) -> None:
    created = api.client.post(
        "/api/v1/runs", json={"name": "mine", "policy": {"period": 3}}, headers=api.headers("agent")
    )
    assert created.status_code == 201, created.text
    policy = _run_policy(api, created.json()["id"])
    assert policy["period"] == 3
    assert policy["mode"] == "correct"
    assert policy["version"] == 1


def test_register_without_policy_copies_the_default(api: Api) -> None:
    changed = api.client.patch("/api/v1/policy/default", json={"period": 5}, headers=api.headers("operator"))
    assert changed.status_code == 200, changed.text
    run_id = api.register("plain")["id"]
    policy = _run_policy(api, run_id)
    assert policy["period"] == 5
    assert policy["version"] == 1


def test_resume_ignores_the_registration_policy(api: Api) -> None:
    headers = api.headers("agent")
    first = api.client.post("/api/v1/runs", json={"name": "exp", "policy": {"period": 2}}, headers=headers)
    assert first.status_code == 201, first.text
    run_id = first.json()["id"]
    # an operator changes the run's policy; a restarted agent registering again with its own policy doesn't undo it
    url = f"/api/v1/runs/{run_id}/policy"
    assert api.client.patch(url, json={"period": 6}, headers=api.headers("operator")).status_code == 200
    again = api.client.post("/api/v1/runs", json={"name": "exp", "policy": REGISTERED_POLICY}, headers=headers)
    assert again.status_code == 200, again.text
    assert again.json()["created"] is False
    assert again.json()["policy"]["version"] == 2
    assert again.json()["policy"]["period"] == 6
    policy = _run_policy(api, run_id)
    assert policy["version"] == 2
    assert policy["period"] == 6
    assert policy["mode"] == "correct"


def test_register_with_invalid_policy_is_422_naming_the_field_and_creates_nothing(api: Api) -> None:
    headers = api.headers("agent")
    for bad, field in (
        ({"period": 0}, "policy.period"),
        ({"period": "3"}, "policy.period"),
        ({"mode": "fix"}, "policy.mode"),
        ({"colour": "red"}, "policy.colour"),
        ({"min_period": 9, "max_period": 4}, "policy"),
    ):
        r = api.client.post("/api/v1/runs", json={"name": "bad", "policy": bad}, headers=headers)
        assert r.status_code == 422, (bad, r.text)
        assert field in r.json()["message"], (bad, r.json())
    runs = api.client.get("/api/v1/runs", headers=api.headers("viewer")).json()["data"]
    assert runs == []
