"""A capture phase's totals, measured around it: ``capture()`` and the background capture alike."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

import torch

from cudagraph_dispatch.support import ModeResolution

from .._compiled import compiles_since, dynamo_compiles
from .._memory._device import free_bytes, reserved_bytes
from .._memory._kv import KVCacheBacking
from ._report import CapturedGraph, CaptureReport


class CaptureTotals:
    """Started when built; ``report()`` reads the wall time, memory and compiles since then.

    The phase's caller synchronizes its stream before ``report()`` where the
    device's work must count in the seconds (``capture()`` does).
    """

    __slots__ = ("_compiled", "_device", "_free", "_reserved", "_start")

    def __init__(self, device: torch.device) -> None:
        self._device: Final = device
        self._compiled: Final = dynamo_compiles()
        self._reserved: Final = reserved_bytes(device)
        self._free: Final = free_bytes(device)
        self._start: Final = time.perf_counter()

    def report(
        self,
        graphs: Sequence[CapturedGraph],
        no_graphs: str | None,
        resolution: ModeResolution,
        kv_cache: KVCacheBacking | None = None,
    ) -> CaptureReport:
        """The phase's report: ``graphs`` and the totals since construction.

        ``no_graphs``: why nothing was captured (``None``: the graphs were);
        ``resolution``: the mode the graphs follow; ``kv_cache``: how much of
        the KV cache is backed now.
        """
        seconds = time.perf_counter() - self._start
        return CaptureReport(
            tuple(graphs),
            seconds,
            reserved_bytes(self._device) - self._reserved,
            no_graphs,
            compiles_since(self._compiled),
            self._free - free_bytes(self._device),
            resolution,
            kv_cache,
        )
