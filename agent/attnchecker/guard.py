"""``protect(model) -> Guard``: attach the protected attention to an unmodified model, and take it off exactly.

The guard owns the run-time side: the step counter, the policy (applied only at step boundaries), the scheduler
that picks the ops to check, the counters, the bounded detection log and what to do about uncorrectable faults.
Integrations (``integrations/``) own how a given architecture is attached; every change they make is recorded as
an undo action, so ``close()`` restores the model exactly.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .context import OPS, TIERS, CheckConfig, OpStats, Runtime
from .coverage import Coverage
from .engine_caches import engine_caches
from .errors import (
    AlreadyProtectedError,
    NoProtectableAttentionError,
    UncorrectableFault,
    UnprotectedAttentionError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
)
from .events import Detection
from .integrations._common import Binder, Site
from .policy import Policy, PolicyError, Scheduler
from .streaming import IntervalStats, add_counts

if TYPE_CHECKING:
    from .transport import TransportConfig

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
    """Optimizer steps skipped under ``on_uncorrectable="skip_step"`` (and by the optimizer net)."""
    tier_checks: Mapping[str, int] = field(default_factory=dict)
    """Checks per tier (context.TIERS): tripwire = op calls only tier 1 looked at, abft = ``sum(checks)``,
    optimizer = optimizer steps whose gradients the last net looked at."""
    tier_catches: Mapping[str, int] = field(default_factory=dict)
    """Faults caught per tier (each Detection once)."""
    coverage: Coverage | None = None
    """Per layer and op: protected by which path, or not and why; and calls that fell back at run time."""

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
            "tier_checks": dict(self.tier_checks),
            "tier_catches": dict(self.tier_catches),
            "coverage": self.coverage.as_dict() if self.coverage is not None else None,
        }


@dataclass(slots=True)
class _Totals:
    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    faults: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    tier_checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    tier_catches: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def add(self, stats: OpStats) -> None:
        add_counts(self.checks, self.faults, stats)
        self.tier_checks["tripwire"] += sum(stats.trip_checks.values())
        self.tier_checks["abft"] += sum(stats.checks.values())
        self.tier_checks["optimizer"] += stats.grad_checks
        for (tier, _op), n in stats.catches.items():
            self.tier_catches[tier] = self.tier_catches.get(tier, 0) + n


@dataclass(frozen=True, slots=True)
class _Streaming:
    """What protect() was told about streaming; the guard starts the transport once the model is attached."""

    collector: str | None
    """Base URL, or None: offline (everything spooled for ``attnchecker sync``)."""
    token: str | None
    run: str
    spool_dir: Path
    interval_s: float
    interval_steps: int
    transport: TransportConfig
    register_policy: bool = False
    """protect() was given ``policy=`` explicitly: send it as a new run's starting policy (docs/wire.md)."""


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
        tripwire=policy.tripwire,
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
        streaming: _Streaming | None = None,
        strict: bool = False,
        scope: str = "attention",
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
        self._binder.strict = strict
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
        self._transport: Any = None
        self._atexit: Any = None
        self._interval: IntervalStats | None = None
        self._remote_policy: Policy | None = None
        try:
            _attach(self._binder, model)
            if not self._binder.sites:
                raise NoProtectableAttentionError(
                    f"attnchecker found no attention it can protect in {type(model).__name__}. "
                    f"Supported: {SUPPORTED_MODELS}."
                )
            _require_supported_params(model, self._binder)
            _check_coverage(self._binder.coverage(), strict=strict)
            if scope == "all":
                from . import linear_abft  # after the attention integrations: their projection hooks must exist

                linear_abft.attach(self._binder, model)
            pre = model.register_forward_pre_hook(self._root_pre_hook)
            post = model.register_forward_hook(self._root_post_hook, always_call=True)
            self._binder.on_close(pre.remove)
            self._binder.on_close(post.remove)
            if optimizer is not None:
                self.attach_optimizer(optimizer, step=True)
        except BaseException:
            self._binder.undo_all()
            raise
        if streaming is not None:
            # Only once the model is attached: a protect() that raises leaves no sender thread behind.
            try:
                self._start_streaming(streaming)
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
    def coverage(self) -> Coverage:
        """What is protected, per layer and op and by which path, and what is not and why (docs/architectures.md),
        including calls that fell back to an unprotected kernel so far."""
        return self._binder.coverage()

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

    @property
    def periods(self) -> Mapping[str, int]:
        """The effective check period of every op now, in steps (pins, the base period, or the adaptive scheduler's
        current value; docs/adaptive.md). What the stats report as ``ops[].period``."""
        return MappingProxyType(self._scheduler.periods())

    @property
    def intervals(self) -> list[dict[str, Any]]:
        """The most recent stats intervals sent to the collector (wire payloads, docs/wire.md), oldest first;
        empty without streaming."""
        return list(self._interval.sent) if self._interval is not None else []

    @property
    def transport(self) -> Any:
        """The :class:`attnchecker.transport.Transport` streaming to the collector (``collector=``), or None.
        ``transport.run_id`` is the collector's id of the run once it registered."""
        return self._transport

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
            if op in OPS:  # whole-step GEMM ops (linear_abft) follow the "out" schedule, not one of their own
                faults_by_op[op] = faults_by_op.get(op, 0) + row[0]
        # An op that was due but never ran (no forward this step, or not present in this model) was not checked.
        checked = frozenset(op for op in config.checked_ops if stats.checks.get(op, 0) > 0)
        check_s = sum(stats.check_seconds.values())
        # A measured step with nothing checked costs 0, and the scheduler's window must see it as such; None means
        # "not measured" (a clock that did not move) and is left out of the average.
        overhead = check_s / step_s if step_s > 0 else None
        self._scheduler.observe(self.runtime.step, checked=checked, faults=faults_by_op, overhead_ratio=overhead)
        changed = self._apply_policy_update()
        finished = self.runtime.step
        self.runtime.step += 1
        self._steps += 1
        self._configure_step()
        if self._interval is not None:
            try:
                self._interval.add(finished, stats, step_s)
                # A new policy version goes out at once, so the collector shows it as applied at this boundary.
                self._interval.maybe_send(applied_policy_version=self._policy.version,
                                          periods=self._scheduler.periods(), force=changed)
            except Exception:  # telemetry must never stop training
                log.exception("attnchecker: stats interval failed at step %d; training goes on", finished)

    def report(self) -> Report:
        """Counts since ``protect()``, including the step in progress."""
        totals = _Totals(checks=dict(self._totals.checks), faults={k: list(v) for k, v in self._totals.faults.items()},
                         tier_checks=dict(self._totals.tier_checks), tier_catches=dict(self._totals.tier_catches))
        if self.runtime.stats is not None:
            totals.add(self.runtime.stats)
        return Report(
            steps=self._steps,
            checks=MappingProxyType(totals.checks),
            faults=MappingProxyType({k: FaultCounts(*v) for k, v in totals.faults.items()}),
            skipped_steps=self._skipped_steps,
            tier_checks=MappingProxyType(totals.tier_checks),
            tier_catches=MappingProxyType(totals.tier_catches),
            coverage=self._binder.coverage(),
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

    def close(self, *, flush_timeout_s: float = 5.0) -> None:
        """Undo everything ``protect()`` did, newest change first, then (when streaming) send the last stats
        interval and close the transport: what cannot reach the collector within ``flush_timeout_s`` is spooled.
        Idempotent; never raises because of the network."""
        if self._closed:
            return
        self._closed = True
        if self._atexit is not None:
            atexit.unregister(self._atexit)
        try:
            last_step = self._final_interval()
        except Exception:  # the model is restored whatever happens to telemetry
            log.exception("attnchecker: could not send the last stats interval")
            last_step = None
        if _GUARDS.get(self.model) is self:
            del _GUARDS[self.model]
        for module in list(self._binder.contexts):
            if _OWNED.get(module) is self:
                del _OWNED[module]
        self._optimizers.clear()
        try:
            self._binder.undo_all()
        finally:
            engine_caches.clear()  # cached engine tensors (a causal mask: ~2 GiB at 8k context) go with the guard
            if self._transport is not None:
                self._transport.close(flush_timeout_s, last_step=last_step)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self.runtime.step}"
        return f"Guard({type(self.model).__name__}, layers={len(self._binder.sites)}, {state})"

    # ----------------------------------------------------------------- internals

    def _apply_policy_update(self) -> bool:
        """At a step boundary: switch to a newer collector policy or a ``set_policy`` one. True when it changed.

        With a collector, the run's policy there is authoritative: the version it answered at registration, then
        every version an operator makes, each applied at the first step boundary after the sender thread saw it
        (``Transport.latest_policy`` is one attribute read). A ``set_policy`` pending at the same boundary wins for
        that boundary; the next collector version replaces it.
        """
        new, self._pending_policy = self._pending_policy, None
        if self._transport is not None:
            remote = self._transport.latest_policy()
            if remote is not None and remote is not self._remote_policy:
                self._remote_policy = remote
                if new is None:
                    new = remote
                    if self._policy.version == 0:
                        _warn_replaced(self._policy, remote, self.run)
        if new is None:
            return False
        self._policy = new
        self._scheduler.set_policy(new)
        return True

    def _start_streaming(self, s: _Streaming) -> None:
        from .transport import Transport

        self._transport = Transport(
            s.collector, s.token, s.run, spool_dir=s.spool_dir,
            run_info=self._run_info(register_policy=s.register_policy), config=s.transport,
        ).start()
        self._interval = IntervalStats(self._transport.emit_stats, rank=self.rank, interval_s=s.interval_s,
                                       interval_steps=s.interval_steps)
        # A script that never calls close() still sends its last interval and finishes the run at exit. Weak, so
        # the hook does not keep a dropped model alive.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            guard = ref()
            if guard is not None:
                guard.close()

        self._atexit = close_at_exit
        atexit.register(close_at_exit)

    def _run_info(self, *, register_policy: bool = False) -> dict[str, Any]:
        """The registration body besides the name (docs/wire.md): what an operator needs to recognise the run, and
        with ``register_policy`` the policy given to protect() as a new run's starting policy (a resumed run keeps
        the collector's)."""
        world_size = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
        param = next(iter(self.model.parameters()), None)
        info: dict[str, Any] = {
            "model": type(self.model).__name__[:200],
            "world_size": world_size,
            "rank": self.rank,
            "host": socket.gethostname()[:200],
            "config": {
                "layers": len(self._binder.sites),
                "integrations": sorted({site.integration for site in self._binder.sites}),
                "ops": sorted({op for site in self._binder.sites for op in site.ops}),
                "coverage": self._binder.coverage().to_wire(),
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "device": str(param.device) if param is not None else None,
                "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
                "torch": torch.__version__,
                "policy": self._policy.to_wire(),
            },
        }
        if register_policy:
            info["policy"] = {k: v for k, v in self._policy.to_wire().items() if k != "version"}
        return info

    def _final_interval(self) -> int | None:
        """At close: fold a step in progress (a forward after the last ``step()``) into the last interval, so the
        stats count every event that was sent, and send it. Returns the last step for the finish record."""
        stats, self.runtime.stats = self.runtime.stats, None
        partial = stats is not None and (any(stats.checks.values()) or bool(stats.faults)
                                         or any(stats.trip_checks.values()) or stats.grad_checks > 0)
        if partial:
            assert stats is not None
            self._totals.add(stats)  # report() keeps counting it after close
        if self._interval is None:
            return None
        if partial:
            assert stats is not None
            self._interval.add(self.runtime.step, stats, 0.0, count_step=False)
        self._interval.maybe_send(applied_policy_version=self._policy.version, periods=self._scheduler.periods(),
                                  force=True)
        if partial:
            return self.runtime.step
        return self.runtime.step - 1 if self._steps else None

    def _configure_step(self) -> None:
        # One new frozen object, swapped in by a single assignment: a layer never sees half a config.
        due = self._scheduler.due(self.runtime.step)
        self.runtime.config = _config_from(self._policy, due)

    def _on_detection(self, det: Detection) -> None:
        det.rank = self.rank
        det.policy_version = self._policy.version
        self._detections.append(det)
        if self._transport is not None:
            self._transport.emit_event(det)  # a put_nowait: never blocks; to_wire() runs on the sender thread
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
        if not self._skip_next_step and self._policy.tripwire and self._policy.mode != "off":
            self._gradient_net(optimizer)
        if not self._skip_next_step:
            return
        self._skip_next_step = False
        self._skipped_steps += 1
        log.warning("attnchecker: skipping optimizer step at step %d after an uncorrectable fault", self.runtime.step)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _gradient_net(self, optimizer: torch.optim.Optimizer) -> None:
        """The last net (tier "optimizer"): a non-finite gradient means a fault got past both tiers (outside the
        protected GEMMs, or in backward). The optimizer never steps on it: "log" and "skip_step" both skip this step
        (stepping would write INF/NaN into the weights, which no later step undoes), "raise" raises. Every period
        snaps to min_period and a Detection (op "grad") is recorded, locally only: the event wire knows the six ops."""
        stats = self.runtime.stats
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None and not p.grad.is_sparse]
        if not grads:
            return
        if stats is not None:
            stats.grad_checks += 1
        norms = torch._foreach_norm(grads, float("inf"))
        if bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):  # sync: one per optimizer step
            return
        self._scheduler.snap_all()
        action = self._policy.on_uncorrectable
        det = Detection(op="grad", layer=0, step=self.runtime.step, pattern="2d", kind="nan", action="uncorrectable",
                        value="nan", residual=None, bound=0.0, tier="optimizer", rank=self.rank,
                        policy_version=self._policy.version)
        for n in norms:
            if not bool(torch.isfinite(n)):  # sync: slow path only, the first bad tensor's kind
                det.kind = "nan" if bool(torch.isnan(n)) else "inf"
                break
        self._detections.append(det)
        if stats is not None:
            # Not in stats.faults: those are per protected op, and "grad" is none of them.
            stats.catches[("optimizer", "grad")] = stats.catches.get(("optimizer", "grad"), 0) + 1
        log.warning("attnchecker: non-finite gradient (%s) at the optimizer at step %d: a fault outside the checked "
                    "ops; %s (on_uncorrectable=%s), every check period back to min_period", det.kind,
                    self.runtime.step, "raising" if action == "raise" else "skipping this optimizer step", action)
        if action == "raise":
            raise UncorrectableFault(
                f"non-finite gradient ({det.kind}) at the optimizer at step {self.runtime.step}; policy "
                "on_uncorrectable='raise'", [det])
        self._skip_next_step = True

    def _optimizer_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step()


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # Wrappers (accelerate's AcceleratedOptimizer, Lightning's) subclass Optimizer without its hook state and forward
    # step() to the optimizer they hold: hook that one.
    while "_optimizer_step_pre_hooks" not in vars(optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    inner: torch.optim.Optimizer = optimizer
    return inner


def _warn_replaced(local: Policy, remote: Policy, run: str | None) -> None:
    """The collector's first policy takes over from the local one: say so when they differ (a resumed run keeps its
    policy on the collector; a new run registered without ``policy=`` gets the collector's default)."""
    mine, theirs = local.to_wire(), remote.to_wire()
    changed = sorted(k for k in mine if k != "version" and mine[k] != theirs.get(k))
    if changed:
        log.warning(
            "attnchecker: run %s now follows the collector's policy v%d, which differs from the local policy in %s "
            "(an existing run keeps its policy on the collector); change the run's policy there (PUT/PATCH "
            "/api/v1/runs/{id}/policy) to use those settings",
            run, remote.version, ", ".join(changed),
        )


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


def _check_coverage(coverage: Coverage, *, strict: bool) -> None:
    """Never silent: one warning listing every op left unprotected (or, strict, an error instead)."""
    gaps = coverage.gaps()
    if not gaps:
        return
    listing = "; ".join(gaps)
    if strict:
        raise UnprotectedAttentionError(
            f"{len(coverage.unprotected)} attention op(s) would run unprotected: {listing}. "
            "Leave out strict=True to train with them unprotected (Guard.coverage lists them)."
        )
    log.warning("attnchecker: %d attention op(s) left unprotected (Guard.coverage): %s",
                len(coverage.unprotected), listing)


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
    spool_dir: str | os.PathLike[str] | None = None,
    faults: Any = None,
    rank: int | None = None,
    max_detections: int = 10_000,
    stats_interval_s: float = 1.0,
    stats_interval_steps: int = 100,
    transport_options: TransportConfig | Mapping[str, Any] | None = None,
    strict: bool = False,
    scope: str = "attention",
) -> Guard:
    """Protect the attention of an unmodified model with ABFT checksums. Returns a :class:`Guard`; also usable as
    ``with protect(model) as guard: ...``.

    Args:
        policy: what to check and how often (default ``Policy()``); a mapping is read as the wire form. With a
            collector, a policy given here is sent at registration and becomes a new run's starting policy (a
            resumed run keeps the collector's; without ``policy=`` a new run gets the collector's default). It is in
            force until the collector's answer arrives; from then on the run's policy on the collector is applied at
            step boundaries (operators change it over REST).
        optimizer: if given, ``Guard.step()`` runs after each ``optimizer.step()``.
        run: the run's name on the collector (every rank of a job passes the same one). Default:
            ``$ATTNCHECKER_RUN``, else ``<model class>-<time>-<host>``.
        collector: stream detections and interval statistics to this collector (``http://host:8000``), through a
            sender thread that never blocks training (docs/transport.md). ``"offline"``: spool only, for
            ``attnchecker sync`` later. None (default): nothing leaves the process.
        token: the agent's bearer token (default ``$ATTNCHECKER_TOKEN``).
        spool_dir: where payloads wait while the collector is unreachable (default ``$ATTNCHECKER_SPOOL_DIR``, else
            ``~/.cache/attnchecker/spool``; one subdirectory per run).
        faults: an ``attnchecker.FaultPlan`` to inject (tests, demos, campaigns).
        rank: the distributed rank, stamped on every detection (default: torch.distributed's rank when it is
            initialised, else 0).
        max_detections: how many recent detections ``Guard.detections`` keeps.
        stats_interval_s, stats_interval_steps: one stats interval goes to the collector every this many seconds
            or steps, whichever comes first (and at a policy change, and at close).
        transport_options: an :class:`attnchecker.transport.TransportConfig`, or a mapping of its fields (timeouts,
            batch size, ``poll_interval_s``, ...); an unknown key is a ValueError that lists the known ones.
        strict: raise ``UnprotectedAttentionError`` instead of warning when an attention op would run unprotected
            (a projection wrapper or attention variant the engine does not support: ``Guard.coverage``), here and at
            a run-time fallback.
        scope: ``"attention"`` (default) protects the attention ops; ``"all"`` also checks every nn.Linear /
            transformers Conv1D GEMM forward and backward (dX and dW), on the steps the ``out`` op is checked
            (docs/fault-coverage.md). Chosen at protect() time: it decides which modules are wrapped.

    Raises:
        NoProtectableAttentionError, AlreadyProtectedError, UnsupportedDtypeError, UnsupportedDeviceError,
        UnprotectedAttentionError (strict), PolicyError, ValueError (bad arguments).
    """
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
    if rank is None:
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    if max_detections < 1:
        raise ValueError(f"max_detections must be >= 1, got {max_detections!r}")
    if scope not in ("attention", "all"):
        raise ValueError(f"scope must be 'attention' or 'all', got {scope!r}")
    streaming = _streaming_config(model, run=run, collector=collector, token=token, spool_dir=spool_dir,
                                  interval_s=stats_interval_s, interval_steps=stats_interval_steps,
                                  transport_options=transport_options, register_policy=policy is not None)
    return Guard(
        model,
        policy=_coerce_policy(policy),
        optimizer=optimizer,
        run=streaming.run if streaming is not None else run,
        faults=faults,
        rank=rank,
        max_detections=max_detections,
        streaming=streaming,
        strict=strict,
        scope=scope,
    )


def _streaming_config(
    model: nn.Module,
    *,
    run: str | None,
    collector: str | None,
    token: str | None,
    spool_dir: str | os.PathLike[str] | None,
    interval_s: float,
    interval_steps: int,
    transport_options: TransportConfig | Mapping[str, Any] | None,
    register_policy: bool = False,
) -> _Streaming | None:
    if collector is None:
        if token is not None or spool_dir is not None or transport_options:
            raise ValueError(
                "protect(token=/spool_dir=/transport_options=) configure streaming, which needs collector= "
                "(a URL such as http://127.0.0.1:8000, or 'offline' to spool only)"
            )
        return None
    if not isinstance(collector, str) or not (collector == "offline" or collector.startswith(("http://", "https://"))):
        raise ValueError(f"collector must be an http(s):// URL or 'offline', got {collector!r}")
    name = run or os.environ.get("ATTNCHECKER_RUN") or (
        f"{type(model).__name__}-{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}")
    if spool_dir is None:
        base = os.environ.get("ATTNCHECKER_SPOOL_DIR") or Path.home() / ".cache" / "attnchecker" / "spool"
        # One directory per run, so `attnchecker sync DIR` uploads exactly that run.
        spool_dir = Path(base) / (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run")
    IntervalStats(lambda _: None, interval_s=interval_s, interval_steps=interval_steps)  # validates both, now
    return _Streaming(
        collector=None if collector == "offline" else collector.rstrip("/"),
        token=token if token is not None else os.environ.get("ATTNCHECKER_TOKEN"),
        run=name,
        spool_dir=Path(spool_dir),
        interval_s=interval_s,
        interval_steps=interval_steps,
        transport=_transport_config(transport_options),
        register_policy=register_policy,
    )


def _transport_config(options: TransportConfig | Mapping[str, Any] | None) -> TransportConfig:
    # httpx and the sender load only for a guard that streams.
    from .transport import TransportConfig

    return TransportConfig.from_options(options)


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
