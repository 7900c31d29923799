"""The low-level tier of ``cudagraph_capture``, for engines built on the capture package.

Like ``trio.lowlevel``: the pieces the engines are made of (the device's
capture lock and stream, the collector and cuBLAS rules around a capture, the
pool's release, weak outputs, the capture switch's check, device memory
reserved as addresses and backed later, a shrinking loop's rows, a replay
chosen on the device), for a runner that builds its own engine on them.
Most users need only ``cudagraph_capture``.
Importing it does not initialize CUDA.
"""

from ._choice import SwitchReplay as SwitchReplay
from ._conditional import LoopFallback as LoopFallback
from ._cublas import drop_cublas_workspaces as drop_cublas_workspaces
from ._device import resolve_device as resolve_device
from ._enabled import capture_disabled_reason as capture_disabled_reason
from ._enabled import check_capture_enabled as check_capture_enabled
from ._gc import collector_paused as collector_paused
from ._guard import OutputGuard as OutputGuard
from ._loop import LoopRows as LoopRows
from ._loop import loop_fallback_counts as loop_fallback_counts
from ._pool import GraphPool as GraphPool
from ._pool import capture_lock as capture_lock
from ._pool import capture_stream as capture_stream
from ._pool import release_graph_memory as release_graph_memory
from ._protocols import RecordSeconds as RecordSeconds
from ._reserved import ReservedMemory as ReservedMemory
from ._weakref import weak_ref_tensors as weak_ref_tensors

__all__ = [
    "GraphPool",
    "LoopFallback",
    "LoopRows",
    "OutputGuard",
    "RecordSeconds",
    "ReservedMemory",
    "SwitchReplay",
    "capture_disabled_reason",
    "capture_lock",
    "capture_stream",
    "check_capture_enabled",
    "collector_paused",
    "drop_cublas_workspaces",
    "loop_fallback_counts",
    "release_graph_memory",
    "resolve_device",
    "weak_ref_tensors",
]
