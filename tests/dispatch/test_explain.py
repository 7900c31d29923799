"""``CUDAGraphDispatcher.explain``: the reason behind a decision, in words."""

from __future__ import annotations

import re
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_dispatch import CaptureSizes, CUDAGraphDispatcher, CUDAGraphMode, DispatchConfig
from tests.strategies import (
    active_lora_counts,
    dispatchers_with_token_counts,
    invalid_mode_sets,
    step_count,
    step_loras,
)

M = CUDAGraphMode
#: The sentences for a batch that runs eagerly, one per reason (the figures vary).
EAGER_REASONS: Final = (
    r"the config's mode is NONE",
    r"an empty batch has no graph",
    r"\d+ tokens exceed the largest capture size \d+",
    r"num_active_loras=\d+ exceeds the largest captured count \d+",
    r"mode \w+ has no graph for a (mixed|uniform decode) batch( with invalid_modes \[.*\])?",
)


def _dispatcher(mode: CUDAGraphMode, lora_counts: tuple[int, ...] = ()) -> CUDAGraphDispatcher:
    return CUDAGraphDispatcher(DispatchConfig(mode, CaptureSizes([1, 8]), 8, lora_counts=lora_counts))


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        (M.NONE, {}, "the config's mode is NONE"),
        (M.FULL, {"num_tokens": 9}, "9 tokens exceed the largest capture size 8"),
        (M.FULL, {"num_tokens": 0}, "an empty batch has no graph"),
        (M.FULL, {"num_active_loras": 1}, "num_active_loras=1 exceeds the largest captured count 0"),
        (M.FULL_DECODE_ONLY, {}, "mode FULL_DECODE_ONLY has no graph for a mixed batch"),
        (
            M.FULL,
            {"invalid_modes": frozenset({M.FULL})},
            r"mode FULL has no graph for a mixed batch with invalid_modes \['FULL'\]",
        ),
        (M.PIECEWISE, {}, "replay the PIECEWISE graph"),
    ],
)
def test_explain_names_the_reason(mode: CUDAGraphMode, kwargs: dict[str, object], expected: str) -> None:
    """Each way to get NONE has its own sentence; a graph decision names the graph."""
    dispatcher = _dispatcher(mode)
    num_tokens = kwargs.pop("num_tokens", 3)
    assert isinstance(num_tokens, int)
    uniform = kwargs.get("uniform_decode", False)
    loras = kwargs.get("num_active_loras", 0)
    invalid = kwargs.get("invalid_modes", frozenset())
    assert isinstance(uniform, bool)
    assert isinstance(loras, int)
    assert isinstance(invalid, frozenset)
    text = dispatcher.explain(
        num_tokens, uniform_decode=uniform, num_active_loras=loras, invalid_modes=invalid
    )

    assert re.search(expected, text), text


def test_explain_agrees_with_dispatch_on_graph_decisions() -> None:
    """For a batch that gets a graph, the sentence names exactly the dispatched key."""
    dispatcher = _dispatcher(M.FULL_AND_PIECEWISE)
    decision = dispatcher.dispatch(5, uniform_decode=True)
    assert str(decision.descriptor) in dispatcher.explain(5, uniform_decode=True)
    graphs = 0
    for mode in (M.FULL, M.PIECEWISE, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE):
        dispatcher = _dispatcher(mode, lora_counts=(2,))
        for n in range(1, 9):  # every count up to the largest size, uniform or mixed, with adapters or not
            for uniform in (False, True):
                for loras in range(min(n, 2) + 1):
                    decision = dispatcher.dispatch(n, uniform_decode=uniform, num_active_loras=loras)
                    text = dispatcher.explain(n, uniform_decode=uniform, num_active_loras=loras)
                    if decision.mode is not M.NONE:
                        graphs += 1
                        assert (
                            text == f"{n} tokens replay the {decision.mode.name} graph {decision.descriptor}"
                        )
    assert graphs > 100


@given(dispatchers_with_token_counts(), st.booleans(), active_lora_counts, invalid_mode_sets)
def test_explain_never_disagrees_with_dispatch(
    case: tuple[CUDAGraphDispatcher, int],
    uniform_decode: bool,
    num_active_loras: int,
    invalid_modes: frozenset[CUDAGraphMode],
) -> None:
    """A graph decision is explained by naming exactly that graph, an eager one by an eager reason."""
    dispatcher, n = case
    n = step_count(dispatcher.config, n, uniform_decode)
    num_active_loras = step_loras(dispatcher.config, n, uniform_decode, num_active_loras)
    mode, key = dispatcher.dispatch(
        n, uniform_decode=uniform_decode, num_active_loras=num_active_loras, invalid_modes=invalid_modes
    )
    text = dispatcher.explain(
        n, uniform_decode=uniform_decode, num_active_loras=num_active_loras, invalid_modes=invalid_modes
    )
    if mode is M.NONE:
        assert any(re.fullmatch(reason, text) for reason in EAGER_REASONS), text
    else:
        assert text == f"{n} tokens replay the {mode.name} graph {key}"
