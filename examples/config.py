"""The reference decoder's shapes and limits (``DecoderConfig``), shared by every example model."""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from cudagraph_dispatch.lowlevel import check_int

#: The largest value of a size or count of an example model's config: far above any model's
#: (a vocabulary of 128k, 128 layers), low enough that a typo (2**40) is named here, not met as an
#: allocation that fails inside torch.
MAX_FIELD: Final = 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Shapes and limits of the reference decoder.

    The defaults are the benchmark model: 8 layers, d=1024, 16 heads of 64,
    bf16, a KV cache for 256 requests of up to 256 tokens (plus one scratch
    row for padding). ``small()`` is a float32 model for CPU tests. Each
    field is checked (``ValueError`` naming it): sizes from 1 to ``MAX_FIELD``.
    """

    num_layers: int = 8
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 2816  # ~2.75 x hidden, as in Llama
    vocab_size: int = 4096
    max_num_seqs: int = 256
    max_seq_len: int = 256
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "intermediate_size",
            "vocab_size",
            "max_num_seqs",
            "max_seq_len",
        ):
            check_int(name, getattr(self, name), minimum=1, maximum=MAX_FIELD)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads: must divide hidden_size={self.hidden_size}, got {self.num_heads!r}")
        if self.head_dim % 2:
            raise ValueError(
                f"num_heads: {self.num_heads} heads of hidden_size={self.hidden_size} give head_dim="
                f"{self.head_dim}, which must be even for rotary embeddings"
            )
        dtype: object = self.dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def scratch_row(self) -> int:
        """The KV cache row that padding rows write to and read from."""
        return self.max_num_seqs

    @classmethod
    def small(cls) -> DecoderConfig:
        """A float32 model small enough for CPU tests: 2 layers, d=128, 4 heads."""
        return cls(
            num_layers=2,
            hidden_size=128,
            num_heads=4,
            intermediate_size=352,
            vocab_size=512,
            max_num_seqs=16,
            max_seq_len=64,
            dtype=torch.float32,
        )

    @classmethod
    def llama_8b_like(cls) -> DecoderConfig:
        """The shape of an 8B Llama (32 layers, d=4096, 32 heads, intermediate 14336, vocab 32000), bf16.

        Random weights (about 15 GiB) and a KV cache for 256 requests of 64
        tokens (about 8.6 GiB): it fits an 80 GB GPU with room for its graphs.
        For the memory and sleep benchmarks.
        """
        return cls(
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            intermediate_size=14336,
            vocab_size=32000,
            max_num_seqs=256,
            max_seq_len=64,
        )
