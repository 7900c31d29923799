"""What the parts of one manager share: built once, read by its steps, its captures and its loops.

Each fact has one owner here: the device is the static buffers' (where the
graphs read their inputs), the mode resolution the dispatcher's, why nothing
is captured (``no_graphs``) this object's. The parts read them from here and
keep no copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic

import torch

from cudagraph_dispatch import CUDAGraphDispatcher
from cudagraph_dispatch.support import ModeResolution

from ._arguments import Arguments
from ._buffers._buffers import StaticBuffers
from ._buffers._outputs import LayoutCell
from ._decode_loop import LoopBuffers
from ._protocols import AttentionMetadataBuilder, OutputT
from ._reports._report import StepCounts
from .ranks import RankAgreement


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerParts(Generic[OutputT]):
    """A manager's model, dispatcher, static buffers, outputs' layout and counters, and its settings.

    ``no_graphs``: why the manager captures nothing (``None``: it captures);
    ``strict``: steps without a graph raise; ``ranks``: the ranks it steps
    with; ``builder``: the attention's metadata builder (``None``: the model
    builds its metadata itself); ``loop``: the decode loop's state, if any.
    """

    model: Callable[..., OutputT]
    dispatcher: CUDAGraphDispatcher
    buffers: StaticBuffers
    layout: LayoutCell
    counts: StepCounts
    no_graphs: str | None
    strict: bool
    ranks: RankAgreement | None
    builder: AttentionMetadataBuilder[object] | None
    loop: LoopBuffers[OutputT] | None

    @classmethod
    def of(
        cls, model: Callable[..., OutputT], checked: Arguments[OutputT], strict: bool
    ) -> ManagerParts[OutputT]:
        """A manager's parts from its ``checked`` arguments: a static buffer per input, fresh counters."""
        config = checked.dispatcher.config
        buffers = StaticBuffers(
            checked.inputs,
            max_tokens=config.capture_sizes.max,
            max_num_seqs=config.max_num_seqs,
            uniform_decode_query_len=config.uniform_decode_query_len,
            device=checked.device,
        )
        layout = LayoutCell(checked.rows)
        decode_loop = checked.given.decode_loop
        loop = None if decode_loop is None else LoopBuffers(decode_loop, config.max_num_seqs, checked.device)
        return cls(
            model,
            checked.dispatcher,
            buffers,
            layout,
            StepCounts(),
            checked.no_graphs,
            strict,
            checked.given.ranks,
            checked.builder,
            loop,
        )

    @property
    def device(self) -> torch.device:
        """Where the static buffers live, and so every graph, step and loop of the manager."""
        return self.buffers.device

    @property
    def resolution(self) -> ModeResolution:
        """The mode the graphs follow (the dispatcher's), for the reports."""
        return self.dispatcher.resolution
