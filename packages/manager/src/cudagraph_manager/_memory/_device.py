"""The manager's device: where work runs, and what a capture costs it, measured around it.

``on_device`` and ``capture_lock_of`` are the device's context and its
capture lock on CUDA, nothing to enter elsewhere. Free memory is the
driver's view, reserved memory torch's allocator's: ``RecordingBytes``
splits one recording's cost between the two, ``CaptureTotals`` measures a
phase (``capture()``, a background capture) and builds its report.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Final

import torch

from cudagraph_capture._pool import capture_lock
from cudagraph_dispatch._support import ModeResolution

from .._compiled import compiles_since, dynamo_compiles
from .._values._reports import CapturedGraph, CaptureReport, KVCacheBacking


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.device(device)`` on a CUDA device (its work runs there), nothing to enter elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def capture_lock_of(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The device's capture lock on CUDA (one capture, or one graph's destruction, at a time); else none.

    Destroying a graph edits torch's registry that captures edit too, so it
    holds the lock as a capture does.
    """
    return capture_lock(device) if device.type == "cuda" else contextlib.nullcontext()


def free_bytes(device: torch.device) -> int:
    """The device's free memory as the driver reports it (0 off CUDA): its drop is what a capture cost."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def empty_cache(device: torch.device) -> None:
    """Give torch's cached free blocks back to the driver; nothing off CUDA.

    Under the device's capture lock: never while another thread captures
    on the device (a capture's blocks are not free to give back yet).
    """
    if device.type == "cuda":
        with capture_lock(device):
            torch.cuda.empty_cache()


def reserved_bytes(device: torch.device) -> int:
    """The device's reserved memory (0 off CUDA): its growth is what torch's allocator took.

    ``torch.cuda.memory_reserved`` is the same figure, but it flattens every
    statistic of the allocator first, a cost paid twice per captured key
    (docs/benchmarks-notes.md says where to measure it).
    """
    if device.type != "cuda":
        return 0
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before CUDA is initialized
    return int(stats["reserved_bytes"]["all"]["current"]) if stats else 0


class RecordingBytes:
    """What one recording cost the device, measured around it: ``with RecordingBytes(device) as cost:``.

    ``pool``: the growth of reserved memory (what torch's allocator took for
    the graph's pool); ``driver``: the rest of the drop of free memory (the
    graph's executable, outside the allocator). Both 0 off CUDA.
    """

    __slots__ = ("_device", "_free", "_reserved", "driver", "pool")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._reserved = self._free = 0
        self.pool = self.driver = 0

    def __enter__(self) -> RecordingBytes:
        self._reserved, self._free = reserved_bytes(self._device), free_bytes(self._device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool = reserved_bytes(self._device) - self._reserved
        self.driver = self._free - free_bytes(self._device) - self.pool


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
            graphs=tuple(graphs),
            seconds=seconds,
            reserved_bytes=reserved_bytes(self._device) - self._reserved,
            no_graphs=no_graphs,
            compiles=compiles_since(self._compiled),
            device_bytes=self._free - free_bytes(self._device),
            resolution=resolution,
            kv_cache=kv_cache,
        )
