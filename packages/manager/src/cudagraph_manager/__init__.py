"""Model-level CUDA graph capture and replay.

``CUDAGraphManager`` takes a model and a description of its inputs
(``StaticInput``), captures every graph the dispatcher plans at start-up
(largest first, one shared pool) and runs each step through the right one:
validate, dispatch, copy into static buffers, pad, replay (FULL through the
monolithic engine, PIECEWISE through the breakable one), cut the outputs back.
``reference`` holds a small Llama-like decoder for the demo, tests and
benchmarks. Importing this package does not initialize CUDA.
"""

from ._errors import NoGraphError as NoGraphError
from ._manager import CUDAGraphManager as CUDAGraphManager
from ._outputs import OutputRows as OutputRows
from ._protocols import GraphEngineFactory as GraphEngineFactory
from ._protocols import ModelOutput as ModelOutput
from ._report import CapturedGraph as CapturedGraph
from ._report import CaptureReport as CaptureReport
from ._report import ManagerStats as ManagerStats
from ._static import Rows as Rows
from ._static import StaticInput as StaticInput
from .reference import DecoderConfig as DecoderConfig
from .reference import ReferenceDecoder as ReferenceDecoder
from .reference import make_step_inputs as make_step_inputs
from .reference import static_inputs as static_inputs

__version__ = "0.1.0"

__all__ = [
    "CUDAGraphManager",
    "CaptureReport",
    "CapturedGraph",
    "DecoderConfig",
    "GraphEngineFactory",
    "ManagerStats",
    "ModelOutput",
    "NoGraphError",
    "OutputRows",
    "ReferenceDecoder",
    "Rows",
    "StaticInput",
    "make_step_inputs",
    "static_inputs",
]
