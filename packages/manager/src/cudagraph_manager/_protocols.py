"""The seams of this package, as types: the model's outputs and the engine factory.

The manager reaches the capture layer only through ``GraphEngineFactory`` and
the capture package's ``GraphEngine`` protocol (``capture``, ``is_captured``,
``replay``, ``clear``): the default factory builds ``cudagraph_capture``'s
wrappers, and a test (or another engine) can pass its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias, TypeVar

import torch

from cudagraph_capture import CaptureOptions, GraphEngine
from cudagraph_dispatch import CUDAGraphMode

#: What a model may return: a tensor, or a flat tuple, list or dict of tensors.
ModelOutput: TypeAlias = (
    torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | dict[str, torch.Tensor]
)

#: The output type of one manager's model (``run`` returns the same structure).
OutputT = TypeVar("OutputT", bound=ModelOutput)
R = TypeVar("R")


class GraphEngineFactory(Protocol):
    """Builds the engine that captures and replays ``model`` for one runtime mode (FULL or PIECEWISE).

    The manager calls ``engine.capture(descriptor, **static_views)`` once per
    key of its plan, then ``engine.replay(descriptor)`` on every step that
    dispatches to that key; ``engine.is_captured(descriptor)`` decides
    between replay and an eager run.
    """

    def __call__(
        self, model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions
    ) -> GraphEngine[..., R]: ...
