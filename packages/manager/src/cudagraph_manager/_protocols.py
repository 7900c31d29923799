"""The seams of this package, as types: the model's outputs and the engine factory.

The manager reaches the capture layer only through ``GraphEngineFactory`` and
the capture package's ``GraphEngine`` protocol (``warm_up``, ``record``, which
hands back a ``GraphEntry`` the manager keeps): the default factory builds
``cudagraph_capture``'s wrappers, and a test (or another engine) can pass its own.
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

    The manager calls ``engine.warm_up(descriptor, static_views)`` and
    ``engine.record(descriptor, static_views)`` once per key of its plan,
    keeps the returned entry on the key, and calls ``entry.replay()`` on
    every step that dispatches to that key.
    """

    def __call__(
        self, model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions
    ) -> GraphEngine[R]: ...
