"""The default ``GraphEngineFactory``: ``cudagraph_capture``'s engine of each runtime mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from cudagraph_capture import CaptureOptions, GraphEngine, graph_engine
from cudagraph_dispatch import CUDAGraphMode

R = TypeVar("R")


def default_engine_factory(
    model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions
) -> GraphEngine[R]:
    """``graph_engine``: FULL -> one graph per key, PIECEWISE -> segments split at eager breaks.

    The manager keeps each entry the engine records; the engine keeps none.
    Another mode raises ``ValueError`` naming ``mode``.
    """
    return graph_engine(model, mode, options)
