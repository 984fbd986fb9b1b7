"""Deploy files checked offline: promtool on the Prometheus config and alert rules, Debian's docker-compose 1.29 on
docker-compose.yml, and the cross-file references nobody would otherwise notice until a deploy (mounted paths,
scrape targets vs compose services, Dockerfile COPY sources)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from dashboard_queries import PROVISIONING_DIR, REPO

DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
COMPOSE_ENV = {"POSTGRES_PASSWORD": "test-pg-password", "GRAFANA_ADMIN_PASSWORD": "test-grafana-password"}

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: `make system-deps`")
needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose: `make system-deps`")


def _run(*command: str | Path, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def _mounts(service: str) -> list[tuple[str, str]]:
    """(source, target) of a service's volumes, short syntax."""
    return [tuple(volume.split(":")[:2]) for volume in SERVICES[service].get("volumes", [])]  # type: ignore[misc]


def _container_ports(service: str) -> set[int]:
    ports = {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in SERVICES[service].get("ports", [])}
    return ports | {int(p) for p in SERVICES[service].get("expose", [])}


@pytest.fixture
def prometheus_dir(tmp_path: Path) -> Path:
    """deploy/prometheus.yml and alerts.yml as compose mounts them, with the bootstrap token file promtool stats."""
    token = tmp_path / "prometheus-token"
    token.write_text("atk_test_token\n")
    config = (DEPLOY / "prometheus.yml").read_text().replace("/run/attnchecker/prometheus-token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(DEPLOY / "alerts.yml", tmp_path / "alerts.yml")
    return tmp_path


@needs_promtool
def test_promtool_accepts_the_prometheus_config_and_its_rule_files(prometheus_dir: Path) -> None:
    result = _run("promtool", "check", "config", prometheus_dir / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert "rules found" in result.stdout


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    result = _run("promtool", "check", "rules", DEPLOY / "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_rules_fire_when_and_only_when_expected(tmp_path: Path) -> None:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    shutil.copy(REPO / "tests" / "dashboards" / "alerts_test.yml", tmp_path)

    result = _run("promtool", "test", "rules", "alerts_test.yml", cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_what_operators_must_hear_about() -> None:
    rules = {r["alert"]: r for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    assert {
        "AttncheckerUncorrectableFault",
        "AttncheckerAgentSilent",
        "AttncheckerOverheadAboveBudget",
        "AttncheckerEventsDropped",
        "AttncheckerPolicyNotApplied",
        "AttncheckerDeviceSuspect",
    } <= set(rules)
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"], name
        assert rule["annotations"]["description"], name
    assert "attnchecker_run_live) == 1" in rules["AttncheckerAgentSilent"]["expr"]


@needs_compose
def test_docker_compose_v1_accepts_the_file() -> None:
    result = _run("docker-compose", "-f", COMPOSE_FILE, "config", "-q", env={**os.environ, **COMPOSE_ENV})
    assert result.returncode == 0, result.stdout + result.stderr


@needs_compose
@pytest.mark.parametrize("missing", sorted(COMPOSE_ENV))
def test_docker_compose_fails_fast_without_a_secret(missing: str) -> None:
    env = {k: v for k, v in {**os.environ, **COMPOSE_ENV}.items() if k != missing}
    result = _run("docker-compose", "-f", COMPOSE_FILE, "config", "-q", env=env)
    assert result.returncode != 0
    assert f"set {missing}" in result.stdout + result.stderr


def test_every_secret_in_compose_is_required_from_the_environment() -> None:
    references = re.findall(r"\$\{(\w+)(:?[?-])?([^}]*)\}", COMPOSE_FILE.read_text())
    secrets = [(name, op) for name, op, _ in references if re.search("PASSWORD|TOKEN|SECRET|KEY", name)]
    assert secrets, "no secrets found: the regex is wrong"
    assert all(op == ":?" for _, op in secrets), secrets


def test_every_service_has_a_healthcheck() -> None:
    assert set(SERVICES) == {"postgres", "migrate", "collector", "prometheus", "grafana", "demo-trainer"}
    for name, service in SERVICES.items():
        assert service.get("healthcheck", {}).get("test"), name


def test_every_bind_mount_exists_in_the_repository_and_is_read_only() -> None:
    for name in SERVICES:
        for source, target in _mounts(name):
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name}: {source} -> {target}"
                assert any(v.endswith(":ro") for v in SERVICES[name]["volumes"] if v.startswith(source)), source
            else:
                assert source in COMPOSE["volumes"], f"{name}: undeclared named volume {source}"


def test_prometheus_scrapes_the_collector_service_on_its_port() -> None:
    [job] = [j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "attnchecker-collector"]
    for target in [t for sc in job["static_configs"] for t in sc["targets"]]:
        host, port = target.split(":")
        assert host in SERVICES, f"scrape target {target}: no compose service {host}"
        assert int(port) in _container_ports(host) or f"--port {port}" in " ".join(SERVICES[host]["command"])
    assert "--port 8000" in " ".join(SERVICES["collector"]["command"])


def test_prometheus_rule_files_and_token_are_mounted_where_the_config_reads_them() -> None:
    mounts = {target: source for source, target in _mounts("prometheus")}
    config_source = mounts["/etc/prometheus/prometheus.yml"]
    assert (REPO / config_source).resolve() == DEPLOY / "prometheus.yml"
    for rule_file in PROMETHEUS["rule_files"]:
        target = str(Path("/etc/prometheus") / rule_file)
        assert target in mounts, f"rule file {rule_file} is not mounted at {target}"
        assert (REPO / mounts[target]).is_file(), rule_file
    [job] = [j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "attnchecker-collector"]
    token_dir = str(Path(job["authorization"]["credentials_file"]).parent)
    assert mounts[token_dir] == "bootstrap-secrets"
    assert ("bootstrap-secrets", token_dir) in _mounts("migrate")


def test_grafana_mounts_the_provisioning_and_dashboards_the_provider_reads() -> None:
    mounts = {target: source for source, target in _mounts("grafana")}
    assert (REPO / mounts["/etc/grafana/provisioning/datasources"]).resolve() == PROVISIONING_DIR / "datasources"
    provider = yaml.safe_load((PROVISIONING_DIR / "dashboards" / "attnchecker.yml").read_text())["providers"][0]
    assert (REPO / mounts[provider["options"]["path"]]).resolve() == REPO / "dashboards" / "json"
    datasource = yaml.safe_load((PROVISIONING_DIR / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    host, port = datasource["url"].removeprefix("http://").split(":")
    assert host in SERVICES
    assert int(port) in _container_ports(host)


def _dockerfiles() -> list[tuple[str, Path, Path]]:
    built = [(name, s["build"]) for name, s in SERVICES.items() if "build" in s]
    return [(name, REPO / b["context"], REPO / b["context"] / b["dockerfile"]) for name, b in built]


@pytest.mark.parametrize(("service", "context", "dockerfile"), _dockerfiles(), ids=[n for n, *_ in _dockerfiles()])
def test_dockerfile_copy_sources_exist_in_the_build_context(service: str, context: Path, dockerfile: Path) -> None:
    assert dockerfile.is_file(), service
    copies = re.findall(r"^(?:COPY|ADD)\s+(?!--from)(.+)$", dockerfile.read_text(), flags=re.MULTILINE)
    assert copies, f"{dockerfile.name}: no COPY"
    for line in copies:
        *sources, _destination = line.split()
        for source in sources:
            assert (context / source).exists(), f"{dockerfile.name}: COPY {source} is not in the build context"


def test_demo_trainer_installs_cpu_torch_before_the_agent() -> None:
    text = (DEPLOY / "trainer.Dockerfile").read_text()
    torch = text.index("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    assert torch < text.index("COPY agent/") < text.index("pip install ./agent")


@pytest.mark.slow
def test_bootstrap_migrates_and_creates_the_stack_tokens_once(tmp_path: Path) -> None:
    """deploy/bootstrap.sh (the compose `migrate` one-shot) run for real, on SQLite instead of PostgreSQL."""
    auth = pytest.importorskip("attnchecker_server.auth")
    testing = pytest.importorskip("collector_testing")
    from attnchecker_server.db import make_engine, make_session_factory

    settings = testing.make_settings("sqlite", tmp_path)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    cli = Path(sys.executable).with_name("attnchecker-server")
    if not cli.exists():
        pytest.skip(f"{cli} is missing: `pip install -e server`")
    env = {
        **os.environ,
        **testing.settings_env(settings),
        "ATTNCHECKER_BOOTSTRAP_DIR": str(secrets),
        "PATH": f"{cli.parent}{os.pathsep}{os.environ['PATH']}",
    }

    def bootstrap() -> dict[str, str]:
        result = subprocess.run(
            ["/bin/sh", str(DEPLOY / "bootstrap.sh")], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return {name: (secrets / name).read_text() for name in ("prometheus-token", "agent-token")}

    first = bootstrap()
    assert bootstrap() == first, "a second run (compose restart, upgrade) must keep the tokens it made"

    sessions = make_session_factory(make_engine(settings, pooled=False))
    with sessions() as session:
        prometheus = auth.authenticate(session, first["prometheus-token"].strip())
        agent = auth.authenticate(session, first["agent-token"].strip())
        assert len(auth.list_tokens(session)) == 2
    assert (prometheus.name, prometheus.role) == ("prometheus", "viewer")
    assert (agent.name, agent.role) == ("demo-trainer", "agent")
