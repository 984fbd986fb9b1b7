"""Issue 15 acceptance: the collector's own dashboard page at /, in a real browser (Playwright driving the
distribution's Chromium), looking at a run that a real protected training process streams.

One collector and one training subprocess serve the whole module. The operator test changes the policy through the
page and waits until the agent reports it applied; it also takes the README's screenshot
(ATTNCHECKER_UPDATE_SCREENSHOT=1 writes docs/img/dashboard.png, otherwise it goes to a temporary directory).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import Collector, running_collector, testing, wait_until
from playwright.sync_api import expect
from ui_trainer import FAULTS, UNCORRECTABLE_STEP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "ui-run"
REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "img" / "dashboard.png"


@dataclasses.dataclass
class Setup:
    collector: Collector
    viewer: str
    run_id: str
    trainer: subprocess.Popen[str]
    trainer_log: Path
    directory: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("web-ui")
    with running_collector("sqlite", directory / "collector") as collector:
        viewer = testing.make_token(collector.settings, "viewer", "ui-viewer")
        stop, log = directory / "stop", directory / "trainer.log"
        with log.open("w") as out:
            trainer = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("ui_trainer.py")), collector.url, collector.agent, RUN,
                 str(directory / "spool"), str(stop)],
                stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            # Every planned fault is in the collector (the trainer has passed the last faulty step).
            expected = len(FAULTS) + 1
            assert wait_until(lambda: _detected(collector) >= expected or trainer.poll() is not None, 120.0)
            assert trainer.poll() is None and _detected(collector) >= expected, \
                f"the run never reached {expected} detections:\n{log.read_text()}"
            yield Setup(collector, viewer, collector.run_by_name(RUN)["id"], trainer, log, directory)
        finally:
            stop.touch()
            try:
                trainer.wait(30)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait(10)


def _detected(collector: Collector) -> int:
    runs = collector.api("GET", "/runs").json()["data"]
    return sum(r["totals"]["detected"] for r in runs if r["name"] == RUN)


def sign_in(page: Any, url: str, token: str) -> None:
    page.goto(url + "/")
    page.get_by_label("Token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#runs")).to_be_visible()


def open_run(page: Any) -> None:
    page.get_by_role("link", name=RUN, exact=True).click()
    expect(page.locator("#run-name")).to_have_text(RUN)


def test_without_a_token_the_page_shows_the_sign_in_form_and_no_data(setup: Setup, page: Any) -> None:
    page.goto(setup.collector.url + "/#/runs/" + setup.run_id)
    expect(page.get_by_label("Token")).to_be_visible()
    expect(page.locator("#runs")).to_have_count(0)
    expect(page.locator("#run-name")).to_have_count(0)
    assert RUN not in page.content()
    # A wrong token is refused with the API's reason, and nothing is stored for the session.
    page.get_by_label("Token").fill("atk_000000000000_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signin-error")).to_have_text("unknown, revoked or expired token")
    assert page.evaluate("sessionStorage.length") == 0
    # An agent token may ingest but not read: the API's 403 shows, not the runs.
    page.get_by_label("Token").fill(setup.collector.agent)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signin-error")).to_contain_text("role 'agent' may not do this")
    expect(page.locator("#runs")).to_have_count(0)


def test_operator_sees_the_run_and_changes_the_policy_which_the_agent_applies(setup: Setup, page: Any) -> None:
    c = setup.collector
    sign_in(page, c.url, c.operator)
    # The token travels only as a header: it is in session storage, never in the address.
    assert page.evaluate("sessionStorage.getItem('attnchecker.token')") == c.operator
    assert c.operator not in page.url

    row = page.locator(f"#runs-body tr[data-run-id='{setup.run_id}']")
    expect(row).to_contain_text("running")
    expect(row).to_have_class(re.compile(r"\bbad\b"))  # it has an uncorrectable fault
    open_run(page)

    run = c.run(setup.run_id)
    totals = run["totals"]
    assert totals["uncorrectable"] >= 1 and totals["detected"] >= len(FAULTS) + 1
    for key in ("detected", "corrected", "uncorrectable"):
        expect(page.locator(f"[data-count='{key}'] .value")).to_have_text(f"{totals[key]:,}")
    # The chart has one mark per event, the uncorrectable ones ringed, one lane per op.
    events = c.events(setup.run_id)
    expect(page.locator("#timeline svg circle.fault")).to_have_count(len(events))
    uncorrectable = [e for e in events if e["action"] == "uncorrectable"]
    assert uncorrectable and {e["step"] for e in uncorrectable} == {UNCORRECTABLE_STEP}
    expect(page.locator("#timeline svg circle.uncorrectable")).to_have_count(len(uncorrectable))
    for op in ("q", "k", "v", "scores", "context", "out"):
        expect(page.locator("#timeline svg text", has_text=re.compile(f"^{op}$"))).to_have_count(1)
    expect(page.locator("#events-table tbody tr.bad")).to_have_count(len(uncorrectable))
    # Overhead and per-op periods come from /metrics; the run checks every op every step (period 1).
    expect(page.locator("#overhead-text")).to_contain_text("budget 5.0 %")
    expect(page.locator("#periods-table tbody tr")).to_have_count(6)
    # The agent registers its coverage map: every attention op of the toy model protected, nothing left open.
    coverage = run["config"]["coverage"]
    assert coverage["unprotected"] == 0 and coverage["protected"] > 0
    expect(page.locator("#coverage")).to_be_visible()
    expect(page.locator("#coverage-summary")).to_have_text(f"{coverage['protected']} ops protected, 0 unprotected")
    expect(page.locator("#coverage-table tbody tr")).to_have_count(len(coverage["layers"]))
    expect(page.locator("#coverage-table tbody tr.bad")).to_have_count(0)

    # The operator's edit: PATCH with If-Match from the form; the agent picks it up and reports it applied.
    expect(page.locator("#policy-form")).to_have_attribute("data-access", "edit")
    expect(page.locator("#policy-save")).to_be_enabled()
    expect(page.locator("#policy-readonly")).to_be_hidden()
    before = run["requested_policy_version"]
    page.locator("#policy-period").fill("2")
    page.locator("#policy-tolerance_factor").fill("2")
    page.locator("#policy-save").click()
    expect(page.locator("#policy-status")).to_contain_text(f"Saved v{before + 1}")
    expect(page.locator("#run-policy")).to_contain_text(f"v{before + 1} / v{before + 1}")
    run = c.run(setup.run_id)
    assert run["requested_policy_version"] == run["applied_policy_version"] == before + 1
    policy = c.api("GET", f"/runs/{setup.run_id}/policy").json()
    assert (policy["period"], policy["tolerance_factor"], policy["updated_by"]) == (2, 2.0, "e2e-operator")
    # ... and the training process itself says so (it prints each version its guard applies).
    assert wait_until(lambda: f"[agent] policy v{before + 1} applied" in setup.trainer_log.read_text(), 10.0)
    expect(page.locator("#history-table tbody tr").first).to_contain_text("period 1 → 2")
    _screenshot(page, setup.directory)

    # A stale edit: someone else changes the policy while this form holds an edit; Save shows the 412 and the
    # version now in force, and the form reloads it instead of overwriting.
    page.locator("#policy-tolerance_factor").fill("3")
    r = c.api("PATCH", f"/runs/{setup.run_id}/policy", json={"overhead_budget": 0.1})
    assert r.status_code == 200, r.text
    current = r.json()["version"]
    page.locator("#policy-save").click()
    expect(page.locator("#policy-status")).to_contain_text("412")
    expect(page.locator("#policy-status")).to_contain_text(f"the policy is at version {current}")
    expect(page.locator("#policy-version")).to_have_text(f"v{current}")
    expect(page.locator("#policy-overhead_budget")).to_have_value("0.1")
    assert c.api("GET", f"/runs/{setup.run_id}/policy").json()["tolerance_factor"] == 2.0


def _screenshot(page: Any, directory: Path) -> None:
    """The README's picture: the run's page once the agent has applied the operator's change."""
    update = os.environ.get("ATTNCHECKER_UPDATE_SCREENSHOT") == "1"
    target = SCREENSHOT if update else directory / "dashboard.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target), full_page=True)
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_viewer_sees_the_run_but_cannot_edit_the_policy(setup: Setup, page: Any) -> None:
    c = setup.collector
    sign_in(page, c.url, setup.viewer)
    open_run(page)
    expect(page.locator("[data-count='detected'] .value")).to_have_text(f"{c.run(setup.run_id)['totals']['detected']:,}")
    # Once the page has asked the API (a PATCH that cannot change anything: If-Match "0"), the editor is read-only.
    expect(page.locator("#policy-form")).to_have_attribute("data-access", "read-only")
    expect(page.locator("#policy-readonly")).to_be_visible()
    for field in ("mode", "period", "tolerance", "tolerance_factor", "overhead_budget"):
        expect(page.locator(f"#policy-{field}")).to_be_disabled()
    expect(page.locator("#policy-save")).to_be_disabled()
    # The server agrees: the viewer's token cannot change it either.
    r = httpx.patch(f"{c.url}/api/v1/runs/{setup.run_id}/policy", json={"period": 5},
                    headers={"Authorization": f"Bearer {setup.viewer}"}, timeout=10)
    assert r.status_code == 403


def test_text_from_agents_is_shown_as_text_never_as_markup(setup: Setup, page: Any) -> None:
    c = setup.collector
    name = '<img src=x onerror="window.pwned=1">"quoted" & run'
    r = c.api("POST", "/runs", json={"name": name, "model": "<b>bold</b>"},
              headers={"Authorization": f"Bearer {c.agent}"})
    assert r.status_code in (200, 201), r.text
    sign_in(page, c.url, setup.viewer)
    link = page.get_by_role("link", name=name, exact=True)
    expect(link).to_be_visible()
    assert page.locator("#runs img").count() == 0 and page.locator("#runs b").count() == 0
    link.click()
    expect(page.locator("#run-name")).to_have_text(name)
    assert page.evaluate("window.pwned") is None
    # A mangled address (bad percent-encoding) falls back to the runs, without a script error.
    page.goto(c.url + "/#/runs/%E0%A4%A")
    expect(page.locator("#runs")).to_be_visible()


def test_open_reads_open_the_page_without_a_token_and_read_only(setup: Setup, page: Any) -> None:
    # A second collector process on the same database, with ATTNCHECKER_OPEN_READS=true.
    settings = setup.collector.settings.model_copy(update={"open_reads": True})
    proc = testing.start_collector(settings, migrate_first=False)
    try:
        page.goto(proc.url + "/")
        expect(page.locator("#runs")).to_be_visible()
        expect(page.get_by_label("Token")).to_have_count(0)
        open_run(page)
        expect(page.locator("#policy-form")).to_have_attribute("data-access", "read-only")
        expect(page.locator("#policy-readonly")).to_be_visible()
        expect(page.locator("#policy-save")).to_be_disabled()
        # An operator can still sign in there to edit.
        page.get_by_role("button", name="Sign in").click()
        page.get_by_label("Token").fill(setup.collector.operator)
        page.get_by_role("button", name="Sign in").last.click()
        expect(page.locator("#run-name")).to_have_text(RUN)  # back on the page it was signed in from
        expect(page.locator("#policy-form")).to_have_attribute("data-access", "edit")
        expect(page.locator("#policy-save")).to_be_enabled()
    finally:
        proc.stop()


def test_the_page_and_its_files_are_served_with_a_strict_content_security_policy(setup: Setup) -> None:
    r = httpx.get(setup.collector.url + "/", timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert "<script" in r.text and "inline" not in r.text
    for path in ("/ui/app.js", "/ui/app.css"):
        assert httpx.get(setup.collector.url + path, timeout=10).status_code == 200
    # No token, no data: the page itself is public, the API behind it is not.
    assert httpx.get(setup.collector.url + "/api/v1/runs", timeout=10).status_code == 401
    # Only the shipped static files: nothing else of the package is reachable under /ui.
    assert httpx.get(setup.collector.url + "/ui/%2e%2e/config.py", timeout=10).status_code == 404


def test_the_coverage_map_shows_when_the_registration_has_one_and_new_or_missing_fields_do_not_break_it(
        setup: Setup, page: Any) -> None:
    c = setup.collector
    # The agent's wire shape (attnchecker.coverage.Coverage.to_wire) with a gap.
    coverage = {"protected": 9, "unprotected": 3, "layers": ["0-1 q,k,v:hook scores,context:sdpa out:hook"],
                "gaps": ["layer 2 q,v,out: unsupported wrapper (peft LoRA variant DoraLinear)"]}
    r = c.api("POST", "/runs", json={"name": "ui-coverage", "config": {"coverage": coverage}},
              headers={"Authorization": f"Bearer {c.agent}"})
    assert r.status_code in (200, 201), r.text
    run_id = r.json()["id"]

    # A later collector adds fields (tier counts, …) and may leave others out: the page takes the real answer,
    # changed that way on its way to the browser, and must still draw.
    def newer_server(route: Any) -> None:
        body = route.fetch().json()
        body["totals"]["tripwire_trips"] = 7
        body["totals"]["tier_note"] = "not a number: not a card"
        body["tiers"] = {"tripwire": {"steps": 12}}
        for key in ("model", "host", "last_step", "applied_policy_version"):
            body.pop(key, None)
        route.fulfill(json=body)

    page.route(re.compile(rf"/api/v1/runs/{run_id}$"), newer_server)
    sign_in(page, c.url, setup.viewer)
    page.get_by_role("link", name="ui-coverage", exact=True).click()
    expect(page.locator("#run-name")).to_have_text("ui-coverage")
    expect(page.locator("#coverage")).to_be_visible()
    expect(page.locator("#coverage-table tbody tr")).to_have_count(2)
    expect(page.locator("#coverage-table tbody tr.bad")).to_contain_text("unsupported wrapper")
    expect(page.locator("#coverage-summary")).to_have_text("9 ops protected, 3 unprotected")
    expect(page.locator("[data-count='tripwire_trips'] .value")).to_have_text("7")
    expect(page.locator("[data-count='tier_note']")).to_have_count(0)
    expect(page.locator("#run-meta")).to_contain_text("model –")
    expect(page.locator("#timeline-empty")).to_be_visible()
