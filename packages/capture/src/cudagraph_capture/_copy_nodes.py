"""A WHILE body's device-to-device memcpy nodes rewritten as copy kernels (``_conditional``'s loop).

torch records a contiguous ``copy_`` between device tensors as a memcpy node;
the paged decode loop's body holds 11 to 13 of them (each layer's attention
output, the advance's next inputs), while the synthetic bodies, whose WHILE
loops cost nothing over back-to-back replays on a 460 us step, hold none.
Issue 40 measured the manager loop's cost per iteration over its floor
growing with the batch (1.7, 7.2, 29.3 us at 1, 8, 64 requests; the bytes
those copies move grow with it). Whether the memcpy nodes of a WHILE body
are that cost is what ``tests/benchmarks/loop_floor_ab.py`` measures, with
this rewrite on and off in one run (``CopyRewrite.on``). The rewrite
edits ``_conditional``'s own clone of the body (never torch's graph): each
memcpy node that copies one contiguous run of device bytes becomes a launch
of ``loop_copy`` (``COPY_KERNEL``) with the same edges in and out. Any other
memcpy node (2D or 3D, host memory), or one the driver will not rewire,
stays as it is: the rewrite changes how a copy runs, never what the body
computes.
"""

# ruff: noqa: N802  (the protocols spell the CUDA API's names)

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Sequence
from typing import Final, Protocol, SupportsInt


class CopyRewrite:
    """Whether ``_conditional`` rewrites a WHILE body's device memcpy nodes as ``loop_copy`` kernels."""

    on: bool = True  # the loop benchmark's A/B flips it around a capture


#: The copy kernel, compiled with the condition kernels (``_conditional._SOURCE``; braces doubled
#: for its ``format``). 16 bytes a thread where both addresses and the size allow, else bytes.
COPY_KERNEL: Final = r"""
struct alignas(16) LoopChunk {{ unsigned long long low, high; }};

// One memcpy node of a loop body as a kernel: n bytes from src to dst (the ranges do not overlap).
extern "C" __global__ void loop_copy(unsigned char *dst, const unsigned char *src, unsigned long long n) {{
  unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  if ((((unsigned long long)dst | (unsigned long long)src | n) & 15ull) == 0ull) {{
    LoopChunk *to = (LoopChunk *)dst;
    const LoopChunk *from = (const LoopChunk *)src;
    for (unsigned long long i = first; i < n / 16; i += stride) to[i] = from[i];
  }} else {{
    for (unsigned long long i = first; i < n; i += stride) dst[i] = src[i];
  }}
}}
"""
THREADS: Final = 256
MAX_BLOCKS: Final = 1024
_DEVICE_MEMORY: Final = 2  # CU_MEMORYTYPE_DEVICE
_UNIFIED_MEMORY: Final = 4  # CU_MEMORYTYPE_UNIFIED: a pointer whose kind the driver says
_MEMCPY_NODE: Final = 1  # CU_GRAPH_NODE_TYPE_MEMCPY

Status = SupportsInt
KernelArg = ctypes.c_uint64 | ctypes.c_void_p | ctypes.c_int
#: Adds a kernel node: (graph, dependencies, function, grid, block, args) -> the node.
AddKernel = Callable[[object, Sequence[object], object, int, int, Sequence[KernelArg]], object]


class _Memcpy3D(Protocol):  # CUDA_MEMCPY3D: the fields read here (read-only)
    @property
    def srcMemoryType(self) -> SupportsInt: ...

    @property
    def srcDevice(self) -> SupportsInt: ...

    @property
    def srcXInBytes(self) -> int: ...

    @property
    def srcY(self) -> int: ...

    @property
    def srcZ(self) -> int: ...

    @property
    def dstMemoryType(self) -> SupportsInt: ...

    @property
    def dstDevice(self) -> SupportsInt: ...

    @property
    def dstXInBytes(self) -> int: ...

    @property
    def dstY(self) -> int: ...

    @property
    def dstZ(self) -> int: ...

    @property
    def WidthInBytes(self) -> int: ...

    @property
    def Height(self) -> int: ...

    @property
    def Depth(self) -> int: ...


class _PointerAttributes(Protocol):  # CUpointer_attribute
    @property
    def CU_POINTER_ATTRIBUTE_MEMORY_TYPE(self) -> object: ...


class GraphEditing(Protocol):  # cuda.bindings.driver: the calls that edit a body graph
    @property
    def CUpointer_attribute(self) -> _PointerAttributes: ...

    def cuGraphChildGraphNodeGetGraph(self, node: object) -> tuple[Status, object]: ...
    def cuGraphGetNodes(self, graph: object, count: int) -> tuple[object, ...]: ...
    def cuGraphNodeGetType(self, node: object) -> tuple[Status, SupportsInt]: ...
    def cuGraphMemcpyNodeGetParams(self, node: object) -> tuple[Status, _Memcpy3D]: ...
    def cuGraphNodeGetDependencies(self, node: object, count: int) -> tuple[object, ...]: ...
    def cuGraphNodeGetDependentNodes(self, node: object, count: int) -> tuple[object, ...]: ...
    def cuGraphAddDependencies(self, graph: object, *edges: object) -> tuple[Status]: ...
    def cuGraphDestroyNode(self, node: object) -> tuple[Status]: ...
    def cuPointerGetAttribute(self, attribute: object, pointer: int) -> tuple[Status, SupportsInt]: ...


class _EditError(RuntimeError):
    """A call that edits the body graph returned an error status."""


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceCopy:
    """One contiguous device-to-device copy: ``size`` bytes from ``src`` to ``dst``."""

    dst: int
    src: int
    size: int

    def blocks(self) -> int:
        """``loop_copy``'s grid for it: one thread per 16 bytes where aligned, else per byte."""
        aligned = (self.dst | self.src | self.size) % 16 == 0
        units = self.size // 16 if aligned else self.size
        return max(1, min(MAX_BLOCKS, -(-units // THREADS)))


@dataclasses.dataclass(frozen=True, slots=True)
class CopyCounts:
    """What a rewrite did: memcpy nodes now ``loop_copy`` kernels, and memcpy nodes left as they were."""

    kernels: int = 0
    kept: int = 0
    error: str = ""  # why the rewrite stopped early (the nodes rewritten by then stay rewritten)


def _ok(what: str, result: tuple[object, ...]) -> tuple[object, ...]:
    if int(result[0]) != 0:  # type: ignore[call-overload]  # a CUresult
        raise _EditError(f"{what} failed: {result[0]!r}")
    return result


def _nodes(what: str, call: Callable[[int], tuple[object, ...]]) -> list[object]:
    """A ``(status, nodes, [edge data,] count)`` query: called for the count, then for the nodes."""
    count = int(_ok(what, call(0))[-1])  # type: ignore[call-overload]  # a size_t
    if count == 0:
        return []
    listed = _ok(what, call(count))[1]
    assert isinstance(listed, list)
    return listed


def device_copy(driver: GraphEditing, params: _Memcpy3D) -> DeviceCopy | None:
    """The copy a memcpy node makes, if one contiguous run of device bytes; ``None`` otherwise."""
    flat = params.Height <= 1 and params.Depth <= 1 and params.WidthInBytes > 0
    if not flat or (params.srcY, params.srcZ, params.dstY, params.dstZ) != (0, 0, 0, 0):
        return None
    ends = ((params.srcMemoryType, params.srcDevice), (params.dstMemoryType, params.dstDevice))
    for kind, pointer in ends:
        if int(kind) == _UNIFIED_MEMORY:
            attribute = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE  # the enum, not 2
            status, found = driver.cuPointerGetAttribute(attribute, int(pointer))
            if int(status) != 0 or int(found) != _DEVICE_MEMORY:
                return None
        elif int(kind) != _DEVICE_MEMORY:
            return None
    dst = int(params.dstDevice) + params.dstXInBytes
    return DeviceCopy(dst, int(params.srcDevice) + params.srcXInBytes, params.WidthInBytes)


def copies_as_kernels(driver: GraphEditing, child: object, function: object, add: AddKernel) -> CopyCounts:
    """Rewrite the memcpy nodes of ``child``'s embedded graph as launches of ``function`` (``loop_copy``).

    ``child`` is the WHILE body's child graph node: its graph is the body's
    clone, edited in place. Returns how many became kernels and how many
    stayed memcpy nodes. An error listing the graph raises ``_EditError``
    (a ``RuntimeError``) before anything is changed.
    """
    graph = _ok("cuGraphChildGraphNodeGetGraph", driver.cuGraphChildGraphNodeGetGraph(child))[1]
    kernels = kept = 0
    for node in _nodes("cuGraphGetNodes", lambda count: driver.cuGraphGetNodes(graph, count)):
        node_type = _ok("cuGraphNodeGetType", driver.cuGraphNodeGetType(node))[1]
        if int(node_type) != _MEMCPY_NODE:  # type: ignore[call-overload]  # a CUgraphNodeType
            continue
        if _replace(driver, graph, node, function, add):
            kernels += 1
        else:
            kept += 1
    return CopyCounts(kernels, kept)


def _replace(driver: GraphEditing, graph: object, node: object, function: object, add: AddKernel) -> bool:
    """The memcpy ``node`` replaced by a ``loop_copy`` launch with its edges; False where it is kept.

    The kernel node is wired in before the memcpy node goes: where wiring
    fails the kernel node is removed again and the memcpy stays; where only
    the removal fails, both copy the same bytes in the same order.
    """
    try:
        params = _ok("cuGraphMemcpyNodeGetParams", driver.cuGraphMemcpyNodeGetParams(node))[1]
        copy = device_copy(driver, params)  # type: ignore[arg-type]  # CUDA_MEMCPY3D
        if copy is None:
            return False
        before = _nodes("cuGraphNodeGetDependencies", lambda n: driver.cuGraphNodeGetDependencies(node, n))
        after = _nodes("cuGraphNodeGetDependentNodes", lambda n: driver.cuGraphNodeGetDependentNodes(node, n))
        args: list[KernelArg] = [
            ctypes.c_void_p(copy.dst),
            ctypes.c_void_p(copy.src),
            ctypes.c_uint64(copy.size),
        ]
        kernel = add(graph, before, function, copy.blocks(), THREADS, args)
    except Exception:  # an error status, or bindings whose API differs: the memcpy stays
        return False
    try:
        if after:
            _add_edges(driver, graph, [kernel] * len(after), after)
    except Exception:
        driver.cuGraphDestroyNode(kernel)
        return False
    driver.cuGraphDestroyNode(node)  # its edges go with it
    return True


def _add_edges(driver: GraphEditing, graph: object, sources: list[object], targets: list[object]) -> None:
    """Edges ``sources[i] -> targets[i]``: cuda-bindings 13 takes edge data (none), 12 does not."""
    try:
        result = driver.cuGraphAddDependencies(graph, sources, targets, None, len(sources))
    except TypeError:  # cuda-bindings 12: (graph, from, to, count)
        result = driver.cuGraphAddDependencies(graph, sources, targets, len(sources))
    _ok("cuGraphAddDependencies", result)
