"""The wire contract for whole-step protection (protect(scope="all")): events and fault stats of the Linear GEMMs
(ops ``linear``, ``linear_dx``, ``linear_dw``) validate against the collector's schemas, and a run registered with
them still validates. Faults come from a TorchDispatchMode below autograd, so the backward GEMMs are hit too."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import attnchecker
from attnchecker import Policy

schemas = pytest.importorskip("attnchecker_server.schemas")

SCHEMA_OF = {"run": schemas.RunRegisterIn, "events": schemas.EventBatchIn, "stats": schemas.StatsIn,
             "finish": schemas.RunFinishIn}


class _InfInto(TorchDispatchMode):
    """Writes INF into element 5 of the listed occurrences of mm/addmm/bmm outputs by shape (shape -> {n, ...},
    counted from 0)."""

    def __init__(self, shapes: dict[tuple[int, ...], set[int]]) -> None:
        super().__init__()
        self.todo = dict(shapes)
        self.seen: dict[tuple[int, ...], int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        gemms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        if func in gemms and tuple(out.shape) in self.todo:
            shape = tuple(out.shape)
            n = self.seen.get(shape, 0)
            if n in self.todo[shape]:
                out.view(-1)[5] = float("inf")
            self.seen[shape] = n + 1
        return out


class _Attn(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.reshape(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


def test_whole_step_events_and_stats_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention backward's checked products (its full check off the CPU, and the encoded kernel's recovery) are
    hit here; the encoded kernel's own events are the next test's."""
    from attnchecker.attention.backward import encoded

    monkeypatch.setattr(encoded, "enabled", False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), _Attn(), nn.Linear(32, 48), nn.Linear(48, 64)).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = attnchecker.protect(model, policy=Policy.full(), optimizer=opt, run="whole-step", collector="offline",
                                spool_dir=tmp_path, scope="all")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    # Tokens M = 32: the head's forward (32, 64), its weight gradient (64, 48) and its input gradient dX = dY W
    # (32, 48): the second GEMM of that shape, after the hidden layer's forward output. Attention (B·H = 4, T = S =
    # D = 16): every product is (4, 16, 16); the forward's scores and context come first, then the backward's S, dP,
    # dV, dQ, dK.
    with _InfInto({(32, 64): {0}, (64, 48): {0}, (32, 48): {1}, (4, 16, 16): {2, 3, 4, 5, 6}}):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1)).backward()
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    guard.close(flush_timeout_s=5.0)
    records = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    for r in records:
        SCHEMA_OF[r["kind"]].model_validate_json(json.dumps(r["body"]))
    events = [e for r in records if r["kind"] == "events" for e in r["body"]["events"]]
    ops = {"linear", "linear_dx", "linear_dw", "scores_bwd", "grad_probs", "grad_v", "grad_q", "grad_k"}
    assert {(e["op"], e["action"]) for e in events} == {(op, "corrected") for op in ops}
    faults = [f for r in records if r["kind"] == "stats" for f in r["body"]["faults"]]
    assert {f["op"] for f in faults} == ops
    assert set(schemas.FAULT_OPS) >= {e["op"] for e in events}
    # Their checks are on the wire too, a row per op beside the attention ops' (not only in the run's check time).
    rows = [o for r in records if r["kind"] == "stats" for o in r["body"]["ops"]]
    assert {o["op"] for o in rows if o["checks"] and o["abft_catches"]} == ops
    assert {o["op"] for o in rows} <= set(schemas.FAULT_OPS)


class _InfIntoFusedBackward(TorchDispatchMode):
    """INF into element 3 of each output (dQ, dK, dV) of the first fused CPU attention backward."""

    def __init__(self) -> None:
        super().__init__()
        self.hit = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default and not self.hit:
            for grad in out:
                grad[0, 0, 1, 3] = float("inf")
            self.hit = True
        return out


def test_encoded_attention_backward_events_and_stats_validate(tmp_path: Path) -> None:
    """The full check of the attention backward on the CPU: the fused kernel on checksum-encoded operands. Its flags
    are recomputed (through the checked products) and reported as such, per output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), _Attn(), nn.Linear(32, 64)).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = attnchecker.protect(model, policy=Policy.full(), optimizer=opt, run="encoded", collector="offline",
                                spool_dir=tmp_path, scope="all")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    fault = _InfIntoFusedBackward()
    with fault:
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1)).backward()
    opt.step()
    assert fault.hit and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    guard.close(flush_timeout_s=5.0)
    records = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    for r in records:
        SCHEMA_OF[r["kind"]].model_validate_json(json.dumps(r["body"]))
    events = [e for r in records if r["kind"] == "events" for e in r["body"]["events"]]
    assert {(e["op"], e["action"]) for e in events} == {(op, "recomputed") for op in ("grad_q", "grad_k", "grad_v")}
    assert set(schemas.FAULT_OPS) >= {e["op"] for e in events}


def test_the_agents_whole_step_vocabulary_is_the_collectors() -> None:
    """One list on each side of the wire (policy.WHOLE_STEP_OPS, schemas.FAULT_OPS), and every op the engine names
    in its events and stats is in it."""
    from attnchecker.attention.backward.checked import BACKWARD_OPS
    from attnchecker.attention.backward.encoded import ENCODED_OPS
    from attnchecker.gemm.linear import GEMM_OPS
    from attnchecker.policy import OPS, WHOLE_STEP_OPS

    assert WHOLE_STEP_OPS == (*GEMM_OPS, *BACKWARD_OPS)
    assert set(ENCODED_OPS) <= set(BACKWARD_OPS)
    assert schemas.FAULT_OPS == (*OPS, *WHOLE_STEP_OPS)
