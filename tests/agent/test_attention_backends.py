"""The attention backend contract (attention/backends): which backend takes a call, why the others do not, what the
coverage map shows, and ATTNCHECKER_ATTENTION forcing one."""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from attnchecker.attention.backends import BACKEND_ENV, BACKENDS, AttentionCall, choose
from attnchecker.attention.backends.tiled_torch import TILE_ENV, TILED_MIN_ENV, tile_choice
from attnchecker.attention.pipeline import BACKEND_ORDER, protected_sdpa
from attnchecker.kernels import fused_attention

native = pytest.mark.skipif(not fused_attention.available(), reason="no C compiler or no BLAS sgemm_ here")


def call_of(make_ctx: Any, *, t: int = 64, s: int | None = None, dtype: torch.dtype = torch.float32,
            requested: str = "auto", **options: Any) -> AttentionCall:
    s = t if s is None else s
    q, k, v = (torch.randn(2, 4, n, 16, dtype=dtype) for n in (t, s, s))
    ctx, _ = make_ctx()
    fields: dict[str, Any] = {"attn_mask": None, "is_causal": False, "scale": 0.25, "dropout_p": 0.0,
                              "return_probs": False, "paper": False, "force": frozenset(), "injected": False}
    fields.update(options)
    return AttentionCall(q_BHTD=q, k_BHSD=k, v_BHSD=v, ctx=ctx, requested=requested, caught=[0], **fields)


def chosen(call: AttentionCall) -> tuple[str, dict[str, tuple[str, ...]]]:
    got = choose(call, BACKEND_ORDER)
    return got.backend.name, got.declined


@pytest.fixture(autouse=True)
def no_tile_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (BACKEND_ENV, TILE_ENV, TILED_MIN_ENV):
        monkeypatch.delenv(name, raising=False)


def test_every_backend_of_the_order_is_named_in_the_contract() -> None:
    assert {b.name for b in BACKEND_ORDER} <= set(BACKENDS)
    assert BACKEND_ORDER[-1].name == "unfused"


@native
def test_auto_takes_the_native_pass_for_fp32_on_the_cpu_at_every_size(make_ctx) -> None:
    assert chosen(call_of(make_ctx, t=8))[0] == "native"
    assert chosen(call_of(make_ctx, t=640))[0] == "native"


def test_auto_takes_the_tile_loop_from_the_size_threshold_and_the_unfused_path_below(make_ctx,
                                                                                      monkeypatch) -> None:
    half = {"dtype": torch.bfloat16}  # the native pass takes float32 only
    name, declined = chosen(call_of(make_ctx, t=511, s=512, **half))
    assert name == "unfused"
    assert any(TILED_MIN_ENV in r for r in declined["tiled"]), declined
    assert any("float32" in r for r in declined["native"]), declined
    assert chosen(call_of(make_ctx, t=512, s=512, **half))[0] == "tiled"
    monkeypatch.setenv(TILED_MIN_ENV, "100")
    assert chosen(call_of(make_ctx, t=10, s=10, **half))[0] == "tiled"
    assert chosen(call_of(make_ctx, t=9, s=10, **half))[0] == "unfused"


@pytest.mark.parametrize(("option", "says"), [
    ({"dropout_p": 0.1}, "dropout"),
    ({"return_probs": True}, "return_probs"),
    ({"paper": True}, "paper-faithful"),
])
def test_calls_no_tile_can_take_run_unfused_and_say_why(make_ctx, option: dict[str, Any], says: str) -> None:
    name, declined = chosen(call_of(make_ctx, t=1024, **option))
    assert name == "unfused"
    for backend in ("native", "tiled"):
        assert any(says in r for r in declined[backend]), declined


def test_a_learned_mask_runs_unfused(make_ctx) -> None:
    mask = torch.zeros(1, 1, 1024, 1024, requires_grad=True)
    name, declined = chosen(call_of(make_ctx, t=1024, attn_mask=mask))
    assert name == "unfused" and any("requires grad" in r for r in declined["tiled"])


@native
def test_an_injected_call_leaves_the_native_pass_for_the_loop_the_injector_writes_into(make_ctx) -> None:
    name, declined = chosen(call_of(make_ctx, t=1024, injected=True))
    assert name == "tiled" and any("attnchecker.inject" in r for r in declined["native"])


def test_a_named_backend_runs_at_every_size(make_ctx) -> None:
    assert chosen(call_of(make_ctx, t=2, requested="tiled"))[0] == "tiled"
    assert chosen(call_of(make_ctx, t=4096, requested="unfused"))[0] == "unfused"


def test_a_named_backend_that_cannot_take_a_call_is_passed_over_with_a_warning(make_ctx, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="attnchecker"):
        name, declined = chosen(call_of(make_ctx, t=64, requested="tiled", dropout_p=0.1))
    assert name == "unfused" and "tiled" in declined
    assert f"{BACKEND_ENV}=tiled cannot take this call" in caplog.text and "dropout" in caplog.text


@pytest.mark.parametrize(("env", "value", "message"), [
    (BACKEND_ENV, "fast", "use auto or one of triton, native, tiled, unfused"),
    (TILE_ENV, "64,32,16", "give 'Tq,Tk'"),
    (TILE_ENV, "0", "must be >= 1"),
    (TILED_MIN_ENV, "lots", "is not an integer"),
])
def test_a_bad_setting_is_a_clear_error(monkeypatch, env: str, value: str, message: str) -> None:
    if env == TILE_ENV:
        monkeypatch.setenv(BACKEND_ENV, "tiled")  # tile sizes are read by the tiled backend only
    monkeypatch.setenv(env, value)
    q = torch.randn(1, 1, 64, 8, dtype=torch.bfloat16)
    from attnchecker.checks.context import CheckConfig, LayerContext, Runtime
    ctx = LayerContext(layer=0, runtime=Runtime(config=CheckConfig()))
    with pytest.raises(ValueError, match=message):
        protected_sdpa(q, q, q, ctx=ctx)


def test_default_tiles_take_all_keys_up_to_the_budget_then_block_them() -> None:
    from attnchecker.attention.backends.tiled_torch import DEFAULT_BLOCK_Q, MIN_BLOCK_K, TILE_BUDGET, default_tiles

    fit = TILE_BUDGET // (8 * DEFAULT_BLOCK_Q)
    got = tile_choice(fit, batch_heads=8)
    assert (got.block_q, got.block_k) == (DEFAULT_BLOCK_Q, fit)  # one tile per query block
    long = default_tiles(4 * fit, 8)
    assert long.block_k == fit and 8 * long.block_q * long.block_k <= TILE_BUDGET  # O(budget), whatever S is
    assert default_tiles(1 << 30, 1 << 10).block_k == MIN_BLOCK_K


def test_the_coverage_map_names_the_backend_of_every_layer_and_why_the_others_did_not_run(monkeypatch) -> None:
    """A protected model's Guard.coverage after a step: each layer's backend and its calls, and the reasons of the
    backends auto passed over (here bf16, which the native pass does not take, below the tiled threshold)."""
    from model_zoo import batch, build, loss_of

    import attnchecker

    model = build("gpt2").to(torch.bfloat16)
    guard = attnchecker.protect(model, policy=attnchecker.Policy.full())
    try:
        loss_of("gpt2", model, batch("gpt2", 0)).backward()
        lines = guard.coverage.backend_lines()
        layers = model.config.n_layer  # type: ignore[union-attr]
        assert lines[0].startswith(f"layers 0-{layers - 1}: unfused (") and "declined: native (" in lines[0], lines
        assert "bfloat16" in lines[0] and TILED_MIN_ENV in lines[0], lines
        rows = guard.coverage.as_dict()["backends"]
        assert {r["layer"] for r in rows} == set(range(layers)) and {r["backend"] for r in rows} == {"unfused"}
        monkeypatch.setenv(BACKEND_ENV, "tiled")
        loss_of("gpt2", model, batch("gpt2", 0)).backward()
        assert any("tiled (" in line for line in guard.coverage.backend_lines())
    finally:
        guard.close()


@pytest.mark.parametrize(("option", "says"), [
    ({"return_probs": True}, "return_probs"),
    ({"paper": True}, "paper-faithful"),
    ({"dtype": torch.float64}, "float32, bfloat16 or float16"),
    ({"attn_mask": torch.zeros(1, 1, 64, 64, requires_grad=True)}, "requires grad"),
])
def test_the_triton_backend_says_why_it_declines_a_call(make_ctx, option: dict[str, Any], says: str) -> None:
    from attnchecker.kernels import triton_attention

    if not triton_attention.available("cpu"):
        pytest.skip("no triton, or not under Triton's interpreter")
    name, declined = chosen(call_of(make_ctx, requested="triton", **option))
    assert name != "triton" and any(says in r for r in declined["triton"]), declined


def test_the_triton_backend_takes_cpu_calls_only_when_named_and_never_under_a_dispatch_mode(make_ctx) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from attnchecker.kernels import triton_attention

    if not triton_attention.available("cpu"):
        pytest.skip("no triton, or not under Triton's interpreter")
    assert chosen(call_of(make_ctx, requested="triton"))[0] == "triton"
    name, declined = chosen(call_of(make_ctx))
    assert name != "triton" and "ATTNCHECKER_ATTENTION=triton" in declined["triton"][0]

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        name, declined = chosen(call_of(make_ctx, requested="triton"))
    assert name != "triton" and any("TorchDispatchMode" in r for r in declined["triton"])


def test_without_triton_installed_the_agent_imports_and_the_triton_backend_says_why_it_declines() -> None:
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['triton'] = None\n"  # import triton now raises ImportError, as where it is missing
        "import torch\n"
        "from attnchecker.attention.pipeline import TRITON\n"
        "from attnchecker.kernels import triton_attention\n"
        "print(triton_attention.available('cuda'), triton_attention.not_available_reason(torch.device('cuda')))\n"
    )
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.startswith("False triton is not installed"), got.stdout


def test_the_triton_backend_leaves_flex_and_varlen_calls_to_the_tile_loop(make_ctx) -> None:
    """A score_mod / BlockMask / varlen window, or a returned log-sum-exp with its own gradient: the kernel applies
    none of them (auto would otherwise take such a CUDA call first)."""
    from attnchecker.attention.tile_mods import TileMods
    from attnchecker.kernels import triton_attention

    if not triton_attention.available("cpu"):
        pytest.skip("no triton, or not under Triton's interpreter")
    mods = TileMods(batch=2, heads=4, t=64, s=64, score_mod=lambda score, b, h, q, kv: score)
    for option in ({"mods": mods}, {"return_lse": True}):
        name, declined = chosen(call_of(make_ctx, requested="triton", **option))
        assert name == "tiled" and any("triton" in r for r in declined["triton"]), declined
