"""The default ``GraphEngineFactory``: ``cudagraph_capture``'s wrappers, one per runtime mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from cudagraph_capture import BreakableCUDAGraphWrapper, CaptureOptions, CUDAGraphWrapper, GraphEngine
from cudagraph_dispatch import CUDAGraphMode

R = TypeVar("R")


def default_engine_factory(
    model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions
) -> GraphEngine[R]:
    """FULL -> ``CUDAGraphWrapper`` (one graph per key), PIECEWISE -> ``BreakableCUDAGraphWrapper``."""
    if mode is CUDAGraphMode.FULL:
        return CUDAGraphWrapper(model, CUDAGraphMode.FULL, options)
    if mode is CUDAGraphMode.PIECEWISE:
        return BreakableCUDAGraphWrapper(model, options)
    raise ValueError(f"mode: expected FULL or PIECEWISE, got {mode!r}")
