"""Capture sizes: the token counts that get a graph, and padding to them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final

from ._validate import check_int

# Steps of the default size list: fine at small batches, coarser above 256.
_SMALL_STEP: Final = 8
_LARGE_START: Final = 256
_LARGE_STEP: Final = 16


class CaptureSizes:
    """A sorted, duplicate-free set of positive token counts to capture.

    ``pad(n)`` is O(1): a table maps every count up to ``max`` to the
    smallest captured size that holds it.
    """

    __slots__ = ("_pad_table", "_sizes")

    def __init__(self, sizes: Iterable[int]) -> None:
        if isinstance(sizes, (str, bytes)):
            raise ValueError(f"capture_sizes: expected integers, got {sizes!r}")
        checked = [check_int(f"capture_sizes[{i}]", s, minimum=1) for i, s in enumerate(sizes)]
        if not checked:
            raise ValueError("capture_sizes: must hold at least one size, got none")
        self._sizes: tuple[int, ...] = tuple(sorted(set(checked)))
        table: list[int] = []
        for size in self._sizes:
            table.extend([size] * (size + 1 - len(table)))
        self._pad_table: tuple[int, ...] = tuple(table)  # index n -> smallest size >= n

    @classmethod
    def default(cls, max_size: int) -> CaptureSizes:
        """vLLM's default list: 1, 2, 4, every 8 up to 256, every 16 above, and ``max_size``."""
        check_int("max_size", max_size, minimum=1)
        small = [1, 2, 4, *range(_SMALL_STEP, min(max_size + 1, _LARGE_START), _SMALL_STEP)]
        large = range(_LARGE_START, max_size + 1, _LARGE_STEP)
        return cls([s for s in (*small, *large) if s <= max_size] + [max_size])

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes, ascending."""
        return self._sizes

    @property
    def max(self) -> int:
        """The largest size: batches above it run without a graph."""
        return self._sizes[-1]

    def pad(self, n: int) -> int | None:
        """The smallest size >= ``n``, or ``None`` when ``n`` exceeds ``max``."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n!r}")
        table = self._pad_table
        return table[n] if n < len(table) else None

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[int]:
        return iter(self._sizes)

    def __contains__(self, n: object) -> bool:
        return n in self._sizes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CaptureSizes) and self._sizes == other._sizes

    def __hash__(self) -> int:
        return hash(self._sizes)

    def __repr__(self) -> str:
        return f"CaptureSizes({list(self._sizes)})"
