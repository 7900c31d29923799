"""The seams of this package, as protocols: an engine can be faked or replaced."""

from __future__ import annotations

from typing import ParamSpec, Protocol, TypeVar

from cudagraph_dispatch import BatchDescriptor

P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)


class GraphEngine(Protocol[P, R_co]):
    """Capture and replay keyed by batch descriptor, called directly (no forward context).

    ``CUDAGraphWrapper`` and ``BreakableCUDAGraphWrapper`` satisfy it; the
    manager depends on this protocol, not on the classes. The engine is the
    one owner of "is this key captured".
    """

    def capture(self, descriptor: BatchDescriptor, /, *args: P.args, **kwargs: P.kwargs) -> R_co:
        """Capture ``descriptor``'s graph from a call with these arguments; return its outputs."""
        ...

    def is_captured(self, descriptor: BatchDescriptor, /) -> bool: ...

    def discard(self, descriptor: BatchDescriptor, /) -> None:
        """Free ``descriptor``'s graph, if captured."""
        ...

    def replay(self, descriptor: BatchDescriptor, /) -> R_co:
        """Replay ``descriptor``'s graph; return the outputs its capture returned, rewritten."""
        ...

    def clear(self) -> None:
        """Free every captured graph."""
        ...
