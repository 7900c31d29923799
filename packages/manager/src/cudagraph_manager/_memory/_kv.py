"""A KV cache sized after the capture: its addresses reserved first, its memory backed from what is free.

``KVCacheMemory`` reserves the addresses of a KV cache of ``max_units``
units (pages of a paged cache, request rows of a row cache) through
``cudagraph_capture.lowlevel.ReservedMemory``, and hands out one tensor
over all of them (``tensor``), so the model's caches can be built and every
graph captured against them while only ``min_units`` are backed (padding's
scratch page or row among them). Afterwards the manager backs it from the
free memory it measures (``back_from_free``), grows or shrinks it
(``back``), drops it for a sleep that keeps the graphs and backs it again
(``drop``, ``back_from_free``): no graph is captured again.

``limit`` is the backed unit count on the device (``[]`` int64), updated in
place on the current stream whenever it changes (a fill, never a host
synchronization): the model clamps the unit ids its graphs read to its
scratch unit where they are not below it, so a step naming a unit that is
not backed never reaches unbacked memory (a kernel that did would fault the
CUDA context: the end of the engine).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Final

import torch

from cudagraph_capture.lowlevel import ReservedMemory, resolve_device
from cudagraph_dispatch._checks import check_dims
from cudagraph_dispatch.lowlevel import check_int

from .._values._reports import KVCacheBacking
from ._device import empty_cache, free_bytes


class KVCacheMemory:
    """A KV cache's device memory: addresses reserved before the graphs are captured, memory backed after.

    Args:
        unit_shape: the shape of one unit the engine hands out (a page of
            every layer, a request's row of every layer); ``tensor`` is
            ``[max_units, *unit_shape]``, so a prefix of the memory is whole units.
        dtype: the cache's dtype.
        max_units: units the reservation holds (default: as many as the
            device's whole memory could hold; addresses cost no memory).
        min_units: units backed from construction to ``close()`` (at least
            1): the units padding writes (the scratch page or row) among them.
        fallback_units: units of the ordinary allocation made where the
            driver's virtual memory cannot be had (the CPU, or a device,
            driver or cuda-bindings without it; default ``min_units``): then
            ``max_units`` is this, every unit stays allocated, and
            ``backing().fallback`` says why.
        device: a CUDA device (default: the current one) or the CPU.

    ``units`` is what is backed (unit ids below it), ``limit`` the same on
    the device. ``back(units, in_use=...)`` grows or shrinks the backing,
    ``back_from_free(margin_bytes)`` grows it by what the device has free
    beyond a margin, ``drop()`` keeps ``min_units`` only, ``close()`` gives
    everything back; a manager built with ``ManagerOptions(kv_cache=...)``
    calls them under its step lock (``back_kv_cache``, ``drop_kv_cache``).
    Newly backed units read as zeros (a memset on the current stream): what
    a unit held before it was given back is gone. Bad arguments raise
    ``ValueError`` naming them, before anything changes; so does any use
    after ``close()``. Thread-safe.
    """

    __slots__ = (
        "_changes",
        "_lock",
        "_seconds",
        "_tensor",
        "_units",
        "dtype",
        "limit",
        "max_units",
        "memory",
        "min_units",
        "unit_bytes",
        "unit_shape",
    )

    def __init__(
        self,
        unit_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        max_units: int | None = None,
        min_units: int = 1,
        fallback_units: int | None = None,
        device: torch.device | str | int | None = None,
    ) -> None:
        shape = check_dims("unit_shape", unit_shape, minimum=1)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r:.80}")
        check_int("min_units", min_units, minimum=1)
        fallback = (
            min_units if fallback_units is None else check_int("fallback_units", fallback_units, minimum=1)
        )
        if fallback < min_units:
            raise ValueError(f"fallback_units: expected at least min_units={min_units}, got {fallback}")
        where = resolve_device(device)
        unit_bytes = dtype.itemsize
        for dim in shape:
            unit_bytes *= dim
        if max_units is None:
            total = torch.cuda.get_device_properties(where).total_memory if where.type == "cuda" else 0
            max_units = max(total // unit_bytes, min_units)
        check_int("max_units", max_units, minimum=min_units)
        self.unit_shape: Final = shape
        self.dtype: Final = dtype
        self.unit_bytes: Final = unit_bytes
        self.min_units: Final = min_units
        self.memory: Final = ReservedMemory(
            max_units * unit_bytes, device=where, fallback_size=fallback * unit_bytes
        )
        #: Units the reservation holds (a fallback's: its allocation's).
        self.max_units: Final = max_units if self.memory.fallback is None else fallback
        self._lock: Final = threading.Lock()
        self._tensor: torch.Tensor | None = self.memory.view(dtype, (self.max_units, *shape))
        self._units = self.max_units if self.memory.fallback is not None else 0
        self._seconds, self._changes = 0.0, 0
        #: ``[]`` int64 on the device: the backed units (``units``), updated in place on the current stream.
        self.limit: Final = torch.zeros((), dtype=torch.int64, device=where)
        if self.memory.fallback is None:
            self._back_bytes(min_units * unit_bytes)
        else:
            self.memory.view(torch.uint8, (self.memory.size,)).zero_()
            self.limit.fill_(self._units)

    # -- what is backed --

    @property
    def device(self) -> torch.device:
        return self.memory.device

    @property
    def units(self) -> int:
        """The units backed now: ids below this may be handed out and read by steps (0 once closed)."""
        return self._units

    @property
    def tensor(self) -> torch.Tensor:
        """``[max_units, *unit_shape]`` over the whole reservation, backed or not (the caches' base)."""
        tensor = self._tensor
        if tensor is None:
            raise ValueError("tensor: this KVCacheMemory is closed")
        return tensor

    def backing(self) -> KVCacheBacking:
        """How much is backed now, and what the last change took."""
        memory = self.memory
        return KVCacheBacking(
            units=self._units,
            max_units=self.max_units,
            unit_bytes=self.unit_bytes,
            backed_bytes=memory.backed_bytes,
            reserved_bytes=memory.size,
            chunk_bytes=memory.granularity,
            mappings=len(memory.mappings),
            seconds=self._seconds,
            changes=self._changes,
            fallback=memory.fallback,
        )

    # -- changing it --

    def back(self, units: int, *, in_use: Iterable[int] | torch.Tensor | None = None) -> int:
        """Back ``units`` units (at least: a mapping's rest is backed too); synchronizes the device.

        Growing needs their memory free on the device (torch's cached blocks
        are given back first where that makes room); shrinking may keep more
        than ``units`` backed (a mapping is unmapped whole:
        ``ReservedMemory.back``).

        Args:
            units: the units to back, from ``min_units`` to ``max_units``.
            in_use: for a shrink, the ids of the units in use (an iterable of
                ints or an integer tensor; ``()`` for none).

        Returns:
            The units backed after.

        Raises:
            ValueError: naming ``units`` (out of range, or its memory not
                free) or ``in_use`` (missing for a shrink, or a unit at or past
                ``units``); nothing changed. Also once closed.
        """
        check_int("units", units, minimum=self.min_units, maximum=self.max_units)
        with self._lock:
            self._open("back")
            start = time.perf_counter()
            if units < self._units:
                _check_in_use(in_use, units, self._units)
            if self.memory.fallback is not None:
                self._units = units
                self.limit.fill_(units)
            else:
                wanted = units * self.unit_bytes
                _check_room(self.memory, wanted, "units", f"{units} units")
                self._back_bytes(wanted)
            self._seconds, self._changes = time.perf_counter() - start, self._changes + 1
            return self._units

    def back_from_free(self, margin_bytes: int) -> int:
        """Grow the backing by what the device has free beyond ``margin_bytes``.

        Free memory is measured as the driver can give it: torch's cached
        blocks that hold no tensor are given back to the device first
        (``torch.cuda.empty_cache()``; ``cudaMemGetInfo`` counts them as
        used, and the driver cannot back the cache with them). What stays
        free is then ``margin_bytes`` to within one chunk, unless the
        reservation was backed whole first; a fallback allocation's units all
        come back, nothing more.

        Args:
            margin_bytes: the device memory to leave free.

        Returns:
            The units backed after.

        Raises:
            ValueError: naming ``margin_bytes`` where less than it is free (or
                the device does not say); nothing changed. Also once closed.
        """
        check_int("margin_bytes", margin_bytes, minimum=0)
        with self._lock:
            self._open("back_from_free")
            start = time.perf_counter()
            memory = self.memory
            if memory.fallback is not None:
                self._units = self.max_units
                self.limit.fill_(self._units)
            else:
                free = backable_bytes(self.device, release_cache=True)
                if free is None:
                    raise ValueError(f"margin_bytes: {self.device} does not say how much memory it has free")
                if free < margin_bytes:
                    raise ValueError(
                        f"margin_bytes: the device has {free} bytes free, less than the margin of "
                        f"{margin_bytes}; nothing was backed"
                    )
                room = (free - margin_bytes) // memory.granularity * memory.granularity
                self._back_bytes(min(memory.size, memory.backed_bytes + room))
            self._seconds, self._changes = time.perf_counter() - start, self._changes + 1
            return self._units

    def drop(self) -> int:
        """Keep ``min_units`` backed and give the rest back (a sleep that keeps the graphs); synchronizes.

        What the dropped units held is gone.

        Returns:
            The units backed after.

        Raises:
            ValueError: once closed.
        """
        with self._lock:
            self._open("drop")
            start = time.perf_counter()
            if self.memory.fallback is not None:
                self._units = self.min_units
                self.limit.fill_(self._units)
            else:
                self._back_bytes(self.min_units * self.unit_bytes)
            self._seconds, self._changes = time.perf_counter() - start, self._changes + 1
            return self._units

    def close(self) -> None:
        """Give all of it back (synchronizes). Views alive then point at unbacked memory: drop them first.

        The graphs that read the cache must not replay afterwards (free them
        first: ``release()``).

        Raises:
            ValueError: a second call.
        """
        with self._lock:
            self._open("close")
            self.limit.fill_(0)
            self._tensor, self._units = None, 0
            self.memory.close()

    def __repr__(self) -> str:
        return f"KVCacheMemory({self.backing()}, unit {list(self.unit_shape)} {self.dtype} on {self.device})"

    def _open(self, what: str) -> None:
        if self._tensor is None:
            raise ValueError(f"{what}: this KVCacheMemory is closed")

    def _back_bytes(self, nbytes: int) -> None:
        """Back the first ``nbytes``; zero the new units, move ``limit`` (first, on a shrink)."""
        memory = self.memory
        at_least = min(self.max_units, nbytes // self.unit_bytes)
        if at_least < self._units:  # steps queued from now on read the smaller limit, before the unmap
            self.limit.fill_(at_least)
        first_new = self._units * self.unit_bytes  # a unit partly backed before is new too
        after = memory.back(nbytes)
        self._units = min(self.max_units, after // self.unit_bytes)
        if after > first_new:
            memory.view(torch.uint8, (after - first_new,), offset=first_new).zero_()
        self.limit.fill_(self._units)


def backable_bytes(device: torch.device, *, release_cache: bool) -> int | None:
    """What the driver can give a cache on ``device`` now (``None`` off CUDA: unknown).

    ``cudaMemGetInfo`` counts torch's cached blocks (reserved, holding no
    tensor) as used, and ``cuMemCreate`` cannot take them. With
    ``release_cache``, ``empty_cache()`` first gives back every cached
    segment that holds no tensor; a segment part of which a tensor (or a live
    graph's pool) still uses stays torch's, and its free blocks are neither
    counted free nor available to the cache: the figure is exactly what the
    driver can back.
    """
    if device.type != "cuda":
        return None
    if release_cache:
        empty_cache(device)  # under the capture lock: another manager may be capturing on the device
    return free_bytes(device)


def _check_room(memory: ReservedMemory, nbytes: int, name: str, what: str) -> None:
    """``ValueError`` naming ``name`` where backing ``nbytes`` needs more memory than the device has free."""
    rounded = -(-nbytes // memory.granularity) * memory.granularity
    need = rounded - memory.backed_bytes
    if need <= 0:
        return
    free = backable_bytes(memory.device, release_cache=False)
    if free is not None and need > free:
        free = backable_bytes(memory.device, release_cache=True)  # torch's cached blocks may make room
    if free is not None and need > free:
        raise ValueError(
            f"{name}: {what} need {need} more bytes of device memory; {memory.device} has {free} free "
            "(nothing was backed)"
        )


def _check_in_use(in_use: Iterable[int] | torch.Tensor | None, units: int, now: int) -> None:
    """``ValueError`` naming ``in_use`` unless every unit it names lies below ``units`` (a shrink)."""
    if in_use is None:
        raise ValueError(
            f"in_use: shrinking from {now} to {units} units needs the ids of the units in use "
            "(in_use=() where none is)"
        )
    if isinstance(in_use, torch.Tensor):
        if in_use.is_floating_point() or in_use.is_complex() or in_use.dtype is torch.bool:
            raise ValueError(f"in_use: expected unit ids (an integer tensor), got a {in_use.dtype} tensor")
        past = in_use[in_use >= units].flatten().tolist()  # one synchronization, off the step path
    else:
        given: object = in_use
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise ValueError(f"in_use: expected unit ids (an iterable of ints), got {in_use!r:.80}")
        ids = list(given)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"in_use: expected unit ids (ints), got {ids!r:.80}")
        past = [i for i in ids if i >= units]
    if past:
        raise ValueError(
            f"in_use: unit(s) {sorted(past)[:5]} in use lie at or past the new end {units}: free them "
            "first (nothing was changed)"
        )
