"""What a guard does after a detection: keep it (a bounded log), and act on an uncorrectable one as the policy's
``on_uncorrectable`` says (log; skip the next optimizer step; raise at the end of the forward). Also the last net
(tier "optimizer"): non-finite gradients never reach the weights."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import torch
from torch import nn

from ..checks.context import Runtime
from ..checks.deferred import drain
from ..errors import UncorrectableFault
from ..events import Detection
from ..policy import Scheduler

__all__ = ["FaultResponse"]

log = logging.getLogger("attnchecker")


class FaultResponse:
    """One per guard. The policy in force is the scheduler's (the guard switches both at step boundaries); the step
    and its counters are the engine runtime's. Training thread only."""

    def __init__(self, runtime: Runtime, scheduler: Scheduler, *, rank: int, max_detections: int) -> None:
        self._runtime = runtime
        self._scheduler = scheduler
        self.rank = rank
        self.detections: deque[Detection] = deque(maxlen=max_detections)
        """The most recent detections, oldest first."""
        self.skipped_steps = 0
        self.optimizers: list[torch.optim.Optimizer] = []
        """Optimizers whose steps can be skipped (hooked by ``Guard.attach_optimizer``)."""
        self._skip_next_step = False
        self._raise_pending: list[Detection] = []
        self._forward_depth = 0

    def on_detection(self, det: Detection) -> None:
        """Keep the detection; act on an uncorrectable one as the policy in force says."""
        self.detections.append(det)
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
        action = self._scheduler.policy.on_uncorrectable
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
            if not self.optimizers:
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

    # The root hooks are host-side bookkeeping of the real forward: eagerly they run, kept out of torch.compile's
    # graphs; while Dynamo traces they add nothing to the graph (an op here would make a graph of its own before a
    # model's first graph break: docs/abft.md, "Under torch.compile"). The checked ops count the forward instead
    # (compiled.registry.context), and the depth stays 0: on_uncorrectable="raise" raises from the op that met it.
    def root_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self._enter_forward()

    def root_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self._exit_forward()

    @torch.compiler.disable
    def _enter_forward(self) -> None:
        self._forward_depth += 1

    @torch.compiler.disable
    def _exit_forward(self) -> None:
        self._forward_depth -= 1
        if self._forward_depth == 0 and self._runtime.stats is not None:
            self._runtime.stats.forwards += 1
        if self._forward_depth == 0 and self._raise_pending:
            # Deferred to the end of the forward so the engine finishes its record of every layer first.
            self._raise_uncorrectable()

    def optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The step's device-side outcomes first (checks/deferred.py): an uncorrectable fault among them can still
        # skip this step. The last net's finiteness of the gradients rides on the same read: one sync a step.
        net = not self._skip_next_step and self._scheduler.policy.tripwire and self._scheduler.policy.mode != "off"
        grads = _gradients(optimizer) if net else []
        finite_t = _finite_norms(grads) if grads else None
        _, finite = drain(self._runtime.deferred, also=finite_t)
        if finite is not None and not self._skip_next_step:
            self._gradient_net(grads, finite)
        if not self._skip_next_step:
            return
        self._skip_next_step = False
        self.skipped_steps += 1
        log.warning("attnchecker: skipping optimizer step at step %d after an uncorrectable fault", self._runtime.step)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _gradient_net(self, grads: list[torch.Tensor], finite: list[bool]) -> None:
        """The last net (tier "optimizer"): a non-finite gradient means a fault got past both tiers (outside the
        protected GEMMs, or in backward). The optimizer never steps on it: "log" and "skip_step" both skip this step
        (stepping would write INF/NaN into the weights, which no later step undoes), "raise" raises. Every period
        snaps to min_period and a Detection (op "grad") is recorded, locally only: the event wire knows the six ops.
        finite: whether each gradient's norm is finite, read on the host with the step's deferred flags."""
        stats = self._runtime.stats
        if stats is not None:
            stats.grad_checks += 1
        bad = _non_finite(grads, finite)
        if bad is None:
            return
        self._scheduler.snap_all()
        action = self._scheduler.policy.on_uncorrectable
        det = Detection(op="grad", layer=0, step=self._runtime.step, pattern="2d",
                        kind="nan" if bool(torch.isnan(bad).any()) else "inf",  # sync: slow path only
                        action="uncorrectable", value="nan", residual=None, bound=0.0, tier="optimizer",
                        rank=self.rank, policy_version=self._scheduler.policy.version)
        self.detections.append(det)
        if stats is not None:
            # Not in stats.faults: those are per protected op, and "grad" is none of them.
            stats.catches[("optimizer", "grad")] = stats.catches.get(("optimizer", "grad"), 0) + 1
        log.warning("attnchecker: non-finite gradient (%s) at the optimizer at step %d: a fault outside the checked "
                    "ops; %s (on_uncorrectable=%s), every check period back to min_period", det.kind,
                    self._runtime.step, "raising" if action == "raise" else "skipping this optimizer step", action)
        if action == "raise":
            raise UncorrectableFault(
                f"non-finite gradient ({det.kind}) at the optimizer at step {self._runtime.step}; policy "
                "on_uncorrectable='raise'", [det])
        self._skip_next_step = True


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None and not p.grad.is_sparse]


def _finite_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """(len(grads),) bool on the device: whether each gradient's 2-norm is finite. One fused norm per tensor, in fp32
    (a half-precision gradient's norm would overflow its own dtype): an INF or NaN element makes it non-finite. On
    CPU (one thread, 23 M fp32 gradients, measured) it costs 3.5 ms, where the ∞-norm took 60 ms: 4 % of a GPT-2
    training step, paid on every step of `protect(model, optimizer=opt)`. No sync.

    Under FSDP2 the gradients are DTensors, their norms partial: the comparison reduces them first (one collective,
    so every rank decides alike) and replicates the result, which comes back as the plain local tensor that the step
    boundary's read takes (a DTensor has no tolist).

    A model split over several devices of one process (``device_map="auto"``, CPU offload) has gradients on each:
    their norms go to one accelerator before they are stacked (a scalar copy each, enqueued in stream order, no
    sync), so the read stays one a step. Never to the CPU: a copy from a device to the host without a sync could be
    read before it lands. Not run on two devices here: the suite's machines have none."""
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    home = next((n.device for n in norms if n.device.type != "cpu"), norms[0].device)
    # A norm is >= 0 or NaN, so "< INF" is isfinite in one elementwise kernel where isfinite makes four.
    finite = torch.stack([n if n.device == home else n.to(home, non_blocking=True) for n in norms]) < math.inf
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(finite, DTensor):
            return finite.full_tensor()
    return finite


def _non_finite(grads: list[torch.Tensor], finite: list[bool]) -> torch.Tensor | None:
    """The first gradient holding an INF or NaN, or None. A gradient whose norm overflows while its elements are
    finite (past ~1e19 their squares leave fp32's range) is looked at element by element (slow path only) and
    passes."""
    for grad, ok in zip(grads, finite, strict=True):
        if not ok and not bool(torch.isfinite(grad).all()):  # sync: slow path only
            return grad
    return None
