"""Fault events of the whole-step GEMMs (protect(scope="all"): ops linear, linear_dx, linear_dw) are stored, filtered
and counted like the attention ops', on SQLite and PostgreSQL; a policy still names attention ops only."""

from server_helpers import Api, make_batch, make_event


def test_whole_step_ops_are_stored_and_filtered(api: Api) -> None:
    run_id = api.register()["id"]
    events = [make_event(step=s, op=op, layer=7, location={"batch": 0, "head": None, "row": 3, "col": 4})
              for s, op in ((1, "linear"), (2, "linear_dx"), (3, "linear_dw"), (4, "scores"))]
    posted = api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=make_batch(events),
                             headers=api.headers("agent"))
    assert posted.status_code == 200, posted.text
    assert posted.json()["accepted"] == 4

    def steps(query: str) -> list[int]:
        response = api.client.get(f"/api/v1/runs/{run_id}/events?{query}", headers=api.headers("viewer"))
        assert response.status_code == 200, response.text
        return [e["step"] for e in response.json()["data"]]

    assert steps("op=linear_dw") == [3]
    assert steps("op=linear") == [1]
    assert steps("") == [1, 2, 3, 4]


def test_a_policy_cannot_pin_a_whole_step_op(api: Api) -> None:
    run_id = api.register()["id"]
    response = api.client.patch(f"/api/v1/runs/{run_id}/policy", json={"op_periods": {"linear": 2}},
                                headers={**api.headers("operator"), "If-Match": "*"})
    assert response.status_code == 422, response.text
    assert "op_periods" in response.text
