"""One step's batch, as the dispatcher, the ranks and an eager step see it.

``RankRequest`` is the one value for "what this step asks of the graphs":
``dispatch``'s arguments, checked (the contract names it for the ranks, each
of which brings one to ``agree_across_ranks``; a process without ranks is one
rank). The dispatcher's hot path takes the same
fields as plain arguments (a step builds no object); everything slower
(``explain``, the ranks' agreement, a step without a graph) takes this.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from ._checks import check_bool, check_int
from ._modes import CUDAGraphMode

#: The modes ``invalid_modes`` may name: the two that have graphs.
GRAPH_MODES: Final = frozenset({CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL})
#: No mode turned off: the default ``invalid_modes`` of a step.
NO_MODES: Final[frozenset[CUDAGraphMode]] = frozenset()


@dataclasses.dataclass(frozen=True, slots=True)
class RankRequest:
    """One rank's step: its token count, whether it is a uniform decode, its adapters, the modes it forbids.

    Args:
        num_tokens: the step's tokens, at least 0 (an ``IntEnum`` count is
            stored as ``int``).
        uniform_decode: every request of the step has
            ``uniform_decode_query_len`` tokens.
        num_active_loras: the adapters the step runs, at most ``num_tokens``
            (a request runs one adapter and has a token; the dispatcher also
            bounds it by the requests its config allows).
        invalid_modes: the graph modes turned off for this step (cascade
            attention turns FULL off): a frozenset of PIECEWISE and FULL.

    Raises:
        ValueError: a bad field, naming it.
    """

    num_tokens: int
    uniform_decode: bool = False
    num_active_loras: int = 0
    invalid_modes: frozenset[CUDAGraphMode] = NO_MODES

    def __post_init__(self) -> None:
        # Normalized in place: the dataclass is frozen to its users, not to its own checks.
        object.__setattr__(self, "num_tokens", int(check_int("num_tokens", self.num_tokens, minimum=0)))
        check_bool("uniform_decode", self.uniform_decode)
        loras = int(check_int("num_active_loras", self.num_active_loras, minimum=0))
        if loras > self.num_tokens:  # an empty batch has none
            raise ValueError(
                f"num_active_loras: {loras} active adapters for {self.num_tokens} tokens; "
                "a request runs one adapter and has at least one token"
            )
        object.__setattr__(self, "num_active_loras", loras)
        modes: object = self.invalid_modes
        if not isinstance(modes, frozenset) or not modes <= GRAPH_MODES:
            raise ValueError(f"invalid_modes: expected a frozenset of PIECEWISE and FULL, got {modes!r}")
        object.__setattr__(self, "invalid_modes", frozenset(modes))  # a subclass's instance made plain
