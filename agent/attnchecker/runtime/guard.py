"""``protect(model) -> Guard``: attach the protected attention to an unmodified model, and take it off exactly.

The guard owns attach/undo and the step clock: at each step boundary it closes the step's counters, feeds the
scheduler, applies a pending policy (only there) and picks the next step's ops. Beside it: ``attach.py`` (what is
attached and checked at protect()), ``response.py`` (the detection log, uncorrectable faults, the optimizer net),
``link.py`` (the collector link), ``report.py`` (the Report). Integrations (``integrations/``) own how a given
architecture is attached; every change they make is recorded as an undo action, so ``close()`` restores the model
exactly. Layers and owners: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import compiled
from ..checks.caches import engine_caches
from ..checks.context import OPS, CheckConfig, OpStats, Runtime
from ..checks.deferred import drain
from ..checks.device_time import settle
from ..coverage import Coverage
from ..errors import AlreadyProtectedError, GuardStateError, NoProtectableAttentionError, UncorrectableFault
from ..events import Detection
from ..integrations._common import Binder, Site
from ..policy import Policy, PolicyError, Scheduler
from .attach import (
    SUPPORTED_MODELS,
    attach_integrations,
    check_coverage,
    make_injector,
    require_supported_params,
    unwrap_optimizer,
)
from .link import RunLink, StreamingConfig, check_device_at_start, run_info, streaming_config
from .report import FaultCounts, Report, Totals
from .response import FaultResponse

if TYPE_CHECKING:
    from ..transport import Transport, TransportConfig

__all__ = ["FaultCounts", "Guard", "Report", "is_protected", "protect", "unprotect"]

log = logging.getLogger("attnchecker")

STATE_FORMAT = 1
"""The layout of ``Guard.state_dict()``; ``load_state_dict`` refuses any other."""

# Live guards by the model they protect, and by every attention module they own (to refuse protecting a model, or
# a part of one, twice). Weak, so a model that is dropped without close() does not stay alive because of us.
_GUARDS: weakref.WeakKeyDictionary[nn.Module, Guard] = weakref.WeakKeyDictionary()
_OWNED: weakref.WeakKeyDictionary[nn.Module, Guard] = weakref.WeakKeyDictionary()


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
        streaming: StreamingConfig | None = None,
        strict: bool = False,
        scope: str = "attention",
    ) -> None:
        self.model = model
        self.run = run
        self.rank = rank
        self._policy = policy
        self._pending_policy: Policy | None = None
        self._scheduler = Scheduler(policy)
        self._runtime = Runtime(
            step=0, injector=make_injector(faults), on_detection=self._on_detection, stats=OpStats()
        )
        self._response = FaultResponse(self._runtime, self._scheduler, rank=rank, max_detections=max_detections)
        self._binder = Binder(self._runtime)
        self._binder.strict = strict
        # Graphs the compiled checked ops kept for a backward that never came go with the guard (compiled.opaque).
        self._binder.on_close(functools.partial(compiled.release, id(self._runtime)))
        self._totals = Totals()
        self._steps = 0
        self._closed = False
        self._step_started = time.perf_counter()
        self._last_overhead: float | None = None
        self._link: RunLink | None = None
        try:
            attach_integrations(self._binder, model)
            if not self._binder.sites:
                raise NoProtectableAttentionError(
                    f"attnchecker found no attention it can protect in {type(model).__name__}. "
                    f"Supported: {SUPPORTED_MODELS}."
                )
            require_supported_params(model, self._binder)
            check_coverage(self._binder.coverage(), strict=strict)
            if scope == "all":
                from ..integrations import linear_layers, moe_experts

                linear_layers.attach(self._binder, model)
                moe_experts.attach(self._binder, model)
            pre = model.register_forward_pre_hook(self._response.root_pre_hook)
            post = model.register_forward_hook(self._response.root_post_hook, always_call=True)
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
                self._link = RunLink(streaming, self.run_info(register_policy=streaming.register_policy,
                                                              device=streaming.device),
                                     rank=rank, close_at_exit=self.close)
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
        """The current step (the engine runtime's step): the number of ``step()`` calls so far."""
        return self._runtime.step

    @property
    def policy(self) -> Policy:
        """The policy in force on the current step (a ``set_policy`` waits for the next step boundary)."""
        return self._policy

    @property
    def policy_scope(self) -> str:
        """Whose policy is in force: "run" (the run's on the collector, or a local one), or "device": the collector's
        suspect-device policy, since an operator marked this rank's device suspect or quarantined (docs/streaming.md).
        """
        return self._link.applied_scope if self._link is not None else "run"

    @property
    def sites(self) -> tuple[Site, ...]:
        """The protected attention layers: module name, layer index, integration, ops verified."""
        return tuple(self._binder.sites)

    @property
    def coverage(self) -> Coverage:
        """What is protected, per layer and op and by which path, and what is not and why (docs/architectures.md),
        including calls that fell back to an unprotected kernel so far."""
        return self._binder.coverage(self._current())

    def _current(self) -> tuple[OpStats, CheckConfig] | None:
        stats = self._runtime.stats
        return None if stats is None else (stats, self._runtime.config)

    @property
    def detections(self) -> list[Detection]:
        """The most recent detections, oldest first (bounded: ``max_detections``). A plain view, which syncs nothing:
        on a GPU the device-side outcomes of the step in progress join it at the step boundary, or when ``report()``
        or ``close()`` reads them."""
        return list(self._response.detections)

    @property
    def injector(self) -> Any:
        """The fault injector (``faults=``), or None. ``injector.injected`` is the ground truth of what was hit.
        Settable (a FaultPlan, an Injector, or None): a campaign plans each step's faults as it goes."""
        return self._runtime.injector

    @injector.setter
    def injector(self, faults: Any) -> None:
        self._runtime.injector = make_injector(faults)

    @property
    def check_config(self) -> CheckConfig:
        """What the engine checks on the step in progress: mode, tolerance, the ops due (``checked_ops``), tripwire.
        Chosen at each step boundary from the policy and the scheduler."""
        return self._runtime.config

    @property
    def step_stats(self) -> OpStats | None:
        """The counters of the step in progress (checks, faults, check and tripwire time); a fresh object after each
        ``step()``, None once closed. Read-only by contract: the guard folds it into ``report()``."""
        return self._runtime.stats

    @property
    def last_overhead_ratio(self) -> float | None:
        """Check time / step time of the last finished step, as the adaptive scheduler saw it (0.0 for a step with
        nothing checked); None before the first ``step()`` and when the step's clock did not move."""
        return self._last_overhead

    def tripwire_only_this_step(self) -> None:
        """Check no op in full on the step in progress (the tripwire still runs, when the policy has it): what a
        step between two full checks costs. For benchmarks; the next ``step()`` picks the due ops as usual."""
        self._runtime.config = dataclasses.replace(self._runtime.config, checked_ops=frozenset())

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
        return self._link.intervals if self._link is not None else []

    @property
    def transport(self) -> Transport | None:
        """The :class:`attnchecker.transport.Transport` streaming to the collector (``collector=``), or None."""
        return self._link.transport if self._link is not None else None

    @property
    def run_id(self) -> str | None:
        """The collector's id of the run once it registered; None before that, and without a collector."""
        return self._link.run_id if self._link is not None else None

    def set_policy(self, policy: Policy | Mapping[str, Any]) -> None:
        """Use ``policy`` from the next step boundary on. Validated now; a bad policy raises ``PolicyError``."""
        self._pending_policy = _coerce_policy(policy)

    def step(self) -> None:
        """Close the current step: feed the scheduler, apply a pending policy, pick the ops of the next step."""
        if self._closed:
            return
        # The step's device-side outcomes (checks/deferred.py) belong to the step that ends here, and so does the
        # device time of its CUDA checks (checks/device_time.py), read once the flags' read has waited for the device.
        drain(self._runtime.deferred)
        settle(self._runtime)
        # Its backward has run: a graph a compiled checked op still keeps had no backward, and never will.
        compiled.release(id(self._runtime))
        stats = self._runtime.stats
        assert stats is not None
        # A fresh interval first: anything the engine records from now on belongs to the next step.
        self._runtime.stats = OpStats()
        # What the sites claim, held to what this step checked.
        self._binder.note_step(stats, self._runtime.config, self._runtime.step)
        self._totals.add(stats)
        now = time.perf_counter()
        step_s = now - self._step_started
        self._step_started = now
        config = self._runtime.config
        faults_by_op: dict[str, int] = {}
        for (op, _kind), row in stats.faults.items():
            # The whole-step GEMM ops (gemm.linear, attention.backward.checked: every faulted op that is not a policy
            # op) follow the "out" schedule, not one of their own: a fault in one brings "out" back to min_period, so
            # the whole step is checked in full again as after a detection in "out" itself.
            key = op if op in OPS else "out"
            faults_by_op[key] = faults_by_op.get(key, 0) + row[0]
        # An op that was due but never ran (no forward this step, or not present in this model) was not checked.
        checked = frozenset(op for op in config.checked_ops if stats.checks.get(op, 0) > 0)
        check_s = sum(stats.check_seconds.values())
        # A measured step with nothing checked costs 0, and the scheduler's window must see it as such; None means
        # "not measured" (a clock that did not move) and is left out of the average.
        overhead = check_s / step_s if step_s > 0 else None
        self._last_overhead = overhead
        self._scheduler.observe(self._runtime.step, checked=checked, faults=faults_by_op, overhead_ratio=overhead)
        changed = self._apply_policy_update()
        finished = self._runtime.step
        self._runtime.step += 1
        self._steps += 1
        self._configure_step()
        if self._link is not None:
            self._link.end_step(finished, stats, step_s, policy_version=self._policy.version,
                                periods=self._scheduler.periods(), force=changed)

    def state_dict(self) -> dict[str, Any]:
        """What a run resumed from a checkpoint needs to go on where this one stopped: the step number (events and
        stats keep counting from it) and the adaptive schedule (each op's period, last check and recovery state), as
        plain ints, floats, bools and None. Save it with the model and optimizer at a step boundary:
        ``torch.save`` (``weights_only`` loads it), ``torch.distributed.checkpoint`` (the guard is ``Stateful``) or
        JSON. Without it a resumed run starts at step 0, checking every op in full until the schedule relaxes again.
        The policy is not in it: ``protect(policy=...)`` or the run's policy on the collector governs the resumed run,
        and the periods are clamped into its bounds (docs/adaptive.md, "Resuming")."""
        return {"format": STATE_FORMAT, "step": self._runtime.step, "schedule": self._scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from ``state_dict()``'s output, at a step boundary: after ``protect()`` and before the first forward,
        or right after a step. The next step is the saved one, with the ops it had due. A state that is not one raises
        ``GuardStateError`` saying which field, and the guard is left as it was."""
        if self._closed:
            raise GuardStateError("load_state_dict on a closed guard: protect() the model again and load into that")
        if _began(self._runtime.stats) or self._runtime.deferred:
            raise GuardStateError(
                "load_state_dict inside a step: a forward has already run since the last step boundary. Load it "
                "right after protect() (before the first forward), as with the optimizer's state.")
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise GuardStateError(f"not a guard state of format {STATE_FORMAT} (Guard.state_dict()): format {got!r}")
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise GuardStateError(f"guard state: step must be an int >= 0, got {step!r}")
        try:
            self._scheduler.load_state_dict(state.get("schedule"), step=step)  # validates all before it takes any
        except ValueError as e:
            raise GuardStateError(f"guard state: {e}") from None
        self._runtime.step = step
        self._last_overhead = None
        self._step_started = time.perf_counter()
        self._configure_step()

    def report(self) -> Report:
        """Counts since ``protect()``, including the step in progress: on a GPU its device-side outcomes are read
        first (one sync when any are pending; under on_uncorrectable="raise" an uncorrectable one raises here)."""
        if not self._closed:
            drain(self._runtime.deferred)
        return self._totals.report(in_progress=self._runtime.stats, steps=self._steps,
                                   skipped_steps=self._response.skipped_steps,
                                   coverage=self._binder.coverage(self._current()))

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *, step: bool = True) -> None:
        """Hook an optimizer: ``step=True`` calls ``Guard.step()`` after each ``optimizer.step()``; either way
        ``on_uncorrectable="skip_step"`` can skip its next step (by setting the gradients to None, which every torch
        optimizer treats as "no update" for that parameter)."""
        optimizer = unwrap_optimizer(optimizer)
        pre = optimizer.register_step_pre_hook(self._response.optimizer_pre_hook)
        self._binder.on_close(pre.remove)
        if step:
            post = optimizer.register_step_post_hook(self._optimizer_post_hook)
            self._binder.on_close(post.remove)
        self._response.optimizers.append(optimizer)

    def close(self, *, flush_timeout_s: float = 5.0) -> None:
        """Undo everything ``protect()`` did, newest change first, then (when streaming) send the last stats
        interval and close the transport: what cannot reach the collector within ``flush_timeout_s`` is spooled.
        Idempotent; never raises because of the network."""
        if self._closed:
            return
        self._closed = True
        # The step in progress's device-side outcomes (a forward after the last step boundary, or a loop that never
        # had one): read before its stats are folded and sent, or its detections would be lost. An uncorrectable
        # one under on_uncorrectable="raise" raises once the model is restored; a read that fails (a device error)
        # is logged, and the model restored all the same.
        uncorrectable: UncorrectableFault | None = None
        try:
            drain(self._runtime.deferred)
        except UncorrectableFault as exc:
            uncorrectable = exc
        except Exception:
            self._runtime.deferred.clear()
            log.exception("attnchecker: could not read the last step's device-side check outcomes")
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
        self._response.optimizers.clear()
        try:
            self._binder.undo_all()
        finally:
            # Cached engine tensors (a causal mask: ~2 GiB at 8k context) are process-wide: they go with the last
            # live guard, not with each one, or closing one model's guard would make every other live guard
            # (a second protected model, a teacher, an EMA copy) rebuild its masks and checksum weights.
            if not _GUARDS:
                engine_caches.clear()
            if self._link is not None:
                self._link.close(flush_timeout_s, last_step=last_step)
        if uncorrectable is not None:
            raise uncorrectable

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self._runtime.step}"
        return f"Guard({type(self.model).__name__}, layers={len(self._binder.sites)}, {state})"

    # ----------------------------------------------------------------- internals

    def _apply_policy_update(self) -> bool:
        """At a step boundary: switch to a newer collector policy (``RunLink.policy_at_boundary``) or a
        ``set_policy`` one. True when it changed."""
        new, self._pending_policy = self._pending_policy, None
        if self._link is not None:
            new = self._link.policy_at_boundary(self._policy, new)
        if new is None:
            return False
        self._policy = new
        self._scheduler.set_policy(new)
        return True

    def run_info(self, *, register_policy: bool = False, device: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The body this guard registers its run with (docs/wire.md): model, world size, rank, host, this rank's
        ``device`` when given, and in ``config`` the protected layers, integrations, ops, coverage and policy."""
        return run_info(self.model, sites=self._binder.sites, coverage=self._binder.coverage(), policy=self._policy,
                        rank=self.rank, register_policy=register_policy, device=device)

    def _final_interval(self) -> int | None:
        """At close: fold a step in progress (a forward after the last ``step()``) into the last interval, so the
        stats count every event that was sent, and send it. Returns the last step for the finish record."""
        stats, self._runtime.stats = self._runtime.stats, None
        partial = _began(stats)
        if partial:
            assert stats is not None
            self._totals.add(stats)  # report() keeps counting it after close
        if self._link is None:
            return None
        self._link.last_interval(self._runtime.step, stats if partial else None, policy_version=self._policy.version,
                                 periods=self._scheduler.periods())
        if partial:
            return self._runtime.step
        return self._runtime.step - 1 if self._steps else None

    def _configure_step(self) -> None:
        # One new frozen object, swapped in by a single assignment: a layer never sees half a config.
        due = self._scheduler.due(self._runtime.step)
        self._runtime.config = _config_from(self._policy, due)

    def _on_detection(self, det: Detection) -> None:
        det.rank = self.rank
        det.policy_version = self._policy.version
        if self._link is not None:
            self._link.emit_event(det)
        self._response.on_detection(det)  # may raise UncorrectableFault (on_uncorrectable="raise")

    def _optimizer_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step()


def _began(stats: OpStats | None) -> bool:
    """The step in progress has run something the guard counts (a check, a trip test, a fault, the gradients' test)."""
    return stats is not None and (any(stats.checks.values()) or bool(stats.faults)
                                  or any(stats.trip_checks.values()) or stats.grad_checks > 0)


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
            a run-time fallback; and ``QuarantinedDeviceError`` instead of a ``QuarantinedDeviceWarning`` when an
            operator has quarantined this rank's device on the collector (docs/streaming.md).
        scope: ``"attention"`` (default) protects the attention ops; ``"all"`` also checks every nn.Linear /
            transformers Conv1D GEMM forward and backward (dX and dW), on the steps the ``out`` op is checked
            (docs/fault-coverage.md). Chosen at protect() time: it decides which modules are wrapped.

    Raises:
        NoProtectableAttentionError, AlreadyProtectedError, UnsupportedDtypeError, UnsupportedDeviceError,
        UnprotectedAttentionError (strict), QuarantinedDeviceError (strict), PolicyError, ValueError (bad arguments,
        or an ``ATTNCHECKER_HOSTNAME`` / ``ATTNCHECKER_DEVICE_UUID`` the collector would refuse).
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
    streaming = streaming_config(model, run=run, collector=collector, token=token, spool_dir=spool_dir,
                                  interval_s=stats_interval_s, interval_steps=stats_interval_steps,
                                  transport_options=transport_options, register_policy=policy is not None)
    if streaming is not None:
        check_device_at_start(streaming, strict=strict)
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
