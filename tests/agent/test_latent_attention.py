"""Multi-head latent attention (DeepSeek-V2/V3, transformers' DeepseekV3): V's head dim differs from Q's and K's
(qk_nope_head_dim + qk_rope_head_dim against v_head_dim), and the attention call gets q, k (B, H, T, Dqk) and
v (B, H, S, Dv). Every backward of the checked attention takes one head dim (the CPU kernel's, the encoded and checked
products', the Triton kernels'); protect() crashed such a model's first backward under either scope, and tier 1's
fused call sent it to SDPA's math path, whose backward scope="all" did not check.

Here a small DeepseekV3 (two dense layers: the routed experts' top-k would turn a rounding difference into another
expert) trains under the default policy with V narrower and wider than Q and K, and faults below autograd (a
dispatch mode that knows nothing of attnchecker) and planned with attnchecker.inject hit its attention forward and
backward on full-check and tier-1 steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from dispatch_faults import ShapeFaults
from gemm_injector import FusedBackwardFault, worst_rel

import attnchecker
from attnchecker import Policy
from attnchecker.attention.backends.tiled_torch import TILE_ENV, TILED_MIN_ENV
from attnchecker.attention.backward import fused, triton_backward
from attnchecker.attention.flex import protected_flex_attention
from attnchecker.inject import Fault, FaultPlan
from attnchecker.kernels import triton_attention_bwd

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on INF and NaN

QK_HEAD_DIM = 24
"""qk_nope_head_dim 16 + qk_rope_head_dim 8."""
STEPS = 12
"""The default schedule checks everything on the first 8 clean steps, then gives the next ones tier 1."""


def _model(v_head_dim: int) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=2,
                              num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                              n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=v_head_dim, max_position_embeddings=64,
                              attention_dropout=0.0)
    return DeepseekV3ForCausalLM(config).train()


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def _step(model: torch.nn.Module, mode: Any = None, ids: torch.Tensor = IDS) -> dict[str, torch.Tensor]:
    """One forward and backward (no optimizer: every step the same function), ``mode`` active over both."""
    model.zero_grad(set_to_none=True)
    if mode is None:
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        with mode:
            model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _unprotected(v_head_dim: int) -> dict[str, torch.Tensor]:
    return _step(_model(v_head_dim))


@pytest.mark.parametrize("v_head_dim", [16, 32], ids=["v_narrower", "v_wider"])
@pytest.mark.parametrize("scope", ["attention", "all"])
def test_latent_attention_trains_under_the_default_policy_with_the_unprotected_gradients(scope: str,
                                                                                       v_head_dim: int) -> None:
    """Full-check steps, then tier-1 steps: every step's gradients are the unprotected model's, nothing is reported,
    and the attention ops were checked both ways."""
    want = _unprotected(v_head_dim)
    model = _model(v_head_dim)
    with attnchecker.protect(model, scope=scope) as guard:
        worst = []
        for _ in range(STEPS):
            worst.append(worst_rel(_step(model), want))
            guard.step()
        tiers = dict(guard.report().tier_checks)
        detections = list(guard.detections)
    assert max(worst) <= 1e-5, worst
    assert detections == []
    assert tiers.get("abft", 0) > 0 and tiers.get("tripwire", 0) > 0, tiers


def _quiet_guard(model: torch.nn.Module, **kwargs: Any) -> attnchecker.Guard:
    """The model protected under scope="all" and stepped (clean) to the default schedule's first step that checks
    neither the whole step nor the attention forward in full."""
    guard = attnchecker.protect(model, scope="all", **kwargs)
    for _ in range(16):
        cfg = guard.check_config
        if not (cfg.checks("out") or cfg.checks("scores") or cfg.checks("context")):
            return guard
        _step(model)
        guard.step()
    guard.close()
    raise AssertionError("the default schedule checked the step in full on 16 steps running")


@pytest.mark.parametrize("v_head_dim", [16, 32], ids=["v_narrower", "v_wider"])
@pytest.mark.parametrize("quiet", [False, True], ids=["checked_step", "tier1_step"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["dQ", "dK", "dV"])
def test_a_fault_in_the_latent_attention_backward_is_corrected(which: int, quiet: bool, v_head_dim: int) -> None:
    """scope="all": INF, NaN or 1e20 written into the fused CPU kernel's dQ, dK or dV (the padded kernel's real
    columns) on the first step, which checks the backward in full, or on a tier-1 step: reported on that gradient
    and repaired, the step's gradients the clean step's."""
    want = _unprotected(v_head_dim)
    model = _model(v_head_dim)
    guard = _quiet_guard(model) if quiet else attnchecker.protect(model, scope="all")
    with guard:
        real = v_head_dim if which == 2 else QK_HEAD_DIM
        fault = FusedBackwardFault(call=1, which=which, kind=("inf", "nan", "near_inf")[which], element=29,
                                   head_dims=real)
        got = _step(model, fault)
        guard.step()
        detections = [(d.op, d.tier, d.action) for d in guard.detections]
    assert fault.hit, "no fused attention backward ran"
    op = ("grad_q", "grad_k", "grad_v")[which]
    assert [d[:2] for d in detections] == [(op, "tripwire" if quiet else "abft")], detections
    assert all(action in ("corrected", "recomputed") for _, _, action in detections), detections
    assert worst_rel(got, want) <= 1e-5


@pytest.mark.parametrize("v_head_dim", [16, 32], ids=["v_narrower", "v_wider"])
@pytest.mark.parametrize("value", ["inf", "nan", "bitflip"])
def test_a_fault_in_the_fused_forward_on_a_tier1_step_is_recomputed(value: str, v_head_dim: int) -> None:
    """Tier 1's fused CPU attention (the call padded to one head dim) hit below autograd in layer 0's output: the
    tripwire catches it, the checked path computes the call again (V's head dim its own), and the gradients are the
    clean step's."""
    want = _unprotected(v_head_dim)
    model = _model(v_head_dim)
    with _quiet_guard(model) as guard:
        mode = ShapeFaults(model, target=0, value=value, seed=5,
                           ops=frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}))
        with mode.active():
            got = _step(model)
        guard.step()
        detections = [(d.op, d.layer, d.tier, d.action) for d in guard.detections]
    assert mode.hit is not None and mode.hit.shape[-1] == max(QK_HEAD_DIM, v_head_dim)
    assert [d[:3] for d in detections] == [("context", 0, "tripwire")], detections
    assert detections[0][3] in ("corrected", "recomputed"), detections
    assert worst_rel(got, want) <= 1e-5


@pytest.mark.parametrize("v_head_dim", [16, 32], ids=["v_narrower", "v_wider"])
@pytest.mark.parametrize(("route", "forward"), [("cpu_kernel", "unfused"), ("cpu_kernel", "tiled"),
                                                ("products", "unfused"), ("products", "tiled"), ("triton", "unfused")])
def test_planned_faults_in_the_latent_attention_are_corrected_on_every_route(route: str, forward: str,
                                                                            v_head_dim: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """attnchecker.inject's faults in S, CL, dV and dQ, steps 1 and 2 of tier 1 for the forward and the backward
    in full (``_planned_run``). Routes: the CPU kernel's; the branch a GPU call the Triton attention declines takes
    (the checked backends, tier 1 included), its backward in the checked PyTorch products or in the Triton kernels
    (interpreter). Forward: the unfused path, or the tile loop (long contexts). Each fault is in the ground truth,
    reported on its op and corrected, and the gradients are the clean step's."""
    if route == "triton" and not triton_attention_bwd.available():
        pytest.skip("the Triton kernels cannot run here (no CUDA, interpreter off)")
    if route != "cpu_kernel":
        monkeypatch.setattr(fused, "cpu_kernel", False)
    monkeypatch.setenv(triton_backward.BACKWARD_ENV, "torch" if route == "products" else "auto")
    if forward == "tiled":
        monkeypatch.setenv(TILED_MIN_ENV, "1")  # auto takes the tile loop from T·S = 1 (the native pass declines)
    run = _planned_run(_model(v_head_dim), _unprotected(v_head_dim))
    assert run.backends == {forward}, run.backends
    assert run.injected == run.detections == PLANNED, (run.injected, run.detections)
    assert run.actions <= {"corrected", "recomputed"}, run.actions
    assert max(run.worst) <= 1e-5, run.worst


PLANNED = [("scores", 0, 0), ("context", 1, 0), ("grad_v", 0, 1), ("grad_q", 1, 2)]
"""(op, layer, step) of ``_planned_run``'s faults."""


@dataclass
class _Run:
    worst: list[float]
    """Each step's worst relative gradient difference from the clean step's (``worst_rel``)."""
    injected: list[tuple[str, int, int]]
    detections: list[tuple[str, int, int]]
    actions: set[str]
    backends: set[str]
    """The checked attention backends that ran."""


def _planned_run(model: torch.nn.Module, want: dict[str, torch.Tensor], ids: torch.Tensor = IDS) -> _Run:
    """Three steps under protect(scope="all"), a fixed schedule that checks the attention forward on step 0 only
    and the whole step on every step, and a fault plan: INF in S and NaN in CL on step 0, near-INF in dV on step 1,
    INF in dQ on step 2 (``PLANNED``)."""
    plan = FaultPlan([Fault(op="scores", layer=0, step=0, kind="inf", row=5, col=3, seed=1),
                      Fault(op="context", layer=1, step=0, kind="nan", row=7, col=2, seed=2),
                      Fault(op="grad_v", layer=0, step=1, kind="near_inf", row=4, col=6, seed=3),
                      Fault(op="grad_q", layer=1, step=2, kind="inf", row=9, col=1, seed=4)])
    policy = Policy(adaptive=False, op_periods={"scores": 1000, "context": 1000})
    with attnchecker.protect(model, scope="all", policy=policy, faults=plan) as guard:
        worst = []
        for _ in range(3):
            worst.append(worst_rel(_step(model, ids=ids), want))
            guard.step()
        return _Run(worst=worst, injected=[(i.op, i.layer, i.step) for i in guard.injector.injected],
                    detections=[(d.op, d.layer, d.step) for d in guard.detections],
                    actions={d.action for d in guard.detections},
                    backends={name for (_, name) in guard.coverage.backends})


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the forward reference
@pytest.mark.parametrize("v_head_dim", [16, 32], ids=["v_narrower", "v_wider"])
def test_a_flex_call_with_its_own_value_head_dim_is_flex_attentions_function(make_ctx, v_head_dim: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """FlexAttention takes V's head dim apart from Q's (torchtitan's DeepSeek-V3 calls it so): the checked call
    (the tile loop, 32 × 32 tiles) gives flex_attention's output and the math gradients, and corrects a fault in
    its context."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setenv(TILE_ENV, "32")
    b, h, t = 2, 2, 64
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(b, h, t, QK_HEAD_DIM, generator=gen) for _ in range(2))
    v = torch.randn(b, h, t, v_head_dim, generator=gen)
    block_mask = create_block_mask(lambda _b, _h, i, j: i >= j, None, None, t, t, device="cpu", BLOCK_SIZE=32)
    want = flex_attention(q, k, v, block_mask=block_mask)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=causal).square().sum().backward()
    ctx, rec = make_ctx([Fault(op="context", layer=0, step=0, kind="inf", row=40, col=v_head_dim - 1, seed=1)])
    got_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    got = protected_flex_attention(*got_leaves, ctx=ctx, block_mask=block_mask)
    got.square().sum().backward()
    assert got.shape == (b, h, t, v_head_dim)
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
    for name, a, r in zip("qkv", got_leaves, leaves, strict=True):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")
    assert [d.op for d in rec.detections] == ["context"], rec.detections
    assert rec.detections[0].action in ("corrected", "recomputed"), rec.detections


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_latent_attention_is_checked_and_its_faults_corrected() -> None:
    """On CUDA in bf16, the default backends: the Triton attention declines V's own head dim, and the checked
    backends take the call, its tier-1 steps included, so that the backward gets the step's check (the Triton
    kernels on the padded operands). The fixed schedule and plan of the CPU test; gradients within bf16's 2e-2 of the
    clean step's."""
    model = _model(16).to(device="cuda", dtype=torch.bfloat16)
    ids = IDS.cuda()
    run = _planned_run(model, _step(model, ids=ids), ids)
    assert run.injected == run.detections == PLANNED, (run.injected, run.detections)
    assert run.actions <= {"corrected", "recomputed"}, run.actions
    assert max(run.worst) <= 2e-2, run.worst
