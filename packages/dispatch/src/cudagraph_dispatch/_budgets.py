"""Token budgets: graphs of packed items (an encoder's images or audio clips), and packing items into them.

An encoder over items of different lengths (a vision transformer over
images of different sizes) packs several items into one forward, their
tokens concatenated, and pads the pack to a *token budget*: the capture
sizes of its FULL graphs (vLLM's encoder graphs: powers of two from 64).
``TokenBudgets`` is the ladder and the bound on items per pack;
``TokenBudgets.pack`` assigns a list of item lengths to budgets. Pure
Python: an engine plans its packs on the host before it touches a tensor.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

from ._checks import check_int, check_items
from ._config import DispatchConfig
from ._modes import CUDAGraphMode
from ._sizes import MAX_CAPTURE_SIZE, CaptureSizes

#: The smallest budget of ``TokenBudgets.default``, as vLLM's encoder graphs start.
DEFAULT_MIN_BUDGET: Final = 64
#: The classes of a usual batch of lengths: ints only (``bool`` is refused, as everywhere).
_INTS: Final = frozenset({int})


class _PackFields(NamedTuple):
    budget: int
    items: tuple[int, ...]
    tokens: int


class Pack(_PackFields):
    """One forward of packed items: the budget it pads to, the items it holds, and their tokens.

    ``items`` are indices into the lengths given to ``TokenBudgets.pack``,
    ascending (the order their tokens are concatenated in); ``tokens`` is
    their total, at most ``budget``, which is the smallest budget holding it.
    A ``NamedTuple`` whose fields are checked when one is built by hand
    (``pack`` builds its own unchecked).

    Args:
        budget: the budget the pack pads to, at least 1.
        items: the items' indices, a tuple of ints >= 0.
        tokens: their total, from ``len(items)`` to ``budget``.

    Raises:
        ValueError: a bad field, naming it (a pack holds its tokens, so its
            padding is never negative).
    """

    __slots__ = ()

    def __new__(cls, budget: int, items: tuple[int, ...], tokens: int) -> Pack:
        check_int("budget", budget, minimum=1)
        given: object = items
        if not isinstance(given, tuple) or any(
            not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in given
        ):
            raise ValueError(f"items: expected a tuple of item indices (ints >= 0), got {items!r:.80}")
        check_int("tokens", tokens, minimum=len(items))
        if tokens > budget:
            raise ValueError(f"tokens: a pack's {tokens} tokens exceed its budget {budget}")
        return super().__new__(cls, budget, items, tokens)

    @property
    def padding(self) -> int:
        """The padding tokens of the pack: ``budget - tokens``."""
        return self.budget - self.tokens


class TokenBudgets:
    """The token budgets an encoder's FULL graphs are captured for, and how items are packed into them.

    ``config()`` is the ``DispatchConfig`` of these graphs (FULL, one key per
    budget); ``pack(lengths)`` splits a batch into packs.

    Args:
        budgets: the token counts that get a graph (positive, at most
            2**20; sorted, duplicates removed).
        max_items: the most items one pack holds (``None``: no bound but the
            tokens, every item having one at least). A graph's attention
            sees ``max_items + 1`` sequences, the padding being one, so a
            small bound keeps its kernels small.

    Raises:
        ValueError: a bad value, naming it.
    """

    __slots__ = ("_ladder", "_max_items", "_orders", "_sizes")

    def __init__(self, budgets: Iterable[int], *, max_items: int | None = None) -> None:
        given = list(check_items("budgets", budgets, "integers"))
        if not given:
            raise ValueError(f"budgets: expected at least one budget, got {budgets!r:.80}")
        sizes = CaptureSizes(
            [check_int(f"budgets[{i}]", b, minimum=1, maximum=MAX_CAPTURE_SIZE) for i, b in enumerate(given)]
        )
        bound = sizes.max if max_items is None else check_int("max_items", max_items, minimum=1)
        self._sizes: Final = sizes
        self._max_items: Final = min(bound, sizes.max)  # a pack never holds more items than tokens
        # The hot path's tables (``pack`` runs on the host before every encoder forward):
        # the ladder to bisect, and the items of a one-pack batch of n items, made once.
        self._ladder: Final = sizes.sizes
        self._orders: Final = tuple(tuple(range(n)) for n in range(min(self._max_items, 64) + 1))

    @classmethod
    def default(cls, max_budget: int, *, max_items: int | None = None) -> TokenBudgets:
        """Powers of two from 64 up to ``max_budget``, and ``max_budget`` itself (vLLM's ladder).

        Args:
            max_budget: the largest budget, from 1 to 2**20.
            max_items: as the constructor's.

        Returns:
            The budgets (``default(8192)``: 64, 128, ..., 8192).

        Raises:
            ValueError: a bad argument, naming it.
        """
        check_int("max_budget", max_budget, minimum=1, maximum=MAX_CAPTURE_SIZE)
        powers = [DEFAULT_MIN_BUDGET << i for i in range(max_budget.bit_length())]
        return cls([*(p for p in powers if p < max_budget), max_budget], max_items=max_items)

    @property
    def budgets(self) -> tuple[int, ...]:
        """The budgets, ascending."""
        return self._sizes.sizes

    @property
    def max(self) -> int:
        """The largest budget: no item may be longer."""
        return self._sizes.max

    @property
    def max_items(self) -> int:
        """The most items one pack holds (the largest budget where no bound was given)."""
        return self._max_items

    def config(self) -> DispatchConfig:
        """FULL graphs, one per budget (key ``BatchDescriptor(budget, min(budget, max_items))``)."""
        return DispatchConfig(CUDAGraphMode.FULL, self._sizes, max_num_seqs=self._max_items)

    def budget_for(self, tokens: int) -> int | None:
        """The budget a pack of ``tokens`` tokens pads to.

        Args:
            tokens: a token count, at least 0.

        Returns:
            The smallest budget holding ``tokens``; ``None`` above the largest.

        Raises:
            ValueError: ``tokens`` is no count, naming it.
        """
        return self._sizes.pad(check_int("tokens", tokens, minimum=0))

    def pack(self, lengths: Sequence[int]) -> tuple[Pack, ...]:
        """Items of these lengths (tokens each) assigned to budgets: the packs, in the order to run them.

        Greedy: a batch that fits one pack (total at most the largest
        budget, at most ``max_items`` items) is one pack of every item, in
        order; else first-fit decreasing (longest item first, into the first
        pack it fits), so no two packs could be merged into one. Each pack
        pads to the smallest budget that holds it.

        Args:
            lengths: each item's tokens, a sequence of ints >= 1.

        Returns:
            One ``Pack`` per forward (no lengths: no packs).

        Raises:
            ValueError: a bad length, or an item longer than the largest
                budget, naming its index and length.
        """
        lens = _checked_lengths(lengths, self._sizes.max)
        total = sum(lens)
        n = len(lens)
        if n <= self._max_items and total <= self._sizes.max:  # one pack: the usual case, no check re-run
            if not n:
                return ()
            items = self._orders[n] if n < len(self._orders) else tuple(range(n))
            return (_pack(self._ladder[bisect_left(self._ladder, total)], items, total),)
        return tuple(
            _pack(self._sizes.pad(tokens) or 0, tuple(sorted(items)), tokens)
            for tokens, items in _first_fit_decreasing(lens, self._sizes.max, self._max_items)
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TokenBudgets)
            and self._sizes == other._sizes
            and self._max_items == other._max_items
        )

    def __hash__(self) -> int:
        return hash((self._sizes, self._max_items))

    def __repr__(self) -> str:
        return f"TokenBudgets({list(self._sizes.sizes)}, max_items={self._max_items})"


def _pack(budget: int, items: tuple[int, ...], tokens: int) -> Pack:
    """A ``Pack`` that ``pack`` made from checked lengths: built without ``Pack``'s checks (hot path)."""
    return tuple.__new__(Pack, (budget, items, tokens))


def _checked_lengths(lengths: Sequence[int], largest: int) -> list[int]:
    """``lengths`` as a list, each an int in ``[1, largest]``; else ``ValueError`` naming the item."""
    given: object = lengths
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise ValueError(f"lengths: expected a sequence of integers, got {given!r}")
    lens = list(given)
    if lens and set(map(type, lens)) == _INTS and min(lens) > 0 and max(lens) <= largest:  # the usual case
        return lens
    for i, n in enumerate(lens):
        check_int(f"lengths[{i}]", n, minimum=1)
        if n > largest:
            raise ValueError(
                f"lengths[{i}]: an item of {n} tokens exceeds the largest budget {largest}; "
                "add a larger budget or split the item"
            )
    return lens


def _first_fit_decreasing(lens: list[int], capacity: int, max_items: int) -> list[tuple[int, list[int]]]:
    """Bins of ``(tokens, item indices)``: each item, longest first, into the first bin with room."""
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(lens)), key=lens.__getitem__, reverse=True):
        n = lens[i]
        for b, (tokens, items) in enumerate(bins):
            if tokens + n <= capacity and len(items) < max_items:
                items.append(i)
                bins[b] = (tokens + n, items)
                break
        else:
            bins.append((n, [i]))
    return bins
