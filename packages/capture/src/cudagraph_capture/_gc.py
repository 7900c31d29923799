"""The garbage-collection policy of captures, one switch: ``CaptureOptions.gc_disable``.

- ``gc_disable=True`` (the default): a capture never collects. No
  ``gc.collect()`` or ``torch.cuda.empty_cache()`` before each capture (over
  many sizes they cost more than the captures), and a loop of captures runs
  inside ``collector_paused``, so no automatic collection walks the heap
  between captures either.
- ``gc_disable=False``: each capture starts with ``gc.collect()`` and
  ``torch.cuda.empty_cache()``, which hands memory that dead tensors held back
  to the device before the capture allocates; the collector is not paused.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from cudagraph_dispatch.lowlevel import check_bool


def collect_before_capture(gc_disable: bool) -> None:
    """Free what dead objects hold before a capture, unless ``gc_disable``."""
    if not gc_disable:
        gc.collect()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def collector_paused(gc_disable: bool = True) -> Iterator[None]:
    """Pause the garbage collector for a loop of captures (only with ``gc_disable``).

    Existing objects are frozen (an explicit ``gc.collect`` then skips them)
    unless the application froze some itself: unfreezing would thaw those too.
    The collector's state is restored on exit, also on an exception.
    """
    if not check_bool("gc_disable", gc_disable):
        yield
        return
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
