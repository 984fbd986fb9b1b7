"""Property-based API fuzzing from the live collector's own OpenAPI schema (a real uvicorn process), with a valid
operator token, and every response check schemathesis has on: no 5xx, every status code documented, bodies and
headers as documented, content types, and the auth checks (the same request without a token must be refused)."""

import re
from typing import Any

import httpx
import pytest
from collector_testing import run_collector
from hypothesis import HealthCheck, given, settings
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import ignored_auth
from server_helpers import Api, make_batch

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES_PER_OPERATION = 45
MIN_REQUESTS = 500


# Rules JSON Schema cannot state (they relate fields to each other or to stored state): a schema-valid request may
# break them, and then the 422 naming them is the right answer, not a rejected valid request (ST202).
UNSCHEMATIC_RULES = [
    r"min_period \(\d+\) must be <= max_period",
    r"step_end \(\d+\) is before step_start",
    r"residual_ratio\.counts has \d+ entries",
    r"residual_ratio\.le must be strictly increasing",
    r"the same event id appears twice in one batch",
    r"takes the run's total",  # counter headroom against the stored totals
    r"rank \(\d+\) must be below world_size",  # a registration that names its device
    r"If-Match version \d+ is stale",  # a well-formed ETag of a version that is not current (412; keep it last)
]


def _only_unschematic_rejections(exc: Any, response: httpx.Response) -> bool:
    if any(getattr(f, "code", None) != "ST202" for f in exc.exceptions):
        return False
    if response.status_code == 412:  # its detail is one string
        return bool(re.search(UNSCHEMATIC_RULES[-1], response.json()["detail"]))
    if response.status_code != 422:
        return False
    return all(any(re.search(rule, e["msg"]) for rule in UNSCHEMATIC_RULES) for e in response.json()["detail"])


def _real_cursors(api: Api, run_id: str) -> dict[str, str]:
    """A next_cursor from each paginated list, issued by this server."""
    api.register("fuzz-other")
    events = make_batch(n=3)
    api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=events, headers=api.headers("agent"))
    viewer = api.headers("viewer")
    runs = api.client.get("/api/v1/runs?limit=1", headers=viewer).json()["next_cursor"]
    page = api.client.get(f"/api/v1/runs/{run_id}/events?limit=1", headers=viewer).json()["next_cursor"]
    assert runs and page
    return {"runs": runs, "events": page}


@pytest.mark.slow
def test_generated_requests_pass_every_response_check(api: Api) -> None:
    run_id = api.register("fuzz-target")["id"]
    cursors = _real_cursors(api, run_id)
    # The operator may write to every run, so generated writes into the real run are accepted, not refused.
    headers = api.headers("operator")
    sent = 0
    failures: list[str] = []
    examples: list[str] = []
    with run_collector(api.settings, migrate_first=False) as collector, httpx.Client(timeout=30) as client:
        schema = schemathesis.openapi.from_url(f"{collector.url}/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()

            @given(case=operation.as_strategy())
            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def exercise(case: Any) -> None:
                nonlocal sent
                # Half the cases hit the real run, so the fuzzer gets past the 404 of a random run id.
                if case.path_parameters and "run_id" in case.path_parameters and sent % 2 == 0:
                    case.path_parameters["run_id"] = run_id
                # Cursors are opaque: any string is schema-valid, only the server's own are accepted. The fuzzer
                # pages with real ones (forged cursors are test_input_bounds' job).
                if case.query and "cursor" in case.query:
                    case.query["cursor"] = cursors["events" if case.path.endswith("/events") else "runs"]
                # Sent with httpx: schemathesis' own requests transport breaks on urllib3 >= 2.8's pool.
                kwargs = case.as_transport_kwargs(base_url=collector.url, headers=headers)
                response = client.request(
                    kwargs["method"],
                    kwargs["url"],
                    headers=kwargs.get("headers"),
                    params=kwargs.get("params"),
                    json=kwargs.get("json"),
                    content=kwargs.get("data"),
                )
                sent += 1
                where = f"{case.method} {case.formatted_path} -> {response.status_code}"
                try:
                    case.validate_response(
                        response, headers=headers, transport_kwargs=kwargs, excluded_checks=[ignored_auth]
                    )
                except FailureGroup as exc:
                    if _only_unschematic_rejections(exc, response):
                        return
                    codes = sorted({line.strip() for line in str(exc).splitlines() if line.strip().startswith("- ")})
                    failures.append(f"{case.method} {case.path} {' '.join(codes)}")
                    if "events:batch" not in case.path:
                        examples.append(f"{where}: {exc}"[:1500])
                # ignored_auth, done here: schemathesis re-sends its probe through its requests transport, which
                # breaks on urllib3 >= 2.8. The same request without the token must be refused, and refused as 401.
                if not case.operation.definition.raw.get("security"):
                    return  # /healthz, /readyz: open by design
                unauthenticated = {k: v for k, v in kwargs["headers"].items() if k.lower() != "authorization"}
                probe = client.request(
                    kwargs["method"],
                    kwargs["url"],
                    headers=unauthenticated,
                    params=kwargs.get("params"),
                    json=kwargs.get("json"),
                    content=kwargs.get("data"),
                )
                if probe.status_code != 401 and not (probe.status_code == 413 and response.status_code == 413):
                    failures.append(f"{where}: without a token it answered {probe.status_code}, not 401")

            exercise()

    assert not failures, "\n".join(sorted(set(failures))) + "\n\nfirst ones:\n" + "\n\n".join(examples[:3])
    assert sent >= MIN_REQUESTS, f"only {sent} generated requests"
