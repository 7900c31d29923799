"""torch's cached cuBLAS workspaces, dropped around captures and at a release (``_segment`` says why)."""

from __future__ import annotations

import torch


def drop_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces; the next GEMM on each stream allocates its own.

    Around every capture (see ``_segment``) and in ``release_graph_memory``. A private torch call,
    present since torch 2.0; where it is missing there is nothing to drop.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
