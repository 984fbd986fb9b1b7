"""Run-scoped agent tokens: an agent writes only to the runs it created or is bound to; expiry; old runs are claimed."""

from datetime import timedelta
from typing import Any

import pytest
from collector_testing import make_token
from server_helpers import Api, make_batch, make_stats, table_counts
from sqlalchemy import text

from attnchecker_server.auth import parse_duration
from attnchecker_server.cli import main
from attnchecker_server.db import make_engine


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _sql(api: Api, statement: str, **params: Any) -> None:
    engine = make_engine(api.settings, pooled=False)
    with engine.begin() as conn:
        conn.execute(text(statement), params)
    engine.dispose()


def _run(api: Api, run_id: str) -> dict[str, Any]:
    response = api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer"))
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _writes(api: Api, run_id: str, headers: dict[str, str]) -> dict[str, int]:
    base = f"/api/v1/runs/{run_id}"
    return {
        "events": api.client.post(f"{base}/events:batch", json=make_batch(), headers=headers).status_code,
        "stats": api.client.post(f"{base}/stats", json=make_stats(applied_policy_version=999), headers=headers).status_code,
        "finish": api.client.post(f"{base}/finish", json={"rank": 0}, headers=headers).status_code,
    }


def test_another_agent_token_can_neither_write_nor_reregister_the_run(api: Api) -> None:
    owner = api.register("victim", model="gpt2", host="node-a", config={"lr": 1e-4})
    other = _bearer(make_token(api.settings, "agent", "intruder"))
    before_counts, before_run = table_counts(api.settings), _run(api, owner["id"])

    assert _writes(api, owner["id"], other) == {"events": 403, "stats": 403, "finish": 403}
    takeover = api.client.post(
        "/api/v1/runs", json={"name": "victim", "rank": 0, "model": "evil", "host": "x", "config": {}}, headers=other
    )
    assert takeover.status_code == 403
    assert owner["id"] not in takeover.text  # the refusal does not hand out the run's id
    assert "bound to" in takeover.json()["detail"] or "may not write" in takeover.json()["detail"]
    assert table_counts(api.settings) == before_counts
    assert _run(api, owner["id"]) == before_run  # model, host, config, status, totals, applied version: unchanged


def test_the_owner_resumes_and_writes(api: Api) -> None:
    run_id = api.register("mine", model="gpt2")["id"]
    assert _writes(api, run_id, api.headers("agent")) == {"events": 200, "stats": 200, "finish": 200}
    resumed = api.client.post("/api/v1/runs", json={"name": "mine", "model": "llama"}, headers=api.headers("agent"))
    assert resumed.status_code == 200
    assert resumed.json()["id"] == run_id
    assert _run(api, run_id)["model"] == "llama"
    assert _run(api, run_id)["status"] == "running"


def test_operators_write_to_every_run(api: Api) -> None:
    run_id = api.register("agent-run")["id"]
    assert _writes(api, run_id, api.headers("operator")) == {"events": 200, "stats": 200, "finish": 200}


def test_tokens_bound_to_a_run_share_it_across_ranks_and_nothing_else(api: Api) -> None:
    rank0 = _bearer(make_token(api.settings, "agent", "job-rank0", run_name="job-7"))
    rank1 = _bearer(make_token(api.settings, "agent", "job-rank1", run_name="job-7"))
    created = api.client.post("/api/v1/runs", json={"name": "job-7", "world_size": 2, "host": "n0"}, headers=rank0)
    assert created.status_code == 201
    run_id = created.json()["id"]
    joined = api.client.post(
        "/api/v1/runs", json={"name": "job-7", "world_size": 2, "rank": 1, "host": "n1"}, headers=rank1
    )
    assert joined.status_code == 200
    assert joined.json()["id"] == run_id
    assert _run(api, run_id)["host"] == "n0"  # rank 1 only marks the run alive
    assert _writes(api, run_id, rank1) == {"events": 200, "stats": 200, "finish": 200}
    # Bound means bound: not another run's name, and not the runs of other tokens.
    other_name = api.client.post("/api/v1/runs", json={"name": "job-8"}, headers=rank1)
    assert other_name.status_code == 403
    assert "bound to run 'job-7'" in other_name.json()["detail"]
    elsewhere = api.register("someone-elses")["id"]
    assert _writes(api, elsewhere, rank1) == {"events": 403, "stats": 403, "finish": 403}
    # An unbound agent token that did not create job-7 may not write to it either.
    assert _writes(api, run_id, api.headers("agent"))["events"] == 403


def test_runs_from_before_ownership_are_claimed_by_the_next_registering_agent(api: Api) -> None:
    run_id = api.register("legacy")["id"]
    _sql(api, "UPDATE run SET owner_token_id = NULL WHERE id = :id", id=run_id)
    claimant = _bearer(make_token(api.settings, "agent", "node-after-upgrade"))
    assert api.client.post("/api/v1/runs", json={"name": "legacy"}, headers=claimant).status_code == 200
    assert _writes(api, run_id, claimant)["events"] == 200
    assert _writes(api, run_id, api.headers("agent"))["events"] == 403  # the first token lost it by not resuming


def test_expired_tokens_are_401_and_live_ones_work(api: Api) -> None:
    live = _bearer(make_token(api.settings, "agent", "short", expires_in=timedelta(hours=1)))
    assert api.client.post("/api/v1/runs", json={"name": "exp"}, headers=live).status_code == 201
    _sql(api, "UPDATE api_token SET expires_at = :past WHERE name = 'short'", past="2020-01-01 00:00:00+00:00")
    response = api.client.post("/api/v1/runs", json={"name": "exp"}, headers=live)
    assert response.status_code == 401
    assert "expired" in response.json()["detail"]


@pytest.mark.parametrize(
    ("text_in", "seconds"), [("45", 45), ("45s", 45), ("30m", 1800), ("12h", 43200), ("90d", 7776000), ("2w", 1209600)]
)
def test_parse_duration(text_in: str, seconds: int) -> None:
    assert parse_duration(text_in) == timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["", "0", "-5m", "1y", "soon", "1.5h"])
def test_parse_duration_rejects_what_it_cannot_read(bad: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(bad)


def test_cli_creates_bound_expiring_tokens(api: Api, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("ATTNCHECKER_DATABASE_URL", api.settings.effective_database_url)
    argv = ["token", "create", "--role", "agent", "--name", "ranks", "--run", "job-9", "--expires-in", "7d"]
    assert main(argv) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert api.client.post("/api/v1/runs", json={"name": "job-9"}, headers=_bearer(token)).status_code == 201
    assert main(["token", "list"]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if "\tranks\t" in row)
    assert "run job-9" in line
    assert "expires 20" in line
    assert main(["token", "create", "--role", "viewer", "--name", "v", "--run", "job-9"]) == 2
    assert "agent tokens only" in capsys.readouterr().err
    assert main(["token", "create", "--role", "agent", "--name", "v", "--expires-in", "soon"]) == 2
    assert "not a duration" in capsys.readouterr().err
