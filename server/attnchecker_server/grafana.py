"""Push the repository's Grafana datasource and dashboards to a running Grafana over its HTTP API.

For a Grafana we don't provision from files (docker-compose.yml does that): the same provisioning YAML and dashboard
JSON are upserted, the datasource by its pinned uid, the dashboards into the provider's folder. Imported lazily by
the CLI (`attnchecker-server grafana push`), so the collector never loads grafana-client to serve.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml  # a server dependency of its own: grafana-client does not pull pyyaml
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

__all__ = ["push"]

# Grafana's provisioning keys that its HTTP API does not take (or takes under another name).
_PROVISIONING_ONLY = {"editable", "orgId", "version", "deleteDatasources"}


def push(url: str, token: str, dashboards_dir: Path, provisioning_dir: Path) -> dict[str, Any]:
    """Upserts every provisioned datasource, the dashboards' folder and every dashboard.

    Args:
        url: Grafana's base URL, e.g. ``https://grafana.example.com`` or ``http://host:3000/grafana/``.
        token: a service-account token with the Editor role (datasources need Admin), sent as a Bearer token.
        dashboards_dir: the dashboard JSON files (``dashboards/json``).
        provisioning_dir: Grafana's provisioning tree (``dashboards/provisioning``): datasources from
            ``datasources/*.yml``, the target folder from the first provider in ``dashboards/*.yml``.

    Returns:
        What happened, for the CLI to print: ``{"grafana_version", "datasources": {uid: "created"|"updated"},
        "folder": {"uid", "title", "created"}, "dashboards": {uid: {"url", "version"}}}``.

    Raises:
        ValueError: a provisioning file or dashboard lacks what is needed (names the file).
        grafana_client.client.GrafanaException: Grafana refused a request (401 on a bad token, 403 on a weak role).
    """
    datasources = _read_datasources(Path(provisioning_dir) / "datasources")
    folder_uid, folder_title = _read_folder(Path(provisioning_dir) / "dashboards")
    dashboards = _read_dashboards(Path(dashboards_dir))

    # grafana-client appends "api" to the URL's path as it is: a sub-path needs its trailing slash.
    if urlsplit(url).path not in ("", "/") and not url.endswith("/"):
        url += "/"
    grafana = GrafanaApi.from_url(url, credential=token, timeout=10)
    result: dict[str, Any] = {
        "grafana_version": grafana.version,  # fails early, and clearly, on a wrong URL or token
        "datasources": {},
        "folder": {"uid": folder_uid, "title": folder_title, "created": False},
        "dashboards": {},
    }

    for payload in datasources:
        uid = payload["uid"]
        if _exists(grafana.datasource.get_datasource_by_uid, uid):
            grafana.datasource.update_datasource_by_uid(uid, payload)
            result["datasources"][uid] = "updated"
        else:
            grafana.datasource.create_datasource(payload)
            result["datasources"][uid] = "created"

    if not _exists(grafana.folder.get_folder, folder_uid):
        grafana.folder.create_folder(folder_title, uid=folder_uid)
        result["folder"]["created"] = True

    for path, dashboard in dashboards:
        # id None + overwrite: matched by uid, so a re-push replaces the dashboard instead of failing on a version clash
        answer = grafana.dashboard.update_dashboard(
            {
                "dashboard": {**dashboard, "id": None},
                "folderUid": folder_uid,
                "overwrite": True,
                "message": f"attnchecker-server grafana push ({path.name})",
            }
        )
        result["dashboards"][dashboard["uid"]] = {"url": answer.get("url"), "version": answer.get("version")}
    return result


def _exists(get: Callable[[str], Any], uid: str) -> bool:
    try:
        get(uid)
    except GrafanaClientError as error:
        if error.status_code == 404:
            return False
        raise
    return True


def _read_datasources(directory: Path) -> list[dict[str, Any]]:
    payloads = []
    for path in sorted(directory.glob("*.y*ml")):
        for entry in (yaml.safe_load(path.read_text()) or {}).get("datasources") or []:
            if not entry.get("uid") or not entry.get("name"):
                raise ValueError(f"{path}: every datasource needs a name and a pinned uid (dashboards refer to it)")
            payloads.append({k: v for k, v in entry.items() if k not in _PROVISIONING_ONLY})
    if not payloads:
        raise ValueError(f"{directory}: no datasources in *.yml")
    return payloads


def _read_folder(directory: Path) -> tuple[str, str]:
    for path in sorted(directory.glob("*.y*ml")):
        for provider in (yaml.safe_load(path.read_text()) or {}).get("providers") or []:
            if provider.get("folderUid"):
                return provider["folderUid"], provider.get("folder") or provider["folderUid"]
    raise ValueError(f"{directory}: no dashboard provider with a folderUid in *.yml")


def _read_dashboards(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    dashboards = []
    for path in sorted(directory.glob("*.json")):
        dashboard = json.loads(path.read_text())
        if not dashboard.get("uid"):
            raise ValueError(f"{path}: a dashboard needs a stable uid to be upserted")
        dashboards.append((path, dashboard))
    if not dashboards:
        raise ValueError(f"{directory}: no dashboards (*.json)")
    return dashboards
