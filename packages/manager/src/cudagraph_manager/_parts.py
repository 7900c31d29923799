"""What the parts of one manager share: built once, read by its eager steps and its captures."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic

import torch

from cudagraph_dispatch import CUDAGraphDispatcher

from ._protocols import AttentionMetadataBuilder, OutputT
from ._reports._report import StepCounts
from ._step._buffers import StaticBuffers
from ._step._outputs import LayoutCell


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerParts(Generic[OutputT]):
    """A manager's model, dispatcher, static buffers, outputs' layout and counters, and its settings.

    ``no_graphs``: why the manager captures nothing (``None``: it captures);
    ``strict``: steps without a graph raise; ``world_size``: its ranks'
    (``None``: no ranks); ``builder``: the attention's metadata builder
    (``None``: the model builds its metadata itself).
    """

    model: Callable[..., OutputT]
    dispatcher: CUDAGraphDispatcher
    buffers: StaticBuffers
    layout: LayoutCell
    counts: StepCounts
    device: torch.device
    no_graphs: str | None
    strict: bool
    world_size: int | None
    builder: AttentionMetadataBuilder[object] | None
