"""Issue 34: identity per rank, attribution of events and intervals to devices, per-device totals across runs, the
operator's status (If-Match, history), the policy a rank on a suspect device follows, and suspicion through the API.
Every test runs on SQLite and on PostgreSQL."""

from typing import Any

from server_helpers import Api, make_batch, make_event, make_stats, new_id

DEVICES = "/api/v1/devices"


def identity(uuid: str, hostname: str = "node-0", **fields: Any) -> dict[str, Any]:
    return {"uuid": uuid, "hostname": hostname, "kind": "cuda", "index": 0, "local_rank": 0, **fields}


def register_rank(api: Api, name: str, rank: int, uuid: str, *, world_size: int = 8, hostname: str = "node-0",
                  token: str = "agent", **device: Any) -> dict[str, Any]:
    body = {"name": name, "world_size": world_size, "rank": rank, "device": identity(uuid, hostname, **device)}
    r = api.client.post("/api/v1/runs", json=body, headers=api.headers(token))
    assert r.status_code in (200, 201), r.text
    return r.json()  # type: ignore[no-any-return]


def post_stats(api: Api, run_id: str, *, rank: int, checks: int, faults: int = 0, kind: str = "inf",
               uncorrectable: int = 0, **fields: Any) -> None:
    body = make_stats(
        rank=rank,
        ops=[{"op": "scores", "checks": checks, "check_seconds": 0.01, "period": 1, "tripwire_checks": checks}],
        faults=[{"op": "scores", "kind": kind, "detected": faults, "corrected": faults - uncorrectable,
                 "uncorrectable": uncorrectable}] if faults else [],
        **fields,
    )
    r = api.client.post(f"/api/v1/runs/{run_id}/stats", json=body, headers=api.headers("agent"))
    assert r.status_code == 200, r.text


def device(api: Api, uuid: str) -> dict[str, Any]:
    r = api.client.get(f"{DEVICES}/{uuid}", headers=api.headers("viewer"))
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_each_rank_registers_its_device_and_the_run_maps_ranks_to_devices(api: Api) -> None:
    run = register_rank(api, "job", 0, "GPU-aaaa", hostname="node-a", pci_bus_id="00000000:07:00.0")
    register_rank(api, "job", 1, "GPU-bbbb", hostname="node-b")
    assert run["device"] == {"uuid": "GPU-aaaa", "status": "ok", "reason": None}
    assert run["policy_scope"] == "run"
    ranks = api.client.get(f"/api/v1/runs/{run['id']}/ranks", headers=api.headers("viewer")).json()["data"]
    assert [(r["rank"], r["hostname"], r["device_uuid"], r["device_status"]) for r in ranks] == [
        (0, "node-a", "GPU-aaaa", "ok"), (1, "node-b", "GPU-bbbb", "ok")]
    listed = api.client.get(DEVICES, headers=api.headers("viewer")).json()
    assert {d["uuid"]: d["hostname"] for d in listed["items"]} == {"GPU-aaaa": "node-a", "GPU-bbbb": "node-b"}
    assert device(api, "GPU-aaaa")["pci_bus_id"] == "00000000:07:00.0"
    assert device(api, "GPU-aaaa")["totals"]["runs"] == 1


def test_events_and_intervals_are_attributed_to_the_device_of_their_rank(api: Api) -> None:
    run_id = register_rank(api, "job", 0, "GPU-aaaa")["id"]
    register_rank(api, "job", 1, "GPU-bbbb")
    api.register("job")  # a rank without identity (an older agent) changes nothing
    post_stats(api, run_id, rank=1, checks=100, faults=3, uncorrectable=1)
    post_stats(api, run_id, rank=0, checks=100)
    post_stats(api, run_id, rank=5, checks=100, faults=7)  # rank 5 registered no device: unattributed
    events = [make_event(step=1, rank=1), make_event(step=2, rank=0), make_event(step=3, rank=5)]
    r = api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=make_batch(events), headers=api.headers("agent"))
    assert r.status_code == 200, r.text
    stored = api.client.get(f"/api/v1/runs/{run_id}/events", headers=api.headers("viewer")).json()["data"]
    assert [(e["rank"], e["device_uuid"]) for e in stored] == [(1, "GPU-bbbb"), (0, "GPU-aaaa"), (5, None)]
    b = device(api, "GPU-bbbb")
    assert b["totals"] == {"checks": 200, "detected": 3, "corrected": 2, "uncorrectable": 1, "runs": 1,
                           "fault_runs": 1}
    assert b["faults"] == [{"kind": "inf", "detected": 3, "corrected": 2, "uncorrectable": 1}]
    assert [e["rank"] for e in b["events"]] == [1]
    assert device(api, "GPU-aaaa")["totals"]["detected"] == 0
    # The run's own totals count every rank, attributed or not.
    assert api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()["totals"]["detected"] == 10


def test_device_totals_add_up_across_runs_and_count_the_runs_with_faults(api: Api) -> None:
    for name, faults in (("run-1", 2), ("run-2", 0), ("run-3", 1)):
        run_id = register_rank(api, name, 0, "GPU-aaaa")["id"]
        post_stats(api, run_id, rank=0, checks=50, faults=faults)
        post_stats(api, run_id, rank=0, checks=50, faults=faults)  # a second fault interval: the same run
    d = device(api, "GPU-aaaa")
    assert (d["totals"]["checks"], d["totals"]["detected"], d["totals"]["runs"], d["totals"]["fault_runs"]) == (
        600, 6, 3, 2)
    assert [(r["run_name"], r["detected"]) for r in sorted(d["runs"], key=lambda r: r["run_name"])] == [
        ("run-1", 4), ("run-2", 0), ("run-3", 2)]


def test_a_token_cannot_attribute_events_to_another_runs_devices(api: Api) -> None:
    from collector_testing import make_token

    victim = register_rank(api, "victim", 0, "GPU-victim")["id"]
    other = make_token(api.settings, "agent", "other-agent")
    headers = {"Authorization": f"Bearer {other}"}
    # Writing into the victim's run is refused outright, events and stats alike.
    assert api.client.post(f"/api/v1/runs/{victim}/stats", json=make_stats(rank=0),
                           headers=headers).status_code == 403
    assert api.client.post(f"/api/v1/runs/{victim}/events:batch", json=make_batch(),
                           headers=headers).status_code == 403
    # In its own run, rank 0 is not the victim's rank 0: nothing lands on the victim's device.
    own = api.client.post("/api/v1/runs", json={"name": "own"}, headers=headers).json()["id"]
    r = api.client.post(f"/api/v1/runs/{own}/stats", json=make_stats(rank=0), headers=headers)
    assert r.status_code == 200
    api.client.post(f"/api/v1/runs/{own}/events:batch", json=make_batch([make_event(rank=0)]), headers=headers)
    assert device(api, "GPU-victim")["totals"]["detected"] == 0
    assert device(api, "GPU-victim")["events"] == []


def test_operators_mark_a_device_with_if_match_and_every_change_is_kept(api: Api) -> None:
    register_rank(api, "job", 0, "GPU-aaaa")
    path = f"{DEVICES}/GPU-aaaa"
    body = {"status": "suspect", "reason": "SDC suspicion from the fleet dashboard"}
    for role in ("viewer", "agent"):
        assert api.client.patch(path, json=body, headers=api.headers(role)).status_code == 403
    first = api.client.get(path, headers=api.headers("viewer"))
    assert first.headers["ETag"] == '"1"' and first.json()["status"] == "ok"
    r = api.client.patch(path, json=body, headers={"If-Match": '"1"', **api.headers("operator")})
    assert r.status_code == 200, r.text
    assert r.headers["ETag"] == '"2"'
    changed = r.json()
    assert (changed["status"], changed["status_by"], changed["status_reason"]) == ("suspect", "alice", body["reason"])
    stale = api.client.patch(path, json={"status": "ok", "reason": "x"},
                             headers={"If-Match": '"1"', **api.headers("operator")})
    assert stale.status_code == 412 and "version 2" in stale.json()["detail"]
    api.client.patch(path, json={"status": "quarantined", "reason": "XID 79 twice"}, headers=api.headers("operator"))
    history = device(api, "GPU-aaaa")["history"]
    assert [(h["version"], h["status"], h["actor"]) for h in history] == [(2, "suspect", "alice"),
                                                                        (3, "quarantined", "alice")]
    assert api.client.patch(f"{DEVICES}/GPU-missing", json=body, headers=api.headers("operator")).status_code == 404
    bad = api.client.patch(path, json={"status": "broken", "reason": "x"}, headers=api.headers("operator"))
    assert bad.status_code == 422 and "status" in bad.json()["message"]
    # The agent on the device may read its status (and nothing else of the fleet).
    status = api.client.get(f"{path}/status", headers=api.headers("agent")).json()
    assert status == {"uuid": "GPU-aaaa", "status": "quarantined", "reason": "XID 79 twice"}
    assert api.client.get(DEVICES, headers=api.headers("agent")).status_code == 403


def test_a_rank_on_a_suspect_device_gets_the_suspect_policy_and_the_others_keep_the_runs(api: Api) -> None:
    run_id = register_rank(api, "job", 0, "GPU-good")["id"]
    register_rank(api, "job", 1, "GPU-bad")
    operator = api.headers("operator")
    api.client.patch(f"/api/v1/runs/{run_id}/policy", json={"period": 4}, headers=operator)  # run policy v2

    def policy(rank: int, etag: str | None = None) -> Any:
        headers = {**api.headers("agent"), **({"If-None-Match": etag} if etag else {})}
        return api.client.get(f"/api/v1/runs/{run_id}/policy", params={"rank": rank}, headers=headers)

    before = policy(1)
    assert (before.headers["X-Policy-Scope"], before.headers["ETag"], before.json()["period"]) == ("run", '"2"', 4)
    assert policy(1, before.headers["ETag"]).status_code == 304
    api.client.patch(f"{DEVICES}/GPU-bad", json={"status": "suspect", "reason": "excess faults"}, headers=operator)
    after = policy(1, before.headers["ETag"])  # the old ETag no longer matches: the scope changed
    assert after.status_code == 200
    assert after.headers["X-Policy-Scope"] == "device" and after.headers["ETag"] == '"device-1"'
    # The default suspect-device policy is full protection: every op on every step, no adaptation.
    assert (after.json()["period"], after.json()["adaptive"], after.json()["version"]) == (1, False, 1)
    assert policy(1, '"device-1"').status_code == 304
    assert policy(0).headers["X-Policy-Scope"] == "run" and policy(0).json()["period"] == 4
    # Without ?rank the run's policy, as before.
    assert api.client.get(f"/api/v1/runs/{run_id}/policy", headers=api.headers("agent")).json()["period"] == 4
    # A rank that registers on the suspect device is told at once.
    again = register_rank(api, "job", 1, "GPU-bad")
    assert again["policy_scope"] == "device" and again["device"]["status"] == "suspect"
    # The operator's policy for suspect devices is versioned like any other.
    r = api.client.patch("/api/v1/policy/suspect", json={"tolerance_factor": 0.5}, headers=operator)
    assert r.status_code == 200 and r.json()["version"] == 2
    assert policy(1).headers["ETag"] == '"device-2"'
    history = api.client.get("/api/v1/policy/suspect/history", headers=api.headers("viewer")).json()["data"]
    assert [(h["version"], h["actor"]) for h in history] == [(1, "system"), (2, "alice")]


def test_the_applied_device_policy_is_per_rank_and_leaves_the_runs_applied_version(api: Api) -> None:
    run_id = register_rank(api, "job", 0, "GPU-good")["id"]
    register_rank(api, "job", 1, "GPU-bad")
    post_stats(api, run_id, rank=0, checks=10, applied_policy_version=1)
    post_stats(api, run_id, rank=1, checks=10, applied_policy_version=3, applied_policy_scope="device")
    ranks = api.client.get(f"/api/v1/runs/{run_id}/ranks", headers=api.headers("viewer")).json()["data"]
    assert [(r["applied_policy_version"], r["applied_policy_scope"]) for r in ranks] == [(1, "run"), (3, "device")]
    assert api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()[
        "applied_policy_version"] == 1


def test_the_device_faulting_ten_times_the_fleet_rate_is_listed_first_and_significant(api: Api) -> None:
    for run in range(2):
        run_id = register_rank(api, f"run-{run}", 0, "GPU-0")["id"]
        for rank in range(8):
            register_rank(api, f"run-{run}", rank, f"GPU-{rank}", hostname=f"node-{rank // 2}")
            post_stats(api, run_id, rank=rank, checks=10_000, faults=30 if rank == 5 else 3)
    listed = api.client.get(DEVICES, headers=api.headers("viewer")).json()
    first = listed["items"][0]
    assert first["uuid"] == "GPU-5" and first["suspicion"]["significant"] is True
    assert "in 2 of 2 runs" in first["suspicion"]["reason"]
    assert [d["uuid"] for d in listed["items"] if d["suspicion"]["significant"]] == ["GPU-5"]
    assert listed["fleet"] == {"devices": 8, "checks": 320_000, "detected": 102, "alpha": 0.01, "min_fault_runs": 2}
    only = api.client.get(DEVICES, params={"significant": "true"}, headers=api.headers("viewer")).json()
    assert [d["uuid"] for d in only["items"]] == ["GPU-5"] and only["total"] == 1
    by_host = api.client.get(DEVICES, params={"hostname": "node-2", "limit": 1}, headers=api.headers("viewer")).json()
    assert [d["uuid"] for d in by_host["items"]] == ["GPU-5"] and by_host["total"] == 2


def test_device_identity_fields_are_bounded(api: Api) -> None:
    def attempt(**device: Any) -> Any:
        body = {"name": "job", "world_size": 2, "rank": 0, "device": {**identity("GPU-aaaa"), **device}}
        return api.client.post("/api/v1/runs", json=body, headers=api.headers("agent"))

    for field, value in (("uuid", "GPU-" + "a" * 61), ("uuid", "GPU aaaa"), ("hostname", "node 1"),
                         ("hostname", "<script>"), ("kind", "CUDA!"), ("pci_bus_id", "zz"), ("serial", "a/b")):
        r = attempt(**{field: value})
        assert r.status_code == 422, (field, value, r.text)
        assert f"device.{field}" in r.json()["message"]
    r = api.client.post("/api/v1/runs", json={"name": "job", "world_size": 2, "rank": 2,
                                              "device": identity("GPU-aaaa")}, headers=api.headers("agent"))
    assert r.status_code == 422 and "must be below world_size" in r.json()["message"]
    assert api.client.get(DEVICES, headers=api.headers("viewer")).json()["items"] == []
    assert api.client.get(f"{DEVICES}/{new_id()}", headers=api.headers("viewer")).status_code == 404
