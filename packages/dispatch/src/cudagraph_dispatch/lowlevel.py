"""The low-level tier of ``cudagraph_dispatch``, for packages built on the dispatcher.

Like ``trio.lowlevel``: the run-time argument checks every public entry point
of ours shares, the forward context's variable, the bounds on sizes and
request counts, and the empty set of invalid modes. Most users need only
``cudagraph_dispatch``. Never imports torch.
"""

from ._checks import check_bool as check_bool
from ._checks import check_int as check_int
from ._config import MAX_NUM_SEQS as MAX_NUM_SEQS
from ._context import FORWARD_CONTEXT_VAR as FORWARD_CONTEXT_VAR
from ._request import NO_MODES as NO_MODES
from ._sizes import MAX_CAPTURE_SIZE as MAX_CAPTURE_SIZE

__all__ = [
    "FORWARD_CONTEXT_VAR",
    "MAX_CAPTURE_SIZE",
    "MAX_NUM_SEQS",
    "NO_MODES",
    "check_bool",
    "check_int",
]
