"""Capture sizes: the token counts that get a graph, and padding to them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Final

from ._checks import check_int, check_items

# Steps of the default size list: fine at small batches, coarser above 256.
_SMALL_STEP: Final = 8
_LARGE_START: Final = 256
_LARGE_STEP: Final = 16

#: Counts up to this bound find their bucket in a table (one index); larger
#: counts by bisection over the sizes. The bound keeps the table at
#: DENSE_PAD_LIMIT + 1 entries, whatever the sizes, while the counts of most
#: steps (decode batches, typical prefill chunks) stay one look-up.
DENSE_PAD_LIMIT: Final = 4096

#: The largest token count a capture size may have: 2**20 (1,048,576 tokens in
#: one step), far above any engine's batch, and low enough that a typo (2**40,
#: 10**9 for ``default``) is an error naming the value, not hours of table
#: building or an allocation that fails deep inside torch.
MAX_CAPTURE_SIZE: Final = 2**20


class CaptureSizes:
    """A sorted, duplicate-free set of positive token counts to capture.

    Padding works on *padding buckets*: the counts that pad to one size.
    With ``bounds = (0, *sizes)``, bucket 0 holds the count 0, bucket ``i``
    the counts in ``(bounds[i-1], bounds[i]]`` (all padded to ``bounds[i]``),
    and bucket ``len(sizes) + 1`` every count above ``max``.
    Everything about a count that depends only on its padded size (the
    dispatcher's decisions) is stored once per bucket, so memory grows with the
    number of sizes, not with the largest one.

    Finding a count's bucket, and so ``pad(n)``, is one table look-up for
    ``n <= DENSE_PAD_LIMIT`` and a bisection, O(log len(sizes)), above it.
    The bucket machinery (``bounds``, ``dense_buckets``, ``representatives()``)
    is public for a dispatcher built on these sizes, which inlines the
    look-up on its per-step path.

    Args:
        sizes: the token counts, any iterable of integers from 1 to 2**20
            (a list, tuple, set, range, generator); duplicates are dropped.

    Raises:
        ValueError: no sizes, a size out of range (naming
            ``capture_sizes[i]``), or a mapping or string (naming
            ``capture_sizes``).
    """

    __slots__ = ("_bounds", "_dense_buckets", "_padded", "_sizes")

    def __init__(self, sizes: Iterable[int]) -> None:
        given = check_items("capture_sizes", sizes, "integers")  # callers may not be typed
        checked = {
            check_int(f"capture_sizes[{i}]", s, minimum=1, maximum=MAX_CAPTURE_SIZE)
            for i, s in enumerate(given)
        }
        if not checked:
            raise ValueError(f"capture_sizes: expected at least one size, got {sizes!r}")
        self._sizes: Final[tuple[int, ...]] = tuple(sorted(checked))
        # Bucket s holds the counts n with bounds[s - 1] < n <= bounds[s]: bisect_left(bounds, n) is n's.
        self._bounds: Final[tuple[int, ...]] = (0, *self._sizes)
        self._padded: Final[tuple[int | None, ...]] = (self._sizes[0], *self._sizes, None)  # by bucket
        self._dense_buckets: Final = _bucket_table(self._bounds, DENSE_PAD_LIMIT)

    @classmethod
    def default(cls, max_size: int) -> CaptureSizes:
        """vLLM's default list: 1, 2, 4, every 8 up to 256, every 16 above, and ``max_size``.

        Args:
            max_size: the largest size, from 1 to 2**20 (always included).

        Returns:
            The sizes up to ``max_size`` (51 for 512).

        Raises:
            ValueError: ``max_size`` out of range, naming it.
        """
        check_int("max_size", max_size, minimum=1, maximum=MAX_CAPTURE_SIZE)
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

    @property
    def bounds(self) -> tuple[int, ...]:
        """``(0, *sizes)``: bucket ``s`` holds the counts ``n`` with ``bounds[s - 1] < n <= bounds[s]``.

        ``bisect_left(bounds, n)`` is ``n``'s bucket; ``len(sizes) + 1`` the bucket above ``max``.
        """
        return self._bounds

    @property
    def dense_buckets(self) -> tuple[int, ...]:
        """The bucket of every count below ``len(dense_buckets)``, by count: a look-up, not a bisection."""
        return self._dense_buckets

    def representatives(self) -> tuple[int, ...]:
        """One count per bucket, in bucket order: 0, every size, and ``max + 1``."""
        return (*self._bounds, self._sizes[-1] + 1)

    def pad(self, n: int) -> int | None:
        """The size a count pads to.

        Args:
            n: a token count, at least 0.

        Returns:
            The smallest size >= ``n``, or ``None`` when ``n`` exceeds ``max``.

        Raises:
            ValueError: ``n`` is no count, naming it.
        """
        check_int("n", n, minimum=0)
        return self._padded[self._bucket(n)]

    def _bucket(self, n: int) -> int:
        """The bucket of a count ``n >= 0`` (see the class docstring); ``n`` is not checked.

        Counts in one bucket pad to one size: ``pad(n)`` depends on ``n`` only
        through ``_bucket(n)``.
        """
        dense = self._dense_buckets
        return dense[n] if n < len(dense) else bisect_left(self._bounds, n)

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


def _bucket_table(bounds: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """``bisect_left(bounds, n)`` for every count ``n`` in ``[0, limit]``, as one tuple."""
    table = [0]
    for bucket, bound in enumerate(bounds[1:], start=1):
        table.extend([bucket] * (min(bound, limit) + 1 - len(table)))
        if bound >= limit:
            break
    table.extend([len(bounds)] * (limit + 1 - len(table)))  # above the largest size
    return tuple(table)
