"""The engine's cached tensors (causal masks, checksum weights, histogram edges) belong to the live guards: closing
the last one, or unprotect() of the last protected model, empties them, so a run's masks (~2 GiB at 8k context on
the GPU) do not outlive it; closing one of several leaves them to the others."""

from __future__ import annotations

import gc
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnchecker
from attnchecker import Policy
from attnchecker.abft import checksum_weights
from attnchecker.checks.caches import _future_mask, engine_caches, fill_future_

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import batch, build, loss_of

ARCH = "nanogpt"  # causal self-attention: the checked path builds its future mask


@pytest.fixture(autouse=True)
def _no_other_live_guard() -> None:
    """The caches go with the last live guard, so these tests need theirs to be the only ones. Earlier tests in the
    same process can leave a guard open (protected without close(), its model still referenced): it is closed here,
    after a collection has dropped those whose models are gone."""
    from attnchecker.runtime.guard import _GUARDS

    gc.collect()
    for guard in list(_GUARDS.values()):
        guard.close()
    assert not _GUARDS


def _checked_forward(model: torch.nn.Module) -> None:
    loss_of(ARCH, model, batch(ARCH, 0)).backward()


def test_unprotect_releases_the_engine_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    # The unfused path's causal forward is the one that caches its future mask (the native pass masks in C).
    monkeypatch.setenv("ATTNCHECKER_ATTENTION", "unfused")
    model = build(ARCH)
    engine_caches.clear()
    attnchecker.protect(model, policy=Policy(period=1, adaptive=False))
    _checked_forward(model)
    assert _future_mask.cache_info().currsize > 0, "a causal checked forward caches its future mask"
    assert engine_caches.entries() > 0
    assert attnchecker.unprotect(model)
    assert engine_caches.entries() == 0
    assert _future_mask.cache_info().currsize == 0


def test_guard_close_releases_the_caches_and_a_new_guard_refills_them() -> None:
    model = build(ARCH)
    with attnchecker.protect(model, policy=Policy(period=1, adaptive=False)):
        _checked_forward(model)
        assert engine_caches.entries() > 0
    assert engine_caches.entries() == 0
    with attnchecker.protect(model, policy=Policy(period=1, adaptive=False)) as guard:
        _checked_forward(model)
        assert engine_caches.entries() > 0
        assert guard.report().checks["scores"] > 0
    assert engine_caches.entries() == 0


def test_closing_one_of_two_guards_leaves_the_caches_to_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models protected in one process (a teacher and a student, an EMA copy, a benchmark's jobs): closing one
    guard must not empty what the other still uses, or that one rebuilds its masks and checksum weights on its next
    checked step. Closing the last one empties them."""
    monkeypatch.setenv("ATTNCHECKER_ATTENTION", "unfused")  # the path that caches its future mask
    engine_caches.clear()
    first, second = build(ARCH), build(ARCH)
    guard_1 = attnchecker.protect(first, policy=Policy(period=1, adaptive=False))
    guard_2 = attnchecker.protect(second, policy=Policy(period=1, adaptive=False))
    _checked_forward(first)
    _checked_forward(second)
    held = engine_caches.entries()
    assert held > 0 and _future_mask.cache_info().currsize > 0
    guard_1.close()
    assert engine_caches.entries() == held, "closing one guard emptied the caches another live guard uses"
    misses = (checksum_weights.cache_info().misses, _future_mask.cache_info().misses)
    _checked_forward(second)
    assert guard_2.report().checks["scores"] > 0
    assert (checksum_weights.cache_info().misses, _future_mask.cache_info().misses) == misses, \
        "the live guard rebuilt cached tensors after the other guard closed"
    guard_2.close()
    assert engine_caches.entries() == 0


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 300), s=st.integers(1, 300), row0=st.integers(0, 300), lead=st.sampled_from([(), (2,), (2, 3)]),
       value=st.sampled_from([0.0, -math.inf]))
def test_fill_future_sets_exactly_the_future_keys(t: int, s: int, row0: int, lead: tuple[int, ...],
                                                  value: float) -> None:
    """fill_future_ (the causal masking of the verified forward and of the checked backward's blocks) against the
    plain masked_fill_ with the (T, S) future mask: rows row0..row0+T of a top-left-aligned causal attention,
    every key j > i set whatever it held (an INF or NaN there too), the rest untouched."""
    x = torch.randn(*lead, t, s, generator=torch.Generator().manual_seed(t * 1000 + s))
    x[..., ::7, ::5] = math.inf
    rows = torch.arange(row0, row0 + t)[:, None]
    want = x.masked_fill(torch.arange(s)[None, :] > rows, value)
    assert torch.equal(fill_future_(x, value, row0=row0), want)
