"""CUDA graph capture engines for PyTorch inference: monolithic and breakable.

``CUDAGraphWrapper`` captures one graph per batch descriptor;
``BreakableCUDAGraphWrapper`` captures graph segments split by eager ops
(``eager_break_during_capture``). Both follow the forward context of
``cudagraph_dispatch``, share one graph pool per device and capture on a
side stream. ``graph_engine(runnable, mode, options)`` is the
engine of a model runner that keeps its graphs itself (a ``GraphEngine``:
``warm_up``, then ``record`` hands back a ``GraphEntry`` the runner owns).
Importing this package does not initialize CUDA.
"""

from typing import TYPE_CHECKING, Final

from cudagraph_dispatch._retired import resolver as _resolver

from ._breakable import BreakableCUDAGraphCapture as BreakableCUDAGraphCapture
from ._breakable import eager_break_during_capture as eager_break_during_capture
from ._enabled import capture_enabled as capture_enabled
from ._enabled import set_capture_enabled as set_capture_enabled
from ._errors import CaptureDisabledError as CaptureDisabledError
from ._errors import CaptureError as CaptureError
from ._errors import CaptureInvalidatedError as CaptureInvalidatedError
from ._loop import DeviceLoop as DeviceLoop
from ._loop import LoopKind as LoopKind
from ._loop import LoopPolicy as LoopPolicy
from ._options import CaptureOptions as CaptureOptions
from ._protocols import GraphEngine as GraphEngine
from ._protocols import GraphEntry as GraphEntry
from ._recorder import graph_engine as graph_engine
from ._wrapper import BreakableCUDAGraphWrapper as BreakableCUDAGraphWrapper
from ._wrapper import CUDAGraphWrapper as CUDAGraphWrapper

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._pool import shared_pool as shared_pool

__version__ = "0.1.0"

__all__ = [
    "BreakableCUDAGraphCapture",
    "BreakableCUDAGraphWrapper",
    "CUDAGraphWrapper",
    "CaptureDisabledError",
    "CaptureError",
    "CaptureInvalidatedError",
    "CaptureOptions",
    "DeviceLoop",
    "GraphEngine",
    "GraphEntry",
    "LoopKind",
    "LoopPolicy",
    "capture_enabled",
    "eager_break_during_capture",
    "graph_engine",
    "set_capture_enabled",
]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "shared_pool": ("cudagraph_capture._pool", "shared_pool"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
