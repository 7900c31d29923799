"""The seam of this package, as a protocol: what ``agree_across_ranks`` calls on a dispatcher."""

from __future__ import annotations

from typing import Protocol

from ._modes import CUDAGraphMode
from ._rule import Dispatch


class GraphDispatcher(Protocol):
    """What ``agree_across_ranks`` calls on a dispatcher: ``dispatch`` alone.

    ``CUDAGraphDispatcher`` is the one implementation; a test may pass a
    fake. The manager builds its own ``CUDAGraphDispatcher`` and reads its
    tables directly, so nothing else of ours takes this protocol.
    """

    def dispatch(
        self,
        num_tokens: int,
        *,
        uniform_decode: bool = ...,
        num_active_loras: int = ...,
        invalid_modes: frozenset[CUDAGraphMode] = ...,
    ) -> Dispatch: ...
