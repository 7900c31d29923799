"""The reference decoder's body over a paged KV cache, attending through any ``PagedBackend``.

``PagedDecoder`` owns the weights (``DecoderBody``) and one paged cache per
layer, ``[2, num_pages, page_size, heads, head_dim]``; its backend is the
attention seam's builder (the manager's ``ManagerOptions(attention=
AttentionOptions(metadata_builder=model.backend))``) and the op each layer
calls. ``make_backend`` builds a backend by name (``BACKENDS``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Final

import torch
from torch import nn

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from cudagraph_dispatch.lowlevel import check_bool, check_int
from cudagraph_dispatch.support import AttentionSupport
from cudagraph_manager import KVCacheMemory
from cudagraph_manager.attention import BatchShape, StepBatch, metadata_extra

from ..body import DecoderBody, LayerCaches
from ..config import DecoderConfig
from .base import PagedBackend
from .batch import PAGED_INPUT_NAMES, PagedBuffers, paged_static_inputs
from .checks import check_token_ids
from .flex_kernel import addressable_slots
from .layout import PagedLayout
from .registry import BACKENDS as BACKENDS
from .registry import ResizablePagedBackend, check_backend
from .registry import make_backend as make_backend


class PagedDecoder(nn.Module):
    """The reference decoder's body over a paged KV cache, attending through ``backend``.

    ``forward(input_ids, positions, slot_mapping, query_lens, seq_lens,
    block_table) -> [T, hidden]`` (``PAGED_INPUT_NAMES``; ``paged.batch``
    says the shapes and padding). The attention reads the step's metadata
    from the forward context: run it through a ``CUDAGraphManager`` built
    with ``AttentionOptions(metadata_builder=model.backend)``, or with ``step``.
    A bad step raises ``ValueError`` naming the input: on the CPU and on
    eager steps at once, from the backend's ``build``, before the manager
    copies the step into its buffers (``input_ids`` outside the vocabulary
    too, by a backend built by name; a backend given checks them in
    ``forward``, on the CPU); on a graph path of a device at
    ``check_steps()`` (the backend's checks).

    Arguments:
        config: the shapes (``DecoderConfig``).
        layout: the cache's paging (default: ``PagedLayout.for_config``).
        backend: a name of ``BACKENDS`` (built by ``make_backend`` for the
            largest batch the config allows) or a ``PagedBackend`` of ``layout``.
        device: where the weights, caches and metadata live.
        breakable: a backend built by name splits PIECEWISE graphs at its
            attention; False records it inline in every capture.
        kv_cache: the cache's memory reserved before the capture and backed
            after (``reserve_paged_cache``): every layer's cache is a view of
            it, each page holding every layer's keys and values (a prefix of
            the reservation is whole pages), and the layout has its
            ``max_units`` pages. A page not backed is never read or written:
            the backend sends block-table entries at or past
            ``kv_cache.limit`` to the scratch page, ``forward`` the slots past
            it to the scratch slot (on the device, no synchronization), and
            eager steps naming one raise ``ValueError``.

    ``graph_support()`` is the backend's support, which the manager resolves
    its mode against. The caches start random (earlier context); over
    reserved memory, zeros.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        layout: PagedLayout | None = None,
        backend: str | PagedBackend[object] = "flex",
        device: torch.device | str | None = None,
        breakable: bool = True,
        kv_cache: KVCacheMemory | None = None,
    ) -> None:
        given: object = config
        if not isinstance(given, DecoderConfig):
            raise ValueError(f"config: expected a DecoderConfig, got {config!r:.80}")
        check_bool("breakable", breakable)
        if kv_cache is not None:
            layout = _reserved_layout(config, layout, kv_cache)
        layout = PagedLayout.for_config(config) if layout is None else layout
        if not isinstance(layout, PagedLayout):
            raise ValueError(f"layout: expected a PagedLayout or None, got {layout!r:.80}")
        super().__init__()
        self.config: Final = config
        self.body: Final = DecoderBody(config, device=device)
        dev = self.body.device
        #: The cache's reserved memory (``None``: ordinary tensors).
        self.kv_cache: Final = kv_cache
        limit = None if kv_cache is None else kv_cache.limit
        if isinstance(backend, str):
            backend = make_backend(
                backend,
                layout,
                config.dtype,
                max_tokens=config.max_num_seqs * layout.max_seq_len,
                max_reqs=config.max_num_seqs,
                device=dev,
                breakable=breakable,
                page_limit=limit,
                vocab_size=config.vocab_size,
            )
        elif (
            limit is not None and getattr(getattr(backend, "buffers", None), "page_limit", None) is not limit
        ):
            raise ValueError(
                f"backend: {backend!r:.80} was not built with page_limit=kv_cache.limit: it would read "
                "pages that are not backed"
            )
        #: The attention backend: the metadata builder the manager calls, the op each layer calls.
        self.backend: PagedBackend[object] = check_backend(backend, layout)
        if kv_cache is None:
            shape = (2, layout.num_pages, layout.page_size, config.num_heads, config.head_dim)
            caches = [torch.randn(shape, device=dev, dtype=config.dtype) for _ in range(config.num_layers)]
        else:
            if kv_cache.device != dev:
                raise ValueError(f"kv_cache: on {kv_cache.device}, the model on {dev}")
            # [pages, page_size, layers, 2, heads, head_dim] -> each layer's [2, pages, page_size, heads, dim]
            caches = [kv_cache.tensor[:, :, i].permute(2, 0, 1, 3, 4) for i in range(config.num_layers)]
        self.caches: Final = LayerCaches(caches)

    @property
    def layout(self) -> PagedLayout:
        """The cache's paging (the backend's; ``allocate_kv_cache`` changes its page count)."""
        return self.backend.layout

    def graph_support(self) -> AttentionSupport:
        """What FULL graphs of this model can replay: its attention backend's support."""
        return self.backend.support

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """One step -> final hidden states ``[T, hidden]``.

        ``query_lens``, ``seq_lens`` and ``block_table`` reach the attention
        through its metadata (built by the backend from the step's inputs),
        not through this call: they are inputs so that the manager checks them.
        """
        del query_lens, seq_lens, block_table  # the backend's metadata holds them, padded
        if input_ids.device.type == "cpu":  # free there; on a device a check would synchronize (the
            check_token_ids(input_ids, self.config.vocab_size)  # embedding's own bounds check asserts)
        backend, caches = self.backend, self.caches
        if self.kv_cache is not None:  # a slot past the pages backed writes the scratch slot (device ops)
            slot_mapping = _backed_slots(slot_mapping, self.kv_cache.limit, self.layout)

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
            backend.attend(q, k, v, caches[index], slot_mapping, out)

        cos, sin = self.body.cos_sin(positions)
        return self.body.run(input_ids, cos, sin, attend)

    def step(self, inputs: dict[str, torch.Tensor], *, uniform_decode: bool = False) -> torch.Tensor:
        """``forward`` on one step's inputs (``PAGED_INPUT_NAMES``) run eagerly, its metadata built here.

        ``uniform_decode``: every request has the same number of tokens (the
        backend may lay the batch out per request), as ``run`` is told it.
        A bad argument raises ``ValueError`` naming it.
        """
        given: object = inputs
        if not isinstance(given, Mapping) or any(
            not isinstance(given.get(name), torch.Tensor) for name in PAGED_INPUT_NAMES
        ):
            raise ValueError(
                f"inputs: expected a mapping of {list(PAGED_INPUT_NAMES)} to tensors, got {given!r:.80}"
            )
        check_bool("uniform_decode", uniform_decode)
        num_tokens, num_reqs = inputs["input_ids"].shape[0], inputs["query_lens"].shape[0]
        if uniform_decode and (num_reqs == 0 or num_tokens % num_reqs):
            raise ValueError(
                f"uniform_decode: {num_tokens} tokens do not split evenly over {num_reqs} requests"
            )
        shape = BatchShape.eager(num_tokens, num_reqs, uniform_decode)
        return self._forward_as(StepBatch(num_tokens, num_reqs, inputs), shape, inputs)

    def _forward_as(
        self, batch: StepBatch, shape: BatchShape, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``forward`` on ``inputs`` with the backend's metadata of ``batch`` as ``shape``, in its context."""
        metadata = self.backend.build(batch, shape)
        key = BatchDescriptor(shape.num_tokens, shape.num_reqs, shape.uniform)
        with set_forward_context(CUDAGraphMode.NONE, key, **metadata_extra(self.backend, metadata)):
            return self.forward(*(inputs[name] for name in PAGED_INPUT_NAMES))

    def check_steps(self) -> None:
        """``ValueError`` naming the first input a step run on a graph got wrong since the last call.

        The backend's ``PagedBuffers`` (``validate="device"``) record a graph
        path's checks on the device, without synchronizing; this reads them
        (one synchronization): call it where you synchronize anyway (reading
        a step's tokens). Eager steps raise at once; the default
        (``"eager"``) leaves a graph path's steps unchecked.
        """
        buffers = getattr(self.backend, "buffers", None)
        if isinstance(buffers, PagedBuffers):
            buffers.check_steps()

    def with_backend(self, backend: PagedBackend[object]) -> PagedDecoder:
        """This model attending through ``backend`` (of its layout): the same weights and caches, shared."""
        twin = copy.copy(self)
        twin.backend = check_backend(backend, self.layout)
        return twin

    def kv_caches(self) -> list[torch.Tensor]:
        """Every layer's paged cache, ``[2, pages, page_size, heads, head_dim]``: the mutable state."""
        return list(self.caches)

    def warm_up(self, max_tokens: int, *, query_len: int = 1) -> None:
        """Run each shape class the attention specializes on once, on padding (an engine's warm-up).

        FlexAttention is compiled with dynamic shapes but specializes on
        sizes 1 and 2, on multiples of its 16-query tile, and on the layout
        (packed or per request): one step of each, up to ``max_tokens``
        tokens, compiles them all before memory is profiled, estimated or
        captured, so none compiles later inside a capture. Only the scratch
        page is written. ``max_tokens`` is at most the largest batch the
        backend built by name holds (``max_num_seqs * max_seq_len``).
        """
        largest = self.config.max_num_seqs * self.layout.max_seq_len
        check_int("max_tokens", max_tokens, minimum=1, maximum=largest)
        check_int("query_len", query_len, minimum=1, maximum=max_tokens)
        max_reqs = min(self.config.max_num_seqs, max_tokens // query_len)
        packed = sorted({n for n in (1, 2, 16, 17, max_tokens) if n <= max_tokens})
        uniform = sorted({r for r in (1, 2, 16, 17, max_reqs) if 1 <= r <= max_reqs})
        shapes = [BatchShape(n, min(n, self.config.max_num_seqs), None, CUDAGraphMode.NONE) for n in packed]
        shapes += [BatchShape(r * query_len, r, query_len, CUDAGraphMode.NONE) for r in uniform]
        with torch.no_grad():
            for shape in shapes:
                self._forward_as(StepBatch.padding(), shape, self._padding(shape))

    def _padding(self, shape: BatchShape) -> dict[str, torch.Tensor]:
        """An all-padding step of ``shape``: every input at its ``pad_value``."""
        device = self.body.device
        return {
            name: torch.full(
                (shape.num_reqs if spec.rows == "reqs" else shape.num_tokens, *spec.shape),
                spec.pad_value,
                dtype=spec.dtype,
                device=device,
            )
            for name, spec in paged_static_inputs(self.layout).items()
        }

    def kv_page_bytes(self) -> int:
        """The bytes of one page (its keys and values over all layers, its slots' page table)."""
        config, layout = self.config, self.layout
        per_layer = 2 * layout.page_size * config.num_heads * config.head_dim * config.dtype.itemsize
        return config.num_layers * per_layer + layout.page_size * torch.int32.itemsize

    def allocate_kv_cache(self, num_pages: int) -> None:
        """Give every layer a cache of ``num_pages`` pages (scratch included), freeing the old ones first.

        One uninitialized allocation for all layers, as an engine sizes its
        cache from the memory left (``examples.kv_sizing``). The backend
        (a ``ResizablePagedBackend``: the same object, so a manager built
        with it keeps it) takes new metadata buffers for the new page count.
        The static inputs' padding does not change (the scratch page is page
        0). Call it before capturing: graphs read the caches and the
        buffers at their addresses. All or nothing: where an allocation
        fails (torch's error), the caches are allocated again at the old page
        count (uninitialized, as after any call) and the layout is unchanged.
        """
        check_int("num_pages", num_pages, minimum=2)
        backend = self.backend
        if self.kv_cache is not None:
            raise ValueError(
                f"num_pages: this model's cache is reserved memory of {self.kv_cache.max_units} pages; back "
                "more or fewer of them (CUDAGraphManager.back_kv_cache) instead"
            )
        if not isinstance(backend, ResizablePagedBackend):
            raise ValueError(
                f"num_pages: this model's backend {backend!r:.80} cannot serve another page count "
                "(it has no resize(num_pages))"
            )
        self._check_cache_fits(num_pages)
        old = self.layout.num_pages
        try:
            self.caches.replace(lambda: self._new_caches(num_pages))
            backend.resize(num_pages)  # all or nothing itself
        except Exception as error:
            self.caches.replace(lambda: self._new_caches(old))
            raise RuntimeError(
                f"num_pages: {num_pages} pages could not be allocated ({error}); the caches are "
                f"{old} pages again (new tensors: recapture graphs that read them)"
            ) from error

    def _check_cache_fits(self, num_pages: int) -> None:
        """``ValueError`` naming ``num_pages`` if its caches exceed the free memory and the old caches'."""
        device = self.body.device
        free = _free_bytes(device)
        need = num_pages * self.kv_page_bytes()
        held = sum(cache.numel() * cache.element_size() for cache in self.caches)
        if free is not None and need > free + held:
            raise ValueError(
                f"num_pages: {num_pages} pages need {need} bytes of cache, more than {device} has for "
                f"them ({free} bytes free and {held} held by the current caches); nothing was changed"
            )

    def _new_caches(self, num_pages: int) -> tuple[torch.Tensor, ...]:
        """Every layer's cache of ``num_pages`` pages, one uninitialized allocation."""
        config, page_size = self.config, self.layout.page_size
        shape = (config.num_layers, 2, num_pages, page_size, config.num_heads, config.head_dim)
        return torch.empty(shape, device=self.body.device, dtype=config.dtype).unbind(0)


def paged_unit_shape(config: DecoderConfig, page_size: int) -> tuple[int, int, int, int, int]:
    """A page of every layer, as ``reserve_paged_cache`` lays it out: ``[page_size, layers, 2, heads, dim]``.

    Each slot holds every layer's key and value: a layer's cache
    ``[2, pages, page_size, heads, head_dim]`` is a view whose slots are
    evenly strided, so the backends' slot views (``view(2, -1, heads,
    head_dim)``) still hold, and a prefix of the memory is whole pages.
    """
    return (page_size, config.num_layers, 2, config.num_heads, config.head_dim)


def max_flex_pages(config: DecoderConfig, page_size: int) -> int:
    """The most pages of a cache over reserved memory that FlexAttention's fused kernel can address.

    A slot of ``reserve_paged_cache``'s layout holds every layer's key and
    value, so one layer's keys are ``layers * 2 * heads * head_dim``
    elements apart, and the kernel's 32-bit offsets end at 2**31 elements
    (``flex_kernel.MAX_KEY_ELEMENTS``): about 4 GiB of cache in all, whatever
    the model. The other backends address any cache.
    """
    check_int("page_size", page_size, minimum=1)
    stride = config.num_layers * 2 * config.num_heads * config.head_dim
    return addressable_slots(stride) // page_size


def reserve_paged_cache(
    config: DecoderConfig,
    *,
    page_size: int = 128,
    max_pages: int | None = None,
    min_pages: int = 1,
    fallback_pages: int | None = None,
    device: torch.device | str | None = None,
) -> KVCacheMemory:
    """A paged cache's memory, reserved and not backed but for ``min_pages`` (the scratch page among them).

    ``max_pages``: the reservation (default: as many pages as the device's
    memory holds); ``fallback_pages``: the ordinary allocation where virtual
    memory cannot be had (default: ``max(min_pages, 2)``). For
    ``PagedDecoder(config, kv_cache=...)`` and ``ManagerOptions(kv_cache=...)``.
    """
    check_int("page_size", page_size, minimum=1)
    return KVCacheMemory(
        paged_unit_shape(config, page_size),
        config.dtype,
        max_units=max_pages,
        min_units=min_pages,
        fallback_units=max(min_pages, 2) if fallback_pages is None else fallback_pages,
        device=device,
    )


def _reserved_layout(config: DecoderConfig, layout: PagedLayout | None, kv_cache: object) -> PagedLayout:
    """The layout of a cache over ``kv_cache``: its pages, their size; ``ValueError`` where they disagree."""
    if not isinstance(kv_cache, KVCacheMemory):
        raise ValueError(f"kv_cache: expected a KVCacheMemory or None, got {kv_cache!r:.80}")
    page_size = kv_cache.unit_shape[0]
    if kv_cache.unit_shape != paged_unit_shape(config, page_size) or kv_cache.dtype != config.dtype:
        raise ValueError(
            f"kv_cache: units of {list(kv_cache.unit_shape)} {kv_cache.dtype}, expected pages of "
            f"{list(paged_unit_shape(config, page_size))} {config.dtype} (reserve_paged_cache)"
        )
    if layout is None:
        return PagedLayout.for_config(config, page_size=page_size, num_pages=kv_cache.max_units)
    if (layout.page_size, layout.num_pages) != (page_size, kv_cache.max_units):
        raise ValueError(
            f"layout: {layout} disagrees with kv_cache's {kv_cache.max_units} pages of {page_size}"
        )
    return layout


def _backed_slots(slot_mapping: torch.Tensor, limit: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """``slot_mapping [T]`` with every slot outside the pages backed (``limit``) sent to the scratch slot."""
    outside = slot_mapping.lt(0).logical_or_(slot_mapping >= limit * layout.page_size)
    return slot_mapping.masked_fill(outside, layout.scratch_slot)


def _free_bytes(device: torch.device) -> int | None:
    """The bytes ``device`` can still allocate (CUDA: free memory; CPU: Linux's MemAvailable), or None."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
