"""The low-level tier of ``cudagraph_capture``, for runners that build on the engines' pieces.

Like ``trio.lowlevel``: what a runner that keeps its own graphs needs beside
``graph_engine`` (the seconds its own engine's entries report, a shrinking
loop's rows, a device argument resolved as the engines resolve it), device
memory reserved as addresses and backed later, and the release of the
graphs' memory. Most users need only
``cudagraph_capture``. Importing it does not initialize CUDA.
"""

from typing import TYPE_CHECKING, Final

from cudagraph_dispatch._retired import resolver as _resolver

from ._device import resolve_device as resolve_device
from ._loop import LoopRows as LoopRows
from ._pool import release_graph_memory as release_graph_memory
from ._protocols import RecordSeconds as RecordSeconds
from ._reserved import ReservedMemory as ReservedMemory

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._choice import SwitchReplay as SwitchReplay
    from ._conditional import LoopFallback as LoopFallback
    from ._cublas import drop_cublas_workspaces as drop_cublas_workspaces
    from ._enabled import capture_disabled_reason as capture_disabled_reason
    from ._enabled import check_capture_enabled as check_capture_enabled
    from ._gc import collector_paused as collector_paused
    from ._guard import OutputGuard as OutputGuard
    from ._loop import loop_fallback_counts as loop_fallback_counts
    from ._pool import GraphPool as GraphPool
    from ._pool import capture_lock as capture_lock
    from ._pool import capture_stream as capture_stream
    from ._weakref import weak_ref_tensors as weak_ref_tensors

__all__ = [
    "LoopRows",
    "RecordSeconds",
    "ReservedMemory",
    "release_graph_memory",
    "resolve_device",
]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "SwitchReplay": ("cudagraph_capture._choice", "SwitchReplay"),
    "GraphPool": ("cudagraph_capture._pool", "GraphPool"),
    "LoopFallback": ("cudagraph_capture._conditional", "LoopFallback"),
    "OutputGuard": ("cudagraph_capture._guard", "OutputGuard"),
    "capture_disabled_reason": ("cudagraph_capture._enabled", "capture_disabled_reason"),
    "capture_lock": ("cudagraph_capture._pool", "capture_lock"),
    "capture_stream": ("cudagraph_capture._pool", "capture_stream"),
    "check_capture_enabled": ("cudagraph_capture._enabled", "check_capture_enabled"),
    "collector_paused": ("cudagraph_capture._gc", "collector_paused"),
    "drop_cublas_workspaces": ("cudagraph_capture._cublas", "drop_cublas_workspaces"),
    "loop_fallback_counts": ("cudagraph_capture._loop", "loop_fallback_counts"),
    "weak_ref_tensors": ("cudagraph_capture._weakref", "weak_ref_tensors"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
