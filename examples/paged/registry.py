"""The paged backends by name (``BACKENDS``, ``make_backend``), and what a model asks of a backend given.

``check_backend`` says whether an object is a ``PagedBackend`` of a layout;
``ResizablePagedBackend`` is one that can serve another page count
(``PagedDecoder.allocate_kv_cache``).
"""

from __future__ import annotations

from typing import Final, Protocol, TypeVar, cast, runtime_checkable

import torch

from cudagraph_dispatch.support import AttentionSupport

from ..body import model_device
from .base import PagedBackend
from .batch import check_buffers
from .flex import FlexPagedAttention
from .gather import GatherPagedAttention
from .layout import PagedLayout

M_co = TypeVar("M_co", covariant=True)

#: The backends by name (``--attention`` of the demo and the benchmarks); ``make_backend`` builds them.
BACKENDS: Final = ("flex", "gather", "varlen", "split_decode")


def make_backend(
    name: str,
    layout: PagedLayout,
    dtype: torch.dtype,
    *,
    max_tokens: int,
    max_reqs: int,
    device: torch.device | str | None = None,
    breakable: bool = True,
    page_limit: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> PagedBackend[object]:
    """The backend called ``name`` (``BACKENDS``), its metadata buffers sized for the largest batch.

    ``dtype`` is the model's (the gather's mask is in it); ``breakable``:
    ``attend`` is an eager break; ``page_limit``: the pages backed of a
    cache over reserved memory (``PagedBuffers``); ``vocab_size``: the
    model's, whose token ids the backend checks where it checks a step.
    ``varlen`` and ``split_decode`` are imported on first use (they need a
    recent torch on CUDA). A bad argument raises ``ValueError`` naming it,
    before anything is allocated.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)} or a PagedBackend, got {name!r:.80}")
    given_dtype: object = dtype
    if not isinstance(given_dtype, torch.dtype) or not given_dtype.is_floating_point:
        raise ValueError(f"dtype: expected the model's floating torch.dtype, got {dtype!r:.80}")
    check_buffers(layout, max_tokens, max_reqs, vocab_size)
    device = model_device(device)
    if name == "flex":
        return FlexPagedAttention(
            layout,
            max_tokens=max_tokens,
            max_reqs=max_reqs,
            device=device,
            breakable=breakable,
            page_limit=page_limit,
            vocab_size=vocab_size,
        )
    if name == "gather":
        return GatherPagedAttention(
            layout,
            dtype,
            max_tokens=max_tokens,
            max_reqs=max_reqs,
            device=device,
            breakable=breakable,
            page_limit=page_limit,
            vocab_size=vocab_size,
        )
    if name == "varlen":
        from .varlen import VarlenPagedAttention

        return VarlenPagedAttention(
            layout,
            max_tokens=max_tokens,
            max_reqs=max_reqs,
            device=device,
            breakable=breakable,
            page_limit=page_limit,
            vocab_size=vocab_size,
        )
    # split_decode, the last of BACKENDS
    from .split_decode import SplitDecodeAttention

    return SplitDecodeAttention(
        layout,
        max_tokens=max_tokens,
        max_reqs=max_reqs,
        device=device,
        breakable=breakable,
        page_limit=page_limit,
        vocab_size=vocab_size,
    )


def check_backend(backend: object, layout: PagedLayout) -> PagedBackend[object]:
    """``backend`` if it is a ``PagedBackend`` of ``layout``; else a ``ValueError`` naming ``backend``."""
    methods = ("build", "build_for_capture", "attend")
    if not all(callable(getattr(backend, name, None)) for name in methods) or not isinstance(
        getattr(backend, "support", None), AttentionSupport
    ):
        raise ValueError(
            f"backend: expected one of {list(BACKENDS)} or a PagedBackend (support, layout, build, "
            f"build_for_capture, attend), got {backend!r:.80}"
        )
    if getattr(backend, "layout", None) != layout:
        raise ValueError(
            f"backend: its layout {getattr(backend, 'layout', None)!r} is not the model's {layout!r}"
        )
    return cast(PagedBackend[object], backend)


@runtime_checkable
class ResizablePagedBackend(PagedBackend[M_co], Protocol[M_co]):
    """A backend that can serve another page count (``PagedDecoder.allocate_kv_cache``): new buffers."""

    def resize(self, num_pages: int) -> None: ...
