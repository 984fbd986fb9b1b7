"""The dashboard's forward/backward split (issue 17), of detections and of checks: each panel's two queries name every
op a fault event or a stats row may carry, each in exactly one phase, so no whole-step op falls out of the split when
the vocabulary grows."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

schemas = pytest.importorskip("attnchecker_server.schemas")

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "json" / "attnchecker-overview.json"


@pytest.mark.parametrize("title", ["Detections by phase", "Checks by phase"])
def test_phase_panel_splits_every_fault_op_into_forward_or_backward(title: str) -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panel = next(p for p in panels if p["title"] == title)
    ops = {}
    for target in panel["targets"]:
        match = re.search(r'op=~"([^"]+)"', target["expr"])
        assert match, target["expr"]
        ops[target["legendFormat"].split(",")[0]] = set(match.group(1).split("|"))
    assert set(ops) == {"forward", "backward"}
    assert not ops["forward"] & ops["backward"]
    assert ops["forward"] | ops["backward"] == set(schemas.FAULT_OPS)
    assert set(schemas.OPS) <= ops["forward"]
