"""Issue 34 acceptance: a simulated fleet on this machine. torchrun starts 8 ranks with the gloo backend, standing in
for 8 GPUs on 4 hosts through ATTNCHECKER_DEVICE_UUID / ATTNCHECKER_HOSTNAME (tests/e2e/fleet_worker.py); they train
three runs one after another against a real collector, one device injecting faults at ten times the others' rate
through the project's injector (a FaultPlan per rank).

Then: that device is first in GET /api/v1/devices and significant, no healthy device is flagged, the alert fires in a
`promtool test rules` case built from the collector's own /metrics (with the Fleet dashboard's suspects query), and
the operator's round trip: marked suspect, the rank on it applies the suspect-device policy (full protection) at its
next step boundary and reports the version it applied, while the other ranks keep the run's policy.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import Collector, running_collector, wait_until
from fleet_worker import BAD_RANK, RUNS, host_of, uuid_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RANKS = 8
REPO = Path(__file__).resolve().parents[2]
FLEET_DASHBOARD = REPO / "dashboards" / "json" / "attnchecker-fleet.json"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Collector, Path, subprocess.Popen[str]]]:
    directory = tmp_path_factory.mktemp("fleet")
    with running_collector("sqlite", directory / "collector") as collector:
        log = (directory / "torchrun.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        # One run-bound token set would do as well; one agent token shared by the job's ranks is the simplest.
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
             str(Path(__file__).with_name("fleet_worker.py")), collector.url, collector.agent, str(directory)],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            yield collector, directory, proc
        finally:
            (directory / "stop").touch()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()


def _runs(collector: Collector) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in collector.api("GET", "/runs", params={"limit": 200}).json()["data"]}


def _poll(predicate: Any, timeout_s: float) -> bool:
    """wait_until, at a pace that leaves the collector to the eight agents on a small machine."""
    return wait_until(predicate, timeout_s, every_s=0.5)


def _sent(directory: Path) -> dict[int, list[dict[str, Any]]]:
    return {r: json.loads((directory / f"sent-{r}.json").read_text()) for r in range(RANKS)}


def _wait_for_the_fault_runs(collector: Collector, directory: Path, proc: subprocess.Popen[str]) -> None:
    """Until every rank has closed its three runs, and the collector holds, on each rank's device and for each run,
    exactly the checks and faults that rank reported (what was spooled on the way is replayed by the next run)."""
    def written() -> bool:
        return proc.poll() is not None or all((directory / f"sent-{r}.json").exists() for r in range(RANKS))

    def stored() -> bool:
        for rank, runs in _sent(directory).items():
            on_device = {r["run_name"]: (r["checks"], r["detected"])
                         for r in collector.api("GET", f"/devices/{uuid_of(rank)}").json().get("runs", [])}
            if any(on_device.get(run["run"]) != (run["checks"], run["detected"]) for run in runs):
                return False
        return True

    log = directory / "torchrun.log"
    assert _poll(written, 240.0) and proc.poll() is None, f"torchrun did not get through the runs:\n{log.read_text()}"
    assert _poll(stored, 60.0), f"the collector never held what the ranks reported:\n{log.read_text()[-3000:]}"


def _device_samples(collector: Collector) -> list[tuple[str, dict[str, str], float]]:
    return [s for s in collector.metrics().samples if s[0].startswith("attnchecker_device_")]


def _promtool_case(samples: list[tuple[str, dict[str, str], float]], suspects_query: str) -> dict[str, Any]:
    """A `promtool test rules` case from one real scrape: every device's suspect and status gauges held for 15
    minutes, two replicas exporting the same values (as every collector replica does)."""
    series = []
    for name, labels, value in samples:
        if name not in ("attnchecker_device_suspect", "attnchecker_device_status"):
            continue
        for instance in ("a", "b"):
            selector = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "instance": instance}.items()))
            series.append({"series": f"{name}{{{selector}}}", "values": f"{value:g}x15"})
    bad = {"Hostname": host_of(BAD_RANK), "UUID": uuid_of(BAD_RANK)}
    return {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "AttncheckerDeviceSuspect", "exp_alerts": []},
                {"eval_time": "10m", "alertname": "AttncheckerDeviceSuspect",
                 "exp_alerts": [{"exp_labels": {**bad, "severity": "warning"}}]},
            ],
            # The dashboard's table keeps the devices this query gives 1 (its filterByValue transformation).
            "promql_expr_test": [{"expr": suspects_query, "eval_time": "10m", "exp_samples": [
                {"labels": f'{{Hostname="{host_of(r)}",UUID="{uuid_of(r)}"}}', "value": int(r == BAD_RANK)}
                for r in range(RANKS)]}],
        }],
    }


def _suspects_query() -> str:
    """The Fleet dashboard's "Suspect devices" table query, as Grafana sends it for every host."""
    spec = importlib.util.spec_from_file_location("dashboard_queries", REPO / "tests/dashboards/dashboard_queries.py")
    dq = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(dq)  # type: ignore[union-attr]
    dashboard = json.loads(FLEET_DASHBOARD.read_text())
    [target] = [t for p, t in dq.iter_queries(dashboard) if p["title"] == "Suspect devices"]
    return str(dq.substitute(target["expr"], dq.variable_values(dashboard)))


def test_a_simulated_fleet_finds_the_bad_device_and_protection_follows_it(
        fleet: tuple[Collector, Path, subprocess.Popen[str]], tmp_path: Path) -> None:
    collector, directory, proc = fleet
    _wait_for_the_fault_runs(collector, directory, proc)

    listed = collector.api("GET", "/devices").json()
    items = listed["items"]
    assert len(items) == RANKS and {d["hostname"] for d in items} == {host_of(r) for r in range(RANKS)}
    sent = _sent(directory)
    report = {r: (sum(run["injected"] for run in sent[r]), sum(run["detected"] for run in sent[r]))
              for r in range(RANKS)}
    first = items[0]
    assert first["uuid"] == uuid_of(BAD_RANK), report
    assert first["suspicion"]["significant"] is True, first["suspicion"]
    assert [d["uuid"] for d in items if d["suspicion"]["significant"]] == [uuid_of(BAD_RANK)], report
    assert first["totals"]["fault_runs"] == RUNS and first["totals"]["runs"] == RUNS + 1
    # Each device holds exactly what its own rank reported (checked above), and that is the faults the rank's injector
    # planted, give or take one that landed where it changes nothing (a score the causal mask discards).
    for rank, (planted, detected) in report.items():
        assert abs(detected - planted) <= max(2, planted // 5), (rank, report)

    # The alert, from the same numbers: a promtool case built from this collector's /metrics.
    samples = _device_samples(collector)
    suspect = {lab["UUID"]: v for name, lab, v in samples if name == "attnchecker_device_suspect"}
    assert suspect == {uuid_of(r): float(r == BAD_RANK) for r in range(RANKS)}
    if shutil.which("promtool") is not None:
        rules = yaml.safe_load((REPO / "deploy" / "alerts.yml").read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations", None)
        (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
        (tmp_path / "fleet_test.yml").write_text(yaml.safe_dump(_promtool_case(samples, _suspects_query())))
        result = subprocess.run(["promtool", "test", "rules", "fleet_test.yml"], cwd=tmp_path, capture_output=True,
                                text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr

    # The operator's round trip on the live run, once every rank has registered and reported the run's policy.
    live = _runs(collector)["fleet-live"]

    def ranks() -> list[dict[str, Any]]:
        return collector.api("GET", f"/runs/{live['id']}/ranks").json()["data"]

    run_version = collector.run(live["id"])["requested_policy_version"]
    assert _poll(lambda: [r["applied_policy_version"] for r in ranks()] == [run_version] * RANKS, 60.0), ranks()
    path = f"/devices/{uuid_of(BAD_RANK)}"
    etag = collector.api("GET", path).headers["ETag"]
    r = collector.api("PATCH", path, json={"status": "suspect", "reason": "significant in the fleet test"},
                      headers={"If-Match": etag})
    assert r.status_code == 200, r.text
    suspect_version = collector.api("GET", "/policy/suspect").json()["version"]

    assert _poll(lambda: ranks()[BAD_RANK]["applied_policy_scope"] == "device", 60.0), ranks()
    for rank in ranks():
        expected = ("device", suspect_version) if rank["rank"] == BAD_RANK else ("run", run_version)
        assert (rank["applied_policy_scope"], rank["applied_policy_version"]) == expected, rank
        assert rank["device_status"] == ("suspect" if rank["rank"] == BAD_RANK else "ok")
    (directory / "stop").touch()
    assert proc.wait(120) == 0, (directory / "torchrun.log").read_text()[-4000:]
    # What each guard itself applied: the run's policy (the default: adaptive), then full protection on the suspect
    # device only.
    for rank in range(RANKS):
        lines = (directory / f"applied-{rank}.log").read_text().splitlines()
        changes = [(c["scope"], c["version"], c["period"], c["adaptive"]) for c in map(json.loads, lines)]
        expected = [("run", run_version, 1, True)]
        if rank == BAD_RANK:
            expected.append(("device", suspect_version, 1, False))
        assert changes == expected, (rank, changes)
    assert collector.run(live["id"])["applied_policy_version"] == run_version
