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
