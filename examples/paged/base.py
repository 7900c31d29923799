"""What a paged attention backend is, and what every backend of this folder shares.

- ``PagedBackend``: the protocol, the builder of its own metadata type
  (``AttentionMetadataBuilder``) and the attention op the layers call, which
  reads that metadata back with ``attention_metadata(self)``.
- ``EagerBreakAttention``: the base of the four backends; its ``attend``
  writes K/V and runs their ``_attend`` as an eager break (or inline).
- ``per_forward``: what a backend derives from its metadata, once per forward.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Final, Protocol, TypeVar

import torch

from cudagraph_capture import eager_break_during_capture
from cudagraph_dispatch import get_forward_context
from cudagraph_dispatch.lowlevel import check_bool
from cudagraph_manager.attention import AttentionMetadataBuilder

from .layout import PagedLayout, write_kv

M_co = TypeVar("M_co", covariant=True)
P = TypeVar("P")


class PagedBackend(AttentionMetadataBuilder[M_co], Protocol[M_co]):
    """A paged attention backend: the builder of its metadata ``M``, and the op the layers call.

    ``attend(q, k, v, kv_cache, slot_mapping, out)`` writes the step's K/V at
    ``slot_mapping`` and the attention of ``q`` into ``out`` (all ``[T,
    heads, head_dim]``), reading its metadata with
    ``attention_metadata(self)``. ``layout`` is the cache's paging.
    """

    @property
    def layout(self) -> PagedLayout: ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: torch.Tensor,
    ) -> None: ...


class EagerBreakAttention(abc.ABC):
    """``attend`` as an eager break: a PIECEWISE capture runs it between its graph segments.

    A backend subclasses it and writes ``_attend``, the attention itself;
    ``attend`` writes the step's K/V into the cache first, inside the break.
    ``breakable=False`` records both inline in every capture instead (a FULL
    graph holds them whole either way).
    """

    def __init__(self, *, breakable: bool) -> None:
        check_bool("breakable", breakable)
        step = self._write_and_attend
        self._run: Final = eager_break_during_capture(step) if breakable else step

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Write the step's K/V at ``slot_mapping``, the attention of ``q`` into ``out`` (``[T, H, D]``)."""
        self._run(q, k, v, kv_cache, slot_mapping, out)

    def _write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        write_kv(kv_cache, slot_mapping, k, v)
        self._attend(q, kv_cache, out)

    @abc.abstractmethod
    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """The attention of ``q`` over ``kv_cache`` (the step's K/V in it) into ``out``, ``[T, H, D]``."""


def per_forward(cache: list[tuple[object, P]], derive: Callable[[], P]) -> P:
    """``derive()`` once per forward: kept in ``cache`` under the forward's context, for its other layers.

    Every forward runs under a context object of its own (a step, a
    warm-up, a recording, a loop iteration), so the next forward derives
    again from the metadata as it then is (docs/design.md, "The attention seam").
    """
    forward = get_forward_context()
    if not cache or cache[0][0] is not forward:
        cache[:] = [(forward, derive())]
    return cache[0][1]
