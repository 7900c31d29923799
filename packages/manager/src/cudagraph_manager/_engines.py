"""The default ``GraphEngineFactory``: ``cudagraph_capture``'s wrappers, one per runtime mode.

The manager builds its engines only through a factory (see ``_protocols``);
this one is used unless the caller passes ``engine_factory``.
"""

from __future__ import annotations

from collections.abc import Callable

from cudagraph_capture import (
    BreakableCUDAGraphWrapper,
    CaptureOptions,
    CUDAGraphWrapper,
    GraphEngine,
)
from cudagraph_dispatch import CUDAGraphMode


def capture_engine(
    model: Callable[..., object], mode: CUDAGraphMode, options: CaptureOptions
) -> GraphEngine[..., object]:
    """The default engines: FULL -> ``CUDAGraphWrapper``, PIECEWISE -> ``BreakableCUDAGraphWrapper``."""
    if mode is CUDAGraphMode.FULL:
        return CUDAGraphWrapper(model, CUDAGraphMode.FULL, options)
    if mode is CUDAGraphMode.PIECEWISE:
        return BreakableCUDAGraphWrapper(model, options)
    raise ValueError(f"mode: expected FULL or PIECEWISE, got {mode!r}")
