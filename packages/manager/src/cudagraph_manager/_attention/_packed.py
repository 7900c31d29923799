"""Packed items (an encoder's images or clips) through the seam: offsets padded as one extra sequence.

A forward of packed items concatenates their tokens; a non-causal attention
over them reads where each item starts (``cu_seqlens``) and a host bound on
one item's tokens (``max_seqlen``). ``PackedMetadataBuilder`` is the seam's
builder for it (docs/design.md, "Encoder graphs"): one buffer allocated at
the largest budget, the items' offsets and then the padded total, so the
padding is one more sequence (attending only to itself), and ``max_seqlen``
the shape's token count, a bound that depends on the shape alone.

The offsets are written by the forward, not by ``build``: the model calls
``PackedMetadata.write_offsets(item_lens)`` on the lengths input it is
given (in a graph, the static buffer, padding rows 0), so a graph captures
the cumsum and a replay's ``build`` is a look-up, no kernel launched.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Final

import torch

from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.budgets import TokenBudgets
from cudagraph_dispatch.lowlevel import check_bool, check_int
from cudagraph_dispatch.support import AttentionSupport, GraphSupport

from .._values._batch import BatchShape, StepBatch


class _Ledger(threading.local):
    """Whether the forward wrote the offsets since the last build, per thread (a background capture's
    builds and forwards run beside the serving thread's); one per builder, shared by its views."""

    written: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PackedMetadata:
    """The metadata of a forward of packed items (``PackedMetadataBuilder``'s).

    ``cu_seqlens [num_reqs + 2]`` int32, once the forward called
    ``write_offsets(lengths)``: 0, each item's end, the real total in each
    padding row of ``lengths`` (empty sequences), then ``num_tokens``, the
    padded total (the end of the padding sequence). Read before the forward
    wrote them (since the step's build), it raises: a forward that forgot
    would read a previous step's offsets. ``offsets`` is the same view,
    unchecked. ``max_seqlen``: the shape's token count, a bound on every
    sequence (the padding's included) that a FULL graph may bake.
    """

    offsets: torch.Tensor
    max_seqlen: int
    num_tokens: int
    ledger: _Ledger = dataclasses.field(default_factory=_Ledger, repr=False, compare=False)

    def __post_init__(self) -> None:
        offsets: object = self.offsets
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int32:
            shown = (
                f"shape {tuple(offsets.shape)} of {offsets.dtype}"
                if isinstance(offsets, torch.Tensor)
                else f"{offsets!r:.80}"
            )
            raise ValueError(f"offsets: expected a 1-D int32 tensor (cu_seqlens), got {shown}")
        if offsets.shape[0] < 2:
            raise ValueError(
                f"offsets: expected 2 rows at least (0, then the padded total), got {offsets.shape[0]}"
            )
        check_int("max_seqlen", self.max_seqlen, minimum=0)
        check_int("num_tokens", self.num_tokens, minimum=0)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The offsets, ``RuntimeError`` unless this forward wrote them (in Python: eager steps, captures)."""
        if not self.ledger.written:
            raise RuntimeError(
                "PackedMetadata.cu_seqlens: read before the forward called write_offsets(lengths) "
                "(the forward writes each step's offsets, in a graph too)"
            )
        return self.offsets

    def write_offsets(self, lengths: torch.Tensor) -> torch.Tensor:
        """``cu_seqlens`` written on the device from ``lengths [num_reqs]`` (the forward's input, padding 0).

        Three ops on the current stream, no host read (a graph captures
        them): the cumsum of ``lengths`` into rows 1 to ``num_reqs``, clamped
        to the padded total (so stale or nonzero padding rows never pass
        it), and the padded total in the last row (row 0 stays 0).

        Args:
            lengths: ``[num_reqs]`` integers on the offsets' device, each item's tokens.

        Returns:
            ``cu_seqlens``.

        Raises:
            ValueError: naming ``lengths`` where it is not that (checked in
                Python: a replay runs none of this).
        """
        offsets = self.offsets
        given: object = lengths
        if not isinstance(given, torch.Tensor):
            raise ValueError(f"lengths: expected a tensor of the items' lengths, got {given!r:.80}")
        if lengths.dim() != 1 or lengths.shape[0] + 2 != offsets.shape[0]:
            raise ValueError(
                f"lengths: expected {offsets.shape[0] - 2} item lengths (the shape's items), "
                f"got shape {tuple(lengths.shape)}"
            )
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise ValueError(f"lengths: expected integer item lengths, got {lengths.dtype}")
        if lengths.device != offsets.device:
            raise ValueError(f"lengths: on {lengths.device}, but the offsets are on {offsets.device}")
        ends = offsets[1:-1]
        torch.cumsum(lengths, 0, dtype=torch.int32, out=ends)
        ends.clamp_(max=self.num_tokens)
        offsets[-1:].fill_(self.num_tokens)
        self.ledger.written = True
        return offsets


class PackedMetadataBuilder:
    """An ``AttentionMetadataBuilder[PackedMetadata]`` for packed items, keyed by token budget.

    Args:
        budgets: the graphs' ``TokenBudgets``; the offsets buffer is sized
            once for its ``max_items`` (``max_items + 2`` rows).
        lengths: the name of the step's input holding each item's tokens
            (``[num_items]`` integers, ``rows="reqs"``): an identifier.
        device: where the buffer lives, the manager's device (default: the
            current CUDA device, else the CPU, as the manager's); a CUDA
            device or the CPU.
        validate: also check the batches of graph paths on the host (one
            synchronization each). Without it, the batches that run no graph
            (eager steps: every step without CUDA) are checked, at once: the
            lengths a 1-D integer tensor of the batch's items, each at least
            1, summing to the step's tokens.

    ``build`` writes nothing: it returns the shape's view of the buffer (the
    same one per graph shape), which the forward fills with
    ``PackedMetadata.write_offsets``. Its ``support`` is ``ALWAYS``: every
    host value depends on the shape alone. Bad arguments raise
    ``ValueError`` naming them, before anything is kept.
    """

    support: Final = AttentionSupport(GraphSupport.ALWAYS, name="packed")

    def __init__(
        self,
        budgets: TokenBudgets,
        *,
        lengths: str = "item_lens",
        device: torch.device | str | None = None,
        validate: bool = False,
    ) -> None:
        given: object = budgets
        if not isinstance(given, TokenBudgets):
            raise ValueError(f"budgets: expected TokenBudgets, got {given!r:.80}")
        given_name: object = lengths
        if not isinstance(given_name, str) or not given_name.isidentifier():
            raise ValueError(
                f"lengths: expected an input name (an identifier, as the manager's inputs), got {lengths!r}"
            )
        self.budgets: Final = budgets
        self.lengths: Final = lengths
        self.validate: Final = check_bool("validate", validate)
        #: Where the offsets live: the manager's device (``CUDAGraphManager`` checks it).
        self.device: Final = resolve_device(device)
        self._offsets: Final = torch.zeros(budgets.max_items + 2, dtype=torch.int32, device=self.device)
        self._views: Final[dict[tuple[int, int], PackedMetadata]] = {}
        self._ledger: Final = _Ledger()

    def build_for_capture(self, shape: BatchShape, /) -> PackedMetadata:
        """The metadata a graph of ``shape`` reads: the same view of the buffer for the same shape.

        Args:
            shape: the batch a forward runs as (``BatchShape``).

        Returns:
            The shape's metadata, kept per graph shape (an eager shape's is not).

        Raises:
            ValueError: ``shape`` is no ``BatchShape``, or has more items than the budgets'.
        """
        given: object = shape
        if not isinstance(given, BatchShape):
            raise ValueError(f"shape: expected a BatchShape, got {given!r:.80}")
        self._ledger.written = False  # the forward that follows writes the offsets
        key = (shape.num_tokens, shape.num_reqs)
        meta = self._views.get(key)
        if meta is None:
            if shape.num_reqs + 2 > self._offsets.shape[0]:
                raise ValueError(
                    f"shape: {shape.num_reqs} items exceed max_items={self.budgets.max_items} of the builder"
                )
            view = self._offsets[: shape.num_reqs + 2]
            meta = PackedMetadata(view, shape.num_tokens, shape.num_tokens, self._ledger)
            if shape.mode is not CUDAGraphMode.NONE:  # a graph's shape: one per key; eager ones are not kept
                self._views[key] = meta
        return meta

    def build(self, batch: StepBatch, shape: BatchShape, /) -> PackedMetadata:
        """The metadata of ``shape`` for ``batch``: no device op (the forward writes the offsets).

        A replay's is one look-up; an eager step's (with ``validate``, every
        step's) batch is checked first.

        Args:
            batch: the step's real batch (``StepBatch``).
            shape: the batch a forward runs it as (``BatchShape``).

        Returns:
            ``build_for_capture(shape)``'s metadata.

        Raises:
            ValueError: naming the lengths input, ``batch`` or ``shape``.
        """
        self._ledger.written = False
        try:
            meta = self._views.get((shape.num_tokens, shape.num_reqs))  # a graph's shape: one look-up
            num_reqs, inputs = batch.num_reqs, batch.inputs
        except AttributeError:  # callers may not be typed: say which argument
            raise _not_a_batch(batch, shape) from None
        check = self.validate or shape.mode is CUDAGraphMode.NONE  # an eager step (on a CPU: every step)
        if check:
            _check_batch(self.lengths, batch, shape)
        if meta is None:
            meta = self.build_for_capture(shape)  # checks the shape's item count
        if num_reqs and not check and inputs.get(self.lengths) is None:
            raise ValueError(f"{self.lengths}: the step has no input of the items' lengths")
        return meta


def _not_a_batch(batch: object, shape: object) -> ValueError:
    """The error of ``build`` given something else than a ``BatchShape`` or a ``StepBatch``."""
    if not isinstance(shape, BatchShape):
        return ValueError(f"shape: expected a BatchShape, got {shape!r:.80}")
    return ValueError(f"batch: expected a StepBatch, got {batch!r:.80}")


def _check_batch(name: str, batch: StepBatch, shape: BatchShape) -> None:
    """``batch`` fits ``shape`` and its lengths input ``name`` is its items': else ``ValueError`` naming it.

    Reads the lengths on the host (a synchronization on a device).
    """
    num_tokens, num_reqs = batch.num_tokens, batch.num_reqs
    if num_tokens > shape.num_tokens or num_reqs > shape.num_reqs or num_reqs > num_tokens:
        raise ValueError(
            f"batch: {num_tokens} tokens of {num_reqs} items do not fit the shape's "
            f"{shape.num_tokens} tokens of {shape.num_reqs} items"
        )
    if not num_reqs:
        return
    lengths: object = batch.inputs.get(name)
    if lengths is None:
        raise ValueError(f"{name}: the step has no input of the items' lengths")
    if (
        not isinstance(lengths, torch.Tensor)
        or lengths.dim() != 1
        or lengths.shape[0] != num_reqs
        or lengths.dtype.is_floating_point
        or lengths.dtype.is_complex
        or lengths.dtype == torch.bool
    ):
        shown = (
            f"shape {tuple(lengths.shape)} of {lengths.dtype}"
            if isinstance(lengths, torch.Tensor)
            else f"{lengths!r:.80}"
        )
        raise ValueError(f"{name}: expected the {num_reqs} items' lengths, a 1-D integer tensor, got {shown}")
    values = lengths.tolist()
    if min(values) < 1 or sum(values) != num_tokens:
        raise ValueError(f"{name}: expected lengths >= 1 summing to the {num_tokens} tokens, got {values}")
