"""Peak Python memory of building something: what the table-size tests bound."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def built_with_peak(make: Callable[[], T]) -> tuple[T, int]:
    """``make()`` and the peak bytes Python allocated while it ran (``tracemalloc``)."""
    tracemalloc.start()
    try:
        built = make()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return built, peak
