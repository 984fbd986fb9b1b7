"""TransportConfig: one validated, frozen value for the transport's settings, and protect(transport_options=) still
taking a plain mapping (docs/streaming.md) that is checked into it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import attnchecker
from attnchecker.transport import Transport, TransportConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
                                 num_layers=1, enable_nested_tensor=False)


@pytest.mark.parametrize(("field", "value"), [
    ("batch_size", 0), ("queue_max", -1), ("max_spool_bytes", 1.5), ("batch_size", True),
    ("flush_interval_s", 0), ("probe_interval_s", -1.0), ("read_timeout_s", "2"), ("replay_leftovers", 1),
])
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"transport.{field}"):
        TransportConfig(**{field: value})


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransportConfig().batch_size = 3  # type: ignore[misc]


def test_options_mapping_becomes_a_config_and_unknown_keys_are_named() -> None:
    assert TransportConfig.from_options({"batch_size": 7}) == TransportConfig(batch_size=7)
    assert TransportConfig.from_options(None) == TransportConfig()
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'batch', 'retries'; known keys are batch_size, "):
        TransportConfig.from_options({"batch": 7, "retries": 3})
    with pytest.raises(ValueError, match="mapping"):
        TransportConfig.from_options([("batch_size", 7)])  # type: ignore[arg-type]


def test_transport_takes_a_config_or_its_fields_not_both(tmp_path: Path) -> None:
    cfg = TransportConfig(batch_size=9)
    assert Transport(None, None, "r", spool_dir=tmp_path, config=cfg).config is cfg
    assert Transport(None, None, "r", spool_dir=tmp_path, batch_size=9).config == cfg
    with pytest.raises(ValueError, match="not both"):
        Transport(None, None, "r", spool_dir=tmp_path, config=cfg, batch_size=9)
    with pytest.raises(ValueError, match="unknown key"):
        Transport(None, None, "r", spool_dir=tmp_path, bogus=1)


@pytest.mark.parametrize("options", [{"batch_size": 3, "poll_interval_s": 0.5},
                                     TransportConfig(batch_size=3, poll_interval_s=0.5)])
def test_protect_passes_transport_options_to_its_transport(options, tmp_path: Path) -> None:
    model = _model()
    with attnchecker.protect(model, collector="offline", spool_dir=tmp_path, transport_options=options) as guard:
        assert guard.transport.config == TransportConfig(batch_size=3, poll_interval_s=0.5)


def test_protect_names_an_unknown_transport_option_and_leaves_the_model_alone(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(ValueError, match="unknown key.*'flush_interval'.*flush_interval_s"):
        attnchecker.protect(model, collector="offline", spool_dir=tmp_path, transport_options={"flush_interval": 1})
    assert not attnchecker.is_protected(model)
