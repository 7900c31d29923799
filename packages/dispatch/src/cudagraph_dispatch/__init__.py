"""CUDA graph dispatch: modes, batch keys, capture sizes, and the dispatcher.

Pure Python, never imports torch: the decisions a serving engine makes each
step (which graph, padded to which size) are values that can be tested and
agreed across ranks without a GPU.
"""

from ._checks import check_bool as check_bool
from ._checks import check_int as check_int
from ._config import MAX_NUM_SEQS as MAX_NUM_SEQS
from ._config import DispatchConfig as DispatchConfig
from ._context import FORWARD_CONTEXT_VAR as FORWARD_CONTEXT_VAR
from ._context import ForwardContext as ForwardContext
from ._context import get_forward_context as get_forward_context
from ._context import set_forward_context as set_forward_context
from ._descriptor import BatchDescriptor as BatchDescriptor
from ._dispatcher import CUDAGraphDispatcher as CUDAGraphDispatcher
from ._modes import CUDAGraphMode as CUDAGraphMode
from ._protocols import GraphDispatcher as GraphDispatcher
from ._ranks import agree_across_ranks as agree_across_ranks
from ._reasons import EagerReason as EagerReason
from ._request import NO_MODES as NO_MODES
from ._request import RankRequest as RankRequest
from ._request import StepRequest as StepRequest
from ._rule import Dispatch as Dispatch
from ._rule import Route as Route
from ._sizes import MAX_CAPTURE_SIZE as MAX_CAPTURE_SIZE
from ._sizes import CaptureSizes as CaptureSizes
from ._support import AttentionSupport as AttentionSupport
from ._support import GraphSupport as GraphSupport
from ._support import ModeNotSupportedError as ModeNotSupportedError
from ._support import ModeResolution as ModeResolution
from ._support import resolve_mode as resolve_mode

__version__ = "0.1.0"

__all__ = [
    "FORWARD_CONTEXT_VAR",
    "MAX_CAPTURE_SIZE",
    "MAX_NUM_SEQS",
    "AttentionSupport",
    "BatchDescriptor",
    "CUDAGraphDispatcher",
    "CUDAGraphMode",
    "CaptureSizes",
    "Dispatch",
    "DispatchConfig",
    "EagerReason",
    "ForwardContext",
    "GraphDispatcher",
    "GraphSupport",
    "ModeNotSupportedError",
    "ModeResolution",
    "NO_MODES",
    "RankRequest",
    "Route",
    "StepRequest",
    "agree_across_ranks",
    "check_bool",
    "check_int",
    "get_forward_context",
    "resolve_mode",
    "set_forward_context",
]
