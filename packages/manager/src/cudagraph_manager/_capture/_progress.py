"""An optional progress bar for the capture loop: tqdm on a terminal, else silence."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def progress(items: Sequence[T], *, desc: str, enabled: bool | None = None) -> Iterator[T]:
    """Iterate ``items``, showing a bar when ``enabled`` (default: stderr is a terminal).

    The bar needs ``tqdm`` (the ``progress`` extra); without it this is a plain
    iteration. tqdm is imported here, on use, never at package import.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return iter(items)
    try:
        from tqdm import tqdm
    except ImportError:
        return iter(items)
    return iter(tqdm(items, desc=desc, unit="graph", leave=False))
