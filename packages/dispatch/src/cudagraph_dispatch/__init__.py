"""CUDA graph dispatch: modes, batch keys, capture sizes, and the dispatcher.

Pure Python, never imports torch: the decisions a serving engine makes each
step (which graph, padded to which size) are values that can be tested and
agreed across ranks without a GPU.
"""

from ._config import DispatchConfig as DispatchConfig
from ._context import ForwardContext as ForwardContext
from ._context import get_forward_context as get_forward_context
from ._context import set_forward_context as set_forward_context
from ._descriptor import BatchDescriptor as BatchDescriptor
from ._dispatcher import CUDAGraphDispatcher as CUDAGraphDispatcher
from ._modes import CUDAGraphMode as CUDAGraphMode
from ._protocols import GraphDispatcher as GraphDispatcher
from ._ranks import agree_across_ranks as agree_across_ranks
from ._reasons import EagerReason as EagerReason
from ._request import RankRequest as RankRequest
from ._request import StepRequest as StepRequest
from ._rule import Dispatch as Dispatch
from ._rule import Route as Route
from ._sizes import CaptureSizes as CaptureSizes

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
    "GraphDispatcher",
    "RankRequest",
    "Route",
    "StepRequest",
    "agree_across_ranks",
    "get_forward_context",
    "set_forward_context",
]
