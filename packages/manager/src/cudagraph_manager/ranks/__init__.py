"""Ranks that step together: the transport of their agreements, apart from the manager.

``RankAgreement`` is the group a manager's ranks agree over: one exchange per
step (through gloo, NCCL or a shared-memory table) of rows of one shape
(``StepRow``: the request, whether the rank can replay, an opaque field the
manager's lockstep capture fills), and ``exchange`` for any other rows. It
knows nothing of captures; nothing here imports the manager.
``NUM_TOKENS_ACROSS_DP`` names the forward context's extra through which an
eager step hands the model every rank's token count.
"""

from ._agreement import NUM_TOKENS_ACROSS_DP as NUM_TOKENS_ACROSS_DP
from ._agreement import Backend as Backend
from ._agreement import RankAgreement as RankAgreement
from ._agreement import RanksDisagreeError as RanksDisagreeError

__all__ = ["NUM_TOKENS_ACROSS_DP", "Backend", "RankAgreement", "RanksDisagreeError"]
