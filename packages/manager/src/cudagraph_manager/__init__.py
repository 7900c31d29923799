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

from ._compiled import CompiledModel as CompiledModel
from ._compiled import compile_for_capture as compile_for_capture
from ._manager import CUDAGraphManager as CUDAGraphManager
from ._memory._kv import KVCacheMemory as KVCacheMemory
from ._memory._outputs import OutputRows as OutputRows
from ._memory._weights import WeightsReplacedError as WeightsReplacedError
from ._options import ManagerOptions as ManagerOptions
from ._steps._plan import NoGraphError as NoGraphError
from ._values._inputs import Rows as Rows
from ._values._inputs import StaticInput as StaticInput
from ._values._loop import DecodeLoop as DecodeLoop
from ._values._loop import LoopResult as LoopResult
from ._values._loop import LoopState as LoopState
from ._values._protocols import BackgroundCapture as BackgroundCapture
from ._values._reports import CapturedGraph as CapturedGraph
from ._values._reports import CapturePhases as CapturePhases
from ._values._reports import CaptureReport as CaptureReport
from ._values._reports import KVCacheBacking as KVCacheBacking
from ._values._reports import ManagerStats as ManagerStats
from ._values._reports import MemoryEstimate as MemoryEstimate

__version__ = "0.1.0"

__all__ = [
    "BackgroundCapture",
    "CUDAGraphManager",
    "CapturePhases",
    "CaptureReport",
    "CapturedGraph",
    "CompiledModel",
    "DecodeLoop",
    "KVCacheBacking",
    "KVCacheMemory",
    "LoopResult",
    "LoopState",
    "ManagerOptions",
    "ManagerStats",
    "MemoryEstimate",
    "NoGraphError",
    "OutputRows",
    "Rows",
    "StaticInput",
    "WeightsReplacedError",
    "compile_for_capture",
]
