"""The surroundings of the capture loop: gc paused, no autograd, the device current, its memory.

Capturing many graphs allocates many small objects: a collection walking the
heap between captures only costs time, so the collector is paused for the
phase. The memory and sync helpers accept any device, so the manager also runs
(with a test engine) where there is no CUDA.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def capture_phase(device: torch.device) -> Iterator[None]:
    """The capture loop's surroundings: gc paused, no autograd, ``device`` current."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_gc_paused())
        stack.enter_context(torch.no_grad())
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield


def reserved_bytes(device: torch.device) -> int:
    """The device's reserved memory (0 off CUDA): its growth is what a capture cost."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def synchronize(device: torch.device) -> None:
    """Wait for the device's work (nothing off CUDA), so a timing includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the garbage collector: no collection walks the heap between captures.

    Existing objects are frozen (explicit ``gc.collect`` calls then skip
    them) unless the application froze some itself: unfreezing would thaw those.
    """
    was_enabled = gc.isenabled()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if was_enabled:
            gc.enable()
