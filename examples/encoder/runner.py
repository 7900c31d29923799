"""The encoder served by one ``CUDAGraphManager``: FULL graphs keyed by token budget.

``EncoderRunner`` packs a batch of items into budgets
(``TokenBudgets.pack``), runs each pack through the manager (padded to its
budget, replayed; eager where no graph is captured) and cuts the output back
into one tensor per item. ``encode_eager`` runs the same packs eagerly,
unpadded (the benchmark's baseline); ``encode_alone`` one item alone,
eagerly (the tests' oracle: a packed forward computes each item as alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from cudagraph_dispatch.budgets import Pack, TokenBudgets
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
from cudagraph_manager.attention import (
    AttentionOptions,
    BatchShape,
    PackedMetadataBuilder,
    StepBatch,
    metadata_extra,
)

from .model import EncoderConfig, Kernel, ViTEncoder


def encoder_static_inputs(config: EncoderConfig) -> dict[str, StaticInput]:
    """The manager's inputs: every patch (rows follow the tokens), each item's patch count (the requests)."""
    return {
        "patches": StaticInput((config.patch_dim,), dtype=config.dtype),
        "item_lens": StaticInput(dtype=torch.int32, rows="reqs", pad_value=0),
    }


class EncoderRunner:
    """A ``ViTEncoder`` and the manager of its budget graphs.

    Arguments:
        config: the encoder's sizes.
        budgets: the graphs' budgets and the most items per pack.
        kernel: the attention kernel (``None``: varlen where it runs).
        device: the device (``None``: CUDA where available, else the CPU).
        strict: the manager's ``strict`` (every pack replays a graph).
    """

    def __init__(
        self,
        config: EncoderConfig,
        budgets: TokenBudgets,
        *,
        kernel: Kernel | None = None,
        device: torch.device | str | None = None,
        strict: bool = False,
    ) -> None:
        where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.budgets: Final = budgets
        self.builder: Final = PackedMetadataBuilder(budgets, lengths="item_lens", device=where)
        self.model: Final = ViTEncoder(config, self.builder, kernel=kernel, device=where).eval()
        self.device: Final = where
        options: ManagerOptions[torch.Tensor] = ManagerOptions(
            attention=AttentionOptions(metadata_builder=self.builder)
        )
        self.manager: Final = CUDAGraphManager(
            self.model,
            encoder_static_inputs(config),
            budgets.config(),
            device=where,
            strict=strict,
            options=options,
        )

    def pack(self, items: Sequence[torch.Tensor]) -> tuple[Pack, ...]:
        """The packs of ``items`` (``ValueError`` names an item above the largest budget)."""
        return self.budgets.pack([item.shape[0] for item in items])

    def encode(self, items: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each item's output ``[patches, hidden]``: its packs replayed (or eager), cut per item."""
        outputs: list[torch.Tensor | None] = [None] * len(items)
        for pack in self.pack(items):
            patches, lens = self._packed(items, pack)
            out = self.manager.run(patches=patches, item_lens=lens)
            # The output aliases graph memory until the next run: one copy, then a view per item.
            pieces = torch.split(out.clone(), [items[i].shape[0] for i in pack.items])
            for i, piece in zip(pack.items, pieces, strict=True):
                outputs[i] = piece
        return [out for out in outputs if out is not None]

    def encode_eager(self, items: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``encode`` without the manager: the same packs run eagerly, unpadded."""
        outputs: list[torch.Tensor | None] = [None] * len(items)
        for pack in self.pack(items):
            patches, lens = self._packed(items, pack)
            pieces = torch.split(self.eager_forward(patches, lens), [items[i].shape[0] for i in pack.items])
            for i, piece in zip(pack.items, pieces, strict=True):
                outputs[i] = piece
        return [out for out in outputs if out is not None]

    def encode_alone(self, item: torch.Tensor) -> torch.Tensor:
        """One item run alone, eagerly: ``[patches, hidden]``."""
        lens = torch.tensor([item.shape[0]], dtype=torch.int32, device=self.device)
        return self.eager_forward(item, lens)

    def eager_forward(self, patches: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """The model on one pack, eagerly, with the builder's metadata of the real pack."""
        num_tokens, num_items = patches.shape[0], lens.shape[0]
        batch = StepBatch(num_tokens, num_items, {"item_lens": lens})
        meta = self.builder.build(batch, BatchShape.eager(num_tokens, num_items, False))
        extra = metadata_extra(self.builder, meta)
        with torch.no_grad(), set_forward_context(CUDAGraphMode.NONE, BatchDescriptor(num_tokens), **extra):
            out: torch.Tensor = self.model(patches=patches, item_lens=lens)
        return out

    def _packed(self, items: Sequence[torch.Tensor], pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        """The pack's patches concatenated ``[tokens, patch_dim]``, and its items' lengths ``[n]`` int32."""
        chosen = [items[i] for i in pack.items]
        lens = torch.tensor([item.shape[0] for item in chosen], dtype=torch.int32).to(self.device)
        return torch.cat(chosen), lens


def random_items(
    config: EncoderConfig,
    lengths: Sequence[int],
    generator: torch.Generator,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Random items of these patch counts, ``[n, patch_dim]`` each, drawn on the CPU from ``generator``."""
    return [
        torch.randn(n, config.patch_dim, generator=generator).to(device=device, dtype=config.dtype)
        for n in lengths
    ]
