"""Issue 34, the agent's side: who a rank is (attnchecker.runtime.identity), the overrides that let one machine stand
in for many, and what protect() does on a device an operator has quarantined on a real collector (a warning, or with
strict=True a refusal that leaves the model untouched)."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from torch import nn

import attnchecker
from attnchecker.runtime.identity import device_identity, gpu_uuid

UUID_RE = re.compile(r"^CPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
                                 num_layers=1, enable_nested_tensor=False)


def test_a_cpu_rank_is_its_machine_under_a_stable_hashed_id() -> None:
    first = device_identity(None, env={"LOCAL_RANK": "3"})
    again = device_identity(torch.device("cpu"), env={})
    assert UUID_RE.match(first["uuid"]) and first["uuid"] == again["uuid"]
    assert (first["kind"], first["index"], first["local_rank"]) == ("cpu", None, 3)
    machine_id = Path("/etc/machine-id")
    if machine_id.exists():  # the id itself never leaves the machine: only a keyed hash of it
        assert machine_id.read_text().strip().replace("-", "") not in first["uuid"].replace("-", "")


def test_the_overrides_name_the_host_and_device_and_bad_ones_are_refused_naming_the_variable() -> None:
    ident = device_identity(None, env={"ATTNCHECKER_HOSTNAME": "sim-node-3", "ATTNCHECKER_DEVICE_UUID": "GPU-sim-7"})
    assert (ident["hostname"], ident["uuid"]) == ("sim-node-3", "GPU-sim-7")
    for name, value in (("ATTNCHECKER_HOSTNAME", "two words"), ("ATTNCHECKER_DEVICE_UUID", "GPU/7"),
                        ("ATTNCHECKER_DEVICE_UUID", "G" * 65)):
        with pytest.raises(ValueError, match=name):
            device_identity(None, env={name: value})


def test_the_systems_host_name_is_made_acceptable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "Büro PC (1)")
    assert device_identity(None, env={})["hostname"] == "B-ro-PC--1-"


def test_a_gpu_uuid_reads_as_nvidia_smi_and_dcgm_exporter_write_it() -> None:
    # torch's _CUuuid prints the bare 8-4-4-4-12 form; NVML, nvidia-smi and dcgm-exporter prefix it.
    props = SimpleNamespace(uuid="5a1f3c2e-7b0d-4f9a-8c11-2d3e4f5a6b7c")
    assert gpu_uuid(props) == "GPU-5a1f3c2e-7b0d-4f9a-8c11-2d3e4f5a6b7c"
    assert gpu_uuid(SimpleNamespace(uuid="MIG-1234")) == "MIG-1234"


def test_protect_registers_the_ranks_identity_and_refuses_a_bad_override_before_attaching(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNCHECKER_HOSTNAME", "sim-node-1")
    monkeypatch.setenv("ATTNCHECKER_DEVICE_UUID", "GPU-sim-2")
    model = _model()
    guard = attnchecker.protect(model, collector="offline", spool_dir=tmp_path, run="identity", rank=2)
    assert guard.transport is not None
    body = json.loads(guard.transport.run_body)  # the registration, byte for byte as it is sent
    guard.close()
    assert body["device"] == {"hostname": "sim-node-1", "kind": "cpu", "uuid": "GPU-sim-2"}
    assert (body["host"], body["rank"], body["world_size"]) == ("sim-node-1", 2, 3)  # rank 2 without torch.distributed
    monkeypatch.setenv("ATTNCHECKER_DEVICE_UUID", "not a uuid")
    with pytest.raises(ValueError, match="ATTNCHECKER_DEVICE_UUID"):
        attnchecker.protect(model, collector="offline", spool_dir=tmp_path, run="identity")
    assert not attnchecker.is_protected(model)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_protect_on_a_quarantined_device_warns_loudly_and_strict_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    testing = pytest.importorskip("collector_testing")
    settings = testing.make_settings("sqlite", tmp_path / "collector")
    testing.migrate(settings)
    agent = testing.make_token(settings, "agent")
    operator = {"Authorization": f"Bearer {testing.make_token(settings, 'operator')}"}
    monkeypatch.setenv("ATTNCHECKER_DEVICE_UUID", "GPU-quarantine-test")
    monkeypatch.setenv("ATTNCHECKER_HOSTNAME", "bad-node")
    with testing.run_collector(settings, migrate_first=False) as collector:
        model = _model()
        kwargs = {"collector": collector.url, "token": agent, "spool_dir": tmp_path / "spool"}
        # First sight: the device is unknown to the collector, nothing is said; the registration makes it known.
        with warnings.catch_warnings():
            warnings.simplefilter("error", attnchecker.QuarantinedDeviceWarning)
            guard = attnchecker.protect(model, run="q-0", **kwargs)
        assert guard.transport is not None and guard.transport.flush(10)
        guard.close()
        r = httpx.patch(f"{collector.url}/api/v1/devices/GPU-quarantine-test", headers=operator, timeout=10,
                        json={"status": "quarantined", "reason": "XID 79 and SDC"})
        assert r.status_code == 200, r.text
        with pytest.warns(attnchecker.QuarantinedDeviceWarning, match="QUARANTINED.*XID 79 and SDC"):
            guard = attnchecker.protect(model, run="q-1", **kwargs)
        guard.close()
        with pytest.raises(attnchecker.QuarantinedDeviceError, match="GPU-quarantine-test on bad-node"):
            attnchecker.protect(model, run="q-2", strict=True, **kwargs)
        assert not attnchecker.is_protected(model)
        names = {run["name"] for run in httpx.get(f"{collector.url}/api/v1/runs", headers=operator,
                                                  timeout=10).json()["data"]}
        assert names == {"q-0", "q-1"}  # the refused start registered nothing
