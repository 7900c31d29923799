"""An opt-in check that graph outputs are not read after a later replay overwrote them.

Graph outputs are non-owning aliases of pool memory that the next replay (of
the same graph, or of another graph in the pool) rewrites; an output kept past
it silently shows newer numbers. PyTorch's CUDA Graph Trees catch that read;
``OutputGuard`` does the same for these engines.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ._weakref import weak_ref_tree


class OutputGuard:
    """Makes the outputs of a replay unreadable once a later replay may have overwritten them.

    Each step's outputs are handed out (``hand_out``) on storages of their own
    (non-owning aliases of graph memory); before the next replay, ``retire``
    sets an access error on those storages, so reading them raises instead of
    returning the later step's numbers. Used by
    ``CUDAGraphManager`` with ``ManagerOptions(check_overwritten_outputs=True)``.
    """

    __slots__ = ("_live", "_steps")

    def __init__(self) -> None:
        if not hasattr(torch._C, "_set_storage_access_error_msg"):
            raise ValueError(
                "OutputGuard: this torch build cannot mark storages unreadable "
                "(torch._C._set_storage_access_error_msg is missing; it comes with CUDA builds)"
            )
        self._live: list[torch.Tensor] = []
        self._steps = 0

    def retire(self, descriptor: object) -> None:
        """At a replay of ``descriptor``'s graph: the outputs handed out so far become unreadable."""
        self._retire(
            f"this graph output (step {self._steps}) was overwritten by a later "
            f"replay (of the graph {descriptor}); clone() the outputs you keep before the next step"
        )

    def replayed(self, descriptor: object, output: object) -> object:
        """After a replay of ``descriptor``: ``retire`` the outputs handed out so far, ``hand_out`` its own.

        Marking the older outputs after the replay rather than before changes
        nothing a caller can see: it reads them from this thread, between steps.
        """
        self.retire(descriptor)
        return self.hand_out(output)

    def retire_all(self) -> None:
        """The graphs were freed (a manager's ``release()``): the outputs handed out become unreadable."""
        self._retire(
            f"this graph output (step {self._steps}) is gone: its graph was released and its memory "
            "given back; clone() the outputs you keep before release()"
        )

    def _retire(self, message: str) -> None:
        for tensor in self._live:
            torch._C._set_storage_access_error_msg(tensor, message)
        self._live.clear()
        self._steps += 1

    def hand_out(self, output: object) -> object:
        """``output`` with every tensor on a storage of its own, remembered for the next ``retire``."""
        fresh = weak_ref_tree(output)
        self._live.extend(t for t in pytree.tree_leaves(fresh) if isinstance(t, torch.Tensor))
        return fresh
