"""The seams of this package, as protocols: an engine can be faked or replaced."""

from __future__ import annotations

from typing import ParamSpec, Protocol, TypeVar

from cudagraph_dispatch import BatchDescriptor

P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)


class GraphEngine(Protocol[P, R_co]):
    """A callable that captures per forward-context descriptor and replays after.

    Both ``CUDAGraphWrapper`` and ``BreakableCUDAGraphWrapper`` satisfy it; the
    manager layer depends on this protocol, not on the classes.
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    @property
    def num_captured(self) -> int: ...

    def captured(self) -> frozenset[BatchDescriptor]: ...

    def clear(self) -> None: ...
