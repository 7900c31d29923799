"""Low-level capture steps shared by both engines: one graph segment begun, ended or aborted.

Both engines capture on a side stream (``on_side_stream``) ordered after the
caller's stream, and the caller's stream after it, with no host
synchronization. Around each segment they drop torch's cached cuBLAS
workspaces, so a captured GEMM takes its workspace from the graph pool
(docs/design.md, "Capture engines", and the README's "cuBLAS workspaces" say
why).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Final

import torch

from cudagraph_dispatch import BatchDescriptor

from ._cublas import drop_cublas_workspaces as drop_cublas_workspaces  # patched by a negative control
from ._errors import CaptureError, CaptureInvalidatedError
from ._pool import GraphPool, retire_shared_pool

# Only this thread's unsafe CUDA calls invalidate its capture: a server's other
# threads may keep working while start-up captures.
_ERROR_MODE: Final = "thread_local"
_EMPTY_GRAPH_WARNING: Final = "graph is empty"
_UNJOINED: Final = ("unjoined", "not joined")


class ThreadState(threading.local):
    """Per-thread capture state: the active breakable capture, if any."""

    def __init__(self) -> None:
        self.breakable: object | None = None


THREAD: Final = ThreadState()


@contextlib.contextmanager
def on_side_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Run the body on ``stream``, ordered after the caller's stream and before its next work."""
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)  # the body sees every write queued before it
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)  # what the caller does next sees the body's work


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph whose ``capture_end`` only records: ``instantiate_segment`` then builds its executable.

    Two calls instead of one, so a capture can say what each cost (torch's
    ``keep_graph=True``; the template graph is host memory, freed with it).
    """
    return torch.cuda.CUDAGraph(keep_graph=True)


def instantiate_segment(graph: torch.cuda.CUDAGraph) -> float:
    """Build the executable of a recorded ``graph`` (``cudaGraphInstantiate``); its host seconds."""
    start = time.perf_counter()
    graph.instantiate()
    return time.perf_counter() - start


def begin_segment(graph: torch.cuda.CUDAGraph, pool: GraphPool) -> None:
    """Start capturing ``graph`` on the current stream, allocating from ``pool``.

    The capture's GEMMs get a workspace allocated from ``pool`` (see above).
    """
    drop_cublas_workspaces()
    graph.capture_begin(pool=pool, capture_error_mode=_ERROR_MODE)


def end_segment(graph: torch.cuda.CUDAGraph, pool: GraphPool, descriptor: BatchDescriptor | None) -> bool:
    """End the capture of ``graph``; False when it captured no work (empty graph).

    An unjoined side stream makes the CUDA runtime refuse to end the capture:
    that becomes a ``CaptureError`` that says which stream rule was broken.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            graph.capture_end()
        except RuntimeError as error:
            drop_cublas_workspaces()
            repair_failed_capture(pool)
            text = str(error).lower()
            if any(word in text for word in _UNJOINED):
                raise CaptureError(
                    "a side stream forked from the capture stream was not joined back before an "
                    "eager break or the end of the capture; make the capturing stream wait for it "
                    "(torch.cuda.current_stream().wait_stream(side_stream)) first",
                    descriptor,
                ) from error
            raise CaptureInvalidatedError(
                f"ending the CUDA graph capture failed: {error}", descriptor
            ) from error
    drop_cublas_workspaces()  # eager GEMMs from now on get a workspace outside the pool
    empty = False
    for warning in caught:
        if _EMPTY_GRAPH_WARNING in str(warning.message).lower():
            empty = True
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return not empty


def abort_segment(graph: torch.cuda.CUDAGraph, pool: GraphPool) -> bool:
    """End a capture that an exception interrupted; whether CUDA had invalidated it.

    The caller raises that exception (``CaptureInvalidatedError`` from it where
    the capture was invalidated: the same capture may succeed when tried again).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            graph.capture_end()
        except RuntimeError:
            repair_failed_capture(pool)  # CUDA refused to end it: the capture was invalidated
            return True
        finally:
            drop_cublas_workspaces()
    return False


def repair_failed_capture(pool: GraphPool) -> None:
    """Finish the bookkeeping that ``capture_end`` skips when CUDA refuses to end a capture.

    CUDA has ended the capture, but torch raised before it (a) stopped routing
    allocations to the pool, in the device and the host caching allocators,
    and (b) took the device's random generator out of capture mode; left so,
    the next capture into the pool and every later ``torch.randn`` on the
    device fail. The generator gets a fresh state, the device allocator is
    closed here, and the shared pool is replaced (the host allocator cannot be
    reached from Python): the process stays usable. A caller's own pool stays
    unusable for new captures; graphs already captured into it still replay.
    """
    device = torch.cuda.current_device()
    with contextlib.suppress(RuntimeError):  # the allocator may have closed it already
        torch._C._cuda_endAllocateToPool(device, pool)
    generator = torch.cuda.default_generators[device]
    generator.graphsafe_set_state(generator.clone_state())
    retire_shared_pool(device, pool)
