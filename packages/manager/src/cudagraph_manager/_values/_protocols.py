"""The seams of this package, as types: outputs, engines, the attention's builder, the background capture.

The manager reaches the capture layer only through ``GraphEngineFactory`` and
the capture package's ``GraphEngine`` protocol (``warm_up``, ``record``, which
hands back a ``GraphEntry`` the manager keeps): the default factory is
``cudagraph_capture.graph_engine`` (its recorders, directly), and a test (or
another engine) can pass its own. ``CaptureJobs`` is what a background capture
asks of the manager's captures, ``CaptureState`` what a step without a graph
asks, ``StepHook`` what a step with ranks calls around its exchange, and
``BackgroundCapture`` the handle ``start_capture()`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

import torch

from cudagraph_capture import CaptureOptions, GraphEngine
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from cudagraph_dispatch.support import AttentionSupport

from ._batch import BatchShape, StepBatch

if TYPE_CHECKING:  # the names are for the annotations
    from ._reports import CaptureReport

#: What a model may return: a tensor, or a flat tuple, list or dict of tensors.
ModelOutput: TypeAlias = (
    torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | dict[str, torch.Tensor]
)

#: The output type of one manager's model (``run`` returns the same structure).
OutputT = TypeVar("OutputT", bound=ModelOutput)
R = TypeVar("R")
M_co = TypeVar("M_co", covariant=True)


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


class AttentionMetadataBuilder(Protocol[M_co]):
    """An attention backend's per-step metadata, built for the batch a forward runs as.

    vLLM's ``AttentionMetadataBuilder[M]``, SGLang's capture/replay pair:
    ``M`` is the backend's own metadata type, which the model reads back
    with ``attention_metadata(builder)``. The builder owns persistent
    buffers sized once for the largest batch; whatever a graph reads lives
    there, at fixed addresses, and ``build`` refills it in place.

    ``support``: the batches a FULL graph of this attention replays
    correctly; the manager resolves its mode against it.
    ``build(batch, shape)``: the metadata of ``batch`` (real rows) padded to
    ``shape`` (``BatchShape``), written on the current stream with no host
    synchronization where ``shape.mode`` is FULL or PIECEWISE. Host values
    in the result (a query-length bound, a split count) may depend on
    ``shape`` alone where ``shape.mode`` is FULL: the graph bakes them.
    ``build_for_capture(shape)``: the metadata a graph of ``shape`` records
    with: the same buffers and host values as ``build`` returns for it (of
    the same type: a replay's ``build`` of another is refused), and host work
    only (the recording runs nothing on the device).
    """

    @property
    def support(self) -> AttentionSupport: ...

    def build(self, batch: StepBatch, shape: BatchShape, /) -> M_co: ...

    def build_for_capture(self, shape: BatchShape, /) -> M_co: ...


class BackgroundCapture(Protocol):
    """The handle ``start_capture()`` returns: a capture beside the serving steps, and its report.

    Two sessions keep it: ``ThreadCapture`` (a thread records while
    ``run()`` serves) and, with ranks, ``LockstepCapture`` (the serving
    steps capture, every rank the same keys together). ``done``: it ended;
    ``progress``: ``(keys finished, keys planned)`` (captured or given up
    on); ``errors``: the error of each key given up on (and of a failed
    warm-up); ``retries``: failed tries that were tried again (the capture
    was invalidated); ``wait(timeout)``: the ``CaptureReport`` once done
    (``TimeoutError`` if ``timeout`` seconds pass first); ``stop()``: record
    no further key.
    """

    @property
    def done(self) -> bool: ...

    @property
    def progress(self) -> tuple[int, int]: ...

    @property
    def errors(self) -> tuple[BaseException, ...]: ...

    @property
    def retries(self) -> int: ...

    def wait(self, timeout: float | None = None) -> CaptureReport: ...

    def stop(self) -> None: ...


class RunningCapture(Protocol):
    """What a step asks of a capture thread: a key it missed (captured next), then that it was served."""

    def missed(self, descriptor: BatchDescriptor, /) -> None: ...

    def served(self) -> None: ...


class StepHook(Protocol):
    """What a step with ranks takes at construction: a field for its exchange, and what follows the exchange.

    The lockstep capture's (``_capture/_lockstep.Lockstep``): ``field()`` is
    this rank's opaque field of the step's row (``RankAgreement.route_step``);
    ``stepped(fields)`` gets every rank's, by rank, right after the exchange
    and before the step runs (where the capture takes its turn), and says
    whether the exchange saw every rank's capture running: strict mode then
    runs the step's eager forward, on every rank alike.
    """

    def field(self) -> tuple[int, ...]: ...

    def stepped(self, fields: Sequence[tuple[int, ...]], /) -> bool: ...


class CaptureState(Protocol):
    """What a step without a graph asks of the manager's captures (``Capturer``): why its key has none.

    ``released``: ``release()`` freed the graphs and no capture started
    since; ``running()``: the background capture still running, if one is
    (a thread's, or with ranks the lockstep one); ``thread_capture()``: the
    capture thread's still running, which a step's miss reorders.
    """

    @property
    def released(self) -> bool: ...

    def running(self) -> BackgroundCapture | None: ...

    def thread_capture(self) -> RunningCapture | None: ...
