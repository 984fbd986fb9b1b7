"""checks.ratio_histogram: the clean ratios kept and folded in at the first read give the histogram, sums and per-op
maxima that folding each check in as it came gives, whatever the mix of ops, non-finite ratios and reads between."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.checks.context import LayerContext, OpStats, Runtime
from attnchecker.checks.ratio_histogram import RESIDUAL_RATIO_BUCKETS, RatioHistogram
from attnchecker.checks.records import _record_ratio

OPS = ("linear", "linear_dx", "q", "grad_probs")
EDGES_FP32 = torch.tensor(RESIDUAL_RATIO_BUCKETS, dtype=torch.float32).tolist()
"""The bucket edges as the device compares them (fp32): 0.001 rounds up there."""
ratio = st.one_of(st.floats(0.0, 2000.0, width=32), st.sampled_from([math.inf, math.nan, 0.0, 1.0, 1000.0]))
# One check's ratios: a scalar with one op (or none), or a vector with one op, one op per ratio, or none.
check = st.one_of(
    st.tuples(ratio.map(lambda r: [r]), st.one_of(st.none(), st.sampled_from(OPS)), st.just(True)),
    st.lists(ratio, min_size=1, max_size=5).flatmap(lambda rs: st.tuples(
        st.just(rs), st.one_of(st.none(), st.sampled_from(OPS), st.lists(st.sampled_from(OPS), min_size=len(rs),
                                                                            max_size=len(rs))), st.just(False))),
)


def one_at_a_time(checks: list) -> tuple[list[int], float, int, dict[str, float]]:
    """The histogram as each check's fold made it: bucket counts, sum and count of the finite ratios, per-op max."""
    counts = [0] * (len(RESIDUAL_RATIO_BUCKETS) + 1)
    total, count, top = 0.0, 0, {}
    for ratios, op, _ in checks:
        names = [op] * len(ratios) if op is None or isinstance(op, str) else op
        for r, name in zip(ratios, names, strict=True):
            finite = math.isfinite(r)
            kept = r if finite else 0.0
            if finite:
                counts[sum(kept > edge for edge in EDGES_FP32)] += 1
                total += kept
                count += 1
            if name is not None:
                top[name] = max(top.get(name, 0.0), kept)
    return counts, total, count, top


@given(st.lists(check, min_size=1, max_size=12), st.sets(st.integers(0, 11)))
@settings(max_examples=150, deadline=None)
def test_folded_at_read_equals_folded_per_check(checks: list, reads_after: set[int]) -> None:
    hist = RatioHistogram()
    for i, (ratios, op, scalar) in enumerate(checks):
        worst = torch.tensor(ratios[0] if scalar else ratios, dtype=torch.float32)
        hist.add(worst, op)
        if i in reads_after:  # a read mid-interval folds what is pending; later adds fold on top of it
            _ = hist.counts
    counts, total, count, top = one_at_a_time(checks)
    assert hist.counts is not None and hist.total is not None and hist.count is not None
    assert hist.counts.tolist() == counts
    assert int(hist.count) == count
    assert float(hist.total) == pytest.approx(total, rel=1e-6, abs=1e-9)
    assert {op: float(t) for op, t in hist.maxima.items()} == pytest.approx(top, rel=1e-7)
    assert all(t.dtype == torch.float32 and t.dim() == 0 for t in hist.maxima.values())


def test_empty_until_a_ratio_is_added() -> None:
    hist = RatioHistogram()
    assert hist.counts is None and hist.total is None and hist.count is None and hist.maxima == {}


def test_a_ratio_is_what_the_check_computed_when_it_was_added() -> None:
    """Folded at the read, a ratio must still be the value the check added: a caller reusing its buffer after the
    add does not change the histogram."""
    hist = RatioHistogram()
    worst = torch.tensor([0.2, 0.3])
    hist.add(worst, "linear")
    worst.fill_(5.0)
    assert float(hist.maxima["linear"]) == pytest.approx(0.3)
    assert hist.counts is not None and hist.counts.tolist() == [0, 0, 0, 2, 0, 0, 0, 0]


def test_op_names_must_match_the_ratios() -> None:
    with pytest.raises(ValueError, match="2 op names for 3 ratios"):
        RatioHistogram().add(torch.zeros(3), ["q", "k"])


def test_stats_read_through_the_engine_record() -> None:
    """The fields the stream and the benches read (residual_counts, _sum, _count, _max) see what _record_ratio
    added, with no explicit flush."""
    stats = OpStats()
    ctx = LayerContext(layer=0, runtime=Runtime(stats=stats))
    _record_ratio(ctx, torch.tensor([0.05, math.nan, 0.7]), ["linear", "linear_dx", "linear"])
    _record_ratio(ctx, torch.tensor(0.002), "q")
    assert stats.residual_counts is not None
    assert stats.residual_counts.tolist() == [0, 1, 1, 0, 1, 0, 0, 0]
    assert int(stats.residual_count) == 3
    assert float(stats.residual_sum) == pytest.approx(0.752)
    assert {op: float(t) for op, t in stats.residual_max.items()} == pytest.approx(
        {"linear": 0.7, "linear_dx": 0.0, "q": 0.002})
