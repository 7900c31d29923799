"""The batch descriptor: the hashable key that names one captured graph."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """Which graph a batch runs: the key of every graph table.

    ``num_tokens`` is the (padded) token count. ``num_reqs`` and ``uniform``
    are set only on keys of graphs that depend on them (FULL graphs, whose
    attention kernels see the request layout); PIECEWISE graphs use the
    relaxed key, which leaves them out.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0

    def relaxed(self) -> BatchDescriptor:
        """This key without the request layout, as PIECEWISE graphs are keyed."""
        return BatchDescriptor(
            self.num_tokens,
            has_lora=self.has_lora,
            num_active_loras=self.num_active_loras,
        )
