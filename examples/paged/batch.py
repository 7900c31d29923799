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
What a backend is: ``base``.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal, TypeAlias

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.lowlevel import check_int
from cudagraph_manager import StaticInput
from cudagraph_manager.attention import BatchShape, StepBatch, pad_offsets, pad_rows

from ..body import model_device
from ..config import MAX_FIELD
from .checks import DeviceChecks
from .checks import check_paged_batch as check_paged_batch
from .layout import PagedLayout

_NONE: Final = CUDAGraphMode.NONE

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

#: How ``PagedBuffers`` checks a real batch: ``"device"`` (``True``), ``"host"`` or not at all (``False``).
Validate: TypeAlias = Literal["eager", "device", "host"] | bool


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


def check_buffers(layout: object, max_tokens: object, max_reqs: object, vocab_size: object) -> None:
    """The sizes of a backend's ``PagedBuffers``: ``ValueError`` naming the first bad one."""
    if not isinstance(layout, PagedLayout):
        raise ValueError(f"layout: expected a PagedLayout, got {layout!r:.80}")
    check_int("max_tokens", max_tokens, minimum=1, maximum=2**31 - 2)  # the int32 offsets hold it
    check_int("max_reqs", max_reqs, minimum=1, maximum=MAX_FIELD)
    if vocab_size is not None:
        check_int("vocab_size", vocab_size, minimum=1, maximum=MAX_FIELD)


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

    ``fill`` checks the real batch (``validate``; the rules of
    ``checks.PROBLEMS``, each error naming the input), then writes it padded
    to ``shape`` with device ops on the current stream. ``views`` is the
    same metadata without writing anything (host only: a recording's).

    ``validate``: ``"eager"`` (or ``True``, the default) checks eager steps
    and CPU tensors on the host (one synchronization, on steps that run
    eagerly anyway, an error at once) and leaves a graph path's (FULL or
    PIECEWISE shapes on a device) unchecked: no synchronization and no
    kernel. ``"device"`` also records a graph path's checks on the device,
    no synchronization (``check_steps()`` raises for them where the caller
    synchronizes), at some forty small kernels a step (their launches cost
    more host time than a small step's replay: ``docs/benchmarks.md``).
    ``"host"``: one synchronization on every path, an error at once (the
    seam's rule broken on graph paths: for debugging and the benchmark's
    baseline). ``False``: no check. ``vocab_size``: the model's vocabulary;
    where a step is checked on the host, its ``input_ids`` are too (before
    the manager copies them into its buffers: the model's own check would
    come after).

    ``page_limit`` (a cache over reserved memory: ``KVCacheMemory.limit``,
    ``[]`` on the device) is the count of pages backed: the checks refuse a
    used page at or past it by name, and ``fill`` sends every block-table
    entry outside ``[0, page_limit)`` to the scratch page (on the device, in
    the step's stream order: no synchronization), so a step that names a
    page not backed reads and writes the scratch page, never unbacked memory.
    """

    __slots__ = (
        "_arange",
        "_block_table",
        "_positions",
        "_query_start_loc",
        "_req_ids",
        "_seq_lens",
        "_views",
        "device_checks",
        "layout",
        "page_limit",
        "validate",
        "vocab_size",
    )

    def __init__(
        self,
        layout: PagedLayout,
        max_tokens: int,
        max_reqs: int,
        device: torch.device | str | None,
        *,
        validate: Validate = True,
        page_limit: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> None:
        check_buffers(layout, max_tokens, max_reqs, vocab_size)
        if validate not in ("eager", "device", "host") and validate is not True and validate is not False:
            raise ValueError(
                f"validate: expected 'eager', 'device', 'host', True or False, got {validate!r:.80}"
            )
        device = model_device(device)
        self.layout: Final = layout
        self.vocab_size: Final = vocab_size
        self.validate: Final[Validate] = "eager" if validate is True else validate
        #: ``[]`` on the device: the pages backed (``None``: every page of the layout).
        self.page_limit: Final = page_limit
        #: A graph path's checks, recorded on the device (``validate="device"``).
        self.device_checks: Final = DeviceChecks(layout, device, page_limit)
        self._query_start_loc: Final = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self._seq_lens: Final = torch.ones(max_reqs, dtype=torch.int32, device=device)
        self._block_table: Final = torch.full(
            (max_reqs, layout.pages_per_seq), layout.scratch_page, dtype=torch.int32, device=device
        )
        self._req_ids: Final = torch.full((max_tokens,), PAD_REQUEST, dtype=torch.int64, device=device)
        self._positions: Final = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._arange: Final = torch.arange(max(max_tokens, max_reqs) + 1, dtype=torch.int32, device=device)
        self._views: Final[dict[BatchShape, PagedMetadata]] = {}

    def check_steps(self) -> None:
        """``ValueError`` naming the first rule a graph path's step broke since the last call (one sync)."""
        self.device_checks.check()

    def request_rows(self) -> tuple[torch.Tensor, ...]:
        """The buffers with a row per request of a decode batch, which a shrinking decode loop moves.

        ``seq_lens`` and ``block_table`` (a row per request) and ``positions``
        (a row per token: one token per request in a decode loop). The others
        are positional (``query_start_loc``, and ``req_ids``: token ``t`` is
        request row ``t``'s) and stay.
        """
        return (self._seq_lens, self._block_table, self._positions)

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
        validate = self.validate
        if validate and num_tokens:
            if validate == "host" or shape.mode is _NONE or self._req_ids.device.type == "cpu":
                # One synchronization, the token ids' check included.
                check_paged_batch(self.layout, batch, shape, self.page_limit, self.vocab_size)
            elif validate == "device":
                self.device_checks.record(batch, shape)  # a graph path: no synchronization
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
            if self.page_limit is not None:  # pages not backed read the scratch page (device ops)
                table = meta.block_table
                table.masked_fill_(
                    table.lt(0).logical_or_(table >= self.page_limit), self.layout.scratch_page
                )
            pad_rows(meta.positions, inputs["positions"], 0)
            # Each token's request, in range whatever the lengths (a device check may report them later).
            ends = torch.cumsum(inputs["query_lens"], 0, dtype=torch.int32)  # the dtype of _arange
            requests = torch.searchsorted(ends, self._arange[:num_tokens], right=True)
            meta.req_ids[:num_tokens].copy_(requests.clamp_(max=num_reqs - 1))
            meta.req_ids[num_tokens:].fill_(PAD_REQUEST)
        else:  # all padding
            meta.seq_lens.fill_(1)
            meta.block_table.fill_(self.layout.scratch_page)
            meta.positions.fill_(0)
            meta.req_ids.fill_(PAD_REQUEST)
        return meta
