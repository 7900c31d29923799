"""A WHILE body's memcpy nodes as copy kernels (``_copy_nodes``), against a fake graph of the driver's calls.

CPU only: which memcpy nodes are rewritten (one contiguous run of device
bytes) and which stay (2D, host memory, a unified pointer to host memory,
a driver that will not rewire), the kernel's arguments and grid, and the
edges the kernel takes over. The real rewrite runs in every GPU loop test
of ``test_loop.py`` (bodies with ``copy_``), and
``test_loop.py::test_gpu_while_body_copies_run_as_kernels_bit_for_bit``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Final

import pytest

from cudagraph_capture._copy_nodes import (
    MAX_BLOCKS,
    THREADS,
    CopyCounts,
    DeviceCopy,
    KernelArg,
    copies_as_kernels,
)

KERNEL, MEMCPY = 0, 1  # CU_GRAPH_NODE_TYPE_*
DEVICE, HOST, UNIFIED = 2, 1, 4  # CU_MEMORYTYPE_*
MEMORY_TYPE_ATTRIBUTE = object()  # CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE


@dataclasses.dataclass
class Memcpy3D:
    srcDevice: int  # noqa: N815  (CUDA_MEMCPY3D's names)
    dstDevice: int  # noqa: N815
    WidthInBytes: int
    srcMemoryType: int = DEVICE  # noqa: N815
    dstMemoryType: int = DEVICE  # noqa: N815
    srcXInBytes: int = 0  # noqa: N815
    dstXInBytes: int = 0  # noqa: N815
    srcY: int = 0  # noqa: N815
    srcZ: int = 0  # noqa: N815
    dstY: int = 0  # noqa: N815
    dstZ: int = 0  # noqa: N815
    Height: int = 1
    Depth: int = 1


@dataclasses.dataclass(frozen=True)
class PointerAttributes:  # CUpointer_attribute
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE: object = MEMORY_TYPE_ATTRIBUTE


@dataclasses.dataclass
class Launch:
    function: object
    blocks: int
    threads: int
    args: tuple[int, ...]


class FakeGraph:
    """One graph's nodes and edges, and the driver calls ``copies_as_kernels`` makes on it."""

    CUpointer_attribute: Final = PointerAttributes()

    def __init__(self, *, wire_fails: bool = False, host_pointers: Sequence[int] = ()) -> None:
        self.types: dict[str, int] = {}
        self.params: dict[str, Memcpy3D | Launch] = {}
        self.edges: set[tuple[str, str]] = set()
        self.wire_fails = wire_fails
        self.host_pointers = set(host_pointers)
        self._names = itertools.count()

    def node(self, kind: int, params: Memcpy3D | Launch | None = None, after: Sequence[str] = ()) -> str:
        name = f"{'k' if kind == KERNEL else 'm'}{next(self._names)}"
        self.types[name] = kind
        if params is not None:
            self.params[name] = params
        self.edges.update((dep, name) for dep in after)
        return name

    def add(
        self,
        graph: object,
        deps: Sequence[object],
        function: object,
        blocks: int,
        threads: int,
        args: Sequence[KernelArg],
    ) -> object:
        assert graph == "body"
        values = tuple(int(arg.value or 0) for arg in args)
        return self.node(KERNEL, Launch(function, blocks, threads, values), [str(d) for d in deps])

    # the driver's calls
    def cuGraphChildGraphNodeGetGraph(self, node: object) -> tuple[int, object]:  # noqa: N802
        assert node == "child"
        return 0, "body"

    def cuGraphGetNodes(self, graph: object, count: int) -> tuple[object, ...]:  # noqa: N802
        nodes = sorted(self.types)
        return (0, nodes[:count], len(nodes))

    def cuGraphNodeGetType(self, node: object) -> tuple[int, int]:  # noqa: N802
        return 0, self.types[str(node)]

    def cuGraphMemcpyNodeGetParams(self, node: object) -> tuple[int, Memcpy3D]:  # noqa: N802
        params = self.params[str(node)]
        assert isinstance(params, Memcpy3D)
        return 0, params

    def cuGraphNodeGetDependencies(self, node: object, count: int) -> tuple[object, ...]:  # noqa: N802
        found = sorted(a for a, b in self.edges if b == node)
        return (0, found[:count], [None] * min(count, len(found)), len(found))  # 13.x: edge data too

    def cuGraphNodeGetDependentNodes(self, node: object, count: int) -> tuple[object, ...]:  # noqa: N802
        found = sorted(b for a, b in self.edges if a == node)
        return (0, found[:count], [None] * min(count, len(found)), len(found))

    def cuGraphAddDependencies(self, graph: object, *edges: object) -> tuple[int]:  # noqa: N802
        sources, targets, data, count = edges
        assert data is None
        if self.wire_fails:
            return (1,)
        assert isinstance(sources, list)
        assert isinstance(targets, list)
        assert count == len(sources)
        self.edges.update(zip(map(str, sources), map(str, targets), strict=True))
        return (0,)

    def cuGraphDestroyNode(self, node: object) -> tuple[int]:  # noqa: N802
        del self.types[str(node)]
        self.params.pop(str(node), None)
        self.edges = {(a, b) for a, b in self.edges if node not in (a, b)}
        return (0,)

    def cuPointerGetAttribute(self, attribute: object, pointer: int) -> tuple[int, int]:  # noqa: N802
        assert attribute is MEMORY_TYPE_ATTRIBUTE  # the bindings take the enum member
        return 0, HOST if pointer in self.host_pointers else DEVICE

    def rewrite(self) -> CopyCounts:
        return copies_as_kernels(self, "child", "loop_copy", self.add)

    def launches(self) -> list[tuple[str, Launch]]:
        return [(n, p) for n, p in self.params.items() if isinstance(p, Launch)]


def test_a_device_copy_becomes_a_kernel_between_the_same_neighbours() -> None:
    graph = FakeGraph()
    first = graph.node(KERNEL)
    copy = graph.node(MEMCPY, Memcpy3D(0x1000, 0x9000, 4096, srcXInBytes=16, dstXInBytes=32), [first])
    last = graph.node(KERNEL, after=[copy])
    assert graph.rewrite() == CopyCounts(kernels=1, kept=0)
    assert copy not in graph.types
    ((kernel, launch),) = graph.launches()
    assert launch == Launch("loop_copy", 1, THREADS, (0x9000 + 32, 0x1000 + 16, 4096))  # dst, src, bytes
    assert graph.edges == {(first, kernel), (kernel, last)}


def test_a_root_and_a_leaf_copy_are_rewritten_too() -> None:
    graph = FakeGraph()
    root = graph.node(MEMCPY, Memcpy3D(0x1000, 0x2000, 8))
    middle = graph.node(KERNEL, after=[root])
    graph.node(MEMCPY, Memcpy3D(0x3000, 0x4000, 8), [middle])
    assert graph.rewrite() == CopyCounts(kernels=2, kept=0)
    kernels = {name for name, _ in graph.launches()}
    assert len(kernels) == 2
    assert {a for a, b in graph.edges} | {b for a, b in graph.edges} == kernels | {middle}
    assert set(graph.types.values()) == {KERNEL}


@pytest.mark.parametrize(
    "params",
    [
        Memcpy3D(0x1000, 0x2000, 64, Height=4),  # 2D
        Memcpy3D(0x1000, 0x2000, 64, Depth=2),  # 3D
        Memcpy3D(0x1000, 0x2000, 64, srcY=1),
        Memcpy3D(0x1000, 0x2000, 64, srcMemoryType=HOST),  # host to device
        Memcpy3D(0x1000, 0x2000, 64, dstMemoryType=HOST),  # device to host
        Memcpy3D(0x1000, 0x2000, 64, srcMemoryType=UNIFIED),  # a unified pointer to host memory
        Memcpy3D(0x1000, 0x2000, 0),  # nothing to copy
    ],
    ids=["2d", "3d", "row_offset", "from_host", "to_host", "unified_host", "empty"],
)
def test_a_copy_that_is_not_one_run_of_device_bytes_stays_a_memcpy(params: Memcpy3D) -> None:
    graph = FakeGraph(host_pointers=[0x1000])
    before = graph.node(KERNEL)
    copy = graph.node(MEMCPY, params, [before])
    assert graph.rewrite() == CopyCounts(kernels=0, kept=1)
    assert graph.types[copy] == MEMCPY
    assert graph.edges == {(before, copy)}


def test_a_unified_pointer_to_device_memory_is_rewritten() -> None:
    graph = FakeGraph()
    graph.node(MEMCPY, Memcpy3D(0x1000, 0x2000, 64, srcMemoryType=UNIFIED, dstMemoryType=UNIFIED))
    assert graph.rewrite() == CopyCounts(kernels=1, kept=0)


def test_a_driver_that_will_not_wire_the_kernel_keeps_the_memcpy_and_drops_the_kernel() -> None:
    graph = FakeGraph(wire_fails=True)
    copy = graph.node(MEMCPY, Memcpy3D(0x1000, 0x2000, 64))
    after = graph.node(KERNEL, after=[copy])
    assert graph.rewrite() == CopyCounts(kernels=0, kept=1)
    assert graph.types == {copy: MEMCPY, after: KERNEL}
    assert graph.edges == {(copy, after)}


@pytest.mark.parametrize(
    ("copy", "blocks"),
    [
        (DeviceCopy(0x1000, 0x2000, 1 << 20), (1 << 20) // 16 // THREADS),  # aligned: 16 bytes a thread
        (DeviceCopy(0x1001, 0x2000, 1 << 20), MAX_BLOCKS),  # unaligned: a byte a thread, capped
        (DeviceCopy(0x1000, 0x2000, 1001), 4),  # an odd size: bytes
        (DeviceCopy(0x1000, 0x2000, 16), 1),
        (DeviceCopy(0x1000, 0x2000, 1 << 30), MAX_BLOCKS),
    ],
)
def test_the_copy_kernels_grid(copy: DeviceCopy, blocks: int) -> None:
    assert copy.blocks() == blocks


def test_the_kernel_arguments_are_what_loop_copy_takes() -> None:
    graph = FakeGraph()
    graph.node(MEMCPY, Memcpy3D(0x1000, 0x2000, 3))
    graph.rewrite()
    ((_, launch),) = graph.launches()
    assert launch.args == (0x2000, 0x1000, 3)
    assert ctypes.sizeof(ctypes.c_uint64) == 8  # n is an unsigned long long on the device
