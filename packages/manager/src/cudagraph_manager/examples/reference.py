"""A reference decoder (Llama-like) for the demo, the tests and the benchmarks.

It has what makes CUDA graphs both worth having and hard to get right in a
real engine: hundreds of small kernels per step, a static KV cache updated in
place, per-step attention metadata, and an attention op that can run inside a
FULL graph or eagerly between PIECEWISE segments.

- Inputs of one step (``num_tokens`` rows, any mix of requests):
  ``input_ids [T]``, ``positions [T]`` (position of each token in its
  sequence) and ``slot_ids [T]`` (the KV cache row of the token's request).
  Tokens of one request in one step sit at consecutive positions (a prefill
  chunk); a uniform decode step has one token per request.
- Attention metadata is built once per step, at the start of ``forward``,
  with capturable torch ops only (no ``.item()``, no host sync, no
  data-dependent shapes): a mask ``[T, max_seq_len]`` (key ``j`` is visible to
  token ``t`` iff ``j <= positions[t]``), the flat cache indices of each
  token's key and value, and the rotary cos/sin. ``metadata`` builds it on
  its own and ``forward_with_metadata`` runs the rest of the step, for callers
  that prepare it outside the graph, as engines prepare theirs.
- ``cached_attention`` writes the step's K/V into the cache at
  ``(slot, position)`` and attends over the request's cache row, writing into
  a caller-provided buffer. The layers call it through an injectable op
  (``AttentionOp``), by default ``breakable_cached_attention``, an
  ``eager_break_during_capture`` op: a breakable (PIECEWISE) capture splits
  the forward there, one break per layer; a FULL capture records it inline.
- Padding rows use a scratch cache row (index ``max_num_seqs``), so padding
  never writes into a real request's cache. Writing K/V is idempotent: the
  same step run twice (a graph replay, then eagerly) gives the same outputs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Final, NamedTuple, TypeAlias

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import Tensor, nn

from cudagraph_capture import eager_break_during_capture
from cudagraph_manager import StaticInput

# Step inputs, in the order of ``ReferenceDecoder.forward``.
INPUT_NAMES: Final[tuple[str, ...]] = ("input_ids", "positions", "slot_ids")

_ROPE_THETA: Final = 10000.0
_RMS_EPS: Final = 1e-5
# Weights are drawn with std fan_in ** -0.5 so every branch contributes to the
# residual stream as much as the embedding does: a wrong attention or MLP
# result then changes the output visibly, and the tests can see it.
_EMBED_STD: Final = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Shapes and limits of the reference decoder.

    The defaults are the benchmark model: 8 layers, d=1024, 16 heads of 64,
    bf16, a KV cache for 256 requests of up to 256 tokens (plus one scratch
    row for padding). ``small()`` is a float32 model for CPU tests.
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
            value: object = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
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
    def scratch_slot(self) -> int:
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


class AttentionMetadata(NamedTuple):
    """Per-step attention metadata, built once per step (``ReferenceDecoder.metadata``).

    A NamedTuple rather than a dataclass so that tracers (torch.compile) see
    through it without a graph break.
    """

    slot_ids: torch.Tensor  # [T] int64: the cache row of each token
    key_index: torch.Tensor  # [T] int64: the token's key row in the flat cache (see ``cached_attention``)
    value_index: torch.Tensor  # [T] int64: its value row, ``key_index + max_seq_len`` (once per step)
    mask: torch.Tensor  # [T, 1, 1, max_seq_len] additive: 0 where key j <= position, else dtype's min
    cos: torch.Tensor  # [T, 2, heads, head_dim]: cos of each rotary angle, for q and k
    sin: torch.Tensor  # [T, 2, heads, head_dim]: sin, negated on the first half (see ``_rotate``)


def rotary_table(config: DecoderConfig, device: torch.device | None = None) -> torch.Tensor:
    """``[max_seq_len, 2, head_dim]`` in the model's dtype: cos and signed sin of every position.

    Row ``p`` holds ``cos(p * f)`` and ``sin(p * f)`` for the frequencies
    ``f = theta ** (-i / half)`` of both halves of a head (the sin negated on
    the first half), computed in float64 once, so a step only gathers its rows.
    """
    half = config.head_dim // 2
    inv_freq = _ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)  # [half]
    angles = torch.arange(config.max_seq_len, dtype=torch.float64)[:, None] * inv_freq  # [L, half]
    cos, sin = angles.cos(), angles.sin()
    table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)  # [L, 2, head_dim]
    return table.to(device=device, dtype=config.dtype)


def build_attention_metadata(
    positions: torch.Tensor,
    slot_ids: torch.Tensor,
    key_positions: torch.Tensor,
    rotary: torch.Tensor,
    num_heads: int,
) -> AttentionMetadata:
    """The metadata of one step, with capturable ops only (no host sync).

    ``positions`` and ``slot_ids`` are ``[T]``; ``key_positions`` is
    ``arange(max_seq_len)``; ``rotary`` is ``rotary_table``'s
    ``[max_seq_len, 2, head_dim]``; cos and sin come from ``rotary_cos_sin``.
    """
    max_seq_len = key_positions.shape[0]
    dtype = rotary.dtype
    hidden = key_positions[None, :] > positions[:, None]  # [T, L]
    # Additive, in the model's dtype: SDPA adds it as is, where a boolean mask
    # would be converted again in every layer. The dtype's min, not -inf: a
    # row is never fully masked (key 0 is always visible), but min stays finite.
    mask = hidden.to(dtype).mul_(torch.finfo(dtype).min)  # [T, L]
    key_index = slot_ids * (2 * max_seq_len) + positions  # [T]: row (slot, 0, position)
    cos, sin = rotary_cos_sin(positions, rotary, num_heads)
    return AttentionMetadata(
        slot_ids=slot_ids,
        key_index=key_index,
        value_index=key_index + max_seq_len,
        mask=mask[:, None, None, :],
        cos=cos,
        sin=sin,
    )


def rotary_cos_sin(
    positions: torch.Tensor, rotary: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
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


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    key_index: torch.Tensor,
    value_index: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write this step's K/V into the cache, attend, write the result to ``out``.

    Shapes: ``q``, ``k``, ``v`` and ``out`` are ``[T, heads, head_dim]``;
    ``kv_cache`` is ``[max_num_seqs + 1, 2, max_seq_len, heads, head_dim]``
    (per request row: its keys, then its values); ``slot_ids``,
    ``key_index`` and ``value_index`` (rows of the cache flattened to
    ``[-1, heads, head_dim]``) are ``[T]``; ``mask`` is
    ``[T, 1, 1, max_seq_len]``. Token ``t`` attends over its request's cache
    row at positions ``<= positions[t]``, which include the keys this step
    writes (a prefill chunk is causal within itself).

    Fixed shapes throughout (the gather reads whole cache rows), so it is
    capturable; the write is idempotent for the same inputs.
    """
    num_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    flat = kv_cache.view(-1, num_heads, head_dim)  # [rows * 2 * max_seq_len, heads, head_dim]
    flat.index_copy_(0, key_index, k)
    flat.index_copy_(0, value_index, v)
    # Keys and values of the step's requests in one advanced-index gather
    # along the leading axis: the fastest layout and gather at 1 to 128 tokens.
    rows = kv_cache[slot_ids].transpose(2, 3)  # [T, 2, heads, L, head_dim]
    result = F.scaled_dot_product_attention(
        q.unsqueeze(2), rows[:, 0], rows[:, 1], attn_mask=mask
    )  # [T, heads, 1, head_dim]
    out.copy_(result.squeeze(2))


#: The attention a layer calls: ``cached_attention``'s arguments, passed
#: positionally in its order (``q, k, v, kv_cache, slot_ids, key_index,
#: value_index, mask, out``), and its effects: it writes the step's K/V into
#: ``kv_cache`` and the attention into ``out``, and returns nothing.
#: ``breakable_cached_attention`` and ``traced_cached_attention`` are
#: ``cached_attention`` behind a break point and as a tracer's op; another
#: engine's break decorator around it is one too. A callable type rather
#: than a Protocol restating ``cached_attention``'s signature: the op is
#: called positionally, so parameter names would add nothing to the type.
AttentionOp: TypeAlias = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], None
]


#: The attention op as an eager break: a breakable (PIECEWISE) capture runs it
#: between graph segments, a FULL capture records it like any other code.
breakable_cached_attention: Final = eager_break_during_capture(cached_attention)


#: ``cached_attention`` as one opaque op for tracers (``torch.compile``),
#: declared as writing the cache and ``out`` in place, as engines register
#: their attention. Traced as plain code instead, its in-place writes into the
#: cache (a graph input) would make the compiled step as slow as eager.
traced_cached_attention: Final = torch.library.custom_op(
    "cudagraph_manager::cached_attention", cached_attention, mutates_args=("kv_cache", "out")
)


@traced_cached_attention.register_fake
def _no_outputs(*args: torch.Tensor) -> None:
    """The op's shape function for tracing: it returns nothing, only writes its arguments."""


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [T, 2, heads, head_dim]`` (halves rotated, Llama/NeoX style).

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``:
    rolling by half a head gives ``(x2, x1)`` and ``sin`` carries the sign,
    so the rotation is three kernels (roll, mul, addcmul) instead of seven.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class DecoderLayer(nn.Module):
    """One pre-norm block: RMSNorm, fused QKV, RoPE, cached attention, SiLU-gated MLP.

    Holds its KV cache as one buffer allocated once,
    ``[max_num_seqs + 1, 2, max_seq_len, heads, head_dim]`` (per request row,
    its keys then its values), the last row being the padding scratch row.
    """

    kv_cache: torch.Tensor

    def __init__(
        self,
        config: DecoderConfig,
        *,
        device: torch.device | None,
        kv_cache_shape: tuple[int, ...] | None = None,
    ) -> None:
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
        # Random contents stand for earlier context: a decode step at position
        # p attends to p keys that earlier steps wrote.
        cache_shape = kv_cache_shape or (
            config.max_num_seqs + 1,
            2,
            config.max_seq_len,
            config.num_heads,
            config.head_dim,
        )
        self.register_buffer(
            "kv_cache", torch.randn(cache_shape, device=device, dtype=dtype), persistent=False
        )

    @property
    def k_cache(self) -> torch.Tensor:
        """The keys: ``[max_num_seqs + 1, max_seq_len, heads, head_dim]``, a view of ``kv_cache``."""
        return self.kv_cache[:, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        """The values, like ``k_cache``."""
        return self.kv_cache[:, 1]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attention: AttentionOp) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``; ``attention`` writes this step's K/V into the cache."""
        q, k, v = self.project(x, meta.cos, meta.sin)
        attn = torch.empty_like(q)
        attention(q, k, v, self.kv_cache, meta.slot_ids, meta.key_index, meta.value_index, meta.mask, attn)
        return self.finish(x, attn)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's inputs: ``x [T, hidden]`` -> rotated q, k and v, ``[T, heads, head_dim]`` each."""
        config = self.config
        num_tokens, d = x.shape[0], config.hidden_size
        h = F.rms_norm(x, (d,), self.input_norm, _RMS_EPS)
        qkv = torch.mm(h, self.qkv_weight).view(num_tokens, 3, config.num_heads, config.head_dim)
        # q and k rotated together: one set of kernels for both.
        q, k = _rotate(qkv[:, :2], cos, sin).unbind(1)  # [T, heads, head_dim] each
        return q, k, qkv[:, 2]

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the block: ``x [T, hidden]`` and the attention ``[T, heads, head_dim]``."""
        num_tokens, d = x.shape[0], self.config.hidden_size
        x = x + torch.mm(attn.view(num_tokens, d), self.o_weight)
        h = F.rms_norm(x, (d,), self.post_norm, _RMS_EPS)
        gate, up = torch.mm(h, self.gate_up_weight).chunk(2, dim=-1)  # [T, intermediate] each
        return x + torch.mm(F.silu(gate) * up, self.down_weight)


class ReferenceDecoder(nn.Module):
    """A Llama-like decoder over a static KV cache, returning final hidden states.

    ``forward(input_ids, positions, slot_ids) -> [T, hidden]``, all inputs
    ``[T]`` int64 on the model's device. Capturable whole (FULL) or split at
    each layer's attention (PIECEWISE: ``num_layers`` eager breaks). Inference
    only: parameters do not require grad.

    ``attention`` is the op every layer calls (``AttentionOp``): when not
    given, ``breakable_cached_attention``, or with ``breakable=False``
    ``traced_cached_attention``, one opaque custom op that writes the cache in
    place, for tracers (``torch.compile``) that should see the whole forward in
    one graph. ``with_attention`` gives this model (its weights and caches)
    with another op.
    """

    key_positions: torch.Tensor
    rotary: torch.Tensor

    def __init__(
        self,
        config: DecoderConfig,
        *,
        device: torch.device | str | None = None,
        breakable: bool = True,
        attention: AttentionOp | None = None,
        kv_cache_shape: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        dev = None if device is None else torch.device(device)
        self.config: Final = config
        if attention is None:
            attention = breakable_cached_attention if breakable else traced_cached_attention
        self.attention: AttentionOp = attention
        self.embed = nn.Parameter(
            torch.randn((config.vocab_size, config.hidden_size), device=dev, dtype=config.dtype) * _EMBED_STD
        )
        layers = [
            DecoderLayer(config, device=dev, kv_cache_shape=kv_cache_shape) for _ in range(config.num_layers)
        ]
        self.layers = nn.ModuleList(layers)
        #: The same modules as ``layers``, typed.
        self.decoder_layers: Final = tuple(layers)
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size, device=dev, dtype=config.dtype))
        self.register_buffer(
            "rotary", rotary_table(config, dev), persistent=False
        )  # [max_seq_len, 2, head_dim]
        self.register_buffer(
            "key_positions", torch.arange(config.max_seq_len, device=dev), persistent=False
        )  # [max_seq_len]
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """One step: ``[T]`` int64 inputs -> final hidden states ``[T, hidden]``."""
        return self.forward_with_metadata(input_ids, self.metadata(positions, slot_ids))

    def metadata(self, positions: torch.Tensor, slot_ids: torch.Tensor) -> AttentionMetadata:
        """The attention metadata of the step at ``positions [T]`` in cache rows ``slot_ids [T]``."""
        return build_attention_metadata(
            positions, slot_ids, self.key_positions, self.rotary, self.config.num_heads
        )

    def forward_with_metadata(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``forward`` on metadata the caller built (``metadata``), outside the graph if it likes.

        A graph of this reads ``meta`` from the caller's tensors, refilled
        before each replay as engines prepare attention metadata. An eager
        break then reads real metadata during capture even where the segment
        before it has not run yet (``breakable_cuda_graphs`` runs it only on
        replay).
        """
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        for layer in self.decoder_layers:
            x = layer.forward(x, meta, self.attention)
        return self.final(x)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the hidden states ``[T, hidden]``."""
        return F.rms_norm(x, (self.config.hidden_size,), self.final_norm, _RMS_EPS)

    def step(self, inputs: dict[str, torch.Tensor], *, uniform_decode: bool = False) -> torch.Tensor:
        """``forward`` on a dict of step inputs (``make_step_inputs``), typed.

        ``uniform_decode`` is accepted for symmetry with ``PagedDecoder.step``:
        this attention reads whole cache rows whatever the batch.
        """
        return self.forward(inputs["input_ids"], inputs["positions"], inputs["slot_ids"])

    def with_attention(self, attention: AttentionOp) -> ReferenceDecoder:
        """This model calling ``attention``: the same weights and KV caches, shared, not copied."""
        twin = copy.copy(self)  # a new module whose parameters, buffers and layers are this one's
        twin.attention = attention
        return twin

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(k_cache, v_cache)`` of every layer: the model's mutable state."""
        return [(layer.k_cache, layer.v_cache) for layer in self.decoder_layers]

    def kv_slot_bytes(self) -> int:
        """The bytes of one KV cache row (a request's keys and values) over all layers."""
        config = self.config
        per_layer = 2 * config.max_seq_len * config.num_heads * config.head_dim * config.dtype.itemsize
        return config.num_layers * per_layer

    def allocate_kv_cache(self, num_slots: int) -> None:
        """Give every layer a KV cache of ``num_slots`` request rows, freeing the old caches first.

        One uninitialized allocation for all layers (each layer's cache is a
        view of it), so the allocator rounds once. At least ``max_num_seqs +
        1`` rows: a batch's requests and the padding row at ``max_num_seqs``;
        the rows beyond hold other sequences (an engine's cache capacity).
        Call it before capturing: graphs read the caches at their addresses.
        """
        config = self.config
        given: object = num_slots
        if not isinstance(given, int) or isinstance(given, bool) or given < config.max_num_seqs + 1:
            raise ValueError(
                f"num_slots: expected an integer >= max_num_seqs + 1 = {config.max_num_seqs + 1}, "
                f"got {num_slots!r}"
            )
        device = self.embed.device
        for layer in self.decoder_layers:  # the old caches go first: the new one may need their memory
            layer.kv_cache = torch.empty(0, device=device, dtype=config.dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # [layers, slots, 2, max_seq_len, heads, head_dim]
        shape = (config.num_layers, num_slots, 2, config.max_seq_len, config.num_heads, config.head_dim)
        caches = torch.empty(shape, device=device, dtype=config.dtype)
        for layer, cache in zip(self.decoder_layers, caches.unbind(0), strict=True):
            layer.kv_cache = cache


def _normal(
    shape: tuple[int, int], fan_in: int, device: torch.device | None, dtype: torch.dtype
) -> torch.Tensor:
    """Weights with std ``fan_in ** -0.5``: each projection keeps its input's scale."""
    return torch.randn(shape, device=device, dtype=dtype) * (1.0 / math.sqrt(fan_in))


def static_inputs(config: DecoderConfig) -> dict[str, StaticInput]:
    """The decoder's inputs for ``CUDAGraphManager``: three ``[T]`` int64 token rows.

    Padding rows get token 0 at position 0 in the scratch cache row, so they
    never write into (or read from) a real request's cache.
    """
    return {
        "input_ids": StaticInput(shape=(), dtype=torch.int64, rows="tokens", pad_value=0),
        "positions": StaticInput(shape=(), dtype=torch.int64, rows="tokens", pad_value=0),
        "slot_ids": StaticInput(shape=(), dtype=torch.int64, rows="tokens", pad_value=config.scratch_slot),
    }


def make_step_inputs(
    config: DecoderConfig,
    num_tokens: int,
    *,
    uniform_decode: bool,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random inputs of one step with ``num_tokens`` tokens (``[T]`` int64 each).

    ``uniform_decode``: one token per request, each in its own cache row, at a
    random position. Otherwise a mixed batch: the first request is a prefill
    chunk of at least 2 tokens (when ``num_tokens >= 2``), the others chunks
    or single decode tokens; each request has its own row and consecutive
    positions. Drawn on the CPU with ``generator``, then moved to ``device``.
    """
    g = generator
    lengths = request_lengths(config, num_tokens, uniform_decode=uniform_decode, generator=g)

    def randint(low: int, high: int) -> int:  # uniform in [low, high]
        return int(torch.randint(low, high + 1, (), generator=g))

    slots = torch.randperm(config.max_num_seqs, generator=g)[: len(lengths)]
    positions: list[torch.Tensor] = []
    slot_rows: list[torch.Tensor] = []
    for length, slot in zip(lengths, slots.tolist(), strict=True):
        start = randint(0, config.max_seq_len - length)
        positions.append(torch.arange(start, start + length))
        slot_rows.append(torch.full((length,), slot, dtype=torch.int64))
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=g)
    return {
        "input_ids": input_ids.to(device),  # [T]
        "positions": torch.cat(positions).to(device),  # [T]
        "slot_ids": torch.cat(slot_rows).to(device),  # [T]
    }


def request_lengths(
    config: DecoderConfig,
    num_tokens: int,
    *,
    uniform_decode: bool,
    query_len: int = 1,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens of each request of a random step (``make_step_inputs``): they add up to ``num_tokens``.

    ``uniform_decode``: ``query_len`` each. Otherwise the first request is a
    prefill chunk of at least 2 tokens (when ``num_tokens >= 2``), the others
    chunks or single decode tokens, at most ``max_seq_len`` each.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected an integer >= 1, got {num_tokens!r}")
    limit = config.max_num_seqs * (query_len if uniform_decode else config.max_seq_len)
    if num_tokens > limit:
        raise ValueError(f"num_tokens: at most {limit} fit the KV cache here, got {num_tokens!r}")
    if uniform_decode:
        if num_tokens % query_len:
            raise ValueError(
                f"num_tokens: a uniform batch has a multiple of {query_len} tokens, got {num_tokens}"
            )
        return [query_len] * (num_tokens // query_len)

    def randint(low: int, high: int) -> int:  # uniform in [low, high]
        return int(torch.randint(low, high + 1, (), generator=generator))

    lengths: list[int] = []
    remaining = num_tokens
    while remaining:
        # Every length lies in [shortest, longest]: the rest always fits the rows left.
        shortest = -(-remaining // (config.max_num_seqs - len(lengths)))
        longest = min(remaining, config.max_seq_len)
        if not lengths and num_tokens >= 2:  # the prefill chunk that makes the batch mixed
            low = min(max(shortest, 2), longest)
            length = randint(low, min(longest, max(low, num_tokens // 2)))
        elif randint(0, 1):  # a decode token, unless the rows run short
            length = shortest
        else:
            length = randint(shortest, min(longest, max(shortest, num_tokens // 4)))
        lengths.append(length)
        remaining -= length
    return lengths
