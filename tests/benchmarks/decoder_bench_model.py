"""The benchmark decoder of the capture-engine benchmarks: Llama-ish, 8 layers, d=1024, bf16.

RMSNorm, fused QKV, rotary embeddings, attention over a static KV cache, a
SiLU-gated MLP: a few hundred small kernels per decode step, which is what
makes a step launch-bound and CUDA graphs worth having.

A decode step has one token per request; request ``b`` of a batch of ``B``
owns KV cache row ``b``. The attention metadata (mask, cache index, rotary
cos/sin) is built once per step at the start of ``forward``, outside the
layers, with capturable ops only; the cache index is prepared before the
step (``prepare``), outside any graph.

The attention op is injected (``attention``): the plain function for eager
and monolithic graphs, an ``eager_break_during_capture`` variant for our
breakable engine, a ``no_graph`` variant for ``breakable_cuda_graphs``.
``with_attention`` returns a view of the same model (same weights, same
cache) with another attention op. Writing K/V is idempotent: the same step
run twice, by any variant, reads and writes the same values.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Final, NamedTuple, Protocol

import torch
from torch import nn
from torch.nn.functional import linear, scaled_dot_product_attention, silu

_ROPE_THETA: Final = 10000.0
_RMS_EPS: Final = 1e-5


@dataclasses.dataclass(frozen=True, slots=True)
class BenchDecoderConfig:
    """Shapes of the benchmark decoder; the KV cache holds ``max_batch`` rows of ``max_seq_len``."""

    num_layers: int = 8
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 2816
    vocab_size: int = 4096
    max_batch: int = 256
    max_seq_len: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class AttentionFn(Protocol):
    """``out[b] = attention of q[b] over cache row b``, after writing this step's K/V.

    Shapes: ``q``, ``k``, ``v``, ``out``: ``[B, heads, head_dim]``; caches:
    ``[max_batch, max_seq_len, heads, head_dim]``; ``cache_index``: ``[B]``;
    ``mask``: ``[B, 1, 1, max_seq_len]`` bool. Writes ``out``, returns nothing.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_index: torch.Tensor,
        mask: torch.Tensor,
        out: torch.Tensor,
        /,
    ) -> None: ...


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_index: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write K/V at ``cache_index``, attend over the first ``B`` cache rows, write ``out``."""
    batch = q.shape[0]
    num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, cache_index, k)
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, cache_index, v)
    keys = k_cache[:batch].transpose(1, 2)  # [B, heads, L, head_dim]
    values = v_cache[:batch].transpose(1, 2)  # [B, heads, L, head_dim]
    result = scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask)  # [B, heads, 1, d]
    out.copy_(result.squeeze(2))


class StepMetadata(NamedTuple):
    """Attention metadata of one step, shared by every layer."""

    cache_index: torch.Tensor  # [B] int64: b * max_seq_len + positions[b]
    mask: torch.Tensor  # [B, 1, 1, max_seq_len] bool: key j visible iff j <= positions[b]
    cos: torch.Tensor  # [B, 1, head_dim // 2]
    sin: torch.Tensor  # [B, 1, head_dim // 2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm in fp32, cast back: ``x [..., d]``, ``weight [d]``."""
    x32 = x.float()
    scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _RMS_EPS)
    return (x32 * scale).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [B, heads, head_dim]`` (halves rotated)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _weight(rows: int, cols: int, config: BenchDecoderConfig, device: torch.device) -> nn.Parameter:
    data = torch.randn(rows, cols, device=device, dtype=config.dtype) / math.sqrt(cols)
    return nn.Parameter(data, requires_grad=False)


def _ones(size: int, config: BenchDecoderConfig, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.ones(size, device=device, dtype=config.dtype), requires_grad=False)


class BenchDecoderLayer(nn.Module):
    """Pre-norm block: RMSNorm, fused QKV, RoPE, attention (injected), SiLU-gated MLP."""

    def __init__(self, config: BenchDecoderConfig, device: torch.device) -> None:
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.config = config
        self.attn_norm = _ones(d, config, device)
        self.qkv = _weight(3 * d, d, config, device)
        self.o_proj = _weight(d, d, config, device)
        self.mlp_norm = _ones(d, config, device)
        self.gate_up = _weight(2 * inter, d, config, device)
        self.down = _weight(d, inter, config, device)

    def forward(
        self,
        h: torch.Tensor,
        meta: StepMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        # h: [B, d] -> [B, d]
        batch, heads, head_dim = h.shape[0], self.config.num_heads, self.config.head_dim
        qkv = linear(rms_norm(h, self.attn_norm), self.qkv).view(batch, 3, heads, head_dim)
        q, k, v = qkv.unbind(1)  # [B, heads, head_dim] each
        q, k = _rotate(q, meta.cos, meta.sin), _rotate(k, meta.cos, meta.sin)
        attn = torch.empty_like(q)  # the attention op writes here
        attention(q, k, v, k_cache, v_cache, meta.cache_index, meta.mask, attn)
        h = h + linear(attn.view(batch, -1), self.o_proj)
        gate, up = linear(rms_norm(h, self.mlp_norm), self.gate_up).chunk(2, dim=-1)
        return h + linear(silu(gate) * up, self.down)

    def run(
        self,
        h: torch.Tensor,
        meta: StepMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        """Typed call of the module."""
        out = self(h, meta, k_cache, v_cache, attention)
        assert isinstance(out, torch.Tensor)
        return out


class BenchDecoder(nn.Module):
    """The benchmark decoder: ``forward(input_ids [B], positions [B]) -> hidden [B, d]``."""

    def __init__(
        self,
        config: BenchDecoderConfig,
        device: torch.device,
        attention: AttentionFn = attention_reference,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention: AttentionFn = attention
        self.embed = nn.Parameter(
            torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=config.dtype),
            requires_grad=False,
        )
        self.layers = nn.ModuleList([BenchDecoderLayer(config, device) for _ in range(config.num_layers)])
        self.typed_layers: list[BenchDecoderLayer] = [
            layer for layer in self.layers if isinstance(layer, BenchDecoderLayer)
        ]
        self.final_norm = _ones(config.hidden_size, config, device)
        cache_shape = (
            config.num_layers,
            config.max_batch,
            config.max_seq_len,
            config.num_heads,
            config.head_dim,
        )
        # Random initial cache: attention over it is not trivially zero.
        self.k_cache: torch.Tensor = torch.randn(cache_shape, device=device, dtype=config.dtype) * 0.5
        self.v_cache: torch.Tensor = torch.randn(cache_shape, device=device, dtype=config.dtype) * 0.5
        self.key_positions = torch.arange(config.max_seq_len, device=device)  # [L]
        self.row_starts = torch.arange(config.max_batch, device=device) * config.max_seq_len  # [max_batch]
        # Where each token's K/V goes: prepared before the step, outside any graph
        # (``prepare``), as an engine prepares attention metadata. A breakable
        # capture runs the eager attention on it: breakable_cuda_graphs runs it
        # before the captured segments ever ran, so an index computed inside
        # them would be garbage there (an out-of-range write).
        self.step_index = self.row_starts.clone()  # [max_batch]
        half = config.head_dim // 2
        self.inv_freq = 1.0 / (
            _ROPE_THETA ** (torch.arange(half, device=device, dtype=torch.float32) / half)
        )  # [head_dim // 2]

    def with_attention(self, attention: AttentionFn) -> BenchDecoder:
        """This model (same weights, same KV cache) with another attention op."""
        clone = copy.copy(self)
        clone.attention = attention
        return clone

    def prepare(self, positions: torch.Tensor) -> None:
        """Fill the step's cache index from ``positions [B]`` (before the step, eagerly)."""
        batch = positions.shape[0]
        torch.add(self.row_starts[:batch], positions, out=self.step_index[:batch])

    def metadata(self, positions: torch.Tensor) -> StepMetadata:
        """The step's attention metadata from ``positions [B]`` (capturable ops only)."""
        batch = positions.shape[0]
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]  # [B, head_dim // 2]
        return StepMetadata(
            cache_index=self.step_index[:batch],
            mask=(self.key_positions[None, :] <= positions[:, None])[:, None, None, :],
            cos=freqs.cos().to(self.config.dtype)[:, None, :],
            sin=freqs.sin().to(self.config.dtype)[:, None, :],
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = self.metadata(positions)  # once per step, outside the layers
        h = self.embed[input_ids]  # [B, d]
        for i, layer in enumerate(self.typed_layers):
            h = layer.run(h, meta, self.k_cache[i], self.v_cache[i], self.attention)
        return rms_norm(h, self.final_norm)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Typed call of the module."""
        out = self(input_ids, positions)
        assert isinstance(out, torch.Tensor)
        return out
