"""The protection policy (what the operator asks for) and the adaptive scheduler (which ops to check on a step).

Torch-free on purpose: the transport's sender thread parses policies from the wire and must not import torch.
The scheduler is pure and deterministic: no clocks, no threads, no I/O; the guard feeds it steps and outcomes.
The rule it follows, and why, is written down in docs/adaptive.md.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .errors import AttnCheckerError

__all__ = ["OPS", "WHOLE_STEP_OPS", "WHOLE_STEP_SCHEDULE", "Policy", "PolicyError", "Scheduler"]

# The agent's vocabulary, torch-free so that the transport, the CLI and the wire contract read it without torch.
# The engine (context.py) re-exports these; nothing defines them a second time.
OPS: tuple[str, ...] = ("q", "k", "v", "scores", "context", "out")
"""The protected operations, in the order they run in a layer."""
WHOLE_STEP_OPS: tuple[str, ...] = ("linear", "linear_dx", "linear_dw", "scores_bwd", "grad_probs", "grad_v", "grad_q",
                                   "grad_k")
"""What protect(scope="all") checks besides OPS: a Linear/Conv1D output, its input and weight gradients
(gemm.linear.GEMM_OPS), and the attention core's backward (attention.backward.checked.BACKWARD_OPS). Events, fault stats
and per-op check stats name them; a policy does not (no period of their own)."""
WHOLE_STEP_SCHEDULE = "out"
"""The op whose schedule the whole-step ops follow (gemm.schedule.gemm_due): the last GEMM of a layer, checked when the
layer is."""
MODES: tuple[str, ...] = ("off", "detect", "correct")
TIERS: tuple[str, ...] = ("tripwire", "abft", "optimizer")
"""Who caught a fault: tier 1 (every step, extreme values), tier 2 (scheduled full ABFT), the optimizer net."""
TOLERANCES: tuple[str, ...] = ("roundoff", "extreme")
ON_UNCORRECTABLE: tuple[str, ...] = ("log", "skip_step", "raise")

# Server-side bookkeeping that travels with a policy but is not part of what the agent acts on.
_WIRE_IGNORED = frozenset({"updated_at", "updated_by"})


class PolicyError(AttnCheckerError, ValueError):
    """A policy field has a value the agent cannot act on. The message names the field and what is allowed.
    A ValueError too, so callers that validate configuration generically catch it."""


def _is_int(x: object) -> bool:
    # bool is a subclass of int, but `period: true` is a client bug, not a period of 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _require_int(name: str, x: object, *, minimum: int) -> None:
    if not _is_int(x) or x < minimum:  # type: ignore[operator]
        raise PolicyError(f"policy.{name} must be an int >= {minimum}, got {x!r}")


def _require_choice(name: str, x: object, allowed: tuple[str, ...]) -> None:
    if x not in allowed:
        raise PolicyError(f"policy.{name} must be one of {', '.join(allowed)}, got {x!r}")


def _require_bool(name: str, x: object) -> None:
    if not isinstance(x, bool):
        raise PolicyError(f"policy.{name} must be a bool, got {x!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """One version of a run's protection policy, exactly the wire's ``PolicyPublic`` fields (docs/wire.md).

    Immutable: a new version is a new object, swapped whole at a step boundary.
    """

    version: int = 0
    """The collector's version number; 0 is a local policy that never came from a collector."""
    mode: str = "correct"
    period: int = 1
    """Base check period in steps for every op that is not pinned in ``op_periods``."""
    op_periods: Mapping[str, int] = field(default_factory=dict)
    """Explicit per-op periods; a pinned op ignores the adaptive scheduler."""
    adaptive: bool = True
    min_period: int = 1
    max_period: int = 8
    """Upper bound of the adaptive period; 8 keeps a quiet run at <= 1/8 of the full checking cost
    (docs/adaptive.md)."""
    tolerance: str = "roundoff"
    tolerance_factor: float = 1.0
    on_uncorrectable: str = "log"
    source_repair: bool = True
    overhead_budget: float = 0.05
    """Check time / step time the adaptive scheduler keeps the run under (0 < x <= 1)."""
    tripwire: bool = True
    """Tier 1: on the steps an op's full check is not due, its output still gets the extreme-value tripwire
    (INF/NaN/near-INF), a trip recovers through the full check, and the optimizer never steps on non-finite
    gradients (docs/adaptive.md). False leaves those steps unchecked, as before tiers existed."""

    def __post_init__(self) -> None:
        _require_int("version", self.version, minimum=0)
        _require_choice("mode", self.mode, MODES)
        _require_int("period", self.period, minimum=1)
        if not isinstance(self.op_periods, Mapping):
            raise PolicyError(f"policy.op_periods must be a mapping op -> int, got {self.op_periods!r}")
        for op, p in self.op_periods.items():
            if op not in OPS:
                raise PolicyError(f"policy.op_periods has unknown op {op!r}; ops are {', '.join(OPS)}")
            _require_int(f"op_periods.{op}", p, minimum=1)
        _require_bool("adaptive", self.adaptive)
        _require_int("min_period", self.min_period, minimum=1)
        _require_int("max_period", self.max_period, minimum=1)
        if self.min_period > self.max_period:
            raise PolicyError(
                f"policy.min_period must be <= policy.max_period, got min_period={self.min_period}, "
                f"max_period={self.max_period}"
            )
        _require_choice("tolerance", self.tolerance, TOLERANCES)
        if not _is_number(self.tolerance_factor) or self.tolerance_factor <= 0:
            raise PolicyError(f"policy.tolerance_factor must be a finite number > 0, got {self.tolerance_factor!r}")
        _require_choice("on_uncorrectable", self.on_uncorrectable, ON_UNCORRECTABLE)
        _require_bool("source_repair", self.source_repair)
        _require_bool("tripwire", self.tripwire)
        if not _is_number(self.overhead_budget) or not 0 < self.overhead_budget <= 1:
            raise PolicyError(f"policy.overhead_budget must be a number with 0 < x <= 1, got {self.overhead_budget!r}")
        # A read-only copy: the caller's dict can change later without changing this version of the policy.
        object.__setattr__(self, "op_periods", MappingProxyType(dict(self.op_periods)))
        object.__setattr__(self, "tolerance_factor", float(self.tolerance_factor))
        object.__setattr__(self, "overhead_budget", float(self.overhead_budget))

    def __reduce__(self) -> tuple[Any, ...]:
        # MappingProxyType does not pickle; rebuild from the wire form (e.g. for multiprocessing data loaders).
        return (_policy_from_fields, (self.to_wire(),))

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Policy:
        """Build from a ``PolicyPublic`` body. Missing fields take the defaults; unknown fields are an error."""
        if not isinstance(data, Mapping):
            raise PolicyError(f"policy must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - _WIRE_IGNORED)
        if unknown:
            raise PolicyError(
                f"policy has unknown field(s) {', '.join(unknown)}; known fields are {', '.join(sorted(known))}"
            )
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_wire(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["op_periods"] = dict(self.op_periods)
        return d

    def replace(self, **changes: Any) -> Policy:
        """A copy with ``changes`` applied, validated like a new policy."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def full(cls, **changes: Any) -> Policy:
        """Every op on every step, no adaptation: the most protection, the most overhead."""
        return cls(**{"period": 1, "adaptive": False, **changes})

    @classmethod
    def paper(cls, **changes: Any) -> Policy:
        """As close to the ATTNChecker paper as the product goes: its absolute thresholds, checksum passing without
        repairing q/k/v at the source, every op on every step."""
        return cls(**{"period": 1, "adaptive": False, "tolerance": "extreme", "source_repair": False, **changes})


def _policy_from_fields(d: dict[str, Any]) -> Policy:
    return Policy(**d)


@dataclass(slots=True)
class _OpState:
    period: int
    """The adaptive period (ignored while the op is pinned or adaptation is off)."""
    last_checked: int | None = None
    quiet: int = 0
    """Consecutive quiet checks since the period last changed."""
    hot: bool = False
    """A fault was seen and the op has not yet had ``quiet_checks`` quiet checks since; exempt from the overhead
    rule."""


class Scheduler:
    """Decides which ops are checked on each step, and adapts the periods to what the checks find.

    Per step the guard calls ``due(step)``, runs the step checking those ops, then ``observe(step, ...)``.
    The rule (docs/adaptive.md), for an unpinned op while ``policy.adaptive``:

    - a detection sets its period to ``min_period`` at once;
    - every ``quiet_checks`` consecutive quiet checks double it, up to ``max_period``;
    - when the measured overhead, averaged over ``overhead_window`` steps, exceeds ``policy.overhead_budget``, the
      period of every op that is not recovering from a fault doubles (up to ``max_period``).

    Pinned ops (``policy.op_periods``) use their pin; with ``adaptive`` off every unpinned op uses ``policy.period``.
    """

    def __init__(self, policy: Policy, *, quiet_checks: int = 8, overhead_window: int = 32) -> None:
        if not _is_int(quiet_checks) or quiet_checks < 1:
            raise ValueError(f"quiet_checks must be an int >= 1, got {quiet_checks!r}")
        if not _is_int(overhead_window) or overhead_window < 1:
            raise ValueError(f"overhead_window must be an int >= 1, got {overhead_window!r}")
        self.quiet_checks = quiet_checks
        self.overhead_window = overhead_window
        self._policy = policy
        self._state = {op: _OpState(period=self._start_period(policy)) for op in OPS}
        self._overhead: list[float] = []

    @property
    def policy(self) -> Policy:
        return self._policy

    @staticmethod
    def _start_period(policy: Policy) -> int:
        return min(max(policy.period, policy.min_period), policy.max_period)

    def set_policy(self, policy: Policy) -> None:
        """Switch to a new policy version, keeping what is still meaningful.

        When a check happened is kept, so a new period counts from the op's last check. Adaptive periods are clamped
        into the new bounds; an op whose base period changed, that was just unpinned, or whose adaptation was just
        turned on starts again from the new base period, because that is what the operator asked for.
        """
        old = self._policy
        restart_all = policy.period != old.period or (policy.adaptive and not old.adaptive)
        for op, st in self._state.items():
            if restart_all or (op in old.op_periods and op not in policy.op_periods):
                st.period = self._start_period(policy)
                st.quiet = 0
                st.hot = False
            else:
                st.period = min(max(st.period, policy.min_period), policy.max_period)
        self._policy = policy
        self._overhead.clear()

    def period(self, op: str) -> int:
        pol = self._policy
        pinned = pol.op_periods.get(op)
        if pinned is not None:
            return pinned
        if not pol.adaptive:
            return pol.period
        return self._state[op].period

    def periods(self) -> dict[str, int]:
        """The effective period of every op now (what the stats report as ``ops[].period``)."""
        return {op: self.period(op) for op in OPS}

    def due(self, step: int) -> frozenset[str]:
        """The ops to check on ``step``: those whose period has elapsed since their last check (first check at the
        first step seen). Does not change state; ``observe`` records what was actually checked."""
        if self._policy.mode == "off":
            return frozenset()
        out = []
        for op, st in self._state.items():
            last = st.last_checked
            # step < last: the run went back (resumed from a checkpoint); check at once rather than wait to catch up.
            if last is None or step < last or step - last >= self.period(op):
                out.append(op)
        return frozenset(out)

    def observe(
        self,
        step: int,
        *,
        checked: Iterable[str],
        faults: Mapping[str, int],
        overhead_ratio: float | None = None,
    ) -> None:
        """Record the end of ``step``.

        Args:
            checked: the ops verified on this step (normally ``due(step)``).
            faults: detections per op on this step; ops missing or at 0 were quiet.
            overhead_ratio: check time / step time of this step (0 for a step with nothing checked), or None when
                not measured. Averaged over ``overhead_window`` steps before it is compared with the budget, because
                a single checked step is expensive by design.
        """
        pol = self._policy
        checked = frozenset(checked)
        unknown = (checked | {op for op, n in faults.items() if n}) - set(OPS)
        if unknown:
            raise ValueError(f"unknown op(s) {', '.join(sorted(unknown))}; ops are {', '.join(OPS)}")
        adapting = pol.adaptive and pol.mode != "off"
        for op in checked:
            self._state[op].last_checked = step
        for op, st in self._state.items():
            if not adapting or op in pol.op_periods:
                continue
            if faults.get(op, 0) > 0:
                st.period, st.quiet, st.hot = pol.min_period, 0, True
            elif op in checked:
                st.quiet += 1
                if st.quiet >= self.quiet_checks:
                    st.period = min(st.period * 2, pol.max_period)
                    st.quiet = 0
                    st.hot = False
        if overhead_ratio is not None and adapting:
            self._observe_overhead(overhead_ratio)

    def state_dict(self) -> dict[str, Any]:
        """The schedule as plain data (ints, bools, floats, None): per op its adaptive period, last checked step,
        quiet checks since the period last changed and whether it is recovering from a fault; and the overhead
        window's ratios so far. ``load_state_dict`` takes it back."""
        return {
            "ops": {op: {"period": st.period, "last_checked": st.last_checked, "quiet": st.quiet, "hot": st.hot}
                    for op, st in self._state.items()},
            "overhead": list(self._overhead),
        }

    def load_state_dict(self, state: object, *, step: int) -> None:
        """Go on from ``state`` (``state_dict()``), the run being at ``step``. All of it is validated before any of it
        is taken: a bad state raises ``ValueError`` saying which field and leaves the schedule as it was.

        Periods are clamped into the current policy's ``[min_period, max_period]``, as ``set_policy`` does, since a
        resumed run may have been given other bounds. An op the state does not name starts afresh (due at once)."""
        if not isinstance(state, Mapping) or not isinstance(state.get("ops"), Mapping):
            raise ValueError("a schedule state is a mapping with an 'ops' mapping (Scheduler.state_dict())")
        unknown = set(state["ops"]) - set(OPS)
        if unknown:
            raise ValueError(f"unknown op(s) {', '.join(sorted(map(str, unknown)))} in the schedule state; ops are "
                             f"{', '.join(OPS)} (a state from a newer attnchecker?)")
        loaded: dict[str, _OpState] = {}
        for op, row in state["ops"].items():
            if not isinstance(row, Mapping):
                raise ValueError(f"schedule state of op {op!r}: a mapping of period, last_checked, quiet, hot, "
                                 f"got {type(row).__name__}")
            fields: list[Any] = [row.get(k) for k in ("period", "last_checked", "quiet", "hot")]
            period, last, quiet, hot = fields
            if not _is_int(period) or period < 1:
                raise ValueError(f"schedule state of op {op!r}: period must be an int >= 1, got {period!r}")
            if last is not None and (not _is_int(last) or not 0 <= last < step):
                raise ValueError(f"schedule state of op {op!r}: last_checked must be None or an int in [0, {step}) "
                                 f"(the state's step is {step}), got {last!r}")
            if not _is_int(quiet) or quiet < 0:
                raise ValueError(f"schedule state of op {op!r}: quiet must be an int >= 0, got {quiet!r}")
            if not isinstance(hot, bool):
                raise ValueError(f"schedule state of op {op!r}: hot must be a bool, got {hot!r}")
            loaded[op] = _OpState(period=period, last_checked=last, quiet=quiet, hot=hot)
        overhead: Any = state.get("overhead", [])
        if (not isinstance(overhead, list) or len(overhead) >= self.overhead_window
                or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r >= 0
                           for r in overhead)):
            raise ValueError(f"schedule state: overhead must be a list of fewer than {self.overhead_window} finite "
                             f"ratios >= 0, got {overhead!r}")
        pol = self._policy
        for st in loaded.values():
            st.period = min(max(st.period, pol.min_period), pol.max_period)
        self._state = {op: loaded.get(op, _OpState(period=self._start_period(pol))) for op in OPS}
        self._overhead = [float(r) for r in overhead]

    def snap_all(self) -> None:
        """A fault the ops' own checks did not catch (the optimizer net saw non-finite gradients): every unpinned op
        goes to ``min_period``, as after a detection in it, since nobody can tell which op let it through."""
        pol = self._policy
        if not pol.adaptive or pol.mode == "off":
            return
        for op, st in self._state.items():
            if op not in pol.op_periods:
                st.period, st.quiet, st.hot = pol.min_period, 0, True

    def _observe_overhead(self, ratio: float) -> None:
        pol = self._policy
        self._overhead.append(ratio)
        if len(self._overhead) < self.overhead_window:
            return
        mean = sum(self._overhead) / len(self._overhead)
        # Start a fresh window either way, so the next decision sees the effect of this one.
        self._overhead.clear()
        if mean <= pol.overhead_budget:
            return
        for op, st in self._state.items():
            if op in pol.op_periods or st.hot:
                continue
            st.period = min(st.period * 2, pol.max_period)
            st.quiet = 0
