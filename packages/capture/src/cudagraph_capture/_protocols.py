"""The seams of this package, as protocols: an engine can be faked or replaced."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import torch

from cudagraph_dispatch import BatchDescriptor

R_co = TypeVar("R_co", covariant=True)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordSeconds:
    """What recording one graph cost the host, in seconds.

    Args:
        recording: from the capture's start to its end (the model's calls,
            the segments' eager breaks included).
        instantiation: building the executables (``cudaGraphInstantiate``),
            which a replay otherwise pays.

    Raises:
        ValueError: a field that is no finite number >= 0, naming it.
    """

    recording: float
    instantiation: float

    def __post_init__(self) -> None:
        for name in ("recording", "instantiation"):
            value: object = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"{name}: expected seconds, a finite number >= 0, got {value!r}")


class GraphEntry(Protocol[R_co]):
    """One captured graph that replays itself; whoever holds it owns the graph.

    ``replay()`` launches the graph (or a breakable capture's segments and
    eager ops) on the current stream and rewrites ``output`` in place; no
    host synchronization. Dropping the last reference frees the graph.
    """

    @property
    def replay(self) -> Callable[[], object]: ...

    @property
    def output(self) -> R_co:
        """The outputs the capture returned: aliases of graph memory, rewritten by every replay."""
        ...

    @property
    def seconds(self) -> RecordSeconds:
        """What its recording cost the host (the recording and the instantiation)."""
        ...


class GraphEngine(Protocol[R_co]):
    """Capture keyed by batch descriptor, for a model runner that keeps the entries itself.

    ``graph_engine(runnable, mode, options)`` builds one; ``CUDAGraphWrapper``
    and ``BreakableCUDAGraphWrapper`` satisfy it too. The manager depends on
    this protocol, not on the classes. The runner is the
    one owner of "is this key captured": it keeps each ``GraphEntry`` that
    ``record`` returns, and ``record`` keeps nothing.
    """

    def warm_up(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
        """Run the model eagerly (``options.warmup_runs`` times) on the capture stream.

        Ordered after the caller's stream and before its next work, under the
        forward context ``(NONE, descriptor)`` with the extras of the caller's
        forward context: what lazy initialization a capture must not meet
        (library handles, compilation) happens here.

        Args:
            descriptor: the key about to be recorded.
            inputs: the model's keyword arguments (the static inputs).
        """
        ...

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> GraphEntry[R_co]:
        """Capture ``descriptor``'s graph from a call with ``inputs``, running nothing on the device.

        The work is recorded, not executed: no warm-up, no run of the
        recorded graph, and a breakable capture's eager breaks are recorded
        without being called (they return ``None`` during it). So the capture
        writes no memory: not the pool (which may hold outputs a caller still
        reads), not the model's buffers. The outputs' values are undefined
        until the first ``replay``. The runnable runs under the forward context
        ``(mode, descriptor)`` with the extras of the caller's.

        Args:
            descriptor: the graph's key.
            inputs: the model's keyword arguments (the static inputs).

        Returns:
            The entry, which the caller owns.

        Raises:
            CaptureError: the capture failed, naming ``descriptor``.
        """
        ...
