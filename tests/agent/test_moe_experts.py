"""protect(scope="all") on mixture-of-experts models: the expert banks of transformers' MoE classes (3-D parameters,
no Linear layers: integrations/moe_experts.py) are checked as the Linear GEMMs are.

Small Mixtral (F.linear over (E, O, I) banks), Qwen3-MoE, DeepSeek-V3 and gpt-oss (x @ W[e] + b[e] over transposed
(E, I, O) banks with biases), four experts, two per token, the routed experts' intermediate size 40 (in Mixtral and
gpt-oss no other GEMM has a dimension of 40 or 80, which is how the tests tell an expert's GEMM). An injector below
autograd that knows nothing of attnchecker (gemm_injector.GemmInjector) corrupts one output element of one expert GEMM
(forward, dX or dW), each in its own run: on the first step (checked in full) and on a quiet step of the default
policy (tier 1)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from gemm_injector import GemmCall, GemmInjector, is_model_gemm, worst_rel

import attnchecker
from attnchecker.gemm import device
from attnchecker.kernels import triton_gemm_check

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on INF and NaN

EXPERT_DIMS = (40, 80)
"""The routed experts' intermediate size and its gate/up width."""
HIDDEN = 64
KINDS = ("inf", "nan", "near_inf", "bitflip")
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def _model(arch: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    common: dict[str, Any] = {"vocab_size": 128, "hidden_size": HIDDEN, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                              "num_experts_per_tok": 2}
    if arch == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=40, num_local_experts=4)).train()
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=40,
                                                        head_dim=16, num_experts=4)).train()
    if arch == "deepseek_v3":
        # Both layers MoE (first_k_dense_replace 0), with the shared expert (a Linear MLP) and latent attention.
        # Latent attention expands K and V to every query head.
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=40,
            n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
            kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)).train()
    if arch == "gpt_oss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(**common, intermediate_size=40, head_dim=16, num_local_experts=4,
                                                    layer_types=["full_attention"] * 2)).train()
    raise ValueError(arch)


def _step(model: torch.nn.Module, mode: GemmInjector | None = None) -> dict[str, torch.Tensor]:
    """One forward and backward (no optimizer: every step the same function), ``mode`` over both."""
    model.zero_grad(set_to_none=True)
    if mode is None:
        model(input_ids=IDS, labels=IDS).loss.backward()
    else:
        with mode:
            loss = model(input_ids=IDS, labels=IDS).loss
            mode.phase = "backward"
            loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _expert_gemm(call: GemmCall) -> bool:
    return is_model_gemm(call) and (call.k in EXPERT_DIMS or any(n in EXPERT_DIMS for n in call.shape))


def _one_of_each_role(calls: list[GemmCall]) -> list[GemmCall]:
    """The first call of each expert GEMM role: the phase, and which of its output's and its reduction's dims
    are the model's and which a token count (forward, dX and dW of gate/up and of down tell apart so)."""
    def dim(n: int) -> int | str:
        return n if n in (*EXPERT_DIMS, HIDDEN) else "tokens"

    kept: dict[tuple[Any, ...], GemmCall] = {}
    for call in calls:
        role = (call.phase, dim(call.k), *map(dim, call.shape))
        kept.setdefault(role, call)
    return list(kept.values())


_QUIET: dict[str, dict[str, Any]] = {}


def _protected(arch: str, quiet: bool) -> tuple[torch.nn.Module, attnchecker.Guard]:
    """A fresh model under protect(scope="all") and the default policy, on its first step (checked in full) or,
    quiet, on the schedule's first step that checks nothing in full (trained there once per process, then resumed
    from that state as a resumed run would)."""
    model = _model(arch)
    guard = attnchecker.protect(model, scope="all")
    if quiet:
        if arch not in _QUIET:
            for _ in range(16):
                if not guard.check_config.checks("out"):
                    break
                _step(model)
                guard.step()
            else:
                raise AssertionError("the default schedule checked the whole step on 16 steps running")
            _QUIET[arch] = guard.state_dict()
        guard.load_state_dict(_QUIET[arch])
    return model, guard


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_moe_models_train_with_their_expert_banks_checked_and_the_unprotected_gradients(arch: str) -> None:
    """12 steps of the default policy (checked in full, then tier 1): every step's gradients are the unprotected
    model's, nothing is reported, and the coverage map lists each layer's bank with its three GEMM ops."""
    want = _step(_model(arch))
    model = _model(arch)
    with attnchecker.protect(model, scope="all") as guard:
        worst = []
        for _ in range(12):
            worst.append(worst_rel(_step(model), want))
            guard.step()
        banks = {(e.name, e.op) for e in guard.coverage.entries if e.path == "experts"}
        detections = list(guard.detections)
    assert max(worst) <= 1e-5, worst
    assert detections == []
    assert banks == {(f"model.layers.{i}.mlp.experts", op) for i in (0, 1)
                     for op in ("linear", "linear_dx", "linear_dw")}, banks


@pytest.mark.parametrize(("arch", "quiet", "gemm_path"), [
    ("mixtral", False, "torch"), ("mixtral", True, "torch"), ("gpt_oss", False, "torch"), ("gpt_oss", True, "torch"),
    # The GPU's path: the checks as Triton kernels (interpreter), repairs on the device, events at the step boundary.
    ("mixtral", False, "triton")])
def test_a_fault_in_any_expert_gemm_is_corrected(arch: str, quiet: bool, gemm_path: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """One call of each expert GEMM of the step (forward, dX, dW of gate/up and of down), each in its own run: the
    step's gradients are the clean step's (1e-5), and every detection is the step's tier (tier 1 on the quiet step,
    whose trip is corrected by the full check it falls back to) and corrected or recomputed. gpt-oss's banks are
    transposed and carry biases (x @ W[e] + b[e])."""
    if gemm_path == "triton" and not triton_gemm_check.available():
        pytest.skip("the Triton GEMM checks cannot run here (no CUDA, interpreter off)")
    monkeypatch.setenv(device.GEMM_ENV, gemm_path)
    model, guard = _protected(arch, quiet)
    recorder = GemmInjector()
    with guard:
        clean = _step(model, recorder)
        guard.step()
        assert guard.detections == []
    targets = _one_of_each_role([c for c in recorder.calls if _expert_gemm(c)])
    # Forward, dX and dW of the gate/up and the down projections.
    assert len(targets) == 6 and {c.phase for c in targets} == {"forward", "backward"}, targets
    if gemm_path == "triton":
        # The interpreter runs a check in seconds: the forward of gate/up, and down's dX and dW.
        targets = targets[:1] + targets[2:4]
    tier = "tripwire" if quiet else "abft"
    failures = []
    for n, call in enumerate(targets):
        kind = KINDS[n % len(KINDS)]
        model, guard = _protected(arch, quiet)
        inj = GemmInjector(target=call.index, kind=kind, element=7 + 13 * n)
        with guard:
            grads = _step(model, inj)
            guard.step()
            found = [(d.op, d.tier, d.action) for d in guard.detections]
        assert inj.hit == call, "the faulty run made different GEMM calls before the target"
        worst = worst_rel(grads, clean)
        if not (worst <= 1e-5 and found and all(t == tier and a in ("corrected", "recomputed") for _, t, a in found)):
            failures.append((call, kind, worst, found))
    assert not failures, failures


def test_without_the_experts_integration_the_same_fault_reaches_the_gradients(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """The control: with the banks left to their own forward (as before integrations/moe_experts.py), an INF in an
    expert's weight gradient on a checked step reaches the gradients unreported, so the test above can fail."""
    from attnchecker.integrations import moe_experts

    monkeypatch.setattr(moe_experts, "attach", lambda _binder, _model: 0)
    model, guard = _protected("mixtral", False)
    # The eager loop, as the integration runs it (the default grouped GEMM is no aten.mm the injector sees).
    model.config._experts_implementation = "eager"
    recorder = GemmInjector()
    with guard:
        _step(model, recorder)
    target = next(c for c in recorder.calls if _expert_gemm(c) and c.phase == "backward" and c.k not in EXPERT_DIMS)
    model, guard = _protected("mixtral", False)
    model.config._experts_implementation = "eager"
    with guard:
        grads = _step(model, GemmInjector(target=target.index, kind="inf"))
        found = list(guard.detections)
    assert found == []
    assert any(not torch.isfinite(g).all() for g in grads.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_an_expert_gemm_fault_is_corrected_on_the_device() -> None:
    """Mixtral in bf16 on CUDA, its first step checked in full on the device (the Triton GEMM checks): INF in the
    first expert's gate/up output and in down's first weight gradient, each in its own run, are reported at the step
    boundary and repaired; the gradients within bf16's 2e-2 of the clean step's."""
    ids = IDS.cuda()

    def run(mode: GemmInjector) -> tuple[dict[str, torch.Tensor], list[tuple[str, str, str]]]:
        model = _model("mixtral").to(device="cuda", dtype=torch.bfloat16)
        with attnchecker.protect(model, scope="all") as guard:
            model.zero_grad(set_to_none=True)
            with mode:
                loss = model(input_ids=ids, labels=ids).loss
                mode.phase = "backward"
                loss.backward()
            guard.step()
            grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
            return grads, [(d.op, d.tier, d.action) for d in guard.detections]

    recorder = GemmInjector()
    clean, found = run(recorder)
    assert found == []
    roles = _one_of_each_role([c for c in recorder.calls if _expert_gemm(c)])
    for call in (roles[0], roles[3]):
        grads, found = run(GemmInjector(target=call.index, kind="inf", element=5))
        assert found and all(t == "abft" and a in ("corrected", "recomputed") for _, t, a in found), (call, found)
        assert worst_rel(grads, clean) <= 2e-2, call
