"""One graph memory pool per device, usable for the life of the process; its capture stream and lock.

The shared pool is pinned by an *anchor*, a one-kernel graph captured into it
at creation (docs/design.md, "Capture engines", says why).
``release_graph_memory`` retires the shared pool (the next capture creates a
new one) and frees its anchor, so the pool's memory goes back to the device
once the last graph captured into it is freed.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, TypeAlias, TypeVar

import torch

from ._cublas import drop_cublas_workspaces
from ._device import cuda_index

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    GraphPool: TypeAlias = _POOL_HANDLE
    """A graph memory pool handle, as ``torch.cuda.graph_pool_handle()`` returns."""
else:
    GraphPool = tuple


class _DevicePool:
    __slots__ = ("anchor", "handle", "scratch")

    def __init__(self, handle: GraphPool, anchor: torch.cuda.CUDAGraph, scratch: torch.Tensor) -> None:
        self.handle: Final = handle
        self.anchor: Final = anchor  # pins the pool while it is the shared one (see module docstring)
        self.scratch: Final = scratch  # the anchor's only operand


_pools: Final[dict[int, _DevicePool]] = {}
_retired: Final[list[_DevicePool]] = []  # replaced after a failed capture; their graphs still replay
_streams: Final[dict[int, torch.cuda.Stream]] = {}
_capture_locks: Final[dict[int, threading.RLock]] = {}
_lock: Final = threading.RLock()  # shared_pool creates the capture stream under it
_T = TypeVar("_T")


def check_pool(field: str, pool: object) -> None:
    """``pool`` is ``None`` or a pool handle torch made in this process, else ``ValueError`` naming ``field``.

    A handle is a plain ``(int, int)`` tuple, so its shape alone cannot tell
    one from a made-up ``(0, 1)``; torch numbers its pools from counters, so
    a handle is one it made when its number was already issued. A pool of
    ``torch.cuda.graph_pool_handle()`` (or ``shared_pool``, or a
    ``torch.cuda.MemPool``'s ``id``) is ``(0, k)``: ``k`` must be below the
    next one, which taking a handle reads (a number, nothing allocated). A
    graph's own pool (``CUDAGraph.pool()`` of a graph captured without one)
    is ``(k, 0)``, ``k >= 1``. Without CUDA no handle exists.
    """
    if pool is None:
        return
    if not (isinstance(pool, tuple) and len(pool) == 2 and all(type(x) is int for x in pool)):
        raise ValueError(
            f"{field}: expected None or a handle from torch.cuda.graph_pool_handle(), got {pool!r}"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"{field}: {pool!r} cannot be a graph pool handle: CUDA is not available here, so torch "
            "made none (pass None)"
        )
    first, second = pool
    if first == 0 and second >= 1:  # a user pool: issued when below the next number
        issued = second < torch.cuda.graph_pool_handle()[1]
    else:  # a graph's private pool
        issued = first >= 1 and second == 0
    if not issued:
        raise ValueError(
            f"{field}: expected None or a handle from torch.cuda.graph_pool_handle() (or shared_pool()), "
            f"got {pool!r}, which torch never made in this process"
        )


def check_stream(field: str, stream: object) -> None:
    """``stream`` is ``None`` or a ``torch.cuda.Stream``, else ``ValueError``."""
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise ValueError(f"{field}: expected None or a torch.cuda.Stream, got {stream!r}")


def _per_device(cache: dict[int, _T], index: int, make: Callable[[int], _T]) -> _T:
    """``cache[index]``, made once under the lock on first use (lock-free afterwards)."""
    value = cache.get(index)
    if value is None:
        with _lock:
            value = cache.get(index)
            if value is None:
                value = cache[index] = make(index)
    return value


def _new_stream(index: int) -> torch.cuda.Stream:
    """A non-blocking stream of the engines' own, created outside torch's stream pool.

    ``torch.cuda.Stream()`` hands out the streams of a pool, 32 per priority,
    round robin: the 33rd stream a program takes is the first again. A serving
    thread's stream could then be the very stream a capture records on in
    another thread, and its steps would be recorded into the graph instead of
    running. So the capture stream is made with the driver's ``cuStreamCreate``
    (in the device's primary context, which torch's runtime uses) and wrapped
    as an ``ExternalStream``; it lives as long as the process. Where the
    driver library cannot be loaded, a pool stream of high priority (a pool
    programs rarely draw from) stands in.
    """
    with torch.cuda.device(index):
        torch.cuda.current_stream(index).query()  # a runtime call: the primary context is current here
        handle = _driver_stream()
    if handle is None:
        return torch.cuda.Stream(device=index, priority=-1)  # type: ignore[no-untyped-call]  # untyped stubs
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))  # type: ignore[no-untyped-call]  # untyped stubs


def _driver_stream() -> int | None:
    """A new non-blocking stream of the current context, from the CUDA driver; ``None`` if it fails."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    stream = ctypes.c_void_p()
    non_blocking = 1  # CU_STREAM_NON_BLOCKING: no implicit sync with the legacy default stream
    if driver.cuStreamCreate(ctypes.byref(stream), non_blocking) != 0 or not stream.value:
        return None
    return stream.value


def capture_lock(device: torch.device | str | int | None = None) -> threading.RLock:
    """The lock of the device's capture stream: one capture (or warm-up) records on it at a time.

    Threads that capture on one device (two managers' background captures,
    or one beside a foreground capture) take turns on the host; a thread may
    take it again inside its own capture.
    """
    return _per_device(_capture_locks, cuda_index(device), lambda _: threading.RLock())


def capture_stream(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """The side stream both engines capture on, one per device, outside torch's stream pool."""
    return _per_device(_streams, cuda_index(device), _new_stream)


def shared_pool(device: torch.device | str | int | None = None) -> GraphPool:
    """The device's shared graph pool; valid even after all its graphs are freed."""
    return _per_device(_pools, cuda_index(device), _new_pinned_pool).handle


def retire_shared_pool(device: int, handle: GraphPool) -> None:
    """Replace the device's shared pool if it is ``handle`` (after a failed capture)."""
    with _lock:
        pool = _pools.get(device)
        if pool is not None and pool.handle == handle:
            _retired.append(_pools.pop(device))


def release_graph_memory(device: torch.device | str | int | None = None) -> None:
    """Give the memory of freed graphs back to the device (not just to torch's cache); synchronizes it.

    Call after freeing graphs (``CUDAGraphManager.release()`` frees its own
    and calls this). The device's shared pool is retired (the next capture
    creates a new one) and its anchor freed, so the pool's memory returns to
    the device once no graph captured into it is alive; then torch's cached
    free blocks are returned (``torch.cuda.empty_cache()``, which frees the
    whole process's cache, as a sleep mode wants), and with them the
    executables of the freed graphs are long gone (the driver frees those
    when a graph is destroyed), with the cached cuBLAS workspaces of eager
    GEMMs (``drop_cublas_workspaces``). What stays: graphs still alive (another
    manager's or wrapper's), a graph output a caller still holds (its block),
    a caller's own pool (``CaptureOptions.pool``), and pools retired after a
    failed capture (their anchors stay: see ``repair_failed_capture``).
    Under the device's capture lock: never during a capture on the device.

    Args:
        device: the CUDA device (``None``: the current one).

    Raises:
        RuntimeError: there is no CUDA device.
        ValueError: ``device`` is not a CUDA device of this machine.
    """
    index = cuda_index(device)
    with capture_lock(index):
        with _lock:
            pool = _pools.pop(index, None)
        del pool  # its anchor with it: the pool is freeable once its last graph is gone
        with torch.cuda.device(index):
            # The eager GEMMs' cached workspaces go too (the next GEMM on a stream makes its own):
            # our graphs took theirs from their pool (see _segment).
            drop_cublas_workspaces()
            torch.cuda.empty_cache()
        _trim_driver_graph_memory(index)


def _trim_driver_graph_memory(index: int) -> None:
    """Ask the driver to give back the memory it keeps cached for graphs (``cuDeviceGraphMemTrim``).

    Best effort: where the driver library cannot be loaded, nothing is done.
    """
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    device = ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(device), index) == 0:
        driver.cuDeviceGraphMemTrim(device)


def _new_pinned_pool(index: int) -> _DevicePool:
    handle = torch.cuda.graph_pool_handle()
    with torch.cuda.device(index):
        scratch = torch.zeros(1, device=f"cuda:{index}")  # [1], outside the pool
        anchor = torch.cuda.CUDAGraph()
        stream = capture_stream(index)
        stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream):
            # Thread-local like every capture here: another thread's work must not break it.
            anchor.capture_begin(pool=handle, capture_error_mode="thread_local")
            try:
                scratch.add_(1)
            finally:
                anchor.capture_end()
        # Not on_side_stream (in _segment, which imports this module): the same ordering.
        torch.cuda.current_stream(index).wait_stream(stream)
    return _DevicePool(handle, anchor, scratch)
