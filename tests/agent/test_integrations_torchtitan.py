"""torchtitan (0.3, requirements-torchtitan.txt): its Llama 3 debug model, built from its own config, trains on CPU
under protect() with every op of every layer protected and checked, on its default FlexAttention, on varlen and with
its SDPA module swapped in; extreme faults injected below autograd are corrected with the fault-free run's loss;
nothing that is not attention (the FFN's w1 is 3x wide, as a fused q/k/v is) is taken for attention; the fused q/k/v
projection is labelled per KV group; FSDP2 (one gloo rank) and torch.compile per block compose with protect() in
either order.

The attention masks come from the model's own get_attention_masks, with its create_block_mask run eagerly: compiled
(as torchtitan ships it) it costs ~29 s of Inductor build on this CPU for the same BlockMask.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchtitan.models.common.attention as tt_attention
from dispatch_faults import attention_modules
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.models.common import Linear
from torchtitan.models.common.attention import QKVLinear, ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_gqa_config
from torchtitan.models.llama3 import model_registry

import attnchecker
from attnchecker import Fault, FaultPlan, Policy

B, T, VOCAB = 2, 64, 2048
OPS = ("q", "k", "v", "scores", "context", "out")
# Two packed documents per row (positions restart at 0), as torchtitan's dataloader emits them.
POSITIONS = torch.cat([torch.arange(40), torch.arange(24)]).repeat(B, 1)
TOKENS = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(1))
INIT = {"weight": functools.partial(torch.nn.init.trunc_normal_, std=0.02)}


@pytest.fixture(autouse=True, scope="module")
def eager_block_masks() -> Iterator[None]:
    saved = tt_attention._compiled_create_block_mask
    tt_attention._compiled_create_block_mask = create_block_mask
    yield
    tt_attention._compiled_create_block_mask = saved


def build(backend: str = "flex", *, layers: int | None = None, n_kv: int | None = None, sdpa: bool = False,
          separate: bool = False, seed: int = 0) -> Any:
    """torchtitan's Llama 3 debugmodel from its own config (dim 256, 16 heads, 6 layers, FFN 768 = 3 x dim), with
    the variants its config builders offer: fewer layers, GQA, separate wq/wk/wv, the SDPA inner attention."""
    cfg = model_registry("debugmodel", attn_backend=backend).model
    if layers is not None:
        cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        a = layer.attention
        if n_kv is not None:
            layer.attention = a = make_gqa_config(dim=256, n_heads=16, n_kv_heads=n_kv, fuse_qkv=True,
                                                  wqkv_param_init=INIT, wo_param_init=INIT,
                                                  inner_attention=a.inner_attention, rope=a.rope)
        if separate:
            a.qkv_linear = QKVLinear.Config(
                head_dim=16, wq=Linear.Config(in_features=256, out_features=256, param_init=INIT),
                wkv=Linear.Config(in_features=256, out_features=256, param_init=INIT))
        if sdpa:
            a.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model


def masks(model: Any, sdpa: bool) -> Any:
    return None if sdpa else model.get_attention_masks(POSITIONS)


def train(model: Any, steps: int, *, sdpa: bool = False, guard_kw: dict[str, Any] | None = None,
          faults: dict[int, Faults] | None = None) -> tuple[list[float], Any]:
    """AdamW steps on the fixed batch; protect(**guard_kw) unless None; faults: step -> dispatch injector."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = attnchecker.protect(model, optimizer=opt, **guard_kw) if guard_kw is not None else None
    attention_masks = masks(model, sdpa)
    losses = []
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            injector = (faults or {}).get(step)
            # Forward only: the backward GEMMs are outside the attention checks' scope (DESIGN.md).
            with injector.active() if injector is not None else _nothing():
                logits = model(TOKENS[:, :-1], POSITIONS, attention_masks)
            loss = F.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, guard
    finally:
        if guard is not None:
            guard.close()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class GemmFault(TorchDispatchMode):
    """Below autograd, knowing nothing of attnchecker: write ``value`` at ``index`` of the ``nth`` (from 0) output of
    an aten mm/bmm made inside an attention module of ``model`` (dispatch_faults.attention_modules: GQAttention here,
    not the FFN, whose w1 and w3 GEMMs have wqkv's shape; None: anywhere) whose shape and reduction length
    ``pick(shape, k)`` accepts."""

    def __init__(self, model: Any, pick: Callable[[tuple[int, ...], int], bool], nth: int, index: tuple[int, ...],
                 value: float) -> None:
        super().__init__()
        self.model, self.pick, self.nth, self.index, self.value = model, pick, nth, index, value
        self.seen = 0
        self.hit: tuple[int, ...] | None = None
        self.depth = 0 if model is not None else 1

    @contextmanager
    def windows(self) -> Iterator[None]:
        handles = []
        for module in attention_modules(self.model) if self.model is not None else []:
            handles.append(module.register_forward_pre_hook(lambda *_: setattr(self, "depth", self.depth + 1)))
            handles.append(module.register_forward_hook(lambda *_: setattr(self, "depth", self.depth - 1),
                                                        always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) and self.hit is None and self.depth > 0:
            if self.pick(tuple(out.shape), args[0].shape[-1]):
                if self.seen == self.nth:
                    out[self.index] = self.value
                    self.hit = tuple(out.shape)
                self.seen += 1
        return out


class Faults:
    """Several injectors active at once."""

    def __init__(self, *injectors: GemmFault) -> None:
        self.injectors = injectors

    @contextmanager
    def active(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for injector in self.injectors:
                stack.enter_context(injector.windows())
                stack.enter_context(injector)
            yield


def assert_every_op_checked(guard: Any, layers: int, path: str) -> None:
    cov = guard.coverage
    assert cov.complete, cov.gaps()
    assert sorted({(e.layer, e.name, e.op) for e in cov.protected}) == sorted(
        (i, f"layers.{i}.attention", op) for i in range(layers) for op in OPS)
    assert {e.path for e in cov.protected if e.op in ("scores", "context")} == {path}
    assert not any("feed_forward" in s.name or "qkv_linear" in s.name for s in guard.sites)


def wqkv_output(shape: tuple[int, ...], k: int) -> bool:
    return shape == (B * T, 768) and k == 256


def scores_tile(shape: tuple[int, ...], k: int) -> bool:
    """q·kᵀ of one tile: (B·H, rows, keys), reduced over the head dim (the checksum products are 2·g wide)."""
    return len(shape) == 3 and shape[0] == B * 16 and shape[-1] > 16 and k == 16


@pytest.mark.slow
def test_llama3_debug_flex_trains_checked_and_faults_below_autograd_are_corrected() -> None:
    """The issue's case: 6 layers of FlexAttention with packed-document masks. Before, protect() took qkv_linear and
    feed_forward for attention, claimed scores/context through sdpa and checked them 0 times."""
    model = build()
    reference = copy.deepcopy(model)
    clean, _ = train(copy.deepcopy(model), 2, guard_kw={})
    # At step 1: an INF in layer 2's fused q/k/v output and a NaN in a scores tile of layer 4, written into the GEMMs'
    # outputs below autograd.
    faults = {1: Faults(GemmFault(model, wqkv_output, 2, (10, 316), math.inf),
                        GemmFault(model, scores_tile, 4, (3, 5, 2), math.nan))}
    got, guard = train(model, 2, guard_kw={"policy": Policy.full()}, faults=faults)
    assert all(f.hit is not None for f in faults[1].injectors)
    # Column 316 of 768 is KV group 6 (48 columns each: q 16, k 16, v 16) at 28: its k, column 12. In thirds it would
    # have been a k at column 60, by chance of the width; column 300 (its q) would have been a k too.
    assert sorted((d.step, d.layer, d.op, d.col, d.action) for d in guard.detections) == [
        (1, 2, "k", 12, "corrected"), (1, 4, "scores", 2, "recomputed")], guard.detections
    assert got == pytest.approx(clean, rel=1e-6)
    assert_every_op_checked(guard, 6, "torchtitan")
    # The protected forward is flex_attention's (eager: torchtitan's compiled kernel is the same function).
    flex_class = tt_attention.FlexAttention
    compiled = flex_class._compiled_flex_attn
    flex_class._compiled_flex_attn = flex_attention
    try:
        with torch.no_grad():
            want = reference(TOKENS[:, :-1], POSITIONS, masks(reference, False))
    finally:
        flex_class._compiled_flex_attn = compiled
    protected = build()
    with attnchecker.protect(protected), torch.no_grad():
        mine = protected(TOKENS[:, :-1], POSITIONS, masks(protected, False))
    torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)


def test_llama3_sdpa_module_with_separate_projections_trains_as_unprotected() -> None:
    """torchtitan's ScaledDotProductAttention swapped in, q/k/v in qkv_linear.wq/wk/wv (no nn.Linear of 3x width):
    before, only scores and context were protected."""
    want, _ = train(build(layers=2, sdpa=True, separate=True), 3, sdpa=True)
    model = build(layers=2, sdpa=True, separate=True)
    # A NaN in layer 1's wv output (the third (B·T, 256) projection GEMM of layer 1: wq, wk, wv, wo per layer).
    faults = {1: Faults(GemmFault(model, lambda shape, k: shape == (B * T, 256) and k == 256, 6, (33, 40), math.nan))}
    got, guard = train(model, 3, sdpa=True, guard_kw={"policy": Policy.full()}, faults=faults)
    assert faults[1].injectors[0].hit is not None
    assert [(d.layer, d.op, d.action) for d in guard.detections] == [(1, "v", "corrected")], guard.detections
    assert got == pytest.approx(want, rel=1e-5)
    assert_every_op_checked(guard, 2, "torchtitan")
    assert {e.path for e in guard.coverage.protected if e.op in ("q", "k", "v")} == {"hook"}


def test_llama3_varlen_trains_on_cpu_where_torchtitan_cannot() -> None:
    model = build("varlen", layers=2)
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        copy.deepcopy(model)(TOKENS[:, :-1], POSITIONS, masks(model, False))
    losses, guard = train(model, 3, guard_kw={})
    assert losses[-1] < losses[0] and all(math.isfinite(x) for x in losses)
    assert guard.detections == []
    assert_every_op_checked(guard, 2, "torchtitan")


def test_fused_qkv_is_labelled_per_kv_group() -> None:
    """wqkv's output is [q heads of group g | k_g | v_g] per KV group: a fault in group 2's k slice is a k fault, at
    that slice's column. Split in thirds, it would have been called a q fault."""
    model = build(layers=1, n_kv=4)
    hd, hpk = 16, 4
    # Column 2 of KV group 0's k: output 66 of 384, which split in thirds would be a q column (0-127).
    col = hpk * hd + 2
    with torch.no_grad():
        x = torch.randn(B, T, 256)
        wqkv = model.layers["0"].attention.qkv_linear.wqkv
        clean = wqkv(x)
    plan = FaultPlan([Fault(op="k", layer=0, step=0, kind="inf", batch=1, row=7, col=2)])
    with attnchecker.protect(model, faults=plan, policy=Policy.full()) as guard, torch.no_grad():
        got = wqkv(x)
        dets = guard.detections
        injected = guard.injector.injected
    assert [(d.op, d.row, d.col, d.action) for d in dets] == [("k", 7, 2, "corrected")], dets
    assert len(injected) == 1
    torch.testing.assert_close(got, clean)
    # Below autograd: an INF in the GEMM's output at that column is a k fault too.
    model2 = build(layers=1, n_kv=4)
    wqkv2 = model2.layers["0"].attention.qkv_linear.wqkv
    with attnchecker.protect(model2, policy=Policy.full()) as guard2, torch.no_grad():
        with Faults(GemmFault(None, lambda shape, k: shape == (B * T, 384), 0, (5, col), math.inf)).active():
            got2 = wqkv2(x)
        dets2 = guard2.detections
    assert [(d.op, d.row, d.col, d.action) for d in dets2] == [("k", 5, 2, "corrected")], dets2
    torch.testing.assert_close(got2, clean)


@pytest.fixture(scope="module")
def gloo() -> Iterator[Any]:
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("order", [("protect", "shard", "compile"), ("shard", "compile", "protect")])
def test_fsdp2_and_compile_per_block_in_either_order(gloo: Any, order: tuple[str, ...]) -> None:
    """FSDP2 fully_shard per block and at the root (one gloo rank), torch.compile per block (aot_eager; the checks
    graph-break, so fullgraph=False), and protect(), in either order: same losses, every op checked."""
    from torch.distributed.fsdp import fully_shard

    want, _ = train(build(layers=2), 2, guard_kw={})
    model = build(layers=2)
    guard = None
    for what in order:
        if what == "protect":
            guard = attnchecker.protect(model, policy=Policy.full())
        elif what == "shard":
            for block in model.layers.values():
                fully_shard(block, mesh=gloo)
            fully_shard(model, mesh=gloo)
        else:
            for block in model.layers.values():
                block.compile(backend="aot_eager")
    assert guard is not None
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard.attach_optimizer(opt)
        attention_masks = masks(model, False)
        got = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(TOKENS[:, :-1], POSITIONS, attention_masks).flatten(0, 1),
                                   TOKENS[:, 1:].flatten())
            loss.backward()
            opt.step()
            got.append(loss.item())
        assert got == pytest.approx(want, rel=1e-5)
        assert_every_op_checked(guard, 2, "torchtitan")
    finally:
        guard.close()
        torch._dynamo.reset()


def test_under_fsdp2_the_step_boundary_reads_the_flags_and_the_sharded_gradients_finiteness_at_once(gloo: Any
                                                                                                     ) -> None:
    """FSDP2's gradients are DTensors, which cannot be read with tolist. The optimizer's step boundary reads the
    step's deferred flags (plain device tensors, as the GPU route leaves them) and the sharded gradients' finiteness
    in one read: a clean step steps; a NaN in a gradient's shard skips the step with a detection at the optimizer."""
    from sync_counter import SyncCounter
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from attnchecker.checks.deferred import defer

    model = build(layers=1)
    for block in model.layers.values():
        fully_shard(block, mesh=gloo)
    fully_shard(model, mesh=gloo)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = attnchecker.protect(model, optimizer=opt)
    try:
        ctx = next(iter(guard._binder.contexts.values()))
        attention_masks = masks(model, False)
        for poisoned in (False, True):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(TOKENS[:, :-1], POSITIONS, attention_masks).flatten(0, 1),
                            TOKENS[:, 1:].flatten()).backward()
            params = [p for p in model.parameters() if p.grad is not None]
            assert all(isinstance(p.grad, DTensor) for p in params)
            if poisoned:
                with torch.no_grad():
                    params[0].grad.to_local().view(-1)[0] = float("nan")
            before = [p.detach().to_local().clone() for p in params]
            defer(ctx, "scores", torch.tensor(False), list)
            with SyncCounter() as reads:
                opt.step()
            if not poisoned:
                assert reads.calls == ["tolist"]
            stepped = [not torch.equal(b, p.detach().to_local()) for b, p in zip(before, params, strict=True)]
            assert all(stepped) if not poisoned else not any(stepped)
        assert [(d.op, d.tier) for d in guard.detections] == [("grad", "optimizer")]
    finally:
        guard.close()


@pytest.mark.usefixtures("gloo")
def test_torchtitans_checkpointer_saves_and_loads_the_guard_state(tmp_path: Any) -> None:
    """docs/adaptive.md, "Resuming": the guard in torchtitan's CheckpointManager's states (DCP, one process). The
    run is saved at step 10 of the default policy (a quiet step) and a fresh model, optimizers and guard load it:
    the guard goes on at step 10 with the saved schedule, not every op due."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    def trainer_parts() -> tuple[Any, Any, Any, attnchecker.Guard, Any]:
        model = build(layers=1, sdpa=True)
        opts = OptimizersContainer(OptimizersContainer.Config(implementation="for-loop", param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})]),
            model_parts=[model])
        scheds = LRSchedulersContainer.Config().build(optimizers=opts, training_steps=100)
        guard = attnchecker.protect(model, optimizer=opts, scope="all")
        checkpointer = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", interval=1),
                                         dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                                         states={}, sd_adapter=None, base_folder=str(tmp_path))
        checkpointer.states["attnchecker"] = guard
        return model, opts, scheds, guard, checkpointer

    model, opts, scheds, guard, checkpointer = trainer_parts()
    try:
        for _ in range(10):
            opts.zero_grad()
            model(TOKENS[:, :-1]).float().logsumexp(-1).mean().backward()
            opts.step()
            scheds.step()
        assert guard.check_config.checked_ops == frozenset()
        checkpointer.save(curr_step=10)
        saved = guard.state_dict()
    finally:
        guard.close()
    _, _, _, resumed, checkpointer = trainer_parts()
    try:
        assert resumed.check_config.checked_ops == frozenset(OPS)
        checkpointer.load(step=10)
        assert resumed.state_dict() == saved and resumed.step_count == 10
        assert resumed.check_config.checked_ops == frozenset()
    finally:
        resumed.close()
