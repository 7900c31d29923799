"""The seams of this package, as protocols: a layer above can be faked."""

from __future__ import annotations

from typing import Protocol

from ._descriptor import BatchDescriptor
from ._modes import CUDAGraphMode
from ._rule import Dispatch


class GraphDispatcher(Protocol):
    """What the capture and manager layers need from a dispatcher."""

    def keys(self, mode: CUDAGraphMode) -> frozenset[BatchDescriptor]: ...

    def dispatch(
        self,
        num_tokens: int,
        *,
        uniform_decode: bool = ...,
        num_active_loras: int = ...,
        invalid_modes: frozenset[CUDAGraphMode] = ...,
    ) -> Dispatch: ...

    def capture_plan(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]: ...
