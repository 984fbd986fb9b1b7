"""Whole-step protection (protect(scope="all")) on both GEMM check paths: the CPU path (gemm/check.py) and the Triton
path (gemm/device.py: its kernels under Triton's interpreter here, as on CUDA), with ``impl``.

A fault injector below autograd (gemm_injector: a TorchDispatchMode on aten mm/addmm/bmm that knows nothing of
attnchecker) corrupts one output element of one GEMM of a GPT-2, Llama or BERT training step, with INF, NaN, 3e20 or an
exponent flip; the step's gradients must equal the fault-free step's to 1e-5, its weights stay finite, and the event
says corrected or recomputed. On the Triton path the reports come at the step boundary (checks/deferred.py).

The interpreter runs a tiny model's step in one to two seconds, so the models have one layer (every kind of GEMM is
still there: attention projections, MLP, LM head). Most tests hit a sample of a step's GEMMs on both paths;
``test_every_linear_gemm_of_a_step_is_corrected_on_the_triton_path`` hits every one on the Triton path (15 to 30
s a model), as tests/agent/test_linear_abft.py and test_whole_step_tripwire.py do on the CPU path. The attention's
own products (q/k/v, scores, context and the fused backward) are checked by the attention's backends, on either path,
and are not the subject here. What a check kernel the GPU cannot compile does to a step:
``test_a_gemm_check_kernel_that_fails_hands_its_gemms_to_the_cpu_path_and_training_goes_on``."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest
import torch
from gemm_injector import GemmCall, GemmInjector, is_model_gemm, worst_rel
from model_zoo import batch, build, injected_step, loss_of
from sync_counter import SyncCounter

import attnchecker
from attnchecker import Policy
from attnchecker.attention.backends import BACKEND_ENV
from attnchecker.attention.backward import fused
from attnchecker.gemm import device, projection
from attnchecker.gemm.linear import GEMM_OPS
from attnchecker.kernels import triton_gemm_check as tg

pytestmark = pytest.mark.skipif(not (tg.available() and tg.interpreted()),
                                reason="runs the Triton kernels on CPU tensors under Triton's interpreter, which "
                                       "tests/agent/conftest.py turns on where there is no CUDA device; on a GPU, "
                                       "test_triton_gemm_gpu.py runs them compiled")
KINDS = ("inf", "nan", "near_inf", "bitflip")
PROJECTION_OPS = ("q", "k", "v", "out")
ONE_LAYER = {"gpt2": {"n_layer": 1}, "llama": {"num_hidden_layers": 1}, "bert": {"num_hidden_layers": 1}}


def model_of(arch: str) -> torch.nn.Module:
    return build(arch, **ONE_LAYER[arch])


@pytest.fixture(params=["cpu", "triton"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The GEMM checks' path; afterwards, that it is the one that ran (Triton kernels launched, or none)."""
    monkeypatch.setenv(device.GEMM_ENV, "auto" if request.param == "cpu" else "triton")
    tg.LAUNCHES.reset()
    yield request.param
    assert (tg.LAUNCHES.by_kernel.get("check_pass", 0) > 0) == (request.param == "triton")


def one_step(arch: str, injector: GemmInjector, *, scope: str | None = "all"
             ) -> tuple[dict[str, torch.Tensor], bool, list]:
    """One forward/backward/SGD step of a fresh seeded model under ``injector``: (gradients, weights finite after the
    step, detections). The optimizer is the guard's, so the step boundary (and the Triton path's reports) comes
    before it steps."""
    model = model_of(arch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = attnchecker.protect(model, optimizer=opt, policy=Policy.full(), scope=scope) if scope else None
    try:
        grads = injected_step(arch, model, opt, injector)
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return grads, finite, list(guard.detections) if guard else []
    finally:
        if guard:
            guard.close()


def guarded_step(arch: str, model: torch.nn.Module, opt: torch.optim.Optimizer, guard: attnchecker.Guard,
                 injector: GemmInjector) -> tuple[dict[str, torch.Tensor], list]:
    """One more step of an attached guard's model under ``injector``: (gradients, this step's detections)."""
    seen = len(guard.detections)
    grads = injected_step(arch, model, opt, injector)
    return grads, list(guard.detections[seen:])


def faults_corrected_in_turn(calls: list[GemmCall],
                             step: Callable[[GemmInjector], tuple[dict[str, torch.Tensor], bool, list]],
                             clean: dict[str, torch.Tensor], *, first: int, stride: int) -> list[tuple]:
    """Each GEMM call hit in turn below autograd (element first + stride·n of the n-th, the four kinds rotating) in a
    fresh ``step``: the failures, where the step's gradients are not the fault-free ones to 1e-5, a weight is not
    finite, or a GEMM check (a Linear's or a projection's) did not report the fault corrected or recomputed."""
    failures = []
    for n, call in enumerate(calls):
        kind = KINDS[n % len(KINDS)]
        injector = GemmInjector(target=call.index, kind=kind, element=first + stride * n)
        grads, finite, detections = step(injector)
        assert injector.hit == call, "the faulty run made different GEMM calls before the target"
        outcome = [(d.op, d.action) for d in detections]
        if not (finite and worst_rel(grads, clean) <= 1e-5 and outcome
                and all(op in (*GEMM_OPS, *PROJECTION_OPS) and action in ("corrected", "recomputed")
                        for op, action in outcome)):
            failures.append((call, kind, worst_rel(grads, clean), outcome))
    return failures


def linear_sample(calls: list[GemmCall]) -> list[GemmCall]:
    """Four of a step's Linear GEMMs: the MLP's up projection (the widest forward product before the LM head: the
    attention's projections are narrower), the LM head's (the step's last forward product), the LM head's first
    backward product and the layer's last. Backward, every model mm is a Linear's dX or dW (the attention's backward
    is the fused kernel)."""
    forward = [c for c in calls if c.phase == "forward" and c.op != "bmm" and is_model_gemm(c)]
    backward = [c for c in calls if c.phase == "backward" and is_model_gemm(c)]
    widest = max(forward[:-1], key=lambda c: c.shape[-1])
    return [widest, forward[-1], backward[0], backward[-1]]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
@pytest.mark.usefixtures("impl")
def test_a_fault_in_a_linear_gemm_of_a_checked_step_is_corrected(arch: str) -> None:
    """Conv1D layers (GPT-2), nn.Linear with and without a bias (Llama, BERT), the LM head and BERT's MLM decoder.
    The kinds rotate with the model, so that each model meets all four."""
    recorder = GemmInjector()
    clean, finite, detections = one_step(arch, recorder)
    assert finite and not detections
    plain, _, _ = one_step(arch, GemmInjector(), scope=None)
    assert worst_rel(clean, plain) <= 1e-5
    shift = ("gpt2", "llama", "bert").index(arch)
    failures = []
    for n, call in enumerate(linear_sample(recorder.calls)):
        kind = KINDS[(n + shift) % len(KINDS)]
        injector = GemmInjector(target=call.index, kind=kind, element=7 + 13 * n)
        grads, finite, detections = one_step(arch, injector)
        assert injector.hit == call, "the faulty run made different GEMM calls before the target"
        outcome = [(d.op, d.action) for d in detections]
        if not (finite and worst_rel(grads, clean) <= 1e-5 and outcome
                and all(op in GEMM_OPS and action in ("corrected", "recomputed") for op, action in outcome)):
            failures.append((call, kind, worst_rel(grads, clean), outcome))
    assert not failures


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.usefixtures("impl")
def test_a_fault_on_a_quiet_step_is_caught_by_tier1_and_corrected(arch: str) -> None:
    """The whole-step GEMMs pinned to a long period: step 0 checks them in full, the steps after it give each output
    tier 1 only (on the Triton path the tier-1 pass, which recomputes a tripped row itself). A fault in
    a Linear GEMM there is caught, corrected in place, and reported by tier "tripwire"; the gradients are the clean
    quiet step's (lr 0: every step computes the same function)."""
    model = model_of(arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = attnchecker.protect(model, optimizer=opt, scope="all", policy=Policy(op_periods={"out": 1000},
                                                                                 adaptive=False))

    def step(injector: GemmInjector) -> tuple[dict[str, torch.Tensor], list]:
        return guarded_step(arch, model, opt, guard, injector)

    try:
        step(GemmInjector())
        assert not guard.check_config.checks("out") and guard.check_config.trips("out")
        recorder = GemmInjector()
        clean, detections = step(recorder)
        assert not detections and guard.report().tier_checks["tripwire"] > 0
        failures = []
        for n, call in enumerate(linear_sample(recorder.calls)[1:]):
            kind = KINDS[n + 1]
            injector = GemmInjector(target=call.index, kind=kind, element=5 + 11 * n)
            grads, detections = step(injector)
            assert injector.hit == call
            outcome = [(d.op, d.tier, d.action) for d in detections]
            if not (worst_rel(grads, clean) <= 1e-5 and outcome
                    and all(t == "tripwire" and a in ("corrected", "recomputed") for _, t, a in outcome)):
                failures.append((call, kind, worst_rel(grads, clean), outcome))
        assert not failures
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    finally:
        guard.close()


@pytest.mark.parametrize(("dtype", "arch"), [(torch.float32, "bert"), (torch.bfloat16, "llama"),
                                             (torch.float16, "gpt2")], ids=["fp32", "bf16", "fp16"])
@pytest.mark.usefixtures("impl")
def test_clean_training_flags_nothing_and_matches_the_unprotected_run(dtype: torch.dtype, arch: str) -> None:
    """Clean AdamW steps under Policy.full(), every GEMM checked: no event, and the run is the unprotected one. fp16
    is autocast with GradScaler from a scale of 2^24, whose first steps' backward GEMMs overflow fp16 on purpose (the
    scaler skips them): an INF the dtype cannot avoid is no fault on either path."""

    def run(scope: str | None) -> tuple[list[float], float, list]:
        model = model_of(arch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, enabled=dtype == torch.float16)
        guard = attnchecker.protect(model, optimizer=opt, policy=Policy.full(), scope=scope) if scope else None
        losses = []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = loss_of(arch, model, batch(arch, step))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        detections = list(guard.detections) if guard else []
        if guard:
            assert guard.report().checks.get("linear_dw", 0) > 0
            guard.close()
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return losses, scaler.get_scale(), detections

    want, want_scale, _ = run(None)
    got, scale, detections = run("all")
    assert detections == []
    assert scale == want_scale
    if dtype == torch.float16:
        assert want_scale < 2.0**24  # the scaler did back off: overflow steps happened
    # Half precision: the protected attention's products run in another order than SDPA's under autocast (1.2e-5
    # apart in bf16 on both paths, its ulp being 4e-3).
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= (1e-5 if dtype == torch.float32
                                                                                 else 1e-3)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_every_linear_gemm_of_a_step_is_corrected_on_the_triton_path(arch: str, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    """Not a sample: every Linear/Conv1D GEMM of a one-layer step on the Triton path (each forward product, each dX
    and dW, the LM head's and BERT's pooler and MLM head included), hit below autograd in turn, the four kinds
    rotating, is corrected or recomputed with the fault-free gradients and finite weights. A q/k/v or output
    projection's forward is the attention integration's check (gemm.projection, its op's name), as on every path."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    recorder = GemmInjector()
    clean, finite, detections = one_step(arch, recorder)
    assert finite and not detections
    calls = [c for c in recorder.calls if is_model_gemm(c) and not (c.phase == "forward" and c.op == "bmm")]
    assert len({c.phase for c in calls}) == 2 and len(calls) >= 12, [(c.phase, c.shape) for c in calls]
    assert not faults_corrected_in_turn(calls, functools.partial(one_step, arch), clean, first=3, stride=17)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_gemms_are_checked_against_their_rounded_operands_and_corrected(dtype: torch.dtype,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast, the form GPU training takes: the integrations hand the Triton path's checks the GEMMs' own
    half-precision operands (the fp32 LayerNorm output and master weight as autocast rounds them), so every operand
    pass takes the tensor-core form, and c_attn's three slices share one pass over x. A clean step flags nothing; an
    INF, NaN, 1e20 or exponent flip written below autograd into c_attn's output (its v slice), the MLP's c_fc, and a
    backward GEMM each is corrected or its row recomputed, and the gradients are the fault-free step's to the dtype's
    rounding (a corrected half-precision element is the exact value rounded, which the GEMM's own may differ from by
    an ulp)."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    passes: list[tuple[int, torch.dtype]] = []  # (factor width, operand dtype) of each operand pass with a factor
    launch = tg.operand_pass

    def spy(x: torch.Tensor, ws: tg.Workspace, **kwargs: object) -> tg.OperandOut:
        right = kwargs.get("right")
        if isinstance(right, torch.Tensor):
            passes.append((right.shape[-1], x.dtype))
        return launch(x, ws, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tg, "operand_pass", spy)

    def step(injector: GemmInjector) -> tuple[dict[str, torch.Tensor], bool, list]:
        model = model_of("gpt2")
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        guard = attnchecker.protect(model, optimizer=opt, policy=Policy.full(), scope="all")
        try:
            with torch.autocast("cpu", dtype=dtype):
                grads = injected_step("gpt2", model, opt, injector)
            return grads, all(bool(torch.isfinite(p).all()) for p in model.parameters()), list(guard.detections)
        finally:
            guard.close()

    recorder = GemmInjector()
    tg.LAUNCHES.reset()
    clean, finite, detections = step(recorder)
    assert finite and not detections and tg.LAUNCHES.by_kernel.get("check_pass", 0) > 0
    # Every pass read the GEMMs' own half-precision operands, and c_attn's q, k, v references came from one of them
    # (3 × 2 columns).
    assert (6, dtype) in passes and all(d == dtype for _, d in passes), passes
    forward = [c for c in recorder.calls if c.phase == "forward" and c.op != "bmm" and is_model_gemm(c)]
    backward = [c for c in recorder.calls if c.phase == "backward" and is_model_gemm(c)]
    # c_attn (3 × 64 features; element 2·64 + 5 of a row is in its v slice), c_fc (256 features), a late dX/dW.
    targets = [(forward[0], 2 * 64 + 5), (max(forward[:-1], key=lambda c: c.shape[-1]), 17), (backward[-2], 9)]
    failures = []
    for n, (call, element) in enumerate(targets):
        injector = GemmInjector(target=call.index, kind=KINDS[n % len(KINDS)], element=element)
        grads, finite, found = step(injector)
        assert injector.hit == call
        outcome = [(d.op, d.action) for d in found]
        if not (finite and worst_rel(grads, clean) <= 2e-2 and outcome
                and all(action in ("corrected", "recomputed") for _, action in outcome)):
            failures.append((call, worst_rel(grads, clean), outcome))
    assert not failures


WIDE = {"gpt2": {"n_layer": 1, "n_embd": 512, "n_head": 8},
        "llama": {"num_hidden_layers": 1, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
                  "num_key_value_heads": 8}}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_wide_layers_are_checked_in_runs_and_their_faults_corrected(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 512 columns and more are checked in runs on the Triton path (device.runs). At width 512 every
    Linear/Conv1D GEMM but the LM head's forward has such rows: GPT-2's c_fc 8 runs, its fused c_attn (checked per
    q/k/v slice) and the rest 2, every dX and dW 2 or 8; Llama's q/k/v/o and down 2, gate and up 4. A clean step
    flags nothing and checks some GEMM in each of those run counts; GPT-2's c_fc forward and the fused c_attn's
    slices, the MLP's dX and dW with rows in 8 runs (a Conv1D's gradient through its transposed view) and c_attn's
    dW, and Llama's sample (``linear_sample``), each hit in turn below
    autograd, the four kinds rotating, is corrected or recomputed with the fault-free gradients (fp32, to 1e-5: a
    corrected half-precision element is the exact value rounded, which the GEMM's own may differ from by an ulp)."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    seen_runs: list[int] = []
    launch = tg.check_pass

    def spy(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, side: tg.RowSide,
            *args: object, **kwargs: object) -> tg.Check:
        seen_runs.append(side.runs)
        return launch(c, a, b, bias, side, *args, **kwargs)

    monkeypatch.setattr(tg, "check_pass", spy)

    def step(injector: GemmInjector) -> tuple[dict[str, torch.Tensor], bool, list]:
        model = build(arch, **WIDE[arch])
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        guard = attnchecker.protect(model, optimizer=opt, policy=Policy.full(), scope="all")
        try:
            grads = injected_step(arch, model, opt, injector)
            return grads, all(bool(torch.isfinite(p).all()) for p in model.parameters()), list(guard.detections)
        finally:
            guard.close()

    recorder = GemmInjector()
    clean, finite, detections = step(recorder)
    assert finite and not detections
    assert set(seen_runs) >= ({1, 2, 8} if arch == "gpt2" else {1, 2, 4}), sorted(set(seen_runs))
    calls = [c for c in recorder.calls if is_model_gemm(c) and not (c.phase == "forward" and c.op == "bmm")]
    # GPT-2 (48 tokens): forward c_attn (48, 1536) and c_fc (48, 2048); backward the MLP's c_proj dX (48, 2048) and
    # dW (2048, 512), c_attn's dW (512, 1536).
    wanted = {("forward", (48, 1536)), ("forward", (48, 2048)), ("backward", (48, 2048)), ("backward", (2048, 512)),
              ("backward", (512, 1536))}
    calls = ([c for c in calls if (c.phase, c.shape) in wanted] if arch == "gpt2" else linear_sample(recorder.calls))
    assert len(calls) >= 4
    assert not faults_corrected_in_turn(calls, step, clean, first=5, stride=31)


@pytest.mark.parametrize(("arch", "projections"), [("gpt2", 2), ("llama", 4)])
def test_a_projection_fault_on_a_quiet_step_is_recomputed_on_the_device(arch: str, projections: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tier 1 of the attention's projections where the GEMM checks' Triton path runs: the tier-1 pass (which
    recomputes a tripped row itself) on the device (gemm.projection._on_device), not the host's sum and its sync
    per call, every step.
    An INF, NaN, 3e20 or exponent flip written below autograd into each projection's forward output (GPT-2's c_attn
    and c_proj; Llama's q, k, v and o) on a quiet step is recomputed, reported at the step boundary with the
    projection's op and tier "tripwire", and the gradients are the clean quiet step's. The host's tier 1 is never
    asked."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")

    def host_tier1(*_args: object) -> bool:
        raise AssertionError("the projections' tier 1 ran on the host")

    model = model_of(arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pinned = dict.fromkeys(("q", "k", "v", "scores", "context", "out"), 1000)
    guard = attnchecker.protect(model, optimizer=opt, policy=Policy(op_periods=pinned, adaptive=False))

    def step(injector: GemmInjector) -> tuple[dict[str, torch.Tensor], list]:
        return guarded_step(arch, model, opt, guard, injector)

    try:
        step(GemmInjector())  # step 0 checks every op in full
        monkeypatch.setattr(projection, "tripped", host_tier1)
        assert not guard.check_config.checks("q") and guard.check_config.trips("q")
        recorder = GemmInjector()
        clean, detections = step(recorder)
        assert not detections and guard.report().tier_checks["tripwire"] > 0
        forward = [c for c in recorder.calls if c.phase == "forward" and c.op != "bmm" and is_model_gemm(c)]
        failures = []
        for n, call in enumerate(forward[:projections]):
            kind = KINDS[n % len(KINDS)]
            grads, detections = step(GemmInjector(target=call.index, kind=kind, element=4 + 9 * n))
            outcome = [(d.op, d.tier, d.action) for d in detections]
            if not (worst_rel(grads, clean) <= 1e-5 and outcome
                    and all(op in PROJECTION_OPS and t == "tripwire" and a == "recomputed" for op, t, a in outcome)):
                failures.append((call, kind, worst_rel(grads, clean), outcome))
        assert not failures
    finally:
        guard.close()


@pytest.mark.parametrize(("arch", "projections"), [("gpt2", 2), ("llama", 4), ("bert", 4)])
def test_a_projection_fault_on_a_checked_step_is_corrected_on_the_device(arch: str, projections: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention's projections' full check where the GEMM checks' Triton path runs: each slice's check pass and
    repair kernel on the device (gemm.projection._on_device), as every other Linear's there, not the host's
    checksum ops and their sync per call. An INF, NaN, 3e20 or exponent flip written below autograd into each
    projection's forward output (GPT-2's fused c_attn, one of its q/k/v slices, and c_proj; Llama's and BERT's q, k, v
    and output projections, BERT's with a bias) on a step of Policy.full() is corrected or its row recomputed,
    reported at the step boundary with the projection's op and tier "abft", and the gradients are the fault-free
    step's. The host's projection check is never asked."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    recorder = GemmInjector()
    clean, finite, detections = one_step(arch, recorder, scope="attention")
    assert finite and not detections

    def host_check(*_args: object, **_kwargs: object) -> object:
        raise AssertionError("a projection's full check ran on the host")

    monkeypatch.setattr(projection._ProjectionInput, "checks", host_check)
    monkeypatch.setattr(projection, "tripped", host_check)
    forward = [c for c in recorder.calls if c.phase == "forward" and c.op != "bmm" and is_model_gemm(c)]
    failures = []
    for n, call in enumerate(forward[:projections]):
        kind = KINDS[n % len(KINDS)]
        injector = GemmInjector(target=call.index, kind=kind, element=6 + 7 * n)
        grads, finite, detections = one_step(arch, injector, scope="attention")
        assert injector.hit == call
        outcome = [(d.op, d.tier, d.action) for d in detections]
        if not (finite and worst_rel(grads, clean) <= 1e-5 and outcome
                and all(op in PROJECTION_OPS and t == "abft" and a in ("corrected", "recomputed")
                        for op, t, a in outcome)):
            failures.append((call, kind, worst_rel(grads, clean), outcome))
    assert not failures


@pytest.mark.parametrize("scope", ["all", "attention"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_a_step_on_the_device_path_adds_no_host_sync(arch: str, scope: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU route end to end (CPU tensors under the interpreter): the Triton attention forward, the GEMM checks'
    Triton path, the attention backward off the CPU kernel. A step, forward and backward, in either scope, makes the
    host wait for the device no more often than the unprotected step does (BERT's mask building waits once, in
    transformers, either way): on the first step every op's full check, the projections' included, on the steps
    after it tier 1 of every projection, Linear GEMM and attention output; their outcomes stay on the device until
    the step boundary. There the optimizer's step reads them, with the last net's finiteness of the gradients, in
    one sync."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setattr(fused, "cpu_kernel", False)
    boundaries: list[list[str]] = []

    def syncs_of_a_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
        opt.zero_grad(set_to_none=True)
        with SyncCounter() as syncs:
            loss_of(arch, model, batch(arch, 0)).backward()
        with SyncCounter() as boundary:
            opt.step()
        boundaries.append(boundary.calls)
        return syncs.calls

    plain = model_of(arch)
    unprotected = syncs_of_a_step(plain, torch.optim.SGD(plain.parameters(), lr=0.0))
    model = model_of(arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pinned = dict.fromkeys(("q", "k", "v", "scores", "context", "out"), 1000)
    guard = attnchecker.protect(model, optimizer=opt, scope=scope, policy=Policy(op_periods=pinned, adaptive=False))
    try:
        tg.LAUNCHES.reset()
        checked = syncs_of_a_step(model, opt)
        assert guard.report().checks.get("q", 0) > 0 and tg.LAUNCHES.by_kernel.get("check_pass", 0) > 0
        quiet = [syncs_of_a_step(model, opt) for _ in range(2)]
        assert not guard.check_config.checks("q") and guard.check_config.trips("q")
        assert [checked, *quiet] == [unprotected] * 3, (checked, quiet, unprotected)
        assert boundaries == [[], ["tolist"], ["tolist"], ["tolist"]], boundaries
        assert guard.report().tier_checks["tripwire"] > 0 and not guard.detections
        assert all("triton" in line for line in guard.coverage.backend_lines())
    finally:
        guard.close()


class _OutputRecorder(GemmInjector):
    """GemmInjector that also keeps the address of each GEMM output's storage, to name the GEMM a check kernel was
    launched on (a view of its output: one of a fused projection's slices, a transposed weight gradient)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.outputs: list[int] = []

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: object = None) -> object:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.outputs) < len(self.calls):
            self.outputs.append(out.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize(("kernel", "fail_at"), [("check_pass", 2), ("check_pass", 5), ("trip_pass", 1),
                                                 ("trip_pass", 2), ("trip_pass_pair", 1), ("trip_pass_pair", 2)])
def test_a_gemm_check_kernel_that_fails_hands_its_gemms_to_the_cpu_path_and_training_goes_on(
        kernel: str, fail_at: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A GEMM check kernel the GPU's Triton cannot compile (the interpreter never compiles one) or whose launch raises,
    on the ``fail_at``-th launch of a step: on a full-check step (``check_pass``: an MLP Linear's forward, where nothing
    of the call was checked yet; the LM head's dW, after its dX was) and on a tier-1 step (``trip_pass``: the fused
    q/k/v projection's one pass over its three slices, and the attention's out projection after it;
    ``trip_pass_pair``, which takes two GEMMs: the first and second of the backward's Linears, their dX and dW). The
    GEMM whose kernel failed (all three slices of the fused projection's), and the rest of that call, are checked on
    the CPU path at once: a NaN written below autograd into that very GEMM's output is corrected or recomputed and
    reported once, and the gradients are the clean step's. Every GEMM of the step is counted once, as on a step where
    nothing failed. The failure is logged once, and the path is never tried again in the
    process: the next step runs on the CPU path, checked."""
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    monkeypatch.setattr(device, "_failed", [])
    real = getattr(tg, kernel)
    launches: list[torch.Tensor] = []
    failed_on: list[int] = []
    armed = [False]

    def launcher(first: torch.Tensor | tg.TripGemm, *args: object, **kwargs: object) -> object:
        c = first.c if isinstance(first, tg.TripGemm) else first  # a pair: its first GEMM's output
        launches.append(c)
        if armed[0] and len(launches) == fail_at:
            failed_on.append(c.untyped_storage().data_ptr())
            raise RuntimeError("PassManager::run failed")
        return real(first, *args, **kwargs)

    monkeypatch.setattr(tg, kernel, launcher)
    tier1 = kernel.startswith("trip_pass")

    def run(injector: GemmInjector, *, sabotage: bool, steps: int = 1) -> tuple[dict[str, torch.Tensor], list, dict]:
        """``steps`` steps of a fresh one-layer GPT-2 under scope="all" (lr 0), the first under ``injector``: the
        first step's gradients, every detection, and the first step's check counts."""
        device._failed.clear()
        launches.clear()
        armed[0] = sabotage
        model = model_of("gpt2")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        guard = attnchecker.protect(model, optimizer=opt, policy=Policy.full(), scope="all")
        try:
            if tier1:
                guard.tripwire_only_this_step()
            grads = injected_step("gpt2", model, opt, injector)
            counts = {"abft": dict(guard.report().checks), "tripwire": guard.report().tier_checks["tripwire"]}
            for _ in range(steps - 1):
                injected_step("gpt2", model, opt, GemmInjector())
            return grads, list(guard.detections), counts
        finally:
            guard.close()

    plain, _, _ = one_step("gpt2", GemmInjector(), scope=None)
    clean, detections, want_counts = run(GemmInjector(), sabotage=False)
    assert not detections and worst_rel(clean, plain) <= 1e-5
    assert len(launches) > fail_at

    recorder = _OutputRecorder()
    with caplog.at_level("ERROR", logger="attnchecker"):
        grads, detections, counts = run(recorder, sabotage=True, steps=2)
    assert len(launches) == fail_at, "the path was tried again after it failed"
    assert len([r for r in caplog.records if "GEMM checks run as PyTorch ops" in r.message]) == 1
    assert device.failed() is not None and "PassManager::run failed" in device.failed()
    assert not detections and worst_rel(grads, clean) <= 1e-5
    assert counts == want_counts

    target = max(i for i, ptr in enumerate(recorder.outputs) if ptr == failed_on[0])
    injector = GemmInjector(target=target, kind="nan", element=11)
    grads, detections, _ = run(injector, sabotage=True)
    assert injector.hit == recorder.calls[target]
    outcome = [(d.op, d.tier, d.action) for d in detections]
    assert len(outcome) == 1 and outcome[0][0] in (*GEMM_OPS, *PROJECTION_OPS), outcome
    assert outcome[0][1:] in ((("tripwire",) if tier1 else ("abft",)) + (a,) for a in ("corrected", "recomputed"))
    assert worst_rel(grads, clean) <= 1e-5
