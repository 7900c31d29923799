"""A reference decoder (Llama-like) for the demo, the tests and the benchmarks.

It has what makes CUDA graphs both worth having and hard to get right in a
real engine: hundreds of small kernels per step, a static KV cache updated in
place, per-step attention metadata, and an attention op that can run inside a
FULL graph or eagerly between PIECEWISE segments.

- Inputs of one step (``num_tokens`` rows, any mix of requests):
  ``input_ids [T]``, ``positions [T]`` (position of each token in its
  sequence) and ``cache_rows [T]`` (the KV cache row of the token's request).
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
  ``(cache row, position)`` and attends over the request's cache row, writing into
  a caller-provided buffer. The layers call it through an injectable op
  (``AttentionOp``), by default ``breakable_cached_attention``, an
  ``eager_break_during_capture`` op: a breakable (PIECEWISE) capture splits
  the forward there, one break per layer; a FULL capture records it inline
  (the attention and its ops: ``reference_attention``).
- Padding rows use a scratch cache row (index ``max_num_seqs``), so padding
  never writes into a real request's cache. Writing K/V is idempotent: the
  same step run twice (a graph replay, then eagerly) gives the same outputs.
"""

from __future__ import annotations

import copy
from typing import Final

import torch
from torch import Tensor, nn

from cudagraph_dispatch import CUDAGraphMode, get_forward_context
from cudagraph_dispatch.lowlevel import check_bool
from cudagraph_manager import KVCacheMemory, StaticInput

from .body import DecoderBody, LayerCaches
from .config import DecoderConfig
from .reference_attention import (
    AttentionMetadata,
    AttentionOp,
    breakable_cached_attention,
    build_attention_metadata,
    traced_cached_attention,
)

# Step inputs, in the order of ``ReferenceDecoder.forward``.
INPUT_NAMES: Final[tuple[str, ...]] = ("input_ids", "positions", "cache_rows")


class ReferenceDecoder(nn.Module):
    """A Llama-like decoder over a static KV cache, returning final hidden states.

    ``forward(input_ids, positions, cache_rows) -> [T, hidden]``, all inputs
    ``[T]`` int64 on the model's device. Capturable whole (FULL) or split at
    each layer's attention (PIECEWISE: ``num_layers`` eager breaks). Inference
    only: parameters do not require grad.

    Arguments:
        config: the shapes (``DecoderConfig``).
        device: where the weights and caches live.
        breakable: the default attention: ``breakable_cached_attention``
            (True) or ``traced_cached_attention`` (False), one opaque custom
            op that writes the cache in place, for tracers
            (``torch.compile``) that should see the whole forward in one graph.
        attention: the op every layer calls (``AttentionOp``) instead;
            ``with_attention`` gives this model (its weights and caches)
            with another op.
        kv_cache: the cache's memory reserved before the capture and backed
            after (``reserve_row_cache``): every layer's cache is a view of
            it, each row holding every layer's keys and values (a prefix of
            the reservation is whole rows; ``max_units`` rows, the scratch
            row ``max_num_seqs`` among the ``min_units`` always backed). A
            row not backed is never read or written: the step's metadata
            sends ``cache_rows`` outside ``[0, kv_cache.limit)`` to the
            scratch row (on the device, no synchronization), and an eager
            step naming one raises ``ValueError``.

    ``body`` holds the weights (``DecoderBody``, shared in kind with
    ``PagedDecoder``); ``caches[i]`` is layer ``i``'s KV cache,
    ``[max_num_seqs + 1, 2, max_seq_len, heads, head_dim]`` (per request
    row, its keys then its values; the last row is the padding scratch row),
    filled with random values that stand for earlier context (over reserved
    memory: ``max_units`` rows, zeros).
    """

    key_positions: torch.Tensor

    def __init__(
        self,
        config: DecoderConfig,
        *,
        device: torch.device | str | None = None,
        breakable: bool = True,
        attention: AttentionOp | None = None,
        kv_cache: KVCacheMemory | None = None,
    ) -> None:
        given: object = config
        if not isinstance(given, DecoderConfig):
            raise ValueError(f"config: expected a DecoderConfig, got {config!r:.80}")
        if kv_cache is not None:
            _check_row_cache(config, kv_cache)
        check_bool("breakable", breakable)
        if attention is not None and not callable(attention):
            raise ValueError(
                f"attention: expected an AttentionOp (a callable) or None, got {attention!r:.80}"
            )
        super().__init__()
        self.config: Final = config
        if attention is None:
            attention = breakable_cached_attention if breakable else traced_cached_attention
        self.attention: AttentionOp = attention
        self.body: Final = DecoderBody(config, device=device)
        dev = self.body.device
        #: The cache's reserved memory (``None``: ordinary tensors).
        self.kv_cache: Final = kv_cache
        if kv_cache is None:
            shape = (config.max_num_seqs + 1, 2, config.max_seq_len, config.num_heads, config.head_dim)
            caches = [torch.randn(shape, device=dev, dtype=config.dtype) for _ in range(config.num_layers)]
        else:
            if kv_cache.device != dev:
                raise ValueError(f"kv_cache: on {kv_cache.device}, the model on {dev}")
            # [rows, 2, max_seq_len, layers, heads, head_dim] -> a layer's [rows, 2, max_seq_len, heads, dim]
            caches = [kv_cache.tensor[:, :, :, i] for i in range(config.num_layers)]
        self.caches: Final = LayerCaches(caches)
        self.register_buffer(
            "key_positions", torch.arange(config.max_seq_len, device=dev), persistent=False
        )  # [max_seq_len]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor
    ) -> torch.Tensor:
        """One step: ``[T]`` int64 inputs -> final hidden states ``[T, hidden]``."""
        return self.forward_with_metadata(input_ids, self.metadata(positions, cache_rows))

    def metadata(self, positions: torch.Tensor, cache_rows: torch.Tensor) -> AttentionMetadata:
        """The attention metadata of the step at ``positions [T]`` in cache rows ``cache_rows [T]``.

        Over reserved memory, rows outside the rows backed go to the scratch
        row (device ops); an eager step naming one raises ``ValueError``
        first (one synchronization: eager steps only).
        """
        if self.kv_cache is not None:
            cache_rows = self._backed_rows(cache_rows, self.kv_cache.limit)
        return build_attention_metadata(
            positions, cache_rows, self.key_positions, self.body.rotary, self.config.num_heads
        )

    def forward_with_metadata(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``forward`` on metadata the caller built (``metadata``), outside the graph if it likes.

        A graph of this reads ``meta`` from the caller's tensors, refilled
        before each replay as engines prepare attention metadata. An eager
        break then reads real metadata during capture even where the segment
        before it has not run yet (``breakable_cuda_graphs`` runs it only on
        replay).
        """
        attention, caches = self.attention, self.caches

        def attend(index: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
            rows = meta.cache_rows
            attention(q, k, v, caches[index], rows, meta.key_index, meta.value_index, meta.mask, out)

        return self.body.run(input_ids, meta.cos, meta.sin, attend)

    def _backed_rows(self, cache_rows: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        outside = cache_rows.lt(0).logical_or_(cache_rows >= limit)  # [T]
        context = get_forward_context()
        eager = context is None or context.runtime_mode is CUDAGraphMode.NONE
        capturing = cache_rows.is_cuda and torch.cuda.is_current_stream_capturing()
        if eager and not capturing and bool(outside.any()):
            raise ValueError(
                f"cache_rows: rows {cache_rows[outside][:4].tolist()} are not backed: the KV cache backs "
                f"rows [0, {int(limit)})"
            )
        return cache_rows.masked_fill(outside, self.config.scratch_row)

    def step(self, inputs: dict[str, torch.Tensor], *, uniform_decode: bool = False) -> torch.Tensor:
        """``forward`` on a dict of step inputs (``examples.inputs.make_step_inputs``), typed.

        ``uniform_decode`` is accepted for symmetry with ``PagedDecoder.step``:
        this attention reads whole cache rows whatever the batch.
        """
        return self.forward(inputs["input_ids"], inputs["positions"], inputs["cache_rows"])

    def with_attention(self, attention: AttentionOp) -> ReferenceDecoder:
        """This model calling ``attention``: the same weights and KV caches, shared, not copied."""
        twin = copy.copy(self)  # a new module whose parameters, buffers and submodules are this one's
        twin.attention = attention
        return twin

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(k_cache, v_cache)`` of every layer, ``[rows, max_seq_len, heads, head_dim]`` views."""
        return [(cache[:, 0], cache[:, 1]) for cache in self.caches]

    def kv_row_bytes(self) -> int:
        """The bytes of one KV cache row (a request's keys and values) over all layers."""
        config = self.config
        per_layer = 2 * config.max_seq_len * config.num_heads * config.head_dim * config.dtype.itemsize
        return config.num_layers * per_layer

    def allocate_kv_cache(self, num_rows: int) -> None:
        """Give every layer a KV cache of ``num_rows`` request rows, freeing the old caches first.

        One uninitialized allocation for all layers (each layer's cache is a
        view of it), so the allocator rounds once. At least ``max_num_seqs +
        1`` rows: a batch's requests and the padding row at ``max_num_seqs``;
        the rows beyond hold other sequences (an engine's cache capacity).
        Call it before capturing: graphs read the caches at their addresses.
        """
        config = self.config
        if self.kv_cache is not None:
            raise ValueError(
                f"num_rows: this model's cache is reserved memory of {self.kv_cache.max_units} rows; back "
                "more or fewer of them (CUDAGraphManager.back_kv_cache) instead"
            )
        given: object = num_rows
        if not isinstance(given, int) or isinstance(given, bool) or given < config.max_num_seqs + 1:
            raise ValueError(
                f"num_rows: expected an integer >= max_num_seqs + 1 = {config.max_num_seqs + 1}, "
                f"got {num_rows!r}"
            )
        # [layers, rows, 2, max_seq_len, heads, head_dim]
        shape = (config.num_layers, num_rows, 2, config.max_seq_len, config.num_heads, config.head_dim)
        device = self.body.device
        self.caches.replace(lambda: torch.empty(shape, device=device, dtype=config.dtype).unbind(0))


def row_unit_shape(config: DecoderConfig) -> tuple[int, int, int, int, int]:
    """One request row of every layer, as ``reserve_row_cache`` lays it out: ``[2, seq, layers, heads, dim]``.

    Each position holds every layer's key (or value): a layer's cache
    ``[rows, 2, max_seq_len, heads, head_dim]`` is a view whose key and
    value rows are evenly strided (``cached_attention`` flattens it), and a
    prefix of the memory is whole rows.
    """
    return (2, config.max_seq_len, config.num_layers, config.num_heads, config.head_dim)


def reserve_row_cache(
    config: DecoderConfig,
    *,
    max_rows: int | None = None,
    fallback_rows: int | None = None,
    device: torch.device | str | None = None,
) -> KVCacheMemory:
    """A row cache's memory, reserved and not backed but for its ``max_num_seqs + 1`` first rows.

    Those rows (a batch's requests, the scratch row) stay backed;
    ``max_rows``: the reservation (default: as many rows as the device's
    memory holds); ``fallback_rows``: the ordinary allocation where virtual
    memory cannot be had (default: those first rows). For
    ``ReferenceDecoder(config, kv_cache=...)`` and ``ManagerOptions(kv_cache=...)``.
    """
    return KVCacheMemory(
        row_unit_shape(config),
        config.dtype,
        max_units=max_rows,
        min_units=config.max_num_seqs + 1,
        fallback_units=fallback_rows,
        device=device,
    )


def _check_row_cache(config: DecoderConfig, kv_cache: object) -> None:
    if not isinstance(kv_cache, KVCacheMemory):
        raise ValueError(f"kv_cache: expected a KVCacheMemory or None, got {kv_cache!r:.80}")
    if kv_cache.unit_shape != row_unit_shape(config) or kv_cache.dtype != config.dtype:
        raise ValueError(
            f"kv_cache: units of {list(kv_cache.unit_shape)} {kv_cache.dtype}, expected rows of "
            f"{list(row_unit_shape(config))} {config.dtype} (reserve_row_cache)"
        )
    if kv_cache.min_units <= config.scratch_row:
        raise ValueError(
            f"kv_cache: {kv_cache.min_units} rows always backed, expected the scratch row "
            f"{config.scratch_row} among them (min_units >= {config.scratch_row + 1})"
        )


def static_inputs(config: DecoderConfig) -> dict[str, StaticInput]:
    """The decoder's inputs for ``CUDAGraphManager``: three ``[T]`` int64 token rows.

    Padding rows get token 0 at position 0 in the scratch cache row, so they
    never write into (or read from) a real request's cache.
    """
    given: object = config
    if not isinstance(given, DecoderConfig):
        raise ValueError(f"config: expected a DecoderConfig, got {config!r:.80}")
    return {
        "input_ids": StaticInput(shape=(), dtype=torch.int64, rows="tokens", pad_value=0),
        "positions": StaticInput(shape=(), dtype=torch.int64, rows="tokens", pad_value=0),
        "cache_rows": StaticInput(shape=(), dtype=torch.int64, rows="tokens", pad_value=config.scratch_row),
    }
