"""The tolerance-margin panel (issue 13): threshold ÷ clean residual, from the same histogram as the residual panel."""
from __future__ import annotations

from dashboard_queries import iter_panels, load_dashboards


def _margin_panel() -> dict:
    [dashboard] = [d for _, d in load_dashboards() if d["uid"] == "attnchecker-overview"]
    [panel] = [p for p in iter_panels(dashboard) if p["title"] == "Tolerance margin"]
    return panel


def test_margin_panel_inverts_quantiles_of_the_residual_histogram() -> None:
    panel = _margin_panel()
    exprs = [t["expr"] for t in panel["targets"]]
    assert len(exprs) == 2
    for expr, q in zip(exprs, ("0.99", "0.5"), strict=True):
        assert expr.startswith(f"1 / histogram_quantile({q}, ")
        assert "attnchecker_checksum_residual_ratio_bucket" in expr


def test_margin_panel_turns_red_below_two() -> None:
    steps = _margin_panel()["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0]["color"] == "red"
    assert steps[1] == {"color": "transparent", "value": 2}
