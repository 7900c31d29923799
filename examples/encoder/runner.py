"""The encoder served by a ``CUDAGraphManager``: FULL graphs keyed by token budget.

``EncoderRunner`` packs a batch of items into budgets
(``TokenBudgets.pack``), runs each pack through the manager (padded to its
budget, replayed; eager where no graph is captured) and cuts the output back
into one tensor per item. ``encode_eager`` runs the same packs eagerly,
unpadded (the benchmark's baseline); ``encode_alone`` one item alone,
eagerly (the tests' oracle: a packed forward computes each item as alone).
Both take the manager's own eager path: a second manager over the same
model and builder that plans no graph (mode NONE) runs every step eagerly,
on the real batch with the builder's metadata of it, as any manager runs a
step without a graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

import torch

from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_dispatch.budgets import Pack, TokenBudgets
from cudagraph_dispatch.lowlevel import check_bool, check_int
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
from cudagraph_manager.attention import AttentionOptions, PackedMetadataBuilder

from ..body import model_device
from ..config import MAX_FIELD
from .model import EncoderConfig, Kernel, ViTEncoder


def encoder_static_inputs(config: EncoderConfig) -> dict[str, StaticInput]:
    """The manager's inputs: every patch (rows follow the tokens), each item's patch count (the requests)."""
    given: object = config
    if not isinstance(given, EncoderConfig):
        raise ValueError(f"config: expected an EncoderConfig, got {config!r:.80}")
    return {
        "patches": StaticInput((config.patch_dim,), dtype=config.dtype),
        "item_lens": StaticInput(dtype=torch.int32, rows="reqs", pad_value=0),
    }


class EncoderRunner:
    """A ``ViTEncoder``, the manager of its budget graphs, and a manager of no graphs for eager runs.

    ``manager`` captures and replays the budgets' graphs; ``eager_manager``
    (the same model, inputs and builder, mode NONE) runs the eager baseline
    and oracle, so they count in its ``stats``, never in ``manager``'s.

    Args:
        config: the encoder's sizes.
        budgets: the graphs' budgets and the most items per pack.
        kernel: the attention kernel (``None``: varlen where it runs).
        device: the device (``None``: the current CUDA device where there is
            one, else the CPU).
        strict: the graph manager's ``strict`` (every pack replays a graph).

    Raises:
        ValueError: a bad argument, naming it, before anything is built; so
            do bad items (``items[i]``), before a pack runs.
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
        encoder_static_inputs(config)  # checks config
        given: object = budgets
        if not isinstance(given, TokenBudgets):
            raise ValueError(f"budgets: expected TokenBudgets, got {budgets!r:.80}")
        check_bool("strict", strict)
        where = resolve_device(device)
        self.config: Final = config
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
        # No graph planned: every step is the manager's eager step (logged once, counted per reason).
        self.eager_manager: Final = CUDAGraphManager(
            self.model,
            encoder_static_inputs(config),
            dataclasses.replace(budgets.config(), mode=CUDAGraphMode.NONE),
            device=where,
            options=options,
        )

    def pack(self, items: Sequence[torch.Tensor]) -> tuple[Pack, ...]:
        """The packs of ``items``: ``ValueError`` naming a bad one (``items[i]``: one too long too)."""
        given: object = items
        if not isinstance(given, (list, tuple)):
            raise ValueError(
                f"items: expected a list or tuple of [patches, patch_dim] tensors, got {given!r:.80}"
            )
        for i, item in enumerate(given):
            self._check_item(f"items[{i}]", item)
        return self.budgets.pack([item.shape[0] for item in items])

    def _check_item(self, name: str, item: object) -> None:
        """``ValueError`` naming ``name`` unless ``item`` is one item, ``[n, patch_dim]``."""
        config = self.config
        if not isinstance(item, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor [patches, {config.patch_dim}], got {item!r:.80}")
        if item.dim() != 2 or item.shape[1] != config.patch_dim or item.shape[0] < 1:
            raise ValueError(f"{name}: expected [patches, {config.patch_dim}], got shape {tuple(item.shape)}")
        if item.shape[0] > self.budgets.max:
            raise ValueError(
                f"{name}: an item of {item.shape[0]} patches exceeds the largest budget {self.budgets.max}; "
                "add a larger budget or split the item"
            )
        if item.dtype != config.dtype or item.device != self.device:
            raise ValueError(
                f"{name}: expected {config.dtype} on {self.device}, got {item.dtype} on {item.device}"
            )

    def encode(self, items: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each item's output ``[patches, hidden]``: its packs replayed (or eager), cut per item."""
        packs = self.pack(items)  # checks the items first
        outputs: list[torch.Tensor | None] = [None] * len(items)
        for pack in packs:
            patches, lens = self._packed(items, pack)
            out = self.manager.run(patches=patches, item_lens=lens)
            # The output aliases graph memory until the next run: one copy, then a view per item.
            pieces = torch.split(out.clone(), [items[i].shape[0] for i in pack.items])
            for i, piece in zip(pack.items, pieces, strict=True):
                outputs[i] = piece
        return [out for out in outputs if out is not None]

    def encode_eager(self, items: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``encode`` without the manager: the same packs run eagerly, unpadded."""
        packs = self.pack(items)  # checks the items first
        outputs: list[torch.Tensor | None] = [None] * len(items)
        for pack in packs:
            patches, lens = self._packed(items, pack)
            pieces = torch.split(self.eager_forward(patches, lens), [items[i].shape[0] for i in pack.items])
            for i, piece in zip(pack.items, pieces, strict=True):
                outputs[i] = piece
        return [out for out in outputs if out is not None]

    def encode_alone(self, item: torch.Tensor) -> torch.Tensor:
        """One item run alone, eagerly: ``[patches, hidden]``."""
        self._check_item("item", item)
        lens = torch.tensor([item.shape[0]], dtype=torch.int32, device=self.device)
        return self.eager_forward(item, lens)

    def eager_forward(self, patches: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """The model on one pack, eagerly, unpadded: a step of ``eager_manager``.

        The manager checks the step as it checks any (names, dtypes, devices,
        shapes) and hands the model the builder's metadata of the real pack,
        whose eager build checks the lengths on the host.

        Args:
            patches: the pack's patches, ``[T, patch_dim]``.
            lens: each item's patches, ``[items]`` int32 (each >= 1, summing
                to ``T``).

        Returns:
            The encoder's output, ``[T, hidden]``.

        Raises:
            ValueError: a bad argument, naming it.
        """
        self._check_item("patches", patches)
        given: object = lens
        if not isinstance(given, torch.Tensor) or given.dim() != 1 or given.device != self.device:
            raise ValueError(
                f"lens: expected a 1-D tensor of the items' lengths on {self.device}, got {given!r:.80}"
            )
        with torch.no_grad():
            return self.eager_manager.run(patches=patches, item_lens=lens)

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
    encoder_static_inputs(config)  # checks config
    given: object = lengths
    if not isinstance(given, (list, tuple, range)):
        raise ValueError(f"lengths: expected a sequence of patch counts, got {given!r:.80}")
    for i, n in enumerate(given):
        check_int(f"lengths[{i}]", n, minimum=1, maximum=MAX_FIELD)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator, got {generator!r:.80}")
    where = model_device(device)
    return [
        torch.randn(n, config.patch_dim, generator=generator).to(device=where, dtype=config.dtype)
        for n in lengths
    ]
