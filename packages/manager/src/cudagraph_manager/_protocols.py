"""The seams of this package, as types: the model's outputs and the capture engines.

The manager talks to the capture layer through ``GraphEngineFactory`` and the
capture package's ``GraphEngine`` protocol: the default factory builds
``cudagraph_capture``'s wrappers, and a test (or another engine) can pass its
own without touching the manager.
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


class GraphEngineFactory(Protocol):
    """Builds the engine that captures ``model`` for one runtime mode (FULL or PIECEWISE).

    The engine follows ``cudagraph_capture.GraphEngine``: with no forward
    context, or one of another mode, it calls the model; otherwise the first
    call for a descriptor captures, and later calls replay (ignoring their
    arguments: a graph reads the tensors it was captured with) and return the
    outputs captured for that descriptor.
    """

    def __call__(
        self, model: Callable[..., object], mode: CUDAGraphMode, options: CaptureOptions
    ) -> GraphEngine[..., object]: ...
