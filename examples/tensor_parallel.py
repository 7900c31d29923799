"""The reference decoder, tensor parallel: heads and MLP columns split across ranks.

Megatron-style sharding of ``ReferenceDecoder``'s weights over the ranks of a
process group: the fused QKV and gate/up projections are column parallel
(each rank computes its own heads and its own slice of the MLP), the output
and down projections are row parallel (each rank's partial product is summed
by an all-reduce). Each rank keeps the KV cache of its heads. The embedding,
norms and rotary table are replicated, so every rank ends a step with the
same hidden states.

Built from a full ``ReferenceDecoder`` (the same seed on every rank), so the
sharded model computes what the unsharded one does, and a test can compare
them. The all-reduces are ``torch.distributed.all_reduce`` calls in the
forward: a FULL capture records them in the graph, a PIECEWISE capture in
the segments between the eager attention breaks.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from cudagraph_dispatch.lowlevel import check_int

from .body import DecoderLayer, rms_norm, rotate
from .config import DecoderConfig
from .reference import ReferenceDecoder
from .reference_attention import AttentionMetadata, AttentionOp, build_attention_metadata


def check_shards(config: DecoderConfig, world_size: int) -> None:
    """``ValueError`` unless the heads and the MLP's width divide over ``world_size`` ranks (an int >= 1)."""
    given: object = config
    if not isinstance(given, DecoderConfig):
        raise ValueError(f"config: expected a DecoderConfig, got {config!r:.80}")
    check_int("world_size", world_size, minimum=1)
    for name, value in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
        if value % world_size:
            raise ValueError(f"config.{name}={value} does not divide over {world_size} ranks")


def _shard(weight: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of ``weight`` along ``dim``, as a tensor of its own."""
    size = weight.shape[dim] // world_size
    return weight.narrow(dim, rank * size, size).contiguous()


class TensorParallelLayer(nn.Module):
    """One ``DecoderLayer`` sharded: this rank's heads and MLP columns, two all-reduces per step."""

    kv_cache: torch.Tensor

    def __init__(
        self,
        full: DecoderLayer,
        kv_cache: torch.Tensor,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
    ) -> None:
        super().__init__()
        config = full.config
        d, heads, head_dim = config.hidden_size, config.num_heads, config.head_dim
        self.group: Final = group
        self.num_heads: Final = heads // world_size  # this rank's heads
        self.head_dim: Final = head_dim
        local = self.num_heads * head_dim
        self.input_norm = nn.Parameter(full.input_norm.detach().clone())
        # [d, 3, heads, head_dim] -> this rank's heads of q, k and v: [d, 3 * local]
        qkv = full.qkv_weight.detach().view(d, 3, heads, head_dim)
        self.qkv_weight = nn.Parameter(_shard(qkv, 2, rank, world_size).view(d, 3 * local))
        self.o_weight = nn.Parameter(_shard(full.o_weight.detach(), 0, rank, world_size))  # [local, d]
        self.post_norm = nn.Parameter(full.post_norm.detach().clone())
        gate, up = full.gate_up_weight.detach().chunk(2, dim=1)  # [d, f] each
        self.gate_up_weight = nn.Parameter(
            torch.cat((_shard(gate, 1, rank, world_size), _shard(up, 1, rank, world_size)), dim=1)
        )  # [d, 2 * f / world_size]
        self.down_weight = nn.Parameter(_shard(full.down_weight.detach(), 0, rank, world_size))  # [f / ws, d]
        # [rows, 2, max_seq_len, heads, head_dim] -> this rank's heads
        self.register_buffer("kv_cache", _shard(kv_cache, 3, rank, world_size), persistent=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attention: AttentionOp) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``, the same on every rank after the all-reduces."""
        num_tokens = x.shape[0]
        h = rms_norm(x, self.input_norm)
        qkv = torch.mm(h, self.qkv_weight).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k = rotate(qkv[:, :2], meta.cos, meta.sin).unbind(1)  # [T, local heads, head_dim] each
        v = qkv[:, 2]
        attn = torch.empty((num_tokens, self.num_heads, self.head_dim), device=x.device, dtype=x.dtype)
        attention(q, k, v, self.kv_cache, meta.cache_rows, meta.key_index, meta.value_index, meta.mask, attn)
        o = torch.mm(attn.view(num_tokens, -1), self.o_weight)  # [T, d]: this rank's partial sum
        dist.all_reduce(o, group=self.group)
        x = x + o
        h = rms_norm(x, self.post_norm)
        gate, up = torch.mm(h, self.gate_up_weight).chunk(2, dim=-1)  # [T, f / world_size] each
        down = torch.mm(F.silu(gate) * up, self.down_weight)  # [T, d]: partial
        dist.all_reduce(down, group=self.group)
        return x + down


class TensorParallelDecoder(nn.Module):
    """``ReferenceDecoder`` split over the ranks of ``group`` (default: the world); same ``forward``.

    ``full`` is the unsharded model, built alike on every rank (same seed,
    same config) on this rank's device; its heads and intermediate size
    must divide by the group's size. The attention op is ``full``'s.
    """

    key_positions: torch.Tensor
    rotary: torch.Tensor

    def __init__(self, full: ReferenceDecoder, group: dist.ProcessGroup | None = None) -> None:
        given: object = full
        if not isinstance(given, ReferenceDecoder):
            raise ValueError(f"full: expected a ReferenceDecoder, got {full!r:.80}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group: expected a torch.distributed.ProcessGroup or None, got {group!r:.80}")
        super().__init__()
        config = full.config
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        try:
            check_shards(config, world_size)
        except ValueError as error:
            raise ValueError(f"full: {error}") from None
        self.config: Final = config
        self.num_heads: Final = config.num_heads // world_size
        self.attention: AttentionOp = full.attention
        body = full.body
        self.embed = nn.Parameter(body.embed.detach().clone())
        layers = [
            TensorParallelLayer(layer, cache, group, rank, world_size)
            for layer, cache in zip(body.layers, full.caches, strict=True)
        ]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers: Final = tuple(layers)
        self.final_norm = nn.Parameter(body.final_norm.detach().clone())
        self.register_buffer("rotary", body.rotary.clone(), persistent=False)  # [max_seq_len, 2, head_dim]
        self.register_buffer("key_positions", full.key_positions.clone(), persistent=False)
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor
    ) -> torch.Tensor:
        """One step: ``[T]`` int64 inputs -> final hidden states ``[T, hidden]`` (the same on every rank)."""
        meta = build_attention_metadata(
            positions, cache_rows, self.key_positions, self.rotary, self.num_heads
        )
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        for layer in self.decoder_layers:
            x = layer.forward(x, meta, self.attention)
        return rms_norm(x, self.final_norm)  # [T, hidden]
