"""``RunLink``: a guard's link to the collector. What protect() was told about streaming, the registration body,
the interval stats, the :class:`~attnchecker.transport.Transport`, the collector's policy taken at step boundaries,
and the one atexit hook that closes the guard (and with it the transport) in a script that never calls close().

Loaded by every guard, but httpx and the sender thread only for a guard that streams (``collector=``).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checks.context import OpStats
from ..coverage import Coverage
from ..errors import QuarantinedDeviceError, QuarantinedDeviceWarning
from ..events import Detection
from ..integrations._common import Site
from ..policy import Policy
from .identity import device_identity
from .streaming import IntervalStats

if TYPE_CHECKING:
    from ..transport import RemotePolicy, Transport, TransportConfig

__all__ = ["RunLink", "StreamingConfig", "check_device_at_start", "run_info", "streaming_config"]

log = logging.getLogger("attnchecker")


@dataclass(frozen=True, slots=True)
class StreamingConfig:
    """What protect() was told about streaming; the guard opens the link once the model is attached."""

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
    device: Mapping[str, Any] | None = None
    """This rank's identity (runtime/identity.py): the registration's ``device``."""


def streaming_config(
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
) -> StreamingConfig | None:
    """protect()'s streaming arguments, validated and with their defaults; None when nothing leaves the process."""
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
    param = next(iter(model.parameters()), None)
    device = device_identity(param.device if param is not None else None)  # ValueError for a bad override, now
    # httpx and the sender load only for a guard that streams.
    from ..transport import TransportConfig

    return StreamingConfig(
        collector=None if collector == "offline" else collector.rstrip("/"),
        token=token if token is not None else os.environ.get("ATTNCHECKER_TOKEN"),
        run=name,
        spool_dir=Path(spool_dir),
        interval_s=interval_s,
        interval_steps=interval_steps,
        transport=TransportConfig.from_options(transport_options),
        register_policy=register_policy,
        device=device,
    )


def run_info(model: nn.Module, *, sites: Sequence[Site], coverage: Coverage, policy: Policy, rank: int,
             register_policy: bool = False, device: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The registration body besides the name (docs/wire.md): what an operator needs to recognise the run, with
    ``register_policy`` the policy given to protect() as a new run's starting policy (a resumed run keeps the
    collector's), and with ``device`` who this rank is (runtime/identity.py)."""
    world_size = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world_size = torch.distributed.get_world_size()
    # protect(rank=N) without torch.distributed: the job has at least N + 1 ranks (the collector checks rank < world).
    world_size = max(world_size, rank + 1)
    param = next(iter(model.parameters()), None)
    info: dict[str, Any] = {
        "model": type(model).__name__[:200],
        "world_size": world_size,
        "rank": rank,
        "host": device["hostname"] if device is not None else socket.gethostname()[:200],
        "config": {
            "layers": len(sites),
            "integrations": sorted({site.integration for site in sites}),
            "ops": sorted({op for site in sites for op in site.ops}),
            "coverage": coverage.to_wire(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": str(param.device) if param is not None else None,
            "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
            "torch": torch.__version__,
            "policy": policy.to_wire(),
        },
    }
    if register_policy:
        info["policy"] = {k: v for k, v in policy.to_wire().items() if k != "version"}
    if device is not None:
        info["device"] = {k: v for k, v in device.items() if v is not None}
    return info


def check_device_at_start(config: StreamingConfig, *, strict: bool) -> str | None:
    """At protect(): the status an operator set on this rank's device on the collector, or None when unknown. On a
    quarantined device ``strict`` refuses (QuarantinedDeviceError), else a loud warning. One request, bounded by the
    transport's connect and read timeouts; a collector that does not answer stops nothing (training is never blocked
    by us), and the registration answer carries the status again."""
    if config.collector is None or config.device is None:
        return None
    from ..transport.client import CollectorClient

    uuid = str(config.device["uuid"])
    client = CollectorClient(config.collector, config.token, connect_timeout_s=config.transport.connect_timeout_s,
                             read_timeout_s=config.transport.read_timeout_s)
    try:
        reply = client.device_status(uuid)
    finally:
        client.close()
    if not reply.ok or not isinstance(reply.body, dict):
        if reply.status != 404:  # 404: a device the collector has not seen yet
            log.info("attnchecker: could not ask the collector about device %s (%s); training goes on",
                     uuid, reply.error or reply.status)
        return None
    status = reply.body.get("status")
    reason = reply.body.get("reason") or "no reason given"
    if status == "quarantined":
        message = (
            f"device {uuid} on {config.device.get('hostname')} is QUARANTINED on the collector ({reason}): faults "
            "from it are not to be trusted. Move this rank to another device, or have an operator lift the "
            f"quarantine (PATCH /api/v1/devices/{uuid}). strict=True refuses to start here."
        )
        if strict:
            raise QuarantinedDeviceError(message)
        log.error("attnchecker: %s", message)
        warnings.warn(message, QuarantinedDeviceWarning, stacklevel=4)
    elif status == "suspect":
        log.warning("attnchecker: device %s is under suspicion on the collector (%s): this rank follows the "
                    "suspect-device policy", uuid, reason)
    return status if isinstance(status, str) else None


class RunLink:
    """A streaming guard's side of the collector. Called on the training thread only (the transport's sender thread
    is behind ``Transport``'s own interface)."""

    def __init__(self, config: StreamingConfig, info: dict[str, Any], *, rank: int,
                 close_at_exit: Callable[[], None]) -> None:
        """``close_at_exit``: a bound method (the guard's ``close``), held weakly."""
        from ..transport import Transport

        self.run = config.run
        # at_exit=False: this link's one hook closes the guard, which closes the transport after its last interval.
        self.transport: Transport = Transport(
            config.collector, config.token, config.run, spool_dir=config.spool_dir, run_info=info,
            config=config.transport,
        ).start(at_exit=False)
        self._interval = IntervalStats(self.transport.emit_stats, rank=rank, interval_s=config.interval_s,
                                       interval_steps=config.interval_steps)
        self._remote: RemotePolicy | None = None
        self.rank = rank
        self.device_uuid = config.device.get("uuid") if config.device is not None else None
        self.applied_scope = "run"
        """Which policy the guard applies: "run", or "device" (the suspect-device policy) since the collector said
        this rank's device is under suspicion. Reported with the applied version in every interval."""
        # Weak, so the hook does not keep a dropped guard (and its model) alive.
        ref = weakref.WeakMethod(close_at_exit)

        def at_exit() -> None:
            close = ref()
            if close is not None:
                close()

        self._at_exit: Callable[[], None] | None = at_exit
        atexit.register(at_exit)

    @property
    def run_id(self) -> str | None:
        """The collector's id of the run once it registered."""
        return self.transport.run_id

    @property
    def intervals(self) -> list[dict[str, Any]]:
        """The most recent stats intervals sent (wire payloads, docs/wire.md), oldest first."""
        return list(self._interval.sent)

    def emit_event(self, det: Detection) -> None:
        self.transport.emit_event(det)  # a put_nowait: never blocks; to_wire() runs on the sender thread

    def policy_at_boundary(self, current: Policy, pending: Policy | None) -> Policy | None:
        """The policy to switch to at this step boundary, or None to keep ``current``.

        The run's policy on the collector is authoritative: the version it answered at registration, then every
        version an operator makes, each applied at the first step boundary after the sender thread saw it
        (``Transport.latest_policy`` is one attribute read). A ``set_policy`` one (``pending``) at the same boundary
        wins for that boundary; the next collector version replaces it.
        """
        remote = self.transport.latest_remote()
        fresh = remote is not None and remote is not self._remote
        if fresh:
            self._remote = remote
        if pending is not None:
            self.applied_scope = "run"  # a set_policy() one is this rank's own, not the suspect-device policy
            return pending
        if not fresh:
            return None
        assert remote is not None
        if remote.scope != self.applied_scope:
            self._say_scope(remote.scope, remote.policy.version)
        self.applied_scope = remote.scope
        if current.version == 0:
            _warn_replaced(current, remote.policy, self.run)
        return remote.policy

    def _say_scope(self, scope: str, version: int) -> None:
        if scope == "device":
            log.warning(
                "attnchecker: rank %d's device %s is under suspicion on the collector: from this step boundary it "
                "follows the suspect-device policy v%d instead of run %s's (GET /api/v1/policy/suspect)",
                self.rank, self.device_uuid, version, self.run)
        else:
            log.warning("attnchecker: rank %d's device %s is no longer under suspicion: back to run %s's policy v%d",
                        self.rank, self.device_uuid, self.run, version)

    def end_step(self, step: int, stats: OpStats, step_s: float, *, policy_version: int, periods: dict[str, int],
                 force: bool) -> None:
        """Fold a finished step into the interval; send it when due (``force``: a new policy version goes out at
        once, so the collector shows it as applied at this boundary). Never raises: telemetry never stops training."""
        try:
            self._interval.add(step, stats, step_s)
            self._interval.maybe_send(applied_policy_version=policy_version, periods=periods, force=force,
                                      applied_policy_scope=self.applied_scope)
        except Exception:
            log.exception("attnchecker: stats interval failed at step %d; training goes on", step)

    def last_interval(self, step: int, partial: OpStats | None, *, policy_version: int,
                      periods: dict[str, int]) -> None:
        """At close: fold a step in progress (``partial``) into the last interval, without counting a step, and
        send it."""
        if partial is not None:
            self._interval.add(step, partial, 0.0, count_step=False)
        self._interval.maybe_send(applied_policy_version=policy_version, periods=periods, force=True,
                                  applied_policy_scope=self.applied_scope)

    def close(self, flush_timeout_s: float, *, last_step: int | None) -> None:
        """Finish the run: what cannot reach the collector within ``flush_timeout_s`` is spooled."""
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        self.transport.close(flush_timeout_s, last_step=last_step)


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
