"""DispatchConfig: an explicit, validated value; bad fields are named in the error."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from tests.strategies import dispatch_configs

SIZES = CaptureSizes([1, 2, 4, 8])


def _config(**overrides: object) -> DispatchConfig:
    """A valid FULL_AND_PIECEWISE config with some fields replaced (possibly by bad values)."""
    fields: dict[str, object] = {
        "mode": CUDAGraphMode.FULL_AND_PIECEWISE,
        "capture_sizes": SIZES,
        "max_num_seqs": 4,
    }
    fields.update(overrides)
    return DispatchConfig(**fields)  # type: ignore[arg-type]  # overrides are deliberately untyped


def test_defaults() -> None:
    """Without options a config decodes one token per request and captures no LoRA counts."""
    config = DispatchConfig(CUDAGraphMode.FULL, SIZES, max_num_seqs=4)
    assert config.uniform_decode_query_len == 1
    assert tuple(config.lora_counts) == ()


@given(dispatch_configs)
def test_rebuilding_a_config_is_idempotent(config: DispatchConfig) -> None:
    """Rebuilding a config from its own fields gives an equal config: validation is idempotent."""
    again = DispatchConfig(
        config.mode,
        config.capture_sizes,
        config.max_num_seqs,
        config.uniform_decode_query_len,
        tuple(config.lora_counts),
    )
    assert again == config
    assert set(again.lora_counts) == set(config.lora_counts)


def test_config_is_frozen() -> None:
    """A dispatcher builds its keys once from its config: the config must not change under it."""
    config = _config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 8  # type: ignore[misc]  # the point: assignment must fail
    assert config.max_num_seqs == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_seqs", -3),
        ("max_num_seqs", 2.5),
        ("max_num_seqs", "4"),
        ("max_num_seqs", True),
        ("uniform_decode_query_len", 0),
        ("uniform_decode_query_len", -1),
        ("uniform_decode_query_len", 1.0),
        ("lora_counts", (0,)),
        ("lora_counts", (2, -1)),
        ("lora_counts", (1.5,)),
        ("lora_counts", 3),
        ("mode", "FULL"),
        ("capture_sizes", [1, 2, 4]),
    ],
)
def test_bad_values_name_the_field_and_value(field: str, value: object) -> None:
    """Each invalid field is a ValueError whose message names the field and the offending value."""
    bad = value[-1] if isinstance(value, tuple) else value
    with pytest.raises(ValueError, match=f"{re.escape(field)}.*{re.escape(repr(bad))}"):
        _config(**{field: value})
