"""Ranks that step together: the transport of their agreements, apart from the manager.

``RankAgreement`` is the group a manager's ranks agree over (one exchange per
step, through gloo, NCCL or a shared-memory table); the manager calls it
through one seam, ``route_step``, and ``capture()`` through ``agree_plan``
and ``all_or_none``. Nothing here imports the manager.
"""

from ._agreement import Backend as Backend
from ._agreement import RankAgreement as RankAgreement
from ._agreement import RanksDisagreeError as RanksDisagreeError

__all__ = ["Backend", "RankAgreement", "RanksDisagreeError"]
