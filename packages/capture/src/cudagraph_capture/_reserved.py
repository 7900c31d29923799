"""Device memory reserved as addresses first and backed later: the driver's virtual memory management.

A graph records addresses, not pages. ``ReservedMemory`` reserves a range of
virtual addresses on a CUDA device (``cuMemAddressReserve``: no memory yet),
hands out tensors over it without a copy (``view``), and backs any prefix of
it with device memory later (``back``: ``cuMemCreate``, ``cuMemMap``,
``cuMemSetAccess``; shrinking: ``cuMemUnmap``, ``cuMemRelease``), so graphs
captured against the range replay once it is backed, and keep replaying
while it grows, shrinks, or is dropped and backed again.

Backing is exact to the device's granularity (2 MiB on an H100 or H200) and
fast: the bytes to back are cut into few mappings (``plan_mappings``: powers
of two times the granularity, largest first, at most ``MAX_MAPPING_BYTES``
each), since each mapping costs a few tens of microseconds whatever its
size. A mapping is unmapped whole (``cuMemUnmap`` takes the exact range), so
a shrink ends at the first mapping boundary at or above the end asked for.

Where the device, the driver or cuda-bindings cannot do this (and on a
CPU), the same object is an ordinary allocation of the size the caller gives
(``fallback``: why). cuda-bindings is imported only when a reservation is
made on a CUDA device; ``VirtualMemory`` types the calls made here (the fake
of the tests implements it over host memory).
"""

# ruff: noqa: N802  (the protocols spell the CUDA API's names)

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Protocol, SupportsInt, TypeVar, cast

import torch

from cudagraph_dispatch._checks import check_dims
from cudagraph_dispatch.lowlevel import check_int

from ._device import resolve_device

#: The largest mapping ``back`` makes: larger ones would make shrinking coarser, not backing faster.
MAX_MAPPING_BYTES: Final = 1 << 30
#: ``CUDA_ERROR_OUT_OF_MEMORY``: ``cuMemCreate`` found too little free memory.
_OUT_OF_MEMORY: Final = 2

Status = SupportsInt  # a CUresult: 0 is success
T = TypeVar("T")


class VirtualMemory(Protocol):
    """The driver's virtual memory calls on one device (``CudaVirtualMemory``, or a test's fake).

    Each raises ``RuntimeError`` naming the call where the driver refuses
    (``torch.OutOfMemoryError`` where ``create`` finds too little memory).
    """

    @property
    def granularity(self) -> int:
        """Sizes and offsets of mappings are multiples of this (``CU_MEM_ALLOC_GRANULARITY_MINIMUM``)."""
        ...

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of addresses (a multiple of the granularity); the first address."""
        ...

    def free(self, address: int, size: int) -> None:
        """Give a reserved range back (nothing may be mapped in it)."""
        ...

    def create(self, size: int) -> object:
        """Device memory of ``size`` bytes, not mapped anywhere yet: its handle."""
        ...

    def map(self, address: int, size: int, handle: object) -> None:
        """Map ``handle``'s memory at ``address`` (the whole of it)."""
        ...

    def allow(self, address: int, size: int) -> None:
        """Let the device read and write the mapped range (every mapping needs it once)."""
        ...

    def unmap(self, address: int, size: int) -> None:
        """Unmap the range one ``map`` mapped, exactly."""
        ...

    def release(self, handle: object) -> None:
        """Give ``create``'s memory back (once unmapped)."""
        ...


def plan_mappings(nbytes: int, granularity: int, largest: int = MAX_MAPPING_BYTES) -> list[int]:
    """The mappings that back ``nbytes`` (a multiple of ``granularity``): sizes, in address order.

    Chunks of ``largest`` (rounded down to a power of two times the
    granularity) first, then the rest as powers of two times the
    granularity, largest first: at most ``nbytes // largest`` plus
    log2(``largest / granularity``) + 1 mappings, exact to the granularity.
    """
    if nbytes % granularity:
        raise ValueError(f"nbytes: {nbytes} is not a multiple of the granularity {granularity}")
    top = granularity << max(0, (largest // granularity).bit_length() - 1)  # a power of two times it
    sizes = [top] * (nbytes // top)
    rest = (nbytes % top) // granularity
    for bit in reversed(range(rest.bit_length())):
        if rest >> bit & 1:
            sizes.append(granularity << bit)
    return sizes


@dataclasses.dataclass(frozen=True, slots=True)
class _Mapping:
    """One mapping: ``size`` bytes at ``offset`` in the range, from ``handle``'s memory."""

    offset: int
    size: int
    handle: object


class _Range:
    """What the driver holds for one reservation: its addresses and mappings (every view keeps it alive).

    A finalizer gives everything back once neither the ``ReservedMemory``
    nor any tensor over the range is alive; ``close()`` gives the memory back
    at once, and the addresses once the views are gone (a stale view then
    never reads another allocation's memory).
    """

    __slots__ = ("__weakref__", "base", "mappings", "vmm")

    def __init__(self, vmm: VirtualMemory, size: int, device: torch.device) -> None:
        self.vmm: Final = vmm
        self.base: Final = vmm.reserve(size)
        self.mappings: Final[list[_Mapping]] = []
        finalizer = weakref.finalize(self, _give_back, vmm, self.base, size, self.mappings, device)
        finalizer.atexit = False  # the driver frees a process's memory when it exits


def _give_back(
    vmm: VirtualMemory, base: int, size: int, mappings: list[_Mapping], device: torch.device
) -> None:
    """Unmap and release every mapping, last first, then free the addresses (a finalizer: never raises)."""
    with contextlib.suppress(Exception):
        if mappings:
            _synchronize(device)  # a graph queued before the last view went may still read them
        _unmap(vmm, base, mappings, len(mappings))
        vmm.free(base, size)


def _unmap(vmm: VirtualMemory, base: int, mappings: list[_Mapping], count: int) -> None:
    """Unmap and release the last ``count`` mappings, last first; each leaves the list once unmapped."""
    for _ in range(count):
        mapping = mappings[-1]
        vmm.unmap(base + mapping.offset, mapping.size)
        mappings.pop()
        vmm.release(mapping.handle)


class ReservedMemory:
    """A range of device addresses reserved once, any prefix of it backed by device memory on demand.

    ``view(dtype, shape, offset=0)`` is a tensor over the range, backed or
    not: graphs may be captured against it before its bytes are backed, and
    replayed once they are (a kernel that touches an unbacked byte faults the
    CUDA context, which ends the process's use of the device). ``back(n)``
    backs the first ``n`` bytes (rounded up to the granularity) or, where
    fewer are asked for than are backed, unbacks the rest down to the first
    mapping boundary at or above ``n``; ``backed_bytes`` is exactly what is
    backed. Contents of newly backed bytes are undefined (memory given back
    and backed again holds nothing of what it held). ``close()`` gives the
    memory back; views alive then point at unbacked addresses (the addresses
    stay reserved until the last view is gone). Thread-safe.

    Args:
        size: bytes of addresses to reserve (rounded up to the granularity).
            Addresses cost no memory: a range larger than the device is fine.
        device: the CUDA device (default: the current one), or the CPU.
        fallback_size: bytes of an ordinary allocation made instead where
            virtual memory cannot be had (the CPU; a device, driver or
            cuda-bindings without it): then ``size`` is this, every byte is
            backed for good, and ``fallback`` says why.

    Raises:
        ValueError: a bad argument, naming it (any use after ``close()``
            too); nothing changes then.
    """

    __slots__ = ("_base", "_lock", "_range", "device", "fallback", "granularity", "size")

    def __init__(
        self, size: int, *, device: torch.device | str | int | None = None, fallback_size: int = 0
    ) -> None:
        check_int("size", size, minimum=1)
        check_int("fallback_size", fallback_size, minimum=0)
        where = resolve_device(device)
        self.device: Final = where
        self._lock: Final = threading.Lock()
        opened = vmm_for(where)
        self._range: _Range | None = None
        if isinstance(opened, str):
            #: Why this is an ordinary allocation (``None``: reserved addresses, backed on demand).
            self.fallback: str | None = opened
            self.size: int = fallback_size
            self.granularity: int = max(fallback_size, 1)  # all of it at once
            self._base: torch.Tensor | None = torch.empty(fallback_size, dtype=torch.uint8, device=where)
            return
        self.fallback = None
        self.granularity = opened.granularity
        self.size = -(-size // opened.granularity) * opened.granularity
        self._range = _Range(opened, self.size, where)
        self._base = wrap_pointer(self._range.base, self.size, where, self._range)

    # -- what is backed --

    @property
    def closed(self) -> bool:
        return self._base is None

    @property
    def backed_bytes(self) -> int:
        """How many bytes from the start are backed by device memory (0 once closed)."""
        if self._range is None:
            return 0 if self._base is None else self.size
        return sum(mapping.size for mapping in self._range.mappings)

    @property
    def mappings(self) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` of each mapping that backs the range, in address order (a fallback's: one)."""
        if self._range is None:
            return () if self._base is None else ((0, self.size),)
        return tuple((mapping.offset, mapping.size) for mapping in self._range.mappings)

    # -- views --

    def view(self, dtype: torch.dtype, shape: Sequence[int], *, offset: int = 0) -> torch.Tensor:
        """A tensor over the range, backed or not; no copy.

        The tensor keeps the addresses reserved, not the memory: see the class.

        Args:
            dtype: the tensor's dtype.
            shape: its shape, non-negative ints.
            offset: the byte it starts at, a multiple of ``dtype``'s size.

        Returns:
            The view, ``shape`` of ``dtype`` from byte ``offset``.

        Raises:
            ValueError: a bad argument, a view past the reservation's end, or
                the reservation closed, naming it.
        """
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r:.80}")
        dims = check_dims("shape", shape, minimum=0)
        check_int("offset", offset, minimum=0)
        if offset % dtype.itemsize:
            raise ValueError(f"offset: {offset} is not a multiple of {dtype}'s {dtype.itemsize} bytes")
        count = 1
        for dim in dims:
            count *= dim
        base = self._open("view")
        end = offset + count * dtype.itemsize
        if end > self.size:
            raise ValueError(
                f"shape: {list(dims)} of {dtype} from offset {offset} ends at byte {end}, past the "
                f"reservation's {self.size}"
            )
        return base[offset:end].view(dtype).view(dims)

    # -- backing --

    def back(self, nbytes: int) -> int:
        """Back the first ``nbytes`` bytes (rounded up to the granularity); fewer than now unbacks the rest.

        Growing maps new memory after what is backed; queued device work is
        not waited for (new bytes are not read by anything queued). Shrinking
        synchronizes the device first (queued work may still read the bytes),
        then unmaps the mappings past the first mapping boundary at or above
        ``nbytes``. A fallback allocation stays whole.

        Args:
            nbytes: the bytes to back, from 0 to ``size``.

        Returns:
            ``backed_bytes``, exactly what is backed now.

        Raises:
            ValueError: ``nbytes`` out of range, or the reservation closed.
            torch.OutOfMemoryError: the device has too little free memory;
                nothing changes then.
            RuntimeError: the driver refused; nothing new is backed.
        """
        check_int("nbytes", nbytes, minimum=0)
        with self._lock:
            self._open("back")
            if nbytes > self.size:
                raise ValueError(f"nbytes: {nbytes} is more than the reservation's {self.size} bytes")
            if self._range is not None:
                rounded = -(-nbytes // self.granularity) * self.granularity
                backed = self.backed_bytes
                if rounded > backed:
                    self._grow(self._range, backed, rounded)
                elif rounded < backed:
                    self._shrink(self._range, rounded)
            return self.backed_bytes

    def close(self) -> None:
        """Give the memory back (synchronizes the device); a second call raises ``ValueError``."""
        with self._lock:
            self._open("close")
            the_range, self._range, self._base = self._range, None, None
            if the_range is not None:
                _synchronize(self.device)
                _unmap(the_range.vmm, the_range.base, the_range.mappings, len(the_range.mappings))
            # The addresses go with the last view (the range's finalizer): at once where there is none.

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.backed_bytes} of {self.size} bytes backed"
        how = f"fallback: {self.fallback}" if self.fallback else f"granularity {self.granularity}"
        return f"ReservedMemory({state} on {self.device}, {how})"

    def _open(self, what: str) -> torch.Tensor:
        base = self._base
        if base is None:
            raise ValueError(f"{what}: this ReservedMemory is closed")
        return base

    def _grow(self, the_range: _Range, backed: int, end: int) -> None:
        """Map ``[backed, end)`` in ``plan_mappings``' chunks; all or nothing."""
        vmm, mappings = the_range.vmm, the_range.mappings
        made = 0
        try:
            offset = backed
            for size in plan_mappings(end - backed, self.granularity):
                handle = vmm.create(size)
                try:
                    vmm.map(the_range.base + offset, size, handle)
                except BaseException:
                    vmm.release(handle)
                    raise
                mappings.append(_Mapping(offset, size, handle))
                made += 1
                offset += size
            vmm.allow(the_range.base + backed, end - backed)  # one call for the new mappings
        except BaseException:
            _unmap(vmm, the_range.base, mappings, made)
            raise

    def _shrink(self, the_range: _Range, end: int) -> None:
        """Unmap every mapping that starts at or past ``end`` (the one holding ``end`` stays whole)."""
        count = sum(1 for mapping in the_range.mappings if mapping.offset >= end)
        if count:
            _synchronize(self.device)
            _unmap(the_range.vmm, the_range.base, the_range.mappings, count)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (it may read memory about to be unmapped)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# A raw device pointer as a torch tensor, without a copy
# ---------------------------------------------------------------------------


def wrap_pointer(pointer: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    """``[nbytes]`` uint8 over memory at ``pointer`` on ``device``; the tensor keeps ``owner`` alive.

    Through a DLPack capsule (torch's ``fromDLPack`` queries nothing about
    the pointer, which may not be backed yet), else ``__cuda_array_interface__``.
    """
    errors = []
    for make in (_from_dlpack, _from_cuda_array_interface):
        try:
            tensor = make(pointer, nbytes, device, owner)
        except Exception as error:  # a torch that refuses this way: try the other
            errors.append(f"{make.__name__}: {type(error).__name__}: {error}")
            continue
        if tensor.data_ptr() == pointer and tensor.device == device and tensor.numel() == nbytes:
            return tensor
        errors.append(f"{make.__name__}: gave a tensor at {tensor.data_ptr():#x} on {tensor.device}")
    raise RuntimeError(f"cannot wrap {nbytes} bytes at {pointer:#x} on {device} as a tensor: {errors}")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


#: DLPack's device types (dlpack.h) and its unsigned integer type code.
_KDL_CPU: Final = 1
_KDL_CUDA: Final = 2
_KDL_UINT: Final = 1
#: What a capsule torch holds keeps alive (its struct, shape, stride and owner), by the struct's address.
_capsules: Final[dict[int, tuple[object, ...]]] = {}


def _let_go(address: int | None) -> None:
    """torch is done with a capsule's tensor: let go of what it kept alive (never raises: C calls it)."""
    with contextlib.suppress(Exception):  # at interpreter exit the registry may be gone already
        _capsules.pop(address or 0, None)


#: The capsules' deleter, a C function pointer alive as long as the module.
_dlpack_deleter: Final = _Deleter(_let_go)
#: ``PyCapsule_New`` with its own prototype (``ctypes.pythonapi``'s is shared by the whole process).
_new_capsule: Final = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)


def _from_dlpack(pointer: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    shape = (ctypes.c_int64 * 1)(nbytes)
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = pointer
    kind = _KDL_CUDA if device.type == "cuda" else _KDL_CPU
    managed.dl_tensor.device = _DLDevice(kind, device.index or 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _dlpack_deleter
    address = ctypes.addressof(managed)
    _capsules[address] = (managed, shape, strides, owner)
    try:
        capsule = _new_capsule(address, b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _capsules.pop(address, None)
        raise


class _CudaArray:
    """``__cuda_array_interface__`` (v3) over a raw pointer; the tensor torch makes of it keeps this alive."""

    def __init__(self, pointer: int, nbytes: int, owner: object) -> None:
        self.owner: Final = owner
        self.__cuda_array_interface__: Final = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


def _from_cuda_array_interface(
    pointer: int, nbytes: int, device: torch.device, owner: object
) -> torch.Tensor:
    if device.type != "cuda":
        raise ValueError(f"device: __cuda_array_interface__ describes CUDA memory, not {device}")
    return torch.as_tensor(_CudaArray(pointer, nbytes, owner), device=device)


# ---------------------------------------------------------------------------
# cuda-bindings, typed: only what this layer calls
# ---------------------------------------------------------------------------


class _Location(Protocol):  # CUmemLocation
    type: object
    id: int


class _AllocationProp(Protocol):  # CUmemAllocationProp
    type: object

    @property
    def location(self) -> _Location: ...


class _AccessDesc(Protocol):  # CUmemAccessDesc
    flags: object

    @property
    def location(self) -> _Location: ...


class _AllocationTypes(Protocol):
    CU_MEM_ALLOCATION_TYPE_PINNED: object


class _LocationTypes(Protocol):
    CU_MEM_LOCATION_TYPE_DEVICE: object


class _GranularityFlags(Protocol):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM: object


class _AccessFlags(Protocol):
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE: object


class _Attributes(Protocol):
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: object


class _Driver(Protocol):  # cuda.bindings.driver
    CUmemAllocationType: _AllocationTypes
    CUmemLocationType: _LocationTypes
    CUmemAllocationGranularity_flags: _GranularityFlags
    CUmemAccess_flags: _AccessFlags
    CUdevice_attribute: _Attributes

    def CUmemAllocationProp(self) -> _AllocationProp: ...
    def CUmemAccessDesc(self) -> _AccessDesc: ...
    def cuDeviceGet(self, ordinal: int) -> tuple[Status, object]: ...
    def cuDeviceGetAttribute(self, attribute: object, device: object) -> tuple[Status, int]: ...
    def cuMemGetAllocationGranularity(self, prop: _AllocationProp, option: object) -> tuple[Status, int]: ...
    def cuMemAddressReserve(
        self, size: int, alignment: int, address: int, flags: int
    ) -> tuple[Status, SupportsInt]: ...
    def cuMemAddressFree(self, address: int, size: int) -> tuple[Status]: ...
    def cuMemCreate(self, size: int, prop: _AllocationProp, flags: int) -> tuple[Status, object]: ...
    def cuMemRelease(self, handle: object) -> tuple[Status]: ...
    def cuMemMap(self, address: int, size: int, offset: int, handle: object, flags: int) -> tuple[Status]: ...
    def cuMemUnmap(self, address: int, size: int) -> tuple[Status]: ...
    def cuMemSetAccess(
        self, address: int, size: int, descs: Sequence[_AccessDesc], count: int
    ) -> tuple[Status]: ...


def _value(what: str, result: tuple[Status, T]) -> T:
    """The value of a ``(status, value)`` result; an error naming ``what`` otherwise."""
    _done(what, (result[0],))
    return result[1]


def _done(what: str, result: tuple[Status]) -> None:
    """Check a ``(status,)`` result: ``torch.OutOfMemoryError`` or ``RuntimeError`` naming ``what``."""
    status = result[0]
    if int(status) == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"{what}: the device is out of memory ({status!r})")
    if int(status) != 0:
        raise RuntimeError(f"{what} failed: {status!r}")


class CudaVirtualMemory:
    """``VirtualMemory`` over cuda-bindings' driver API, on one device's primary context (torch's)."""

    __slots__ = ("_access", "_device", "_driver", "_prop", "granularity")

    def __init__(self, driver: _Driver, device: int) -> None:
        self._driver: Final = driver
        self._device: Final = device
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop: Final = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access: Final = access
        minimum = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        with self._current():
            self.granularity: Final = int(
                _value("cuMemGetAllocationGranularity", driver.cuMemGetAllocationGranularity(prop, minimum))
            )

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """The device's primary context current on this thread (a runtime call makes it so)."""
        with torch.cuda.device(self._device):
            torch.cuda.current_stream(self._device).query()
            yield

    def reserve(self, size: int) -> int:
        with self._current():
            address = self._driver.cuMemAddressReserve(size, self.granularity, 0, 0)
            return int(_value("cuMemAddressReserve", address))

    def free(self, address: int, size: int) -> None:
        with self._current():
            _done("cuMemAddressFree", self._driver.cuMemAddressFree(address, size))

    def create(self, size: int) -> object:
        with self._current():
            return _value("cuMemCreate", self._driver.cuMemCreate(size, self._prop, 0))

    def map(self, address: int, size: int, handle: object) -> None:
        with self._current():
            _done("cuMemMap", self._driver.cuMemMap(address, size, 0, handle, 0))

    def allow(self, address: int, size: int) -> None:
        with self._current():
            _done("cuMemSetAccess", self._driver.cuMemSetAccess(address, size, [self._access], 1))

    def unmap(self, address: int, size: int) -> None:
        with self._current():
            _done("cuMemUnmap", self._driver.cuMemUnmap(address, size))

    def release(self, handle: object) -> None:
        with self._current():
            _done("cuMemRelease", self._driver.cuMemRelease(handle))


def open_virtual_memory(
    device: torch.device, import_module: Callable[[str], object] = importlib.import_module
) -> VirtualMemory | str:
    """The driver's virtual memory on ``device``, or why there is none (the fallback's reason), uncached."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    try:
        driver = cast(_Driver, import_module("cuda.bindings.driver"))
    except ImportError as error:
        return f"cuda-bindings is not installed (cannot import {error.name or 'cuda.bindings.driver'})"
    index = device.index or 0
    try:
        with torch.cuda.device(index):
            torch.cuda.current_stream(index).query()
            handle = _value("cuDeviceGet", driver.cuDeviceGet(index))
            attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            supported = _value("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(attribute, handle))
        if not supported:
            return f"{device} does not support virtual memory management"
        return CudaVirtualMemory(driver, index)
    except Exception as error:  # an error status, or bindings whose API differs
        return f"the driver's virtual memory is not usable here ({type(error).__name__}: {error})"


_opened: Final[dict[torch.device, VirtualMemory | str]] = {}
_opened_lock: Final = threading.Lock()


def vmm_for(device: torch.device) -> VirtualMemory | str:
    """``open_virtual_memory(device)``, once per device and process (a reason is kept too)."""
    with _opened_lock:
        opened = _opened.get(device)
        if opened is None:
            opened = _opened[device] = open_virtual_memory(device)
        return opened
