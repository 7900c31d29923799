"""``CUDAGraphDispatcher.explain``: the reason behind a decision, in words."""

from __future__ import annotations

import re

import pytest

from cudagraph_dispatch import CaptureSizes, CUDAGraphDispatcher, CUDAGraphMode, DispatchConfig

M = CUDAGraphMode


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
