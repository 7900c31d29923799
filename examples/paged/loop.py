"""Decoding on the device for ``PagedDecoder``: the advance of a decode loop (``DecodeLoop``).

A decode loop runs "the one-step forward, then the advance" until every
request is done. The advance (``PagedAdvance``) turns one step's final hidden
states into the next step, in place, with device ops only, so it can be
captured with the step (one WHILE launch for the whole loop):

- logits ``hidden @ embed.T`` (the tied embedding, in float32) and the next
  token of every request (``greedy``: the argmax; or a caller's sampler);
- the token written at row ``step`` of ``state.tokens`` (``NO_TOKEN`` for a
  request that finished at an earlier step);
- a request finishes at ``eos_id`` or when its length (its context and the
  token just sampled) reaches ``max_len``; ``state.active`` says which go on
  and ``state.stop`` is set once none does;
- for the requests that go on: the next ``input_ids`` (the token), their
  ``positions`` and ``seq_lens`` + 1, the next ``slot_mapping`` through the
  block table, in the static inputs and in the backend's ``PagedMetadata``
  (what every paged backend reads); what a backend derives from it (flex's
  block masks, gather's page tables, varlen's gathered key map) its next
  forward derives again.

A finished request (and every padding row) keeps its inputs: its last token
at its last position and slot, inert (it rewrites the same K/V) and never past
its pages. ``decode_batch`` draws a uniform decode batch whose block tables
hold pages up to ``max_len``, so the loop never runs out of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import torch
from torch import Tensor

from cudagraph_dispatch.lowlevel import check_int
from cudagraph_manager import LoopState
from cudagraph_manager.attention import attention_metadata

from .batch import PagedMetadata
from .model import PagedDecoder

#: What a finished request's rows of the tokens hold: no token was generated at that step.
NO_TOKEN: Final = -1

#: A sampler: logits ``[num_reqs, vocab]`` float32 -> the next tokens ``[num_reqs]`` int64.
#: Capturable: device ops only, no host sync, no torch random numbers (a WHILE launch does not
#: advance torch's generator).
Sampler = Callable[[Tensor], Tensor]


def greedy(logits: Tensor) -> Tensor:
    """The most likely token of each row: ``logits [num_reqs, vocab]`` -> ``[num_reqs]`` int64."""
    return logits.argmax(-1)


@dataclasses.dataclass(frozen=True, slots=True)
class PagedAdvance:
    """One decode step's advance for ``PagedDecoder`` (``DecodeLoop(advance, max_steps)``).

    Made by ``greedy_advance`` (or directly, with a ``sample``). Call it as
    ``advance(hidden, inputs, state)`` under the step's forward context:
    ``hidden [num_reqs, hidden]`` the step's final hidden states (one token
    per request, padding rows included), ``inputs`` the padded key's static
    inputs by name (``PAGED_INPUT_NAMES``), ``state`` the loop's tensors.
    ``step_inputs`` is the same without the backend's metadata, for a host
    loop whose every step builds the metadata afresh (``manager.run``).

    Fields:
        model: the decoder (its embedding, layout and backend).
        eos_id: the token that ends a request (it is emitted), or ``None``.
        max_len: the longest a request gets, its context and generated tokens
            together; at most the block table's and the rotary table's reach.
        sample: logits -> tokens (``Sampler``; default ``greedy``).
        embed: the embedding ``[vocab, hidden]`` in float32, taken when the
            advance is made (the model's own tensor when it is float32).
    """

    model: PagedDecoder
    eos_id: int | None
    max_len: int
    sample: Sampler = greedy
    embed: Tensor = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        model: object = self.model
        if not isinstance(model, PagedDecoder):
            raise ValueError(f"model: expected a PagedDecoder, got {model!r:.80}")
        vocab = self.model.config.vocab_size
        if self.eos_id is not None:
            check_int("eos_id", self.eos_id, minimum=0, maximum=vocab - 1)
        reach = min(self.model.layout.max_seq_len, self.model.config.max_seq_len)
        check_int("max_len", self.max_len, minimum=2, maximum=reach)
        if not callable(self.sample):
            raise ValueError(f"sample: expected a callable (logits -> tokens), got {self.sample!r:.80}")
        # Float32 logits: an argmax over bf16 logits meets ties, which a padded batch's GEMM
        # (another tiling than the real batch's) would break differently.
        object.__setattr__(self, "embed", self.model.body.embed.detach().float())

    def __call__(self, outputs: Tensor, inputs: Mapping[str, Tensor], state: LoopState) -> None:
        """The whole advance: tokens, ``active``, ``stop``, the next inputs and the backend's metadata."""
        going = self.step_inputs(outputs, inputs, state)
        advance_metadata(attention_metadata(self.model.backend), going)

    def step_inputs(self, outputs: Tensor, inputs: Mapping[str, Tensor], state: LoopState) -> Tensor:
        """Tokens, ``active``, ``stop`` and the next static inputs; returns ``going [num_reqs]`` bool.

        ``going``: the requests that take another step (``state.active`` after
        this one). Device ops on the current stream, no host sync.
        """
        live = state.active  # [R] bool: active during this step
        if outputs.shape[0] != live.shape[0]:
            raise ValueError(
                f"outputs: a decode loop's step has one token per request, got {outputs.shape[0]} rows "
                f"for {live.shape[0]} requests"
            )
        logits = torch.mm(outputs.float(), self.embed.T)  # [R, vocab] float32
        sampled = self.sample(logits)  # [R] int64
        emitted = torch.where(live, sampled, NO_TOKEN)  # [R]
        state.tokens.index_copy_(0, state.step.view(1), emitted[None])
        length = inputs["seq_lens"].long() + 1  # [R]: the context and the token just sampled
        done = length >= self.max_len
        if self.eos_id is not None:
            done |= sampled == self.eos_id
        going = live & ~done  # [R] bool
        state.active.copy_(going)
        torch.logical_not(going.any(), out=state.stop)
        _advance_inputs(inputs, sampled, going, self.model.layout.page_size)
        return going


def greedy_advance(model: PagedDecoder, *, eos_id: int | None, max_len: int) -> PagedAdvance:
    """Greedy decoding for ``model``: the argmax token, a stop at ``eos_id`` or at ``max_len`` tokens.

    ``DecodeLoop(greedy_advance(model, eos_id=2, max_len=256), max_steps=64)``.
    Each request's block-table row must hold its pages up to ``max_len - 1``
    keys (the last token is sampled, never fed). Bad arguments raise
    ``ValueError`` naming them.
    """
    return PagedAdvance(model, eos_id, max_len)


def _advance_inputs(inputs: Mapping[str, Tensor], sampled: Tensor, going: Tensor, page_size: int) -> None:
    """The requests that go on take ``sampled`` at their next position and slot; the rest keep theirs."""
    input_ids, positions = inputs["input_ids"], inputs["positions"]  # [R] int64 each
    slot_mapping, table = inputs["slot_mapping"], inputs["block_table"]  # [R] int64, [R, M] int32
    input_ids.copy_(torch.where(going, sampled, input_ids))
    positions.add_(going)
    inputs["seq_lens"].add_(going)  # [R] int32
    # Clamped: a request that stopped may sit at its table's end; its slot is not replaced.
    column = torch.div(positions, page_size, rounding_mode="floor").clamp_(max=table.shape[1] - 1)
    page = table.gather(1, column[:, None])[:, 0].long()  # [R]
    slot_mapping.copy_(torch.where(going, page * page_size + positions % page_size, slot_mapping))


def advance_metadata(meta: object, going: Tensor) -> None:
    """Advance a paged backend's metadata by one decode step for the requests in ``going [R]``.

    ``PagedMetadata``: ``seq_lens`` and each token's position + 1 (one token
    per request, so token ``r`` is request ``r``'s). What a backend derives
    from them (flex's and gather's plans, varlen's gathered key map) is
    keyed by the forward's context, so the next forward derives it from the
    advanced metadata.
    A metadata type without a ``PagedMetadata`` raises ``ValueError``.
    """
    paged = getattr(meta, "paged", None)
    if not isinstance(paged, PagedMetadata):
        raise ValueError(f"meta: expected a paged backend's metadata (with .paged), got {meta!r:.80}")
    paged.seq_lens.add_(going)  # [R] int32
    paged.positions.add_(going)  # [T] int64, T == R


def decode_batch(
    model: PagedDecoder,
    seq_lens: Sequence[int],
    *,
    max_len: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """A uniform decode batch for a loop: request ``r`` at length ``seq_lens[r]``, feeding its last token.

    Random last tokens (the cache holds random earlier context); each
    request's block-table row holds distinct pages, drawn from a shuffled
    pool, up to ``max_len`` keys (the scratch page past them), so a loop up to
    ``max_len`` stays on its own pages. ``ValueError`` names ``seq_lens`` when
    a length is out of ``[1, max_len]`` or the cache has too few pages.
    """
    layout = model.layout
    page_size, width = layout.page_size, layout.pages_per_seq
    check_int("max_len", max_len, minimum=1, maximum=min(layout.max_seq_len, model.config.max_seq_len))
    lengths = [check_int("seq_lens", length, minimum=1, maximum=max_len) for length in seq_lens]
    per_request = -(-max_len // page_size)
    if not lengths or len(lengths) * per_request > layout.num_pages - 1:
        raise ValueError(
            f"seq_lens: {len(lengths)} requests of up to {max_len} keys need {len(lengths) * per_request} "
            f"pages, at least 1 request and at most the cache's {layout.num_pages - 1}"
        )
    pool = torch.randperm(layout.num_pages - 1, generator=generator)[: len(lengths) * per_request] + 1
    table = torch.full((len(lengths), width), layout.scratch_page, dtype=torch.int32)  # [R, M]
    table[:, :per_request] = pool.view(len(lengths), per_request).int()
    lens = torch.tensor(lengths, dtype=torch.int64)  # [R]
    positions = lens - 1  # [R]: each request's last token
    slots = (
        table[torch.arange(len(lengths)), positions // page_size].long() * page_size + positions % page_size
    )
    ids = torch.randint(0, model.config.vocab_size, (len(lengths),), generator=generator)
    return {
        "input_ids": ids.to(device),  # [R]
        "positions": positions.to(device),  # [R]
        "slot_mapping": slots.to(device),  # [R]
        "query_lens": torch.ones(len(lengths), dtype=torch.int32).to(device),  # [R]
        "seq_lens": lens.int().to(device),  # [R]
        "block_table": table.to(device),  # [R, pages_per_seq]
    }
