"""The public seams of this package, as types: outputs, the engine factory, the builder, the handle.

A key's graph is warmed up, recorded and replayed by a ``GraphEngine`` (the
capture package's protocol: ``warm_up``, ``record``, which hands back the
``GraphEntry`` the graph table keeps), built per runtime mode by a
``GraphEngineFactory``: the default is ``cudagraph_capture.graph_engine``
(its recorders, directly), and a test or another engine passes its own
(``ManagerOptions.engine_factory``). That is the capture package's one seam
a caller replaces; the rest of it the manager uses directly: the decode
loops' ``DeviceLoop`` (no factory: tests patch it), the device's capture
lock, stream and pool, the collector's switch, the errors, ``CaptureOptions``,
``OutputGuard`` and the KV cache's ``ReservedMemory``.
``AttentionMetadataBuilder`` is what an attention backend implements;
``BackgroundCapture`` is the handle ``start_capture()`` returns, kept by two
sessions (``ThreadCapture``, ``LockstepCapture``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias, TypeVar

import torch

from cudagraph_capture import CaptureOptions, GraphEngine
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.support import AttentionSupport

from ._batch import BatchShape, StepBatch
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

    The manager builds one per runtime mode of its plan and calls
    ``engine.warm_up(descriptor, static_views)`` where its warm-up rule says
    a key needs one, ``engine.record(descriptor, static_views)`` for each
    capture of a key (and, into a pool of their own, for the estimate's
    probes), keeps the returned entry in its graph table, and calls
    ``entry.replay()`` on every step routed to that key.
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

    def wait(self, timeout: float | None = None) -> CaptureReport:
        """Wait for the capture to end (with ranks: take steps of 0 tokens until it ends on every rank).

        Args:
            timeout: seconds to wait at most (``None``: no bound).

        Returns:
            The capture's report.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            ValueError: ``timeout`` is no number of seconds >= 0.
            RuntimeError: called from inside the capture it waits for.
        """
        ...

    def stop(self) -> None:
        """Capture no further key; ``wait()`` then returns soon, the report saying how many were left."""
        ...
