"""Model-level CUDA graph capture and replay.

``CUDAGraphManager`` takes a model and a description of its inputs
(``StaticInput``), captures every graph the dispatcher plans at start-up
(largest first, one shared pool) and runs each step through the right one:
validate, dispatch, copy into static buffers, pad, replay (FULL through the
monolithic engine, PIECEWISE through the breakable one), cut the outputs back.
``compile_for_capture`` compiles a model for it (inductor, one compile for
every size, no inductor graphs). Importing this package does not initialize
CUDA, loads neither dynamo nor inductor, and loads no example code:
the reference decoder and the demo live in the repository's ``examples/``.
"""

from typing import TYPE_CHECKING, Final

from cudagraph_dispatch._retired import resolver as _resolver

from ._compiled import CompiledModel as CompiledModel
from ._compiled import compile_for_capture as compile_for_capture
from ._manager import CUDAGraphManager as CUDAGraphManager
from ._memory._kv import KVCacheMemory as KVCacheMemory
from ._memory._weights import WeightsReplacedError as WeightsReplacedError
from ._options import ManagerOptions as ManagerOptions
from ._steps._plan import NoGraphError as NoGraphError
from ._values._inputs import StaticInput as StaticInput
from ._values._loop import DecodeLoop as DecodeLoop
from ._values._loop import LoopState as LoopState
from ._values._protocols import BackgroundCapture as BackgroundCapture
from ._values._reports import CaptureReport as CaptureReport
from ._values._reports import MemoryEstimate as MemoryEstimate

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._memory._outputs import OutputRows as OutputRows
    from ._values._inputs import Rows as Rows
    from ._values._loop import LoopResult as LoopResult
    from ._values._reports import CapturedGraph as CapturedGraph
    from ._values._reports import CapturePhases as CapturePhases
    from ._values._reports import KVCacheBacking as KVCacheBacking
    from ._values._reports import ManagerStats as ManagerStats

__version__ = "0.1.0"

__all__ = [
    "BackgroundCapture",
    "CUDAGraphManager",
    "CaptureReport",
    "CompiledModel",
    "DecodeLoop",
    "KVCacheMemory",
    "LoopState",
    "ManagerOptions",
    "MemoryEstimate",
    "NoGraphError",
    "StaticInput",
    "WeightsReplacedError",
    "compile_for_capture",
]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "CapturePhases": ("cudagraph_manager._values._reports", "CapturePhases"),
    "CapturedGraph": ("cudagraph_manager._values._reports", "CapturedGraph"),
    "KVCacheBacking": ("cudagraph_manager._values._reports", "KVCacheBacking"),
    "LoopResult": ("cudagraph_manager._values._loop", "LoopResult"),
    "ManagerStats": ("cudagraph_manager._values._reports", "ManagerStats"),
    "OutputRows": ("cudagraph_manager._memory._outputs", "OutputRows"),
    "Rows": ("cudagraph_manager._values._inputs", "Rows"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
