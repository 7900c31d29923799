"""A small ViT-like encoder over packed items: patch embedding, transformer blocks, non-causal attention.

Items (images as patches, ``[num_patches, patch_dim]`` each) are packed into
one forward: their patches concatenated, ``item_lens`` each item's count.
The attention reads where each item starts from the seam
(``attention_metadata(builder)``, a ``PackedMetadata`` whose offsets the
forward writes from ``item_lens`` first: a graph captures that cumsum, so a
replay launches nothing for them on the host): every token attends
to the tokens of its own item only, so a packed forward computes each item
as it would alone. Positions restart at 0 in each item. Two kernels:

- ``"varlen"``: FlashAttention's varlen kernel (``examples.flash_varlen``; CUDA, bf16/fp16):
  offsets a tensor, ``max_seqlen`` a host bound of the shape.
- ``"masked"``: SDPA with a block-diagonal mask built from the offsets on
  the device (any device and dtype; quadratic memory in the budget).

Every op is capturable (no host read of the batch): a FULL graph of a
budget replays any pack of that budget.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from cudagraph_dispatch.lowlevel import check_int
from cudagraph_manager.attention import PackedMetadata, PackedMetadataBuilder, attention_metadata

from ..body import model_device
from ..config import MAX_FIELD
from ..flash_varlen import FLASH_DTYPES, flash_varlen

Kernel = Literal["varlen", "masked"]


@dataclasses.dataclass(frozen=True, slots=True)
class EncoderConfig:
    """The encoder's sizes: ``patch_dim`` inputs per patch, ``hidden`` wide, ``layers`` blocks.

    ``max_positions``: the position table's rows (patches per item, at
    most; padding rows past it reuse the last). ``small()`` is a CPU-sized one.
    Checked when built (``ValueError`` naming the field): sizes from 1 to
    ``MAX_FIELD``, ``heads`` dividing ``hidden``, a floating ``dtype``.
    """

    patch_dim: int = 588  # 3 x 14 x 14 pixels
    hidden: int = 768
    heads: int = 12
    layers: int = 12
    mlp_ratio: int = 4
    max_positions: int = 1024
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("patch_dim", "hidden", "heads", "layers", "mlp_ratio", "max_positions"):
            check_int(name, getattr(self, name), minimum=1, maximum=MAX_FIELD)
        if self.hidden % self.heads:
            raise ValueError(f"heads: must divide hidden={self.hidden}, got {self.heads}")
        dtype: object = self.dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")

    @classmethod
    def small(cls) -> EncoderConfig:
        """Two blocks of 64 wide, float32: the CPU tests' encoder."""
        return cls(patch_dim=48, hidden=64, heads=4, layers=2, max_positions=1024, dtype=torch.float32)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class _Packing:
    """What every block of one forward reads: the metadata, and each token's item (for the mask)."""

    __slots__ = ("item", "meta")

    def __init__(self, meta: PackedMetadata, num_tokens: int, device: torch.device) -> None:
        tokens = torch.arange(num_tokens, dtype=torch.int32, device=device)  # [T]
        self.meta: Final = meta
        # [T]: the sequence of each token (padding is one more; right=True steps over empty ones).
        self.item: Final = torch.searchsorted(meta.cu_seqlens, tokens, right=True) - 1

    def positions(self, limit: int) -> torch.Tensor:
        """[T] int64: each token's index within its item, at most ``limit - 1``."""
        tokens = torch.arange(self.item.shape[0], device=self.item.device)
        return (tokens - self.meta.cu_seqlens[self.item]).clamp_(max=limit - 1)


class _Block(nn.Module):
    """A pre-norm transformer block: non-causal attention within each item, then an MLP."""

    def __init__(self, config: EncoderConfig, kernel: Kernel, device: torch.device | None) -> None:
        super().__init__()
        width = config.hidden
        dtype = config.dtype
        self.heads: Final = config.heads
        self.kernel: Final = kernel
        self.norm1 = nn.LayerNorm(width, device=device, dtype=dtype)
        self.qkv = nn.Linear(width, 3 * width, device=device, dtype=dtype)
        self.proj = nn.Linear(width, width, device=device, dtype=dtype)
        self.norm2 = nn.LayerNorm(width, device=device, dtype=dtype)
        self.up = nn.Linear(width, config.mlp_ratio * width, device=device, dtype=dtype)
        self.down = nn.Linear(config.mlp_ratio * width, width, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, packing: _Packing) -> torch.Tensor:  # x: [T, hidden]
        num_tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(num_tokens, 3, self.heads, -1).unbind(1)  # [T, H, D] each
        attended = _attend(q, k, v, packing, self.kernel)  # [T, H, D]
        x = x + self.proj(attended.reshape(num_tokens, width))
        hidden: torch.Tensor = self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))
        return x + hidden


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: _Packing, kernel: Kernel
) -> torch.Tensor:
    """Each token attends to its own item's tokens, non-causally: ``[T, H, D]``."""
    meta = packing.meta
    if kernel == "varlen":
        bound = meta.max_seqlen
        return flash_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, bound, bound, causal=False)
    same_item = packing.item[:, None] == packing.item[None, :]  # [T, T] block-diagonal
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=same_item)
    return out.squeeze(0).transpose(0, 1)


def choose_kernel(kernel: Kernel | None, device: torch.device, dtype: torch.dtype) -> Kernel:
    """``kernel``, or ``"varlen"`` where it runs (CUDA, bf16/fp16), else ``"masked"``."""
    if kernel is None:
        return "varlen" if device.type == "cuda" and dtype in FLASH_DTYPES else "masked"
    if kernel not in ("varlen", "masked"):
        raise ValueError(f"kernel: expected 'varlen', 'masked' or None, got {kernel!r}")
    if kernel == "varlen" and (device.type != "cuda" or dtype not in FLASH_DTYPES):
        raise ValueError(f"kernel: 'varlen' runs on CUDA in bf16/fp16, not {device.type} {dtype}")
    return kernel


class ViTEncoder(nn.Module):
    """A ViT-like encoder over packed items: ``forward(patches, item_lens) -> [T, hidden]``.

    Arguments:
        config: the sizes and dtype.
        builder: the seam's builder whose metadata the attention reads (its
            offsets on the weights' device).
        kernel: ``"varlen"`` or ``"masked"`` (``None``: varlen where it runs).
        device: where the weights live (default: the builder's device).

    A bad argument raises ``ValueError`` naming it, before any weight is made.
    """

    def __init__(
        self,
        config: EncoderConfig,
        builder: PackedMetadataBuilder,
        *,
        kernel: Kernel | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        given: object = config
        if not isinstance(given, EncoderConfig):
            raise ValueError(f"config: expected an EncoderConfig, got {config!r:.80}")
        given_builder: object = builder
        if not isinstance(given_builder, PackedMetadataBuilder):
            raise ValueError(f"builder: expected a PackedMetadataBuilder, got {builder!r:.80}")
        where = model_device(device) or builder.device
        if where != builder.device:
            raise ValueError(
                f"device: {device!r}, but the builder's offsets are on {builder.device}: the attention "
                "reads them with the weights' tensors; build both on one device"
            )
        super().__init__()
        dtype = config.dtype
        self.config: Final = config
        self.builder: Final = builder
        self.kernel: Final = choose_kernel(kernel, where, dtype)
        self.embed = nn.Linear(config.patch_dim, config.hidden, device=where, dtype=dtype)
        self.positions = nn.Embedding(config.max_positions, config.hidden, device=where, dtype=dtype)
        self.blocks = nn.ModuleList(_Block(config, self.kernel, where) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden, device=where, dtype=dtype)

    def forward(self, patches: torch.Tensor, item_lens: torch.Tensor) -> torch.Tensor:
        """``patches [T, patch_dim]`` of packed items -> ``[T, hidden]``; ``item_lens [items]``, 0 to pad."""
        meta = attention_metadata(self.builder)
        meta.write_offsets(item_lens)  # the offsets every block reads: in a graph, captured with it
        packing = _Packing(meta, patches.shape[0], patches.device)
        x = self.embed(patches) + self.positions(packing.positions(self.config.max_positions))
        for block in self.blocks:
            x = block(x, packing)
        out: torch.Tensor = self.norm(x)
        return out
