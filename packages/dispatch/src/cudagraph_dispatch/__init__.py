"""CUDA graph dispatch: modes, batch keys, capture sizes, and the dispatcher.

Pure Python, never imports torch: the decisions a serving engine makes each
step (which graph, padded to which size) are values that can be tested and
agreed across ranks without a GPU. The package README lists every public
name with the reason it is public, and the names retired from the API.
"""

from typing import TYPE_CHECKING, Final

from ._config import DispatchConfig as DispatchConfig
from ._context import ForwardContext as ForwardContext
from ._context import get_forward_context as get_forward_context
from ._context import set_forward_context as set_forward_context
from ._descriptor import BatchDescriptor as BatchDescriptor
from ._dispatcher import CUDAGraphDispatcher as CUDAGraphDispatcher
from ._modes import CUDAGraphMode as CUDAGraphMode
from ._ranks import agree_across_ranks as agree_across_ranks
from ._reasons import EagerReason as EagerReason
from ._request import RankRequest as RankRequest
from ._retired import resolver as _resolver
from ._rule import Dispatch as Dispatch
from ._sizes import CaptureSizes as CaptureSizes

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._protocols import GraphDispatcher as GraphDispatcher
    from ._rule import Route as Route

    StepRequest = RankRequest

__version__ = "0.1.0"

__all__ = [
    "BatchDescriptor",
    "CUDAGraphDispatcher",
    "CUDAGraphMode",
    "CaptureSizes",
    "Dispatch",
    "DispatchConfig",
    "EagerReason",
    "ForwardContext",
    "RankRequest",
    "agree_across_ranks",
    "get_forward_context",
    "set_forward_context",
]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "GraphDispatcher": ("cudagraph_dispatch._protocols", "GraphDispatcher"),
    "Route": ("cudagraph_dispatch._rule", "Route"),
    "StepRequest": ("cudagraph_dispatch._request", "RankRequest"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
