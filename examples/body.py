"""The decoder's body: what the row-cache and the paged decoders share, everything but the attention.

Weights (embedding, each layer's RMSNorms, fused QKV, output projection and
SiLU-gated MLP, the final norm) and the rotary table. ``DecoderBody.run``
runs one step through them and calls back for each layer's attention, so a
decoder supplies only its KV caches and the attention over them
(``ReferenceDecoder``: a cache row per request; ``PagedDecoder``: pages).
``LayerCaches`` holds a decoder's per-layer caches as buffers.

Shapes: ``T`` tokens of a step, ``hidden = heads * head_dim``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Final, TypeAlias

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import Tensor, nn

from cudagraph_capture.lowlevel import resolve_device

from .config import DecoderConfig

ROPE_THETA: Final = 10000.0
RMS_EPS: Final = 1e-5
# Weights are drawn with std fan_in ** -0.5 so every branch contributes to the
# residual stream as much as the embedding does: a wrong attention or MLP
# result then changes the output visibly, and the tests can see it.
_EMBED_STD: Final = 1.0

#: One layer's attention, as ``DecoderBody.run`` calls it: ``attend(layer_index, q, k, v, out)``
#: with ``q, k, v, out [T, heads, head_dim]``; it writes the step's K/V into the layer's cache and
#: the attention into ``out``, and returns nothing.
LayerAttention: TypeAlias = Callable[[int, Tensor, Tensor, Tensor, Tensor], None]


def rotary_table(config: DecoderConfig, device: torch.device | None = None) -> Tensor:
    """``[max_seq_len, 2, head_dim]`` in the model's dtype: cos and signed sin of every position.

    Row ``p`` holds ``cos(p * f)`` and ``sin(p * f)`` for the frequencies
    ``f = theta ** (-i / half)`` of both halves of a head (the sin negated on
    the first half), computed in float64 once, so a step only gathers its rows.
    """
    half = config.head_dim // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)  # [half]
    angles = torch.arange(config.max_seq_len, dtype=torch.float64)[:, None] * inv_freq  # [L, half]
    cos, sin = angles.cos(), angles.sin()
    table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)  # [L, 2, head_dim]
    return table.to(device=device, dtype=config.dtype)


def rotary_cos_sin(positions: Tensor, rotary: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """cos and sin ``[T, 2, heads, head_dim]`` of the tokens at ``positions [T]`` (``rotary_table``'s rows).

    Expanded to the full shape of q and k once per step: every layer's
    rotation then runs on contiguous operands (vectorized kernels, not
    broadcasting ones).
    """
    cos_sin = rotary[positions]  # [T, 2, head_dim]
    shape = (positions.shape[0], 2, num_heads, rotary.shape[-1])
    return (
        cos_sin[:, 0, None, None, :].expand(shape).contiguous(),
        cos_sin[:, 1, None, None, :].expand(shape).contiguous(),
    )


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x [T, 2, heads, head_dim]`` (halves rotated, Llama/NeoX style).

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``:
    rolling by half a head gives ``(x2, x1)`` and ``sin`` carries the sign,
    so the rotation is three kernels (roll, mul, addcmul) instead of seven.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm of ``x [T, d]`` with ``weight [d]``."""
    return F.rms_norm(x, (weight.shape[0],), weight, RMS_EPS)


def _normal(shape: tuple[int, int], fan_in: int, device: torch.device | None, dtype: torch.dtype) -> Tensor:
    """Weights with std ``fan_in ** -0.5``: each projection keeps its input's scale."""
    return torch.randn(shape, device=device, dtype=dtype) * (1.0 / math.sqrt(fan_in))


class DecoderLayer(nn.Module):
    """One pre-norm block's weights: RMSNorm, fused QKV, RoPE; then the output projection, the MLP.

    ``project`` gives the attention's inputs, ``finish`` the rest of the
    block after it; the attention and its cache belong to the decoder.
    """

    def __init__(self, config: DecoderConfig, *, device: torch.device | None) -> None:
        super().__init__()
        self.config: Final = config
        d, f, dtype = config.hidden_size, config.intermediate_size, config.dtype
        self.input_norm = nn.Parameter(torch.ones(d, device=device, dtype=dtype))
        # Projections stored [in, out] and applied with mm (x @ W): at one token
        # cuBLAS picks a faster kernel for the d x d output projection in this layout.
        self.qkv_weight = nn.Parameter(_normal((d, 3 * d), d, device, dtype))
        self.o_weight = nn.Parameter(_normal((d, d), d, device, dtype))
        self.post_norm = nn.Parameter(torch.ones(d, device=device, dtype=dtype))
        self.gate_up_weight = nn.Parameter(_normal((d, 2 * f), d, device, dtype))
        self.down_weight = nn.Parameter(_normal((f, d), f, device, dtype))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The attention's inputs: ``x [T, hidden]`` -> rotated q, k and v, ``[T, heads, head_dim]`` each."""
        config = self.config
        h = rms_norm(x, self.input_norm)
        qkv = torch.mm(h, self.qkv_weight).view(x.shape[0], 3, config.num_heads, config.head_dim)
        # q and k rotated together: one set of kernels for both.
        q, k = rotate(qkv[:, :2], cos, sin).unbind(1)  # [T, heads, head_dim] each
        return q, k, qkv[:, 2]

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """The rest of the block: ``x [T, hidden]`` and the attention ``[T, heads, head_dim]``."""
        x = x + torch.mm(attn.view(x.shape), self.o_weight)
        h = rms_norm(x, self.post_norm)
        gate, up = torch.mm(h, self.gate_up_weight).chunk(2, dim=-1)  # [T, intermediate] each
        return x + torch.mm(F.silu(gate) * up, self.down_weight)


class DecoderBody(nn.Module):
    """A Llama-like decoder's weights and rotary table; ``run`` is one step with the attention called back.

    Inference only: parameters do not require grad. ``layers`` are the
    blocks (``DecoderLayer``), ``embed [vocab, hidden]`` and ``final_norm
    [hidden]`` the ends, ``rotary`` the ``rotary_table``.
    """

    rotary: Tensor

    def __init__(self, config: DecoderConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        dev = model_device(device)
        self.config: Final = config
        self.embed = nn.Parameter(
            torch.randn((config.vocab_size, config.hidden_size), device=dev, dtype=config.dtype) * _EMBED_STD
        )
        layers = [DecoderLayer(config, device=dev) for _ in range(config.num_layers)]
        self.blocks = nn.ModuleList(layers)
        #: The same modules as ``blocks``, typed.
        self.layers: Final = tuple(layers)
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size, device=dev, dtype=config.dtype))
        self.register_buffer(
            "rotary", rotary_table(config, dev), persistent=False
        )  # [max_seq_len, 2, head_dim]
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The rotary cos and sin of a step's ``positions [T]`` (``rotary_cos_sin``)."""
        return rotary_cos_sin(positions, self.rotary, self.config.num_heads)

    def run(self, input_ids: Tensor, cos: Tensor, sin: Tensor, attend: LayerAttention) -> Tensor:
        """One step: ``input_ids [T]`` -> final hidden states ``[T, hidden]``, ``attend`` at every layer."""
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        for index, layer in enumerate(self.layers):
            q, k, v = layer.project(x, cos, sin)
            attn = torch.empty_like(q)
            attend(index, q, k, v, attn)
            x = layer.finish(x, attn)
        return self.final(x)

    def final(self, x: Tensor) -> Tensor:
        """The final norm of the hidden states ``[T, hidden]``."""
        return rms_norm(x, self.final_norm)


class LayerCaches(nn.Module):
    """A decoder's KV cache of each layer, as buffers: graphs read them in place, ``to()`` moves them.

    ``caches[i]`` is layer ``i``'s; ``replace`` swaps them all (the old ones
    are dropped first, so the new ones may take their memory).
    """

    def __init__(self, caches: Sequence[Tensor]) -> None:
        super().__init__()
        self.names: Final = tuple(f"layer{index}" for index in range(len(caches)))
        for name, cache in zip(self.names, caches, strict=True):
            self.register_buffer(name, cache, persistent=False)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> Tensor:
        cache = self._buffers[self.names[index]]
        assert cache is not None  # registered with a tensor, replaced only by tensors
        return cache

    def __iter__(self) -> Iterator[Tensor]:
        return (self[index] for index in range(len(self.names)))

    def replace(self, make: Callable[[], Sequence[Tensor]]) -> None:
        """Drop every cache, then take ``make()``'s (one per layer)."""
        device, dtype = self[0].device, self[0].dtype
        for name in self.names:
            setattr(self, name, torch.empty(0, device=device, dtype=dtype))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for name, cache in zip(self.names, make(), strict=True):
            setattr(self, name, cache)


def model_device(device: torch.device | str | int | None) -> torch.device | None:
    """Where an example model's weights go: ``device`` resolved (``None``: torch's default device).

    A CUDA device or the CPU, as a manager's (``resolve_device``: a CUDA
    device that does not exist here, ``mps`` or ``cpu:1`` raise
    ``ValueError`` naming ``device``), or ``meta`` (a shape's probe, no data).
    """
    if device is None:
        return None
    given: object = device
    if given == "meta" or (isinstance(given, torch.device) and given.type == "meta"):
        return torch.device("meta")
    return resolve_device(device)
