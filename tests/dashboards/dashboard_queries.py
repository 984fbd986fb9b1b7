"""Helpers shared by the dashboard tests (static here, live in tests/e2e/test_prometheus_live.py).

Reads the committed dashboard JSON, turns each panel query into plain PromQL the way Grafana would (macros and
template variables substituted), and reads the metrics table of docs/wire.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS_DIR = REPO / "dashboards" / "json"
PROVISIONING_DIR = REPO / "dashboards" / "provisioning"
WIRE_MD = REPO / "docs" / "wire.md"

# dcgm-exporter's series a dashboard may join with ours on (UUID) (the Fleet dashboard): its default counters' names
# before 4.9. They are not the collector's, so the wire contract does not list them, and they exist only where
# Prometheus scrapes dcgm-exporter too.
DCGM_SERIES = frozenset({"DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"})
# Each dashboard's scope variable, and the label its collector selectors must filter by.
SCOPES = {"attnchecker-overview": 'run=~"$run"', "attnchecker-fleet": 'Hostname=~"$hostname"'}

# Grafana's built-in macros, replaced by what Grafana would send for a 1 h range and a 15 s scrape interval.
MACROS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "__range_s": "3600", "__range_ms": "3600000"}
# $var, ${var}, ${var:format} and the deprecated [[var]]
VARIABLE_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")


def load_dashboards() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, json.loads(path.read_text())) for path in sorted(DASHBOARDS_DIR.glob("*.json"))]


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def iter_queries(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every Prometheus query of the dashboard."""
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield panel, target


def variable_values(dashboard: dict[str, Any], **overrides: str) -> dict[str, str]:
    """What each template variable stands for in a query: a multi/All query variable becomes its allValue regex."""
    values = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "datasource":
            values[variable["name"]] = variable["current"]["value"]
        else:
            values[variable["name"]] = variable.get("allValue") or ".*"
    return {**values, **overrides}


def variables_used(text: str) -> set[str]:
    return {next(group for group in match.groups() if group) for match in VARIABLE_RE.finditer(text)}


def substitute(expr: str, variables: dict[str, str], rate_interval: str | None = None) -> str:
    """The PromQL Grafana would send: macros first (they start with `$__`), then template variables."""
    macros = {**MACROS, **({"__rate_interval": rate_interval} if rate_interval else {})}

    def replace(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name in macros:
            return macros[name]
        if name in variables:
            return variables[name]
        raise KeyError(f"undefined variable ${name} in {expr!r}")

    return VARIABLE_RE.sub(replace, expr)


def metric_names(promql: str) -> set[str]:
    """Names of the series a PromQL expression selects (raises ValueError when it does not parse)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(promql), pre_visit=visit)
    return names


def wire_metrics() -> dict[str, str]:
    """{metric name: type} from the metrics table of docs/wire.md (its `| metric | type | labels |` rows)."""
    metrics = {}
    for line in WIRE_MD.read_text().splitlines():
        match = re.match(r"\|\s*`(attnchecker_\w+)`\s*\|\s*([a-z]+)", line)
        if match:
            metrics[match.group(1)] = match.group(2)
    return metrics


def series_names(metrics: dict[str, str]) -> set[str]:
    """The series names a set of metric families exposes (histograms as _bucket, _sum and _count)."""
    names = set()
    for name, kind in metrics.items():
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names
