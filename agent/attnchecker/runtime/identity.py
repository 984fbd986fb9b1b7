"""Who this rank is, as it registers with the collector (docs/wire.md, "Device identity"): its host, local rank, and
the device its model runs on, named the way the rest of the fleet's tooling names it, so that the collector can
attribute every fault to a device and join its series with dcgm-exporter's ``on (UUID)``.

- A GPU: ``GPU-<uuid>`` from ``torch.cuda.get_device_properties(i).uuid`` (nvidia-smi and dcgm-exporter write it that
  way); with ``nvidia-ml-py`` installed, also its PCI bus id and serial through NVML.
- A CPU: ``CPU-<uuid>``, a keyed hash of the machine id (``/etc/machine-id``), which systemd asks applications to hash
  rather than expose; the MAC address as a last resort.

``ATTNCHECKER_HOSTNAME`` and ``ATTNCHECKER_DEVICE_UUID`` override the host and the uuid, so one machine can stand in
for many in tests and simulations. Runs once, at ``protect()``; never on the training step.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["HOSTNAME_ENV", "UUID_ENV", "device_identity"]

log = logging.getLogger("attnchecker")

HOSTNAME_ENV = "ATTNCHECKER_HOSTNAME"
UUID_ENV = "ATTNCHECKER_DEVICE_UUID"
# What the collector accepts (its DeviceIdentityIn): short tokens that are safe as label values and path segments.
_UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
_MACHINE_ID_KEY = b"attnchecker device identity"
"""The application key systemd's machine-id(5) asks for: the id itself never leaves the machine."""


def _override(env: Mapping[str, str], name: str, pattern: re.Pattern[str], what: str) -> str | None:
    given = env.get(name)
    if given and not pattern.match(given):
        raise ValueError(f"{name}={given!r} is not {what} the collector accepts: {pattern.pattern}")
    return given or None


def _hostname(env: Mapping[str, str]) -> str:
    given = _override(env, HOSTNAME_ENV, _HOST_RE, "a host name")
    if given:
        return given
    # The system's own name, made acceptable: anything outside the alphabet becomes '-'.
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-")[:253]
    return name or "localhost"


def _local_rank(env: Mapping[str, str]) -> int | None:
    value = env.get("LOCAL_RANK")  # torchrun, accelerate and Lightning set it
    return int(value) if value is not None and value.isdigit() else None


def _machine_uuid() -> str:
    for path in _MACHINE_ID_FILES:
        try:
            machine_id = path.read_text().strip()
        except OSError:
            continue
        if machine_id:
            digest = hmac.new(_MACHINE_ID_KEY, machine_id.encode(), hashlib.sha256).digest()
            return f"CPU-{uuid.UUID(bytes=digest[:16])}"
    # No machine id (a minimal container): the MAC address, hashed the same way; stable while the interface is.
    digest = hmac.new(_MACHINE_ID_KEY, str(uuid.getnode()).encode(), hashlib.sha256).digest()
    return f"CPU-{uuid.UUID(bytes=digest[:16])}"


def gpu_uuid(props: Any) -> str:
    """``GPU-…`` as NVML, nvidia-smi and dcgm-exporter write it, from torch's device properties (whose ``uuid``
    prints the bare 8-4-4-4-12 hex form)."""
    text = str(props.uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _nvml(device_uuid: str) -> dict[str, str]:
    """PCI bus id and serial through NVML, when nvidia-ml-py is installed and the driver answers; else nothing."""
    try:
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py: optional
    except ImportError:
        return {}
    out: dict[str, str] = {}
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(device_uuid)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            out["pci_bus_id"] = bus.decode() if isinstance(bus, bytes) else str(bus)
            try:
                serial = pynvml.nvmlDeviceGetSerial(handle)
                out["serial"] = serial.decode() if isinstance(serial, bytes) else str(serial)
            except pynvml.NVMLError:
                pass  # consumer boards have no serial
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVML is a nice-to-have: the uuid is what identifies the device
        log.debug("attnchecker: NVML gave no PCI id or serial for %s: %s", device_uuid, e)
    return {k: v for k, v in out.items() if v and re.match(r"^[A-Za-z0-9._:-]{1,64}$", v)}


def device_identity(device: torch.device | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``device`` object of the registration body for a model whose parameters live on ``device`` (None: CPU).
    ValueError naming the variable when an override is not something the collector accepts."""
    env = os.environ if env is None else env
    kind = device.type if device is not None else "cpu"
    ident: dict[str, Any] = {"hostname": _hostname(env), "kind": kind, "index": None,
                             "local_rank": _local_rank(env)}
    if kind == "cuda" and torch.cuda.is_available():
        assert device is not None
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        ident.update(index=index, uuid=gpu_uuid(props), name=str(props.name)[:200])
        ident.update(_nvml(ident["uuid"]))
    else:
        ident["uuid"] = _machine_uuid()
    given = _override(env, UUID_ENV, _UUID_RE, "a device uuid (e.g. GPU-3f1c…)")
    if given:
        ident["uuid"] = given
        # NVML described the real device; the uuid now names another one.
        ident.pop("pci_bus_id", None)
        ident.pop("serial", None)
    return ident
