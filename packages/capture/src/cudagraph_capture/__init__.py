"""CUDA graph capture engines for PyTorch inference: monolithic and breakable.

``CUDAGraphWrapper`` captures one graph per batch descriptor;
``BreakableCUDAGraphWrapper`` captures graph segments split by eager ops
(``eager_break_during_capture``). Both follow the forward context of
``cudagraph_dispatch``, share one graph pool per device (``shared_pool``) and
capture on a side stream. ``graph_engine(runnable, mode, options)`` is the
engine of a model runner that keeps its graphs itself (a ``GraphEngine``:
``warm_up``, then ``record`` hands back a ``GraphEntry`` the runner owns).
Importing this package does not initialize CUDA.
"""

from ._breakable import BreakableCUDAGraphCapture as BreakableCUDAGraphCapture
from ._breakable import eager_break_during_capture as eager_break_during_capture
from ._conditional import LoopFallback as LoopFallback
from ._cublas import drop_cublas_workspaces as drop_cublas_workspaces
from ._device import resolve_device as resolve_device
from ._enabled import capture_disabled_reason as capture_disabled_reason
from ._enabled import capture_enabled as capture_enabled
from ._enabled import check_capture_enabled as check_capture_enabled
from ._enabled import set_capture_enabled as set_capture_enabled
from ._errors import CaptureDisabledError as CaptureDisabledError
from ._errors import CaptureError as CaptureError
from ._gc import collector_paused as collector_paused
from ._guard import OutputGuard as OutputGuard
from ._loop import DeviceLoop as DeviceLoop
from ._loop import LoopKind as LoopKind
from ._loop import LoopPolicy as LoopPolicy
from ._loop import loop_fallback_counts as loop_fallback_counts
from ._options import CaptureOptions as CaptureOptions
from ._pool import GraphPool as GraphPool
from ._pool import capture_lock as capture_lock
from ._pool import capture_stream as capture_stream
from ._pool import release_graph_memory as release_graph_memory
from ._pool import shared_pool as shared_pool
from ._protocols import GraphEngine as GraphEngine
from ._protocols import GraphEntry as GraphEntry
from ._protocols import RecordSeconds as RecordSeconds
from ._recorder import graph_engine as graph_engine
from ._weakref import weak_ref_tensors as weak_ref_tensors
from ._wrapper import BreakableCUDAGraphWrapper as BreakableCUDAGraphWrapper
from ._wrapper import CUDAGraphWrapper as CUDAGraphWrapper

__version__ = "0.1.0"

__all__ = [
    "BreakableCUDAGraphCapture",
    "BreakableCUDAGraphWrapper",
    "CUDAGraphWrapper",
    "CaptureDisabledError",
    "CaptureError",
    "CaptureOptions",
    "DeviceLoop",
    "GraphEngine",
    "RecordSeconds",
    "GraphEntry",
    "GraphPool",
    "LoopFallback",
    "LoopKind",
    "LoopPolicy",
    "OutputGuard",
    "capture_disabled_reason",
    "capture_enabled",
    "check_capture_enabled",
    "capture_lock",
    "capture_stream",
    "collector_paused",
    "drop_cublas_workspaces",
    "loop_fallback_counts",
    "eager_break_during_capture",
    "graph_engine",
    "release_graph_memory",
    "resolve_device",
    "set_capture_enabled",
    "shared_pool",
    "weak_ref_tensors",
]
