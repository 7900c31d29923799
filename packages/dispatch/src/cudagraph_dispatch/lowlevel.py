"""The low-level tier of ``cudagraph_dispatch``: the argument checks of code built on the dispatcher.

Like ``trio.lowlevel``: ``check_int`` and ``check_bool``, the run-time
checks every public entry point of these packages makes, for an engine's own
seams (an attention backend, a runner) that should refuse a bad argument in
the same words. Most users need only ``cudagraph_dispatch``. Never imports
torch.
"""

from typing import TYPE_CHECKING, Final

from ._checks import check_bool as check_bool
from ._checks import check_int as check_int
from ._retired import resolver as _resolver

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._config import MAX_NUM_SEQS as MAX_NUM_SEQS
    from ._context import FORWARD_CONTEXT_VAR as FORWARD_CONTEXT_VAR
    from ._request import NO_MODES as NO_MODES
    from ._sizes import MAX_CAPTURE_SIZE as MAX_CAPTURE_SIZE

__all__ = ["check_bool", "check_int"]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "FORWARD_CONTEXT_VAR": ("cudagraph_dispatch._context", "FORWARD_CONTEXT_VAR"),
    "MAX_CAPTURE_SIZE": ("cudagraph_dispatch._sizes", "MAX_CAPTURE_SIZE"),
    "MAX_NUM_SEQS": ("cudagraph_dispatch._config", "MAX_NUM_SEQS"),
    "NO_MODES": ("cudagraph_dispatch._request", "NO_MODES"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
