"""The device's memory as a capture measures it: free (the driver's view) and reserved (torch's)."""

from __future__ import annotations

import torch


def free_bytes(device: torch.device) -> int:
    """The device's free memory as the driver reports it (0 off CUDA): its drop is what a capture cost."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


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
