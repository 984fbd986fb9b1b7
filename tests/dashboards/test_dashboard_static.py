"""Static checks of the committed Grafana dashboards (no Grafana on our machines: this and the live PromQL test
in tests/e2e/test_prometheus_live.py are what stands between a typo and an empty panel)."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
import yaml
from dashboard_queries import (
    DCGM_SERIES,
    PROVISIONING_DIR,
    SCOPES,
    iter_panels,
    iter_queries,
    load_dashboards,
    metric_names,
    series_names,
    substitute,
    variable_values,
    variables_used,
    wire_metrics,
)

DASHBOARDS = load_dashboards()
QUERIES = [
    pytest.param(dashboard, panel, target, id=f"{path.stem}:{panel['id']}:{target['refId']}")
    for path, dashboard in DASHBOARDS
    for panel, target in iter_queries(dashboard)
]
PROVISIONED_DATASOURCES = yaml.safe_load((PROVISIONING_DIR / "datasources" / "prometheus.yml").read_text())[
    "datasources"
]
PROVISIONED_UID = PROVISIONED_DATASOURCES[0]["uid"]
TEMPLATED_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _dashboard(uid: str) -> dict[str, Any]:
    [dashboard] = [d for _, d in DASHBOARDS if d["uid"] == uid]
    return dashboard


def _overview() -> dict[str, Any]:
    return _dashboard("attnchecker-overview")


def _panel(title: str, uid: str = "attnchecker-overview") -> dict[str, Any]:
    [panel] = [p for p in iter_panels(_dashboard(uid)) if p["title"] == title]
    return panel


def test_dashboards_have_stable_uids_and_a_current_classic_schema() -> None:
    assert [path.name for path, _ in DASHBOARDS] == ["attnchecker-fleet.json", "attnchecker-overview.json"]
    uids = [dashboard["uid"] for _, dashboard in DASHBOARDS]
    assert len(set(uids)) == len(uids)
    for path, dashboard in DASHBOARDS:
        assert re.fullmatch(r"[a-z0-9-]{1,40}", dashboard["uid"]), path
        assert path.stem == dashboard["uid"], "file named after its uid, so a reader can find it from the URL"
        assert dashboard["id"] is None, "a numeric id ties the JSON to one Grafana database"
        assert 39 <= dashboard["schemaVersion"] <= 41
        assert dashboard["title"]
        assert dashboard["editable"] is False


@pytest.mark.parametrize(("path", "dashboard"), DASHBOARDS, ids=[p.stem for p, _ in DASHBOARDS])
def test_panel_ids_are_unique(path: Any, dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in iter_panels(dashboard)]
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"


@pytest.mark.parametrize(("path", "dashboard"), DASHBOARDS, ids=[p.stem for p, _ in DASHBOARDS])
def test_panels_fit_the_grid_without_overlapping(path: Any, dashboard: dict[str, Any]) -> None:
    boxes = []
    for panel in iter_panels(dashboard):
        grid = panel["gridPos"]
        assert min(grid["w"], grid["h"]) >= 1, panel["title"]
        assert min(grid["x"], grid["y"]) >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']}: wider than Grafana's 24 columns"
        boxes.append((panel["title"], grid))
    for (a, ga), (b, gb) in itertools.combinations(boxes, 2):
        apart = (
            ga["x"] + ga["w"] <= gb["x"]
            or gb["x"] + gb["w"] <= ga["x"]
            or ga["y"] + ga["h"] <= gb["y"]
            or gb["y"] + gb["h"] <= ga["y"]
        )
        assert apart, f"{path.name}: panels {a!r} and {b!r} overlap"


@pytest.mark.parametrize(("dashboard", "panel", "target"), QUERIES)
def test_query_parses_after_grafana_substitution(dashboard: dict, panel: dict, target: dict) -> None:
    promql = substitute(target["expr"], variable_values(dashboard))
    try:
        metric_names(promql)
    except ValueError as error:
        pytest.fail(f"{panel['title']} [{target['refId']}]: {promql!r} does not parse: {error}")


@pytest.mark.parametrize(("dashboard", "panel", "target"), QUERIES)
def test_query_names_only_metrics_the_wire_contract_lists(dashboard: dict, panel: dict, target: dict) -> None:
    names = metric_names(substitute(target["expr"], variable_values(dashboard)))
    assert names - DCGM_SERIES, f"{panel['title']}: a panel query must select at least one collector metric"
    unknown = names - series_names(wire_metrics()) - DCGM_SERIES
    assert not unknown, f"{panel['title']} [{target['refId']}] selects metrics docs/wire.md does not list: {unknown}"


@pytest.mark.parametrize(("dashboard", "panel", "target"), QUERIES)
def test_query_ranges_use_rate_interval(dashboard: dict, panel: dict, target: dict) -> None:
    ranges = re.findall(r"\[([^\]]*)\]", target["expr"])
    where = f"{dashboard['uid']}: {panel['title']} [{target['refId']}]"
    assert all(r == "$__rate_interval" for r in ranges), f"{where}: range {ranges}, not $__rate_interval"


def test_wire_metrics_table_matches_the_collectors_metric_names() -> None:
    metrics = pytest.importorskip("attnchecker_server.metrics")
    assert {name: kind for name, (kind, _) in metrics.METRIC_NAMES.items()} == wire_metrics()


def test_wire_metrics_table_is_read_and_every_metric_is_on_a_dashboard() -> None:
    metrics = wire_metrics()
    assert len(metrics) >= 20
    assert metrics["attnchecker_checksum_residual_ratio"] == "histogram"
    used = set().union(*(metric_names(substitute(t["expr"], variable_values(d))) for _, d in DASHBOARDS
                         for _, t in iter_queries(d)))
    # The status gauge drives the alert and the count of marked devices; the device cap's omissions are for the
    # collector's operator (as the run cap's are).
    assert series_names(metrics) - used <= {
        f"{name}_{suffix}" for name, kind in metrics.items() if kind == "histogram" for suffix in ("sum", "count")
    } | {"attnchecker_metrics_devices_omitted"}


@pytest.mark.parametrize(("path", "dashboard"), DASHBOARDS, ids=[p.stem for p, _ in DASHBOARDS])
def test_every_template_variable_used_is_defined(path: Any, dashboard: dict[str, Any]) -> None:
    defined = {variable["name"] for variable in dashboard["templating"]["list"]}
    used = {name for name in variables_used(json.dumps(dashboard)) if not name.startswith("__")}
    assert used <= defined, f"{path.name}: undefined {used - defined}"
    assert defined <= used, f"{path.name}: defined but unused {defined - used}"


def test_datasource_is_the_templated_provisioned_prometheus() -> None:
    assert [ds["uid"] for ds in PROVISIONED_DATASOURCES] == ["attnchecker-prometheus"]
    for _, dashboard in DASHBOARDS:
        [datasource] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
        assert datasource["name"] == "datasource"
        assert datasource["query"] == "prometheus"
        assert datasource["current"]["value"] == PROVISIONED_UID
        for panel in iter_panels(dashboard):
            if panel["type"] != "row":
                assert panel["datasource"] == TEMPLATED_DATASOURCE, panel["title"]
        for panel, target in iter_queries(dashboard):
            assert target.get("datasource", TEMPLATED_DATASOURCE) == TEMPLATED_DATASOURCE, panel["title"]
    # a name or ${DS_...} would bind the JSON to one Grafana's datasource list
    assert "DS_" not in json.dumps([d for _, d in DASHBOARDS])


def test_run_variable_lists_runs_from_checks_with_all_and_multi() -> None:
    [run] = [v for v in _overview()["templating"]["list"] if v["name"] == "run"]
    assert run["type"] == "query"
    assert run["datasource"] == TEMPLATED_DATASOURCE
    assert run["definition"] == run["query"]["query"] == "label_values(attnchecker_checks_total, run)"
    assert run["multi"] is True
    assert run["includeAll"] is True
    assert run["allValue"] == ".*"


@pytest.mark.parametrize(("dashboard", "panel", "target"), QUERIES)
def test_scoped_queries_filter_by_the_dashboards_scope_variable(dashboard: dict, panel: dict, target: dict) -> None:
    """The overview's collector selectors filter by $run, the fleet's by $hostname (dcgm-exporter's series are
    joined on UUID with a filtered selector of ours)."""
    names = metric_names(substitute(target["expr"], variable_values(dashboard)))
    per_process = {n for n in names if n.startswith("attnchecker_ingest_")}
    if names - per_process - DCGM_SERIES:  # the collector's own ingest metrics carry no run label
        selectors = len(re.findall(r"attnchecker_\w+\{", target["expr"]))
        scope = SCOPES[dashboard["uid"]]
        assert target["expr"].count(scope) == selectors, f"{panel['title']}: a selector ignores {scope}"


def test_refids_are_unique_within_each_panel() -> None:
    for _, dashboard in DASHBOARDS:
        for panel in iter_panels(dashboard):
            refs = [t["refId"] for t in panel.get("targets", [])]
            assert len(refs) == len(set(refs)), panel["title"]


def test_uncorrectable_faults_stat_turns_red_above_zero() -> None:
    panel = _panel("Uncorrectable faults")
    assert panel["type"] == "stat"
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps == [{"color": "green", "value": None}, {"color": "red", "value": 1}]
    assert panel["options"]["colorMode"] == "background"
    assert "attnchecker_faults_uncorrectable_total" in panel["targets"][0]["expr"]


def test_overhead_panel_compares_check_time_ratio_with_the_budget() -> None:
    exprs = [t["expr"] for t in _panel("Check overhead vs budget")["targets"]]
    assert "rate(attnchecker_check_seconds_total" in exprs[0]
    assert "rate(attnchecker_step_seconds_total" in exprs[0]
    assert "attnchecker_overhead_budget_ratio" in exprs[1]


def test_residual_panel_takes_quantiles_of_the_histogram_buckets() -> None:
    for target in _panel("Checksum residual over bound")["targets"]:
        assert target["expr"].startswith("histogram_quantile(")
        assert "attnchecker_checksum_residual_ratio_bucket" in target["expr"]


def test_fleet_suspect_devices_stat_turns_red_above_zero_and_every_device_series_uses_dcgm_labels() -> None:
    panel = _panel("Significant devices", "attnchecker-fleet")
    assert panel["type"] == "stat"
    assert panel["fieldConfig"]["defaults"]["thresholds"]["steps"] == [{"color": "green", "value": None},
                                                                       {"color": "red", "value": 1}]
    assert "attnchecker_device_suspect" in panel["targets"][0]["expr"]
    for _, target in iter_queries(_dashboard("attnchecker-fleet")):
        for grouping in re.findall(r"by \(([^)]*)\)", target["expr"]):
            labels = {label.strip() for label in grouping.split(",")}
            assert labels & {"UUID", "status"} or labels <= {"kind", "action"}, target["expr"]
            assert not labels & {"uuid", "hostname", "run"}, f"dcgm-exporter spells them UUID and Hostname: {grouping}"


def test_fleet_suspect_devices_table_keeps_the_devices_the_statistic_flags() -> None:
    panel = _panel("Suspect devices", "attnchecker-fleet")
    [target] = panel["targets"]
    assert target["expr"].startswith("max by (Hostname, UUID) (attnchecker_device_suspect{")
    [keep] = [t for t in panel["transformations"] if t["id"] == "filterByValue"]
    assert keep["options"]["type"] == "include"
    assert keep["options"]["filters"] == [{"fieldName": "Value", "config": {"id": "equal", "options": {"value": 1}}}]


def test_fleet_joins_dcgm_exporter_series_on_uuid() -> None:
    panel = _panel("XID and ECC errors beside ABFT faults", "attnchecker-fleet")
    exprs = [t["expr"] for t in panel["targets"]]
    assert all(any(name in e for e in exprs) for name in DCGM_SERIES)
    for expr in exprs:
        assert "on (UUID)" in expr and "attnchecker_device_" in expr and any(n in expr for n in DCGM_SERIES), expr
