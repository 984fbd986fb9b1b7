"""Issue 34: the collector page's Devices view in a real browser (Playwright driving the distribution's Chromium), over
a fleet fed through the real HTTP API as agents feed it: 8 devices on 4 hosts, two runs, one device at ten times the
others' fault rate. The viewer sees it first and marked significant; an operator marks it suspect from its page."""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import Collector, running_collector, testing
from playwright.sync_api import expect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BAD = "GPU-0000000a-0000-4000-8000-000000000005"


def _uuid(rank: int) -> str:
    return f"GPU-0000000a-0000-4000-8000-{rank:012d}"


def _feed(c: Collector) -> None:
    """What 8 agents send: each rank registers its device, then one interval per run."""
    agent = httpx.Client(base_url=f"{c.url}/api/v1", headers={"Authorization": f"Bearer {c.agent}"}, timeout=10)
    with agent:
        for run in range(2):
            for rank in range(8):
                device = {"uuid": _uuid(rank), "hostname": f"host-{rank // 2}", "kind": "cuda", "index": rank % 2,
                          "name": "<img src=x onerror=window.pwned=1>" if rank == 0 else "NVIDIA H200"}
                r = agent.post("/runs", json={"name": f"ui-fleet-{run}", "world_size": 8, "rank": rank,
                                              "device": device})
                assert r.status_code in (200, 201), r.text
                faults = 30 if rank == 5 else 3
                stats = {"interval_id": str(uuid.uuid4()), "rank": rank, "step_start": 0, "step_end": 99,
                         "steps": 100, "ops": [{"op": "scores", "checks": 5000, "tripwire_checks": 5000}],
                         "faults": [{"op": "scores", "kind": "inf", "detected": faults, "corrected": faults}]}
                assert agent.post(f"/runs/{r.json()['id']}/stats", json=stats).status_code == 200


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Collector, str]]:
    with running_collector("sqlite", tmp_path_factory.mktemp("ui-fleet") / "collector") as c:
        _feed(c)
        yield c, testing.make_token(c.settings, "viewer", "ui-viewer")


def _sign_in(page: Any, url: str, token: str) -> None:
    page.goto(url + "/")
    page.get_by_label("Token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#runs")).to_be_visible()
    page.get_by_role("link", name="Devices", exact=True).click()
    expect(page.locator("#devices")).to_be_visible()


def test_the_viewer_sees_the_bad_device_first_and_significant_and_cannot_mark_it(
        fleet: tuple[Collector, str], page: Any) -> None:
    c, viewer = fleet
    _sign_in(page, c.url, viewer)
    rows = page.locator("#devices-body tr")
    expect(rows).to_have_count(8)
    expect(rows.first).to_have_attribute("data-uuid", BAD)
    expect(rows.first).to_have_class("bad")
    expect(rows.first.locator(".significant")).to_have_count(1)
    expect(page.locator("#devices-body tr .significant")).to_have_count(1)
    expect(rows.first).to_contain_text("in 2 of 2 runs")
    expect(page.locator("#fleet-summary")).to_contain_text("8 with checks")
    page.get_by_role("link", name=BAD, exact=True).click()
    expect(page.locator("#device-uuid")).to_have_text(BAD)
    expect(page.locator("#device-suspicion")).to_contain_text("Significant.")
    expect(page.locator("[data-count='detected'] .value")).to_have_text("60")
    expect(page.locator("#device-runs-table tbody tr")).to_have_count(2)
    expect(page.locator("#device-form")).to_have_attribute("data-access", "read-only")
    expect(page.locator("#device-save")).to_be_disabled()
    # A device name an agent sent is text on the page, never markup.
    page.goto(f"{c.url}/#/devices/{_uuid(0)}")
    expect(page.locator("#device-meta")).to_contain_text("<img src=x onerror=window.pwned=1>")
    assert page.locator("#device-meta img").count() == 0 and page.evaluate("window.pwned") is None


def test_an_operator_marks_the_device_suspect_from_its_page(fleet: tuple[Collector, str], page: Any) -> None:
    c, _ = fleet
    _sign_in(page, c.url, c.operator)
    page.get_by_role("link", name=BAD, exact=True).click()
    expect(page.locator("#device-form")).to_have_attribute("data-access", "edit")
    page.locator("#device-status").select_option("suspect")
    page.locator("#device-reason").fill("significant on the Devices page")
    page.locator("#device-save").click()
    expect(page.locator("#device-status-result")).to_contain_text("Set to suspect (v2)")
    expect(page.locator("#device-history-table tbody tr").first).to_contain_text("e2e-operator")
    device = c.api("GET", f"/devices/{BAD}").json()
    assert (device["status"], device["status_by"], device["status_reason"]) == (
        "suspect", "e2e-operator", "significant on the Devices page")
    page.get_by_role("link", name="← all devices").click()
    expect(page.locator(f"#devices-body tr[data-uuid='{BAD}'] [data-status='suspect']")).to_have_count(1)


def test_a_status_changed_elsewhere_while_the_operator_chooses_is_not_overwritten(
        fleet: tuple[Collector, str], page: Any) -> None:
    """The page polls every 2 s. A poll that lands while the operator is choosing must neither reset the choice nor
    carry the newer version into the PATCH: the save answers 412 and the form then shows the status in force."""
    c, _ = fleet
    other = _uuid(3)
    _sign_in(page, c.url, c.operator)
    page.get_by_role("link", name=other, exact=True).click()
    expect(page.locator("#device-form")).to_have_attribute("data-access", "edit")
    expect(page.locator("#device-status")).to_have_value("ok")
    page.locator("#device-status").select_option("suspect")
    page.locator("#device-reason").fill("looked at its events")
    seen = c.api("GET", f"/devices/{other}")
    r = c.api("PATCH", f"/devices/{other}", headers={"If-Match": seen.headers["etag"]},
              json={"status": "quarantined", "reason": "second operator"})
    assert r.status_code == 200, r.text
    # The next poll shows the change in the header; the operator's choice stays as it was.
    expect(page.locator("#device-meta [data-status='quarantined']")).to_have_count(1, timeout=10_000)
    expect(page.locator("#device-status")).to_have_value("suspect")
    page.locator("#device-save").click()
    expect(page.locator("#device-status-result")).to_contain_text("412")
    expect(page.locator("#device-status-result")).to_contain_text("not saved")
    expect(page.locator("#device-status")).to_have_value("quarantined")
    device = c.api("GET", f"/devices/{other}").json()
    assert (device["status"], device["status_reason"]) == ("quarantined", "second operator")
