"""The dashboard's forward/backward split (issue 17): its two queries name every op a fault event may carry, each in
exactly one phase, so no whole-step op falls out of the split when the vocabulary grows."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

schemas = pytest.importorskip("attnchecker_server.schemas")

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "json" / "attnchecker-overview.json"


def test_phase_panel_splits_every_fault_op_into_forward_or_backward() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panel = next(p for p in panels if p["title"] == "Detections by phase")
    ops = {}
    for target in panel["targets"]:
        match = re.search(r'op=~"([^"]+)"', target["expr"])
        assert match, target["expr"]
        ops[target["legendFormat"]] = set(match.group(1).split("|"))
    assert set(ops) == {"forward", "backward"}
    assert not ops["forward"] & ops["backward"]
    assert ops["forward"] | ops["backward"] == set(schemas.FAULT_OPS)
    assert set(schemas.OPS) <= ops["forward"]
