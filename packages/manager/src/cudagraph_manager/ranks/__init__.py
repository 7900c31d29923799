"""Ranks that step together: the transport of their agreements, apart from the manager.

``RankAgreement`` is the group a manager's ranks agree over: one exchange per
step (through gloo, NCCL or a shared-memory table) of rows of one shape
(``StepRow``: the request, whether the rank can replay, an opaque field the
manager's lockstep capture fills), and ``exchange`` for any other rows. It
knows nothing of captures; nothing here imports the manager.
``NUM_TOKENS_ACROSS_DP`` names the forward context's extra through which an
eager step hands the model every rank's token count.
"""

from typing import TYPE_CHECKING, Final

from cudagraph_dispatch._retired import resolver as _resolver

from ._agreement import NUM_TOKENS_ACROSS_DP as NUM_TOKENS_ACROSS_DP
from ._agreement import RankAgreement as RankAgreement
from ._agreement import RanksDisagreeError as RanksDisagreeError

if TYPE_CHECKING:  # the retired names (``_RETIRED``), typed for the code that still imports them
    from ._agreement import Backend as Backend

__all__ = ["NUM_TOKENS_ACROSS_DP", "RankAgreement", "RanksDisagreeError"]

#: Names retired from the API, each with its home (module, name): still resolved here, to the same
#: object, for the code that imports them; in neither ``__all__`` nor ``dir()`` (README: "Names
#: retired from the API").
_RETIRED: Final = {
    "Backend": ("cudagraph_manager.ranks._agreement", "Backend"),
}

if not TYPE_CHECKING:  # for mypy, a module without __getattr__: an unknown name stays an error
    __getattr__, __dir__ = _resolver(__name__, __all__, _RETIRED)
