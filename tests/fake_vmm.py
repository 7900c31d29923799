"""A fake of the driver's virtual memory over host memory, for the bookkeeping of reserved memory on a CPU.

``FakeVirtualMemory`` implements ``cudagraph_capture._reserved.VirtualMemory``
the way the CUDA driver behaves where it matters to the bookkeeping: a
reservation is a range of addresses (here a host buffer, so tensors over it
can be read and written), memory comes in handles of multiples of the
granularity, a mapping is unmapped whole, access is set on mapped ranges
only, and memory beyond ``capacity`` is refused as the driver's
out-of-memory. Every mistake the driver would refuse raises ``AssertionError``
here (a bug of the code under test, never a user error). ``fail`` makes the
next calls of one name fail, as a driver that refuses.

``use_fake_vmm(monkeypatch, fake)`` makes every ``ReservedMemory`` (and
``KVCacheMemory``) built on the CPU use it, and the free memory a
``KVCacheMemory`` measures there the fake's capacity left (unlimited: none
measured).
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Final

import pytest
import torch

from cudagraph_capture import _reserved
from cudagraph_manager._memory import _kv


class FakeVirtualMemory:
    """``VirtualMemory`` over host buffers; ``capacity`` bytes of device memory (``None``: unlimited)."""

    def __init__(self, granularity: int = 4096, capacity: int | None = None) -> None:
        self.granularity: Final = granularity
        self.capacity = capacity
        self._buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.reserved: dict[int, int] = {}  # base -> size
        self.handles: dict[object, int] = {}  # live handle -> size
        self.mapped: dict[int, tuple[int, object]] = {}  # address -> (size, handle)
        self.allowed: list[tuple[int, int]] = []
        self.calls: list[str] = []
        self._failing: dict[str, int] = {}
        self._ids = itertools.count(1)

    # -- the test's controls --

    def fail(self, call: str, times: int = 1) -> None:
        """Make the next ``times`` calls of ``call`` (``create``, ``map``, ...) fail as the driver refuses."""
        self._failing[call] = times

    @property
    def used(self) -> int:
        """Device memory in handles now (what ``free`` memory would have lost)."""
        return sum(self.handles.values())

    @property
    def mapped_bytes(self) -> int:
        return sum(size for size, _ in self.mapped.values())

    def _call(self, name: str) -> None:
        self.calls.append(name)
        left = self._failing.get(name, 0)
        if left:
            self._failing[name] = left - 1
            raise RuntimeError(f"cu{name} failed: the fake driver refused")

    # -- VirtualMemory --

    def reserve(self, size: int) -> int:
        self._call("reserve")
        assert size > 0, size
        assert size % self.granularity == 0, size
        buffer = ctypes.create_string_buffer(size + self.granularity)  # aligned as the driver aligns
        base = -(-ctypes.addressof(buffer) // self.granularity) * self.granularity
        self._buffers[base] = buffer
        self.reserved[base] = size
        return base

    def free(self, address: int, size: int) -> None:
        self._call("free")
        assert self.reserved.get(address) == size, (address, size)
        assert not any(address <= a < address + size for a in self.mapped), "freed while mapped"
        del self.reserved[address]
        del self._buffers[address]

    def create(self, size: int) -> object:
        self._call("create")
        assert size > 0, size
        assert size % self.granularity == 0, size
        if self.capacity is not None and self.used + size > self.capacity:
            raise torch.OutOfMemoryError(f"cuMemCreate: the fake device is out of memory ({size} bytes)")
        handle = ("handle", next(self._ids))
        self.handles[handle] = size
        return handle

    def map(self, address: int, size: int, handle: object) -> None:
        self._call("map")
        assert self.handles.get(handle) == size, "a handle is mapped whole"
        assert address % self.granularity == 0
        assert any(b <= address and address + size <= b + s for b, s in self.reserved.items()), "not reserved"
        assert not any(a < address + size and address < a + s for a, (s, _) in self.mapped.items()), "overlap"
        assert handle not in {h for _, h in self.mapped.values()}, "a handle mapped twice"
        self.mapped[address] = (size, handle)

    def allow(self, address: int, size: int) -> None:
        self._call("allow")
        covered = sum(s for a, (s, _) in self.mapped.items() if address <= a and a + s <= address + size)
        assert covered == size, "access is set on a fully mapped range"
        self.allowed.append((address, size))

    def unmap(self, address: int, size: int) -> None:
        self._call("unmap")
        assert self.mapped.get(address, (None,))[0] == size, "cuMemUnmap takes exactly a mapped range"
        del self.mapped[address]

    def release(self, handle: object) -> None:
        self._call("release")
        assert handle in self.handles
        assert handle not in {h for _, h in self.mapped.values()}, "released while mapped"
        del self.handles[handle]


def use_fake_vmm(monkeypatch: pytest.MonkeyPatch, fake: FakeVirtualMemory) -> None:
    """Reservations on the CPU use ``fake`` (a device without the fake falls back as usual)."""
    real = _reserved.vmm_for
    cpu = torch.device("cpu")
    monkeypatch.setattr(_reserved, "vmm_for", lambda device: fake if device == cpu else real(device))
    measure = _kv.backable_bytes

    def backable(device: torch.device, *, release_cache: bool) -> int | None:
        if device != cpu:
            return measure(device, release_cache=release_cache)
        return None if fake.capacity is None else fake.capacity - fake.used

    monkeypatch.setattr(_kv, "backable_bytes", backable)
