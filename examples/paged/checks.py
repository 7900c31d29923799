"""What makes a paged step valid, checked on the host or recorded on the device (``PagedBuffers.fill``).

``paged_problems`` computes every rule of ``PROBLEMS`` for a real batch as
one bool tensor, with device ops only (indices clamped, so a bad value never
indexes out of range): no host synchronization. ``check_paged_batch`` reads
it once (one synchronization) and raises ``ValueError`` naming the first
input that breaks a rule; ``DeviceChecks`` ORs it into a flag on the device
instead, which ``DeviceChecks.check`` reads when the caller synchronizes.
"""

from __future__ import annotations

from typing import Final

import torch

from cudagraph_manager.attention import BatchShape, StepBatch

from .layout import PagedLayout

#: Each rule: the input that breaks it, and what it says (formatted with the layout's and step's counts).
PROBLEMS: Final = (
    ("query_lens", "every request has at least one token in the step"),
    ("query_lens", "the requests' tokens add up to the step's tokens ({num_tokens})"),
    ("query_lens", "a uniform batch has the same tokens per request ({query_len}): got other query lengths"),
    ("seq_lens", "a request's context holds its tokens of this step: got a length below its query_lens"),
    ("seq_lens", "a request's context fits its block table: at most {max_seq_len} keys"),
    (
        "block_table",
        "a request's used pages are real: page {scratch} is the scratch page that padding writes",
    ),
    ("block_table", "used pages are in [1, {num_pages}) (the pages backed): got a page out of range"),
    ("block_table", "a request's used pages are distinct: got a page named twice in one row"),
    (
        "positions",
        "each request's tokens sit at the last query_lens positions of its context "
        "(seq_lens - query_lens up to seq_lens - 1); got other positions",
    ),
    (
        "slot_mapping",
        "a token's slot is block_table[request, position // page_size] * page_size "
        "+ position % page_size; got other slots",
    ),
    ("slot_mapping", "each token writes a slot of its own: got two tokens writing one slot"),
)


#: The inputs a paged step's checks read.
_BATCH_INPUTS: Final = ("positions", "slot_mapping", "query_lens", "seq_lens", "block_table")


def paged_problems(
    layout: PagedLayout,
    batch: StepBatch,
    shape: BatchShape | None = None,
    page_limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[len(PROBLEMS)]`` bool: which rules ``batch`` (1 token or more) breaks; device ops, no sync.

    ``shape``: the batch the forward runs as (its ``query_len``: every
    request's, for a uniform batch). ``page_limit``: ``[]`` on the device,
    the pages backed (a cache over reserved memory); default: all of the
    layout's. A batch without request rows for its tokens is refused at
    once (its counts are on the host).
    """
    inputs, num_tokens = batch.inputs, batch.num_tokens
    missing = [name for name in _BATCH_INPUTS if not isinstance(inputs.get(name), torch.Tensor)]
    if missing:
        raise ValueError(
            f"{missing[0]}: the step has no such tensor (a paged step has {list(_BATCH_INPUTS)})"
        )
    query_lens, seq_lens = inputs["query_lens"].long(), inputs["seq_lens"].long()  # [R]
    table, positions = inputs["block_table"].long(), inputs["positions"]  # [R, M], [T]
    num_reqs, width = table.shape
    if num_reqs == 0:
        raise ValueError(f"query_lens: 0 requests for the step's {num_tokens} tokens")
    page_size, device = layout.page_size, table.device
    columns = torch.arange(width, device=device)  # [M]
    used = columns[None, :] * page_size < seq_lens[:, None]  # [R, M]
    ends = torch.cumsum(query_lens, 0)  # [R]
    tokens = torch.arange(num_tokens, device=device)  # [T]
    requests = torch.searchsorted(ends, tokens, right=True).clamp_(max=num_reqs - 1)  # [T]: in range
    expected = seq_lens[requests] - ends[requests] + tokens  # [T]: its position, by its request
    page = table[requests, expected.div(page_size, rounding_mode="floor").clamp(0, width - 1)]
    slots = page * page_size + expected.remainder(page_size)  # [T]
    named = torch.where(used, table, -1 - columns[None, :]).sort(dim=1).values  # unused: distinct
    written = inputs["slot_mapping"].sort().values  # [T]
    query_len = shape.query_len if shape is not None else None
    pages = layout.num_pages if page_limit is None else page_limit  # [] on the device: no sync
    return torch.stack(
        (
            (query_lens < 1).any(),
            ends[-1] != num_tokens,
            (query_lens != query_len).any() if query_len is not None else used.new_zeros(()),
            (seq_lens < query_lens).any(),
            (seq_lens > layout.max_seq_len).any(),
            (used & (table == layout.scratch_page)).any(),
            (used & ((table < 0) | (table >= pages))).any(),
            (named[:, 1:] == named[:, :-1]).any(),
            (positions != expected).any(),
            (inputs["slot_mapping"] != slots).any(),
            (written[1:] == written[:-1]).any(),
        )
    )


def describe(
    layout: PagedLayout,
    problems: list[bool],
    num_tokens: object,
    query_len: object,
    num_pages: object = None,
) -> str:
    """The first broken rule of ``problems``, naming its input (``num_pages``: the pages backed)."""
    name, rule = PROBLEMS[problems.index(True)]
    text = rule.format(
        num_tokens=num_tokens,
        query_len=query_len,
        max_seq_len=layout.max_seq_len,
        scratch=layout.scratch_page,
        num_pages=layout.num_pages if num_pages is None else num_pages,
    )
    return f"{name}: {text}"


def check_paged_batch(
    layout: PagedLayout,
    batch: StepBatch,
    shape: BatchShape | None = None,
    page_limit: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> None:
    """``ValueError`` naming the first input of ``batch`` that no paged cache can serve (one host sync).

    The rules of ``PROBLEMS``: every request has tokens (``query_len`` each
    in a uniform ``shape``), and they add up to ``num_tokens``; its context
    holds them and fits the block table (``seq_lens``); the pages it uses
    are real pages (not the scratch page, not past the pages backed:
    ``page_limit``), each named once; each token's position and slot are
    where its request's block table puts it, and no two tokens write one slot.
    With ``vocab_size``, then its ``input_ids`` (``check_token_ids``), read
    in the same synchronization.
    """
    problems = paged_problems(layout, batch, shape, page_limit)
    if vocab_size is not None:
        ids = batch.inputs["input_ids"]
        outside = ((ids < 0) | (ids >= vocab_size)).any().to(problems.device)
        problems = torch.cat((problems, outside[None]))
    flags = problems.tolist()  # the one synchronization
    if any(flags[: len(PROBLEMS)]):
        query_len = shape.query_len if shape is not None else None
        pages = layout.num_pages if page_limit is None else int(page_limit)
        raise ValueError(describe(layout, flags, batch.num_tokens, query_len, pages))
    if vocab_size is not None and flags[-1]:
        check_token_ids(batch.inputs["input_ids"], vocab_size)  # names the ids (they are outside)


class DeviceChecks:
    """The rules a graph path's steps broke, recorded on the device (no synchronization) until checked.

    ``record`` ORs a step's ``paged_problems`` into a flag on the device;
    ``check`` reads it (one synchronization: call it where the caller
    synchronizes anyway, reading a step's results) and raises ``ValueError``
    naming the first broken rule, then clears it.
    """

    __slots__ = ("_flags", "layout", "page_limit")

    def __init__(
        self, layout: PagedLayout, device: torch.device | str | None, page_limit: torch.Tensor | None = None
    ) -> None:
        self.layout: Final = layout
        self.page_limit: Final = page_limit
        self._flags: Final = torch.zeros(len(PROBLEMS), dtype=torch.bool, device=device)

    def record(self, batch: StepBatch, shape: BatchShape) -> None:
        self._flags.logical_or_(paged_problems(self.layout, batch, shape, self.page_limit))

    def check(self) -> None:
        problems = self._flags.tolist()
        if any(problems):
            self._flags.zero_()
            pages = None if self.page_limit is None else "the pages backed"
            detail = describe(self.layout, problems, "the step's count", "q", pages)
            raise ValueError(f"a step run on a graph since the last check: {detail}")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """``ValueError`` naming ``input_ids`` if one is outside ``[0, vocab_size)`` (on a device: one sync)."""
    outside = (input_ids < 0) | (input_ids >= vocab_size)
    if input_ids.numel() and bool(outside.any()):
        raise ValueError(
            f"input_ids: expected token ids in [0, {vocab_size}), got {input_ids[outside][:4].tolist()}"
        )
