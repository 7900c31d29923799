"""The loop engine's graphs built by the real builder (``CudaConditional``) on a fake driver, run on the host.

``FakeDriver`` stands for cuda-bindings' driver: it records every node the
builder adds (kernel nodes with copies of their arguments, conditional
nodes with their body graphs, child graph nodes), and launching an
executable interprets the recorded graph: kernel nodes run the real kernels
compiled for the host (``kernel_host``), a WHILE node repeats its body while
its handle's value (set by those kernels) is non-zero, an IF node runs it
once, a SWITCH node the body of its value, a child node replays the recorded
body. So the builder's node order, dependencies, handles and every
argument of every kernel are checked on the CPU, against the host loop.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import Final

from cudagraph_capture._conditional import CudaConditional, RecordedGraph, _Kernels
from tests.capture.kernel_host import kernel_signatures


@dataclasses.dataclass
class _Graph:
    nodes: list[_Node] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Node:
    kind: str  # "kernel", "WHILE", "IF", "SWITCH", "child"
    graph: _Graph
    deps: list[_Node]
    name: str = ""
    shape: tuple[int, int, int] = (1, 1, 0)
    args: list[ctypes.Array[ctypes.c_char]] = dataclasses.field(default_factory=list)
    handle: int = 0
    bodies: list[_Graph] = dataclasses.field(default_factory=list)
    child: int = 0


class _Params:
    """``CUgraphNodeParams`` and ``CUDA_KERNEL_NODE_PARAMS`` at once: the fields the builder sets."""

    def __init__(self) -> None:
        self.type: object = None
        self.conditional = self
        self.handle: int = 0
        self.size = 0
        self.ctx: object = None
        self.phGraph_out: list[_Graph] = []
        self.func: object = None
        self.gridDimX = self.gridDimY = self.gridDimZ = 1
        self.blockDimX = self.blockDimY = self.blockDimZ = 1
        self.sharedMemBytes = 0
        self.kernelParams = 0


class _Types:
    CU_GRAPH_NODE_TYPE_CONDITIONAL = "conditional"
    CU_GRAPH_COND_TYPE_WHILE = "WHILE"
    CU_GRAPH_COND_TYPE_IF = "IF"
    CU_GRAPH_COND_TYPE_SWITCH = "SWITCH"


class FakeDriver:
    """The driver calls ``CudaConditional`` makes, recording graphs; ``cuGraphLaunch`` runs them.

    ``bodies``: the recorded graphs by ``raw_cuda_graph()`` (``RegisteringGraphs`` adds them);
    ``refuse``: node kinds whose
    adding fails (``"SWITCH"``, ``"nested"``: a WHILE node inside a conditional node's body).
    """

    CU_GRAPH_COND_ASSIGN_DEFAULT: Final = 1
    CUgraphNodeType: Final = _Types
    CUgraphConditionalNodeType: Final = _Types

    def __init__(self, lib: ctypes.CDLL, refuse: Sequence[str] = ()) -> None:
        self.lib, self.refuse = lib, tuple(refuse)
        self.bodies: dict[int, RecordedGraph] = {}
        self.signatures = kernel_signatures()
        self.values: dict[int, int] = {}
        self._next_handle = 1000
        self.inside: set[int] = set()  # the body graphs of conditional nodes

    # -- what the builder calls --

    def CUgraphNodeParams(self) -> _Params:  # noqa: N802 - the CUDA API's name
        return _Params()

    def CUDA_KERNEL_NODE_PARAMS(self) -> _Params:  # noqa: N802 - the CUDA API's name
        return _Params()

    def CUgraph(self, handle: int) -> int:  # noqa: N802 - the CUDA API's name
        return handle

    def CUstream(self, handle: int) -> int:  # noqa: N802 - the CUDA API's name
        return handle

    def cuGraphCreate(self, flags: int) -> tuple[int, _Graph]:  # noqa: N802 - the CUDA API's name
        return 0, _Graph()

    def cuGraphConditionalHandleCreate(  # noqa: N802 - the CUDA API's name
        self, graph: _Graph, ctx: object, default: int, flags: int
    ) -> tuple[int, int]:
        self._next_handle += 1
        return 0, self._next_handle

    def add_node(
        self, graph: _Graph, deps: Sequence[_Node], edges: None, count: int, params: _Params
    ) -> tuple[int, _Node]:
        kind = str(params.conditional.type)
        nested = kind == "WHILE" and id(graph) in self.inside
        if kind in self.refuse or (nested and "nested" in self.refuse):
            return 801, _Node(kind, graph, [])  # CUDA_ERROR_NOT_SUPPORTED
        bodies = [_Graph() for _ in range(params.size)]
        self.inside.update(id(b) for b in bodies)
        params.phGraph_out = bodies
        node = _Node(kind, graph, list(deps), handle=int(params.handle), bodies=bodies)
        graph.nodes.append(node)
        return 0, node

    def cuGraphAddKernelNode(  # noqa: N802 - the CUDA API's name
        self, graph: _Graph, deps: Sequence[_Node] | None, count: int, params: _Params
    ) -> tuple[int, _Node]:
        name = str(params.func)
        sizes = self.signatures[name]
        pointers = (ctypes.c_void_p * len(sizes)).from_address(params.kernelParams)
        args = [
            ctypes.create_string_buffer(ctypes.string_at(pointers[i] or 0, size), size)
            for i, size in enumerate(sizes)
        ]
        shape = (params.gridDimX, params.blockDimX, params.sharedMemBytes)
        node = _Node("kernel", graph, list(deps or []), name=name, shape=shape, args=args)
        graph.nodes.append(node)
        return 0, node

    def cuGraphAddChildGraphNode(  # noqa: N802 - the CUDA API's name
        self, graph: _Graph, deps: Sequence[_Node] | None, count: int, child: int
    ) -> tuple[int, _Node]:
        node = _Node("child", graph, list(deps or []), child=child)
        graph.nodes.append(node)
        return 0, node

    def cuGraphInstantiate(self, graph: _Graph, flags: int) -> tuple[int, _Graph]:  # noqa: N802
        return 0, graph

    def cuGraphLaunch(self, graph: _Graph, stream: object) -> tuple[int]:  # noqa: N802
        self._run(graph)
        return (0,)

    def cuGraphExecDestroy(self, graph: _Graph) -> tuple[int]:  # noqa: N802
        return (0,)

    def cuGraphDestroy(self, graph: _Graph) -> tuple[int]:  # noqa: N802
        return (0,)

    # -- running a graph --

    def _run(self, graph: _Graph) -> None:
        done: set[int] = set()
        for node in graph.nodes:  # added after their dependencies: a topological order
            assert all(id(dep) in done for dep in node.deps), (
                f"{node.kind} {node.name} before its dependencies"
            )
            self._node(node)
            done.add(id(node))

    def _node(self, node: _Node) -> None:
        if node.kind == "kernel":
            array = (ctypes.c_void_p * len(node.args))(*(ctypes.addressof(a) for a in node.args))
            getattr(self.lib, f"launch_{node.name}")(node.shape[0], node.shape[1], array)
            self._drain()
        elif node.kind == "child":
            self.bodies[node.child].replay()
        elif node.kind == "WHILE":
            while self.values[node.handle]:
                self._run(node.bodies[0])
        elif node.kind == "IF":
            if self.values[node.handle]:
                self._run(node.bodies[0])
        else:  # SWITCH: the body of the value; none past the last
            value = self.values[node.handle]
            if value < len(node.bodies):
                self._run(node.bodies[value])

    def _drain(self) -> None:
        handles = (ctypes.c_ulonglong * 1024)()
        values = (ctypes.c_uint * 1024)()
        for i in range(self.lib.drain(handles, values)):
            self.values[int(handles[i])] = int(values[i])


def host_layer(driver: FakeDriver, *, switch: bool = True) -> CudaConditional:
    """The real builder over ``driver``: its kernels by name, its ``cuGraphAddNode`` the driver's."""
    kernels = _Kernels("ctx", "module", {name: name for name in driver.signatures})
    return CudaConditional(driver, driver.add_node, kernels, 0, switch=switch)  # type: ignore[arg-type]


class RegisteringGraphs:
    """A ``LoopGraphs`` (``FakeGraphs``') whose recordings ``driver`` can replay as child graph nodes."""

    def __init__(self, driver: FakeDriver) -> None:
        from tests.capture.loop_fakes import FakeGraphs

        self.graphs = FakeGraphs()
        self.driver = driver
        self.device = 0
        self.session = self.graphs.session
        self.warm_up = self.graphs.warm_up

    def record(self, work: object, *, instantiate: bool) -> RecordedGraph:
        graph = self.graphs.record(work, instantiate=instantiate)  # type: ignore[arg-type]  # a callable
        self.driver.bodies[graph.raw_cuda_graph()] = graph
        return graph
