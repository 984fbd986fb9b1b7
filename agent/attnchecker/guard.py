"""``protect(model) -> Guard``: attach the protected attention to an unmodified model, and take it off exactly.

The guard owns the run-time side: the step counter, the policy (applied only at step boundaries), the scheduler
that picks the ops to check, the counters, the bounded detection log and what to do about uncorrectable faults.
Integrations (``integrations/``) own how a given architecture is attached; every change they make is recorded as
an undo action, so ``close()`` restores the model exactly.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .context import OPS, CheckConfig, OpStats, Runtime
from .errors import (
    AlreadyProtectedError,
    NoProtectableAttentionError,
    StreamingUnavailableError,
    UncorrectableFault,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
)
from .events import Detection
from .integrations._common import Binder, Site
from .policy import Policy, PolicyError, Scheduler
from .streaming import add_counts

__all__ = ["FaultCounts", "Guard", "Report", "is_protected", "protect", "unprotect"]

log = logging.getLogger("attnchecker")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = ("cpu", "cuda")
SUPPORTED_MODELS = (
    "Hugging Face transformers models whose attention goes through the AttentionInterface "
    "(tested: GPT-2, BERT, RoBERTa, Llama), and GPT-Neo; "
    "plain PyTorch modules that call torch.nn.functional.scaled_dot_product_attention (nanoGPT style); "
    "torch.nn.MultiheadAttention and the nn.Transformer*Layer modules built on it "
    "(see docs/architectures.md)"
)

# Live guards by the model they protect, and by every attention module they own (to refuse protecting a model, or
# a part of one, twice). Weak, so a model that is dropped without close() does not stay alive because of us.
_GUARDS: weakref.WeakKeyDictionary[nn.Module, Guard] = weakref.WeakKeyDictionary()
_OWNED: weakref.WeakKeyDictionary[nn.Module, Guard] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class FaultCounts:
    detected: int = 0
    corrected: int = 0
    """Corrected in place or by recomputation."""
    uncorrectable: int = 0


@dataclass(frozen=True, slots=True)
class Report:
    """What the guard has counted since ``protect()``. Plain data; ``as_dict()`` is JSON-ready."""

    steps: int
    """Step boundaries passed (``Guard.step()`` calls)."""
    checks: Mapping[str, int]
    """Verified op calls, per op."""
    faults: Mapping[tuple[str, str], FaultCounts]
    """Per (op, kind); kinds are events.KINDS."""
    skipped_steps: int = 0
    """Optimizer steps skipped under ``on_uncorrectable="skip_step"``."""

    @property
    def detected(self) -> int:
        return sum(c.detected for c in self.faults.values())

    @property
    def corrected(self) -> int:
        return sum(c.corrected for c in self.faults.values())

    @property
    def uncorrectable(self) -> int:
        return sum(c.uncorrectable for c in self.faults.values())

    def by_op(self) -> dict[str, FaultCounts]:
        out: dict[str, list[int]] = {}
        for (op, _kind), c in self.faults.items():
            row = out.setdefault(op, [0, 0, 0])
            row[0] += c.detected
            row[1] += c.corrected
            row[2] += c.uncorrectable
        return {op: FaultCounts(*row) for op, row in out.items()}

    def as_dict(self) -> dict[str, Any]:
        faults: dict[str, dict[str, dict[str, int]]] = {}
        for (op, kind), c in sorted(self.faults.items()):
            faults.setdefault(op, {})[kind] = {
                "detected": c.detected,
                "corrected": c.corrected,
                "uncorrectable": c.uncorrectable,
            }
        return {
            "steps": self.steps,
            "checks": dict(self.checks),
            "faults": faults,
            "detected": self.detected,
            "corrected": self.corrected,
            "uncorrectable": self.uncorrectable,
            "skipped_steps": self.skipped_steps,
        }


@dataclass(slots=True)
class _Totals:
    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    faults: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def add(self, stats: OpStats) -> None:
        add_counts(self.checks, self.faults, stats)


def _coerce_policy(policy: Policy | Mapping[str, Any] | None) -> Policy:
    if policy is None:
        return Policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Mapping):
        return Policy.from_wire(policy)
    raise PolicyError(
        f"policy must be an attnchecker.Policy, a mapping of its fields, or None; got {type(policy).__name__}"
    )


def _config_from(policy: Policy, checked_ops: frozenset[str]) -> CheckConfig:
    return CheckConfig(
        mode=policy.mode,
        tolerance=policy.tolerance,
        tolerance_factor=policy.tolerance_factor,
        source_repair=policy.source_repair,
        checked_ops=checked_ops,
    )


class Guard:
    """The handle ``protect()`` returns. Use ``step()`` at step boundaries (automatic with ``optimizer=``),
    ``report()`` / ``detections`` to see what happened, ``set_policy()`` to change the policy, ``close()`` to undo.

    Not thread-safe except ``set_policy`` (a single reference assignment, picked up at the next ``step()``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        policy: Policy,
        optimizer: torch.optim.Optimizer | None,
        run: str | None,
        faults: Any,
        rank: int,
        max_detections: int,
    ) -> None:
        self.model = model
        self.run = run
        self.rank = rank
        self._policy = policy
        self._pending_policy: Policy | None = None
        self._scheduler = Scheduler(policy)
        self.runtime = Runtime(
            step=0, injector=_make_injector(faults), on_detection=self._on_detection, stats=OpStats()
        )
        self._binder = Binder(self.runtime)
        self._detections: deque[Detection] = deque(maxlen=max_detections)
        self._totals = _Totals()
        self._steps = 0
        self._skipped_steps = 0
        self._skip_next_step = False
        self._raise_pending: list[Detection] = []
        self._forward_depth = 0
        self._optimizers: list[torch.optim.Optimizer] = []
        self._closed = False
        self._step_started = time.perf_counter()
        try:
            _attach(self._binder, model)
            if not self._binder.sites:
                raise NoProtectableAttentionError(
                    f"attnchecker found no attention it can protect in {type(model).__name__}. "
                    f"Supported: {SUPPORTED_MODELS}."
                )
            _require_supported_params(model, self._binder)
            pre = model.register_forward_pre_hook(self._root_pre_hook)
            post = model.register_forward_hook(self._root_post_hook, always_call=True)
            self._binder.on_close(pre.remove)
            self._binder.on_close(post.remove)
            if optimizer is not None:
                self.attach_optimizer(optimizer, step=True)
        except BaseException:
            self._binder.undo_all()
            raise
        _GUARDS[model] = self
        for module in self._binder.contexts:
            _OWNED[module] = self
        self._configure_step()

    # ----------------------------------------------------------------- public API

    @property
    def step_count(self) -> int:
        """The current step (``runtime.step``): the number of ``step()`` calls so far."""
        return self.runtime.step

    @property
    def policy(self) -> Policy:
        """The policy in force on the current step (a ``set_policy`` waits for the next step boundary)."""
        return self._policy

    @property
    def sites(self) -> tuple[Site, ...]:
        """The protected attention layers: module name, layer index, integration, ops verified."""
        return tuple(self._binder.sites)

    @property
    def detections(self) -> list[Detection]:
        """The most recent detections, oldest first (bounded: ``max_detections``)."""
        return list(self._detections)

    @property
    def injector(self) -> Any:
        """The fault injector (``faults=``), or None. ``injector.injected`` is the ground truth of what was hit."""
        return self.runtime.injector

    @property
    def closed(self) -> bool:
        return self._closed

    def set_policy(self, policy: Policy | Mapping[str, Any]) -> None:
        """Use ``policy`` from the next step boundary on. Validated now; a bad policy raises ``PolicyError``."""
        self._pending_policy = _coerce_policy(policy)

    def step(self) -> None:
        """Close the current step: feed the scheduler, apply a pending policy, pick the ops of the next step."""
        if self._closed:
            return
        stats = self.runtime.stats
        assert stats is not None
        # A fresh interval first: anything the engine records from now on belongs to the next step.
        self.runtime.stats = OpStats()
        self._totals.add(stats)
        now = time.perf_counter()
        step_s = now - self._step_started
        self._step_started = now
        config = self.runtime.config
        faults_by_op: dict[str, int] = {}
        for (op, _kind), row in stats.faults.items():
            faults_by_op[op] = faults_by_op.get(op, 0) + row[0]
        # An op that was due but never ran (no forward this step, or not present in this model) was not checked.
        checked = frozenset(op for op in config.checked_ops if stats.checks.get(op, 0) > 0)
        check_s = sum(stats.check_seconds.values())
        overhead = check_s / step_s if step_s > 0 and check_s > 0 else None
        self._scheduler.observe(self.runtime.step, checked=checked, faults=faults_by_op, overhead_ratio=overhead)
        pending, self._pending_policy = self._pending_policy, None
        if pending is not None:
            self._policy = pending
            self._scheduler.set_policy(pending)
        self.runtime.step += 1
        self._steps += 1
        self._configure_step()

    def report(self) -> Report:
        """Counts since ``protect()``, including the step in progress."""
        totals = _Totals(checks=dict(self._totals.checks), faults={k: list(v) for k, v in self._totals.faults.items()})
        if self.runtime.stats is not None:
            totals.add(self.runtime.stats)
        return Report(
            steps=self._steps,
            checks=MappingProxyType(totals.checks),
            faults=MappingProxyType({k: FaultCounts(*v) for k, v in totals.faults.items()}),
            skipped_steps=self._skipped_steps,
        )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *, step: bool = True) -> None:
        """Hook an optimizer: ``step=True`` calls ``Guard.step()`` after each ``optimizer.step()``; either way
        ``on_uncorrectable="skip_step"`` can skip its next step (by setting the gradients to None, which every torch
        optimizer treats as "no update" for that parameter)."""
        optimizer = _unwrap_optimizer(optimizer)
        pre = optimizer.register_step_pre_hook(self._optimizer_pre_hook)
        self._binder.on_close(pre.remove)
        if step:
            post = optimizer.register_step_post_hook(self._optimizer_post_hook)
            self._binder.on_close(post.remove)
        self._optimizers.append(optimizer)

    def close(self) -> None:
        """Undo everything ``protect()`` did, newest change first. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if _GUARDS.get(self.model) is self:
            del _GUARDS[self.model]
        for module in list(self._binder.contexts):
            if _OWNED.get(module) is self:
                del _OWNED[module]
        self._optimizers.clear()
        self._binder.undo_all()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self.runtime.step}"
        return f"Guard({type(self.model).__name__}, layers={len(self._binder.sites)}, {state})"

    # ----------------------------------------------------------------- internals

    def _configure_step(self) -> None:
        # One new frozen object, swapped in by a single assignment: a layer never sees half a config.
        due = self._scheduler.due(self.runtime.step)
        self.runtime.config = _config_from(self._policy, due)

    def _on_detection(self, det: Detection) -> None:
        det.rank = self.rank
        det.policy_version = self._policy.version
        self._detections.append(det)
        if det.action != "uncorrectable":
            log.debug(
                "attnchecker: %s %s %s in layer %d op %s at step %d",
                det.action,
                det.pattern,
                det.kind,
                det.layer,
                det.op,
                det.step,
            )
            return
        action = self._policy.on_uncorrectable
        log.warning(
            "attnchecker: uncorrectable %s %s fault in layer %d op %s at step %d (on_uncorrectable=%s)",
            det.pattern,
            det.kind,
            det.layer,
            det.op,
            det.step,
            action,
        )
        if action == "skip_step":
            if not self._optimizers:
                log.warning("attnchecker: on_uncorrectable=skip_step but no optimizer is attached; nothing skipped")
            self._skip_next_step = True
        elif action == "raise":
            self._raise_pending.append(det)
            if self._forward_depth == 0:
                # Not inside the protected model's own forward (a submodule called directly): raise now.
                self._raise_uncorrectable()

    def _raise_uncorrectable(self) -> None:
        dets, self._raise_pending = self._raise_pending, []
        first = dets[0]
        raise UncorrectableFault(
            f"uncorrectable {first.pattern} {first.kind} fault in layer {first.layer} op {first.op} at step "
            f"{first.step} ({len(dets)} in this forward); policy on_uncorrectable='raise'",
            dets,
        )

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        self._forward_depth += 1

    def _root_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_depth -= 1
        if self._forward_depth == 0 and self._raise_pending:
            # Deferred to the end of the forward so the engine finishes its record of every layer first.
            self._raise_uncorrectable()

    def _optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._skip_next_step:
            return
        self._skip_next_step = False
        self._skipped_steps += 1
        log.warning("attnchecker: skipping optimizer step at step %d after an uncorrectable fault", self.runtime.step)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _optimizer_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step()


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # Wrappers (accelerate's AcceleratedOptimizer, Lightning's) subclass Optimizer without its hook state and forward
    # step() to the optimizer they hold: hook that one.
    while "_optimizer_step_pre_hooks" not in vars(optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    inner: torch.optim.Optimizer = optimizer
    return inner


def _make_injector(faults: Any) -> Any:
    if faults is None:
        return None
    from .inject import FaultPlan, Injector

    if isinstance(faults, Injector):
        return faults
    if not isinstance(faults, FaultPlan):
        raise TypeError(f"faults must be an attnchecker.FaultPlan (or Injector), got {type(faults).__name__}")
    return Injector(faults)


def _attach(binder: Binder, model: nn.Module) -> None:
    from .integrations import sdpa, torch_mha
    from .integrations import transformers as hf

    # transformers models anywhere in the tree (the model itself, or inside DDP, a LightningModule, a wrapper).
    inside_hf: set[nn.Module] = set()
    for prefix, root in hf.transformers_roots(model):
        hf.attach(binder, root, prefix=prefix)
        inside_hf.update(root.modules())
    sdpa.attach(binder, model, exclude=inside_hf)
    torch_mha.attach(binder, model)


def _iter_site_params(binder: Binder) -> Iterator[tuple[str, torch.Tensor]]:
    names = {site.layer: site.name for site in binder.sites}
    for module, ctx in binder.contexts.items():
        for pname, p in module.named_parameters():
            yield f"{names.get(ctx.layer, '?')}.{pname}".lstrip("."), p


def _require_supported_params(model: nn.Module, binder: Binder) -> None:
    params = list(_iter_site_params(binder)) or [(n, p) for n, p in model.named_parameters()]
    for name, p in params:
        if p.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedDtypeError(
                f"attnchecker supports float32, bfloat16 and float16 attention; parameter {name!r} is {p.dtype}. "
                "Cast the model (e.g. model.float()) before protect(), or use autocast for mixed precision."
            )
        if p.device.type not in SUPPORTED_DEVICES:
            raise UnsupportedDeviceError(
                f"attnchecker runs on {', '.join(SUPPORTED_DEVICES)}; parameter {name!r} is on {p.device}. "
                "Move the model to a supported device before protect()."
            )


def protect(
    model: nn.Module,
    *,
    policy: Policy | Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    run: str | None = None,
    collector: str | None = None,
    token: str | None = None,
    faults: Any = None,
    rank: int = 0,
    max_detections: int = 10_000,
) -> Guard:
    """Protect the attention of an unmodified model with ABFT checksums. Returns a :class:`Guard`; also usable as
    ``with protect(model) as guard: ...``.

    Args:
        policy: what to check and how often (default ``Policy()``); a mapping is read as the wire form.
        optimizer: if given, ``Guard.step()`` runs after each ``optimizer.step()``.
        run: a name for this run (reported with the guard; used by streaming once it lands).
        collector, token: streaming to a collector. Not wired yet: giving either raises
            :class:`StreamingUnavailableError` instead of silently dropping events.
        faults: an ``attnchecker.FaultPlan`` to inject (tests, demos, campaigns).
        rank: the distributed rank, stamped on every detection.
        max_detections: how many recent detections ``Guard.detections`` keeps.

    Raises:
        NoProtectableAttentionError, AlreadyProtectedError, UnsupportedDtypeError, UnsupportedDeviceError,
        StreamingUnavailableError, PolicyError.
    """
    if collector is not None or token is not None:
        raise StreamingUnavailableError(
            "protect(collector=..., token=...): streaming to a collector is not wired into the agent yet, and "
            "accepting these arguments would silently drop every event. Call protect() without them for now; "
            "Guard.report() and Guard.detections hold what the guard saw."
        )
    if not isinstance(model, nn.Module):
        raise NoProtectableAttentionError(f"protect() needs a torch.nn.Module, got {type(model).__name__}")
    if model in _GUARDS:
        raise AlreadyProtectedError(
            f"{type(model).__name__} is already protected by {_GUARDS[model]!r}; close() that guard first"
        )
    for name, module in model.named_modules():
        owner = _OWNED.get(module)
        if owner is not None:
            raise AlreadyProtectedError(
                f"module {name or '<root>'} ({type(module).__name__}) is already protected by {owner!r} "
                f"(protecting {type(owner.model).__name__}); close() that guard first"
            )
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    if max_detections < 1:
        raise ValueError(f"max_detections must be >= 1, got {max_detections!r}")
    return Guard(
        model,
        policy=_coerce_policy(policy),
        optimizer=optimizer,
        run=run,
        faults=faults,
        rank=rank,
        max_detections=max_detections,
    )


def is_protected(model: nn.Module) -> bool:
    """Whether a live guard protects the model, or any attention module inside it."""
    if model in _GUARDS:
        return True
    return any(module in _OWNED for module in model.modules())


def unprotect(model: nn.Module) -> bool:
    """Close the guard that protects ``model`` (as returned by ``protect``). Returns False if there was none."""
    guard = _GUARDS.get(model)
    if guard is None:
        return False
    guard.close()
    return True
