"""The paged model's step inputs, and the metadata every paged backend builds from them (the seam's use).

A step is described by six inputs (``PAGED_INPUT_NAMES``): per token
``input_ids``, ``positions`` and ``slot_mapping`` ``[T]``; per request
``query_lens`` (its tokens in this step), ``seq_lens`` (its context after
this step) ``[R]`` and ``block_table [R, pages_per_seq]``. Tokens are grouped
by request in block-table order; a request's tokens sit at the last
``query_len`` positions of its context. The manager pads the token inputs
with constants (position 0, the scratch slot) and hands the real batch to
the backend, which builds ``PagedMetadata`` padded to the batch the forward
runs as (``PagedBuffers.fill``), in buffers it keeps at fixed addresses.
What a backend is: ``backend``.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.lowlevel import check_bool
from cudagraph_manager import StaticInput
from cudagraph_manager.attention import BatchShape, StepBatch, pad_offsets, pad_rows

from .layout import PagedLayout

#: The step inputs of the paged model, in the order of ``PagedDecoder.forward``.
PAGED_INPUT_NAMES: Final[tuple[str, ...]] = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_lens",
    "seq_lens",
    "block_table",
)
#: The request of a padding token: no request owns the scratch page.
PAD_REQUEST: Final = -1


def paged_static_inputs(layout: PagedLayout) -> dict[str, StaticInput]:
    """The paged model's inputs for ``CUDAGraphManager``: three token rows, three request rows.

    Padding tokens sit at position 0 of the scratch page; padding requests
    have no tokens, one key and the scratch page as their block table (the
    backend's metadata pads them the same way, ``PagedBuffers``).
    """
    return {
        "input_ids": StaticInput(dtype=torch.int64, rows="tokens", pad_value=0),
        "positions": StaticInput(dtype=torch.int64, rows="tokens", pad_value=0),
        "slot_mapping": StaticInput(dtype=torch.int64, rows="tokens", pad_value=layout.scratch_slot),
        "query_lens": StaticInput(dtype=torch.int32, rows="reqs", pad_value=0),
        "seq_lens": StaticInput(dtype=torch.int32, rows="reqs", pad_value=1),
        "block_table": StaticInput(
            shape=(layout.pages_per_seq,), dtype=torch.int32, rows="reqs", pad_value=layout.scratch_page
        ),
    }


@dataclasses.dataclass(frozen=True, slots=True)
class PagedMetadata:
    """What every paged backend reads, padded to ``shape``: views of ``PagedBuffers`` (fixed addresses).

    Padding tokens are ``PAD_REQUEST``'s, at position 0; padding requests
    have one key (``seq_lens`` 1) on the scratch page. ``max_query_len`` and
    ``max_seq_len`` are host bounds that depend on the shape alone, so a
    FULL graph may bake them.
    """

    shape: BatchShape
    query_start_loc: (
        torch.Tensor
    )  # [R + 1] int32: uniform shapes q * r; mixed: the padded total after the real
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, pages_per_seq] int32
    req_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int


class PagedBuffers:
    """The persistent buffers of ``PagedMetadata``, sized once for the largest batch, refilled per step.

    ``fill`` checks the real batch (``validate``: two host synchronizations,
    errors naming the input; ``check_paged_batch``), then writes it padded
    to ``shape`` with device ops on the current stream. ``views`` is the
    same metadata without writing anything (host only: a recording's).
    """

    __slots__ = (
        "_arange",
        "_block_table",
        "_positions",
        "_query_start_loc",
        "_req_ids",
        "_seq_lens",
        "_views",
        "layout",
        "validate",
    )

    def __init__(
        self,
        layout: PagedLayout,
        max_tokens: int,
        max_reqs: int,
        device: torch.device | str | None,
        *,
        validate: bool = True,
    ) -> None:
        check_bool("validate", validate)
        self.layout: Final = layout
        self.validate: Final = validate
        self._query_start_loc: Final = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self._seq_lens: Final = torch.ones(max_reqs, dtype=torch.int32, device=device)
        self._block_table: Final = torch.full(
            (max_reqs, layout.pages_per_seq), layout.scratch_page, dtype=torch.int32, device=device
        )
        self._req_ids: Final = torch.full((max_tokens,), PAD_REQUEST, dtype=torch.int64, device=device)
        self._positions: Final = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._arange: Final = torch.arange(max(max_tokens, max_reqs) + 1, dtype=torch.int32, device=device)
        self._views: Final[dict[BatchShape, PagedMetadata]] = {}

    def views(self, shape: BatchShape) -> PagedMetadata:
        """The metadata of ``shape`` as the buffers hold it now (cut once per graph shape, kept).

        An eager shape (mode NONE: the real batch's counts, of which a server
        sees many) is cut anew each time, so the table stays the size of the plan.
        """
        meta = self._views.get(shape)
        if meta is None:
            num_tokens, num_reqs = shape.num_tokens, shape.num_reqs
            if num_tokens > self._req_ids.shape[0] or num_reqs > self._seq_lens.shape[0]:
                raise ValueError(
                    f"shape: {shape} exceeds the buffers' {self._req_ids.shape[0]} tokens and "
                    f"{self._seq_lens.shape[0]} requests"
                )
            query_len = shape.query_len
            meta = PagedMetadata(
                shape,
                self._query_start_loc[: num_reqs + 1],
                self._seq_lens[:num_reqs],
                self._block_table[:num_reqs],
                self._req_ids[:num_tokens],
                self._positions[:num_tokens],
                query_len if query_len is not None else max(num_tokens, 1),
                self.layout.max_seq_len,
            )
            if shape.mode is not CUDAGraphMode.NONE:
                self._views[shape] = meta
        return meta

    def fill(self, batch: StepBatch, shape: BatchShape) -> PagedMetadata:
        """The metadata of ``batch`` padded to ``shape``, in place; ``ValueError`` names a bad input."""
        num_tokens, num_reqs, inputs = batch.num_tokens, batch.num_reqs, batch.inputs
        if self.validate and num_tokens:
            check_paged_batch(self.layout, batch)
        meta = self.views(shape)
        offsets = meta.query_start_loc
        if shape.query_len is not None:  # uniform: every request, padding included, has query_len tokens
            torch.mul(self._arange[: shape.num_reqs + 1], shape.query_len, out=offsets)
        elif num_reqs:
            torch.cumsum(inputs["query_lens"], 0, dtype=torch.int32, out=offsets[1 : num_reqs + 1])
            offsets[num_reqs + 1 :].fill_(shape.num_tokens)  # pad_offsets, without a copy of the real ones
        else:
            pad_offsets(offsets, self._arange[:1], shape.num_tokens)
        if num_reqs:
            pad_rows(meta.seq_lens, inputs["seq_lens"], 1)
            pad_rows(meta.block_table, inputs["block_table"], self.layout.scratch_page)
            pad_rows(meta.positions, inputs["positions"], 0)
            requests = self._arange[:num_reqs].long()
            # output_size: the count is known on the host, so no synchronization.
            meta.req_ids[:num_tokens].copy_(
                torch.repeat_interleave(requests, inputs["query_lens"], output_size=num_tokens)
            )
            meta.req_ids[num_tokens:].fill_(PAD_REQUEST)
        else:  # all padding
            meta.seq_lens.fill_(1)
            meta.block_table.fill_(self.layout.scratch_page)
            meta.positions.fill_(0)
            meta.req_ids.fill_(PAD_REQUEST)
        return meta


def check_paged_batch(layout: PagedLayout, batch: StepBatch) -> None:
    """``ValueError`` naming the first input of ``batch`` that no paged cache can serve (two host syncs).

    Checked: every request has tokens, and they add up to ``num_tokens``;
    its context holds them and fits the block table (``seq_lens``); the
    pages it uses are real pages (not the scratch page, not past the
    cache); each token's position and slot are where its request's block
    table puts it.
    """
    inputs = batch.inputs
    query_lens, seq_lens = inputs["query_lens"].long(), inputs["seq_lens"].long()  # [R]
    table, positions = inputs["block_table"].long(), inputs["positions"]  # [R, M], [T]
    page_size, num_tokens = layout.page_size, batch.num_tokens
    used = (
        torch.arange(table.shape[1], device=table.device)[None, :] * page_size < seq_lens[:, None]
    )  # [R, M]
    problems = torch.stack(
        (
            (query_lens < 1).any(),
            query_lens.sum() != num_tokens,
            (seq_lens < query_lens).any(),
            (seq_lens > layout.max_seq_len).any(),
            (used & (table == layout.scratch_page)).any(),
            (used & ((table < 0) | (table >= layout.num_pages))).any(),
        )
    ).tolist()  # the first synchronization; the second checks what indexes the block table
    if any(problems):
        raise ValueError(_describe(layout, problems, num_tokens))
    device = table.device
    requests = torch.repeat_interleave(torch.arange(query_lens.shape[0], device=device), query_lens)  # [T]
    starts = torch.cumsum(query_lens, 0) - query_lens  # [R]: each request's first token
    offset = (
        torch.arange(num_tokens, device=device) - starts[requests]
    )  # [T]: the token's place in its request
    expected = seq_lens[requests] - query_lens[requests] + offset  # [T]
    slots = table[requests, expected // page_size] * page_size + expected % page_size  # [T]
    wrong = torch.stack(((positions != expected).any(), (inputs["slot_mapping"] != slots).any())).tolist()
    if wrong[0]:
        raise ValueError(
            "positions: each request's tokens sit at the last query_lens positions of its context "
            "(seq_lens - query_lens up to seq_lens - 1); got other positions"
        )
    if wrong[1]:
        raise ValueError(
            "slot_mapping: a token's slot is block_table[request, position // page_size] * page_size "
            "+ position % page_size; got other slots"
        )


_PROBLEMS: Final = (
    ("query_lens", "every request has at least one token in the step"),
    ("query_lens", "the requests' tokens add up to the step's {num_tokens} tokens"),
    ("seq_lens", "a request's context holds its tokens of this step: got a length below its query_lens"),
    ("seq_lens", "a request's context fits its block table: at most {max_seq_len} keys"),
    (
        "block_table",
        "a request's used pages are real: page {scratch} is the scratch page that padding writes",
    ),
    ("block_table", "used pages are in [1, {num_pages}): got a page out of range"),
)


def _describe(layout: PagedLayout, problems: list[bool], num_tokens: int) -> str:
    name, rule = _PROBLEMS[problems.index(True)]
    text = rule.format(
        num_tokens=num_tokens,
        max_seq_len=layout.max_seq_len,
        scratch=layout.scratch_page,
        num_pages=layout.num_pages,
    )
    return f"{name}: {text}"
