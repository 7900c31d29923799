"""One key of the capture plan: the views its graph reads, its two capture acts, its graph once captured.

A ``PlannedKey`` is built once per key of the dispatcher's plan. Its ``entry``
(the engine's ``GraphEntry``: graph, outputs, replay) is the one place that
says whether the key is captured: a capture sets it, in one assignment,
after the outputs were checked, so the serving thread replays it from its
next step; ``clear()`` drops it, which frees the graph. The two acts of its
capture (``warm_up``, ``record``) serve ``capture()``, the background capture
and the estimate's probes alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable
from types import MappingProxyType
from typing import Final, Generic, cast

import torch

from cudagraph_capture import CaptureError, GraphEngine, GraphEntry
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, ForwardContext, set_forward_context

from .._attention._seam import BatchShape, StepBatch, metadata_extra
from .._memory._device import free_bytes, reserved_bytes
from .._protocols import AttentionMetadataBuilder, OutputT
from .._reports._report import CapturedGraph
from .._step._buffers import StaticBuffers
from .._step._outputs import OutputLayout


class PlannedKey(Generic[OutputT]):
    """A planned graph: its mode and key, its row counts, its input views, its entry and counters."""

    __slots__ = (
        "builder",
        "context",
        "descriptor",
        "eager_shape",
        "entry",
        "inputs",
        "last_cut",
        "mode",
        "num_reqs",
        "num_tokens",
        "replays",
        "shape",
    )

    def __init__(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        buffers: StaticBuffers,
        max_num_seqs: int,
        builder: AttentionMetadataBuilder[object] | None = None,
    ) -> None:
        self.mode: Final = mode
        self.descriptor: Final = descriptor
        self.num_tokens: Final = descriptor.num_tokens
        # PIECEWISE keys are relaxed (no request count): size their request rows as vLLM does.
        self.num_reqs: Final = (
            descriptor.num_reqs if descriptor.num_reqs is not None else min(self.num_tokens, max_num_seqs)
        )
        self.inputs: Final = buffers.views(self.num_tokens, self.num_reqs)  # the graph's keyword arguments
        #: The attention's view of the graph's batch, and of the same batch run eagerly (no CUDA).
        self.shape: Final = BatchShape.of_key(mode, descriptor, self.num_reqs)
        self.eager_shape: Final = dataclasses.replace(self.shape, mode=CUDAGraphMode.NONE)
        self.builder: Final = builder
        # A PIECEWISE replay runs its eager breaks for real, and they may read the forward context.
        self.context: Final = ForwardContext(mode, descriptor) if mode is CUDAGraphMode.PIECEWISE else None
        #: The captured graph (``keep``), which replays itself; ``None``: not captured.
        self.entry: GraphEntry[OutputT] | None = None
        self.replays = 0
        # The last (entry, num_tokens, num_reqs, cut): steps of one row count reuse the cut.
        self.last_cut: tuple[GraphEntry[OutputT], int, int, object] | None = None

    def build(self, batch: StepBatch) -> ForwardContext | None:
        """The attention's metadata of ``batch`` padded to this key; the context its replay runs under.

        FULL: ``None`` (the graph reads the builder's buffers). PIECEWISE: the
        key's context carrying the metadata, which the eager attention reads.
        """
        builder = self.builder
        assert builder is not None
        metadata = builder.build(batch, self.shape)
        context = self.context
        if context is None:
            return None
        return ForwardContext(
            context.runtime_mode, self.descriptor, MappingProxyType(metadata_extra(builder, metadata))
        )

    def keep(self, entry: GraphEntry[OutputT]) -> None:
        """Store a checked entry: the key is captured, and replays from the serving thread's next step."""
        self.last_cut = None
        self.entry = entry  # last, one assignment: the serving thread sees uncaptured or captured

    def replayed(
        self, entry: GraphEntry[OutputT], layout: OutputLayout | None, num_tokens: int, num_reqs: int
    ) -> OutputT:
        """Count a replay of ``entry`` (this key's); its outputs cut to the real rows.

        The outputs come in a fresh container (a caller's edits stay theirs).
        ``layout`` is set by the capture of every captured key.
        """
        self.replays += 1
        assert layout is not None
        last = self.last_cut
        if last is not None and last[0] is entry and last[1] == num_tokens and last[2] == num_reqs:
            cut = last[3]
        else:
            cut = layout.cut(entry.output, num_tokens, num_reqs)
            self.last_cut = (entry, num_tokens, num_reqs, cut)
        return cast(OutputT, cut.copy() if isinstance(cut, (list, dict)) else cut)

    def drop(self) -> None:
        """Forget the entry, which frees the graph: the key is not captured any more.

        The caller holds the device's capture lock (freeing a graph edits
        torch's registry of live graphs, which a capture edits too).
        """
        self.entry = self.last_cut = None

    def reset_replays(self) -> None:
        self.replays = 0

    def warm_up(self, engine: GraphEngine[OutputT], buffers: StaticBuffers) -> None:
        """Fill the views with pad values and run the model eagerly on them (on the current stream).

        Pad values, never the last real batch: a warm-up really runs, KV-cache
        writes included. The model's own error at this size is raised as a
        ``CaptureError`` naming the key.
        """
        try:
            buffers.fill_padding(self.num_tokens, self.num_reqs)
            builder = self.builder
            if builder is None:
                engine.warm_up(self.descriptor, self.inputs)
            else:  # an all-padding batch's metadata, on the stream the warm-up is ordered after
                metadata = builder.build(StepBatch.padding(), self.shape)
                with set_forward_context(
                    CUDAGraphMode.NONE, self.descriptor, **metadata_extra(builder, metadata)
                ):
                    engine.warm_up(self.descriptor, self.inputs)
        except CaptureError:
            raise
        except Exception as error:
            raise CaptureError(
                f"the warm-up failed with {type(error).__name__}: {error}", self.descriptor
            ) from error

    def record(
        self, engine: GraphEngine[OutputT], device: torch.device, start: float, warmup_seconds: float
    ) -> tuple[GraphEntry[OutputT], CapturedGraph]:
        """Record the graph (nothing runs on the device); the entry, and what it cost since ``start``.

        ``pool_bytes`` is the growth of reserved memory over the recording
        alone (a warm-up's eager blocks are not the pool's); ``driver_bytes``
        the rest of the drop of free memory (the graph's executable). The
        seconds count from ``start``, ``warmup_seconds`` of them the key's
        warm-up. The entry is not stored: the caller checks it first.
        """
        reserved, free = reserved_bytes(device), free_bytes(device)
        with self._capture_metadata():
            entry = engine.record(self.descriptor, self.inputs)
        pool_bytes = reserved_bytes(device) - reserved
        driver_bytes = free - free_bytes(device) - pool_bytes
        spent = entry.seconds
        return entry, CapturedGraph(
            self.mode,
            self.descriptor,
            time.perf_counter() - start,
            pool_bytes,
            driver_bytes,
            warmup_seconds,
            spent.recording,
            spent.instantiation,
        )

    def _capture_metadata(self) -> contextlib.AbstractContextManager[object]:
        """The forward context that hands the recording its metadata (``build_for_capture``: host only)."""
        builder = self.builder
        if builder is None:
            return contextlib.nullcontext()
        try:
            metadata = builder.build_for_capture(self.shape)
        except Exception as error:
            raise CaptureError(
                f"the attention's build_for_capture({self.shape}) failed with "
                f"{type(error).__name__}: {error}",
                self.descriptor,
            ) from error
        return set_forward_context(CUDAGraphMode.NONE, self.descriptor, **metadata_extra(builder, metadata))


def by_mode(keys: Iterable[PlannedKey[OutputT]]) -> dict[CUDAGraphMode, list[PlannedKey[OutputT]]]:
    """``keys`` grouped by mode, each group in the order given (a plan's: largest first)."""
    grouped: dict[CUDAGraphMode, list[PlannedKey[OutputT]]] = {}
    for key in keys:
        grouped.setdefault(key.mode, []).append(key)
    return grouped


def replays_by_size(keys: Iterable[PlannedKey[OutputT]]) -> dict[tuple[CUDAGraphMode, int], int]:
    """Replays per (mode, num_tokens) over ``keys`` (keys of one size differ by requests or LoRAs)."""
    replays: dict[tuple[CUDAGraphMode, int], int] = {}
    for key in keys:
        if key.replays:
            size = (key.mode, key.num_tokens)
            replays[size] = replays.get(size, 0) + key.replays
    return replays
