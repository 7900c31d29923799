"""CUDAGraphMode and BatchDescriptor: the value types every layer keys on."""

from __future__ import annotations

import dataclasses
import re
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from tests.strategies import batch_descriptors, mixed_case_names, modes

M: Final = CUDAGraphMode

# What docs/design.md ("Modes") says each mode runs for uniform decode and for mixed batches.
# (decode_mode, mixed_mode, separate_routine, is_runtime_mode)
SPEC: Final[dict[CUDAGraphMode, tuple[CUDAGraphMode, CUDAGraphMode, bool, bool]]] = {
    M.NONE: (M.NONE, M.NONE, False, True),
    M.PIECEWISE: (M.PIECEWISE, M.PIECEWISE, False, True),
    M.FULL: (M.FULL, M.FULL, False, True),
    M.FULL_DECODE_ONLY: (M.FULL, M.NONE, True, False),
    M.FULL_AND_PIECEWISE: (M.FULL, M.PIECEWISE, True, False),
}
RUNTIME: Final = (M.NONE, M.PIECEWISE, M.FULL)


def test_members_are_the_five_of_the_contract() -> None:
    """The enum has exactly the five documented modes: callers match on them by name."""
    assert {m.name for m in CUDAGraphMode} == {
        "NONE",
        "PIECEWISE",
        "FULL",
        "FULL_DECODE_ONLY",
        "FULL_AND_PIECEWISE",
    }


@pytest.mark.parametrize("mode", list(CUDAGraphMode))
def test_decode_and_mixed_modes(mode: CUDAGraphMode) -> None:
    """decode_mode/mixed_mode split combined modes as documented and are the identity otherwise."""
    decode, mixed, _, _ = SPEC[mode]
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed


@pytest.mark.parametrize("mode", list(CUDAGraphMode))
def test_separate_routine_and_runtime_mode(mode: CUDAGraphMode) -> None:
    """Only combined modes have separate routines, and only the other three are runtime modes."""
    _, _, separate, runtime = SPEC[mode]
    assert mode.separate_routine() is separate
    assert mode.is_runtime_mode() is runtime


@given(modes)
def test_split_modes_are_runtime_modes(mode: CUDAGraphMode) -> None:
    """Whatever the config mode, a forward runs in a runtime mode: the split never yields a combined one."""
    assert mode.decode_mode().is_runtime_mode()
    assert mode.mixed_mode().is_runtime_mode()


@pytest.mark.parametrize("mode", list(CUDAGraphMode))
@pytest.mark.parametrize("runtime", RUNTIME)
def test_has_mode(mode: CUDAGraphMode, runtime: CUDAGraphMode) -> None:
    """has_mode(r) is true exactly when r is the decode or the mixed mode of this mode."""
    decode, mixed, _, _ = SPEC[mode]
    assert mode.has_mode(runtime) is (runtime in (decode, mixed))


@given(mixed_case_names())
def test_parse_is_case_insensitive(case: tuple[CUDAGraphMode, str]) -> None:
    """parse accepts a mode's name in any mix of cases (config files and CLIs differ)."""
    mode, text = case
    assert CUDAGraphMode.parse(text) is mode


@pytest.mark.parametrize("text", ["bogus", "", "FULL_AND", "piece wise", "FULLDECODEONLY"])
def test_parse_unknown_name_lists_valid_names(text: str) -> None:
    """An unknown name is a ValueError that quotes the input and lists every valid name."""
    with pytest.raises(ValueError, match=re.escape(repr(text))) as info:
        CUDAGraphMode.parse(text)
    message = str(info.value)
    for mode in CUDAGraphMode:
        assert mode.name in message


def test_batch_descriptor_defaults() -> None:
    """Only num_tokens is required; the rest default to a relaxed, LoRA-free key."""
    key = BatchDescriptor(7)
    assert (key.num_tokens, key.num_reqs, key.uniform, key.has_lora, key.num_active_loras) == (
        7,
        None,
        False,
        False,
        0,
    )


@given(batch_descriptors)
def test_batch_descriptor_is_hashable_by_value(key: BatchDescriptor) -> None:
    """Equal descriptors hash equal, so a copy finds the graph stored under the original."""
    copy = dataclasses.replace(key)
    assert copy is not key
    assert copy == key
    assert hash(copy) == hash(key)
    assert {key: "graph"}[copy] == "graph"


@given(batch_descriptors, batch_descriptors)
def test_batch_descriptor_equality_is_by_fields(a: BatchDescriptor, b: BatchDescriptor) -> None:
    """Two descriptors are the same key exactly when all five fields agree."""
    assert (a == b) is (dataclasses.astuple(a) == dataclasses.astuple(b))


def test_batch_descriptor_is_frozen_and_slotted() -> None:
    """A key cannot change under a graph table (frozen) and carries no per-instance dict (slotted)."""
    key = BatchDescriptor(8, num_reqs=8, uniform=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.num_tokens = 16  # type: ignore[misc]  # the point: assignment must fail
    assert key.num_tokens == 8
    assert not hasattr(key, "__dict__")
    assert "__slots__" in vars(BatchDescriptor)


@given(batch_descriptors)
def test_relaxed_drops_only_the_request_layout(key: BatchDescriptor) -> None:
    """relaxed() clears num_reqs and uniform and keeps tokens and LoRA: the PIECEWISE key of a batch."""
    relaxed = key.relaxed()
    assert relaxed == BatchDescriptor(
        key.num_tokens, None, False, has_lora=key.has_lora, num_active_loras=key.num_active_loras
    )
    assert relaxed.relaxed() == relaxed


@given(st.builds(BatchDescriptor, st.integers(0, 600)))
def test_relaxed_of_a_relaxed_key_is_equal(key: BatchDescriptor) -> None:
    """A key that is already relaxed (num_reqs None, not uniform) is its own relaxed form."""
    assert key.relaxed() == key
