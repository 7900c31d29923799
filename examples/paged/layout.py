"""How a paged KV cache is laid out: pages of a fixed size, a block table per request, a scratch page.

Engines keep K/V in fixed-size pages: a request owns a list of pages (its row
of the block table), each token's K/V goes to a slot (``page * page_size +
offset``: the slot mapping), and the attention reads the pages through the
block table. Page 0 is the scratch page: padding tokens write and read it,
no request owns it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Final, Protocol

import torch

from cudagraph_dispatch.lowlevel import check_int

from ..config import MAX_FIELD

#: The largest page index the block table (int32) holds: a cache's most pages.
_INT32_MAX: Final = 2**31 - 1


class SequenceLimits(Protocol):
    """What a model's config says of its requests (``DecoderConfig`` has both)."""

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class PagedLayout:
    """How each layer's KV cache is paged: ``[2, num_pages, page_size, heads, head_dim]``.

    ``num_pages`` includes the scratch page (page 0) that padding uses, so
    padding's values do not depend on how many pages the cache has;
    ``pages_per_seq`` is the block table's width, enough for ``max_seq_len``.
    Checked (``ValueError`` naming the field): ``page_size`` and
    ``pages_per_seq`` from 1 to ``MAX_FIELD``, ``num_pages`` from 2 to what the
    int32 block table holds.
    """

    page_size: int
    num_pages: int
    pages_per_seq: int

    #: The page that padding reads and writes.
    scratch_page: ClassVar[int] = 0

    def __post_init__(self) -> None:
        for name, most in (("page_size", MAX_FIELD), ("num_pages", _INT32_MAX), ("pages_per_seq", MAX_FIELD)):
            check_int(name, getattr(self, name), minimum=1, maximum=most)
        if self.num_pages < 2:
            raise ValueError(
                f"num_pages: expected at least one page besides the scratch page, got {self.num_pages}"
            )

    @property
    def max_seq_len(self) -> int:
        """The most keys a request's block table can address."""
        return self.pages_per_seq * self.page_size

    @property
    def scratch_slot(self) -> int:
        """The slot padding tokens write their K/V to: the scratch page's first."""
        return self.scratch_page * self.page_size

    @classmethod
    def for_config(
        cls, config: SequenceLimits, *, page_size: int = 128, num_pages: int | None = None
    ) -> PagedLayout:
        """Pages of ``page_size`` tokens; by default every request at ``max_seq_len``, and scratch."""
        limits: object = config
        if not all(isinstance(getattr(limits, name, None), int) for name in ("max_num_seqs", "max_seq_len")):
            raise ValueError(
                f"config: expected a config with integer max_num_seqs and max_seq_len (a DecoderConfig), "
                f"got {config!r:.80}"
            )
        check_int("page_size", page_size, minimum=1)
        pages_per_seq = -(-config.max_seq_len // page_size)
        if num_pages is None:
            num_pages = config.max_num_seqs * pages_per_seq + 1
        return cls(page_size, num_pages, pages_per_seq)


def page_of_slot(layout: PagedLayout, device: torch.device | str | None) -> torch.Tensor:
    """``[num_pages * page_size]`` int32: the page of every slot of the cache.

    A FlexAttention mask reads a key's page from this table: inductor 2.11
    failed to generate the division of a key index by the page size inside
    the kernel.
    """
    slots = torch.arange(layout.num_pages * layout.page_size, dtype=torch.int32, device=device)
    return slots.div_(layout.page_size, rounding_mode="floor")  # in place: no second table cached


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the step's ``k, v [T, heads, head_dim]`` at their slots (idempotent for the same step)."""
    heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache.view(2, -1, heads, head_dim)  # [2, num_pages * page_size, heads, head_dim]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
