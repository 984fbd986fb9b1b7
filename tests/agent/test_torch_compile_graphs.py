"""A protected model compiles to as many graphs, with as many breaks, as the unprotected one (issue 35): every checked
op is a torch.library custom op while Dynamo traces (attnchecker/compiled/), so nothing of the engine cuts the graph.

Counted by ``torch._dynamo.explain`` over one training forward, loss included (transformers' loss breaks GPT-2's graph
once, protected or not), in train mode, under the default policy and both scopes; and over torchtitan's Llama 3 with
its SDPA inner attention compiled per block, as torchtitan compiles it."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from model_zoo import batch, build, loss_of

import attnchecker


def _explain(fn: Any) -> tuple[int, int, list[str], set[str]]:
    """(graphs, breaks, break reasons, the attnchecker ops in the graphs)."""
    torch._dynamo.reset()
    try:
        got = torch._dynamo.explain(fn)()
    finally:
        torch._dynamo.reset()
    ops = {str(node.target).split(".")[1] for g in got.graphs for node in g.graph.nodes
           if node.op == "call_function" and str(node.target).startswith("attnchecker.")}
    return got.graph_count, got.graph_break_count, [r.reason for r in got.break_reasons], ops


@functools.cache
def _unprotected(arch: str) -> tuple[int, int]:
    model, b = build(arch), batch(arch, 0)
    graphs, breaks, _, _ = _explain(lambda: loss_of(arch, model, b))
    return graphs, breaks


@pytest.mark.parametrize("scope", ["attention", "all"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_a_protected_hf_model_compiles_to_the_unprotected_graphs(arch: str, scope: str) -> None:
    model, b = build(arch), batch(arch, 0)
    with attnchecker.protect(model, scope=scope):
        graphs, breaks, reasons, ops = _explain(lambda: loss_of(arch, model, b))
    assert (graphs, breaks) == _unprotected(arch), reasons
    # The checks are in the graphs, not skipped.
    assert ops == {"attention", "projection_check"} | ({"linear"} if scope == "all" else set())


@pytest.mark.parametrize("scope", [None, "attention", "all"])
def test_a_protected_torchtitan_block_compiles_to_one_graph(scope: str | None) -> None:
    """torchtitan's ScaledDotProductAttention variant, each block on its own as torchtitan compiles it: one graph, no
    break, as unprotected."""
    import test_integrations_torchtitan as tt

    model = tt.build(layers=1, sdpa=True)
    guard = attnchecker.protect(model, scope=scope) if scope else None
    block = next(iter(model.layers.values()))
    x = model.tok_embeddings(tt.TOKENS[:, :-1]).detach().requires_grad_()
    try:
        graphs, breaks, reasons, ops = _explain(lambda: block(x, None, tt.POSITIONS).sum())
    finally:
        if guard is not None:
            guard.close()
    assert (graphs, breaks) == (1, 0), reasons
    want = set() if scope is None else {"attention", "projection_check"} | ({"linear"} if scope == "all" else set())
    assert ops == want


def test_a_protected_torchtitan_block_compiles_with_fullgraph() -> None:
    """torchtitan's apply_compile compiles each block with fullgraph=True: a protected block trains that way."""
    import test_integrations_torchtitan as tt

    model = tt.build(layers=1, sdpa=True)
    block = next(iter(model.layers.values()))
    x = model.tok_embeddings(tt.TOKENS[:, :-1]).detach().requires_grad_()
    want = block(x, None, tt.POSITIONS)
    want.sum().backward()
    want_grad, x.grad = x.grad, None
    torch._dynamo.reset()
    try:
        with attnchecker.protect(model) as guard:
            got = torch.compile(block, backend="aot_eager", fullgraph=True)(x, None, tt.POSITIONS)
            got.sum().backward()
            checks, detections = guard.report().checks, list(guard.detections)
    finally:
        torch._dynamo.reset()
    assert checks["scores"] == checks["context"] == 1  # checked inside the one graph, not skipped
    assert detections == []
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, want_grad)
