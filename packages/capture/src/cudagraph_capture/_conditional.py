"""Loop and choice graphs built with the CUDA driver, through cuda-bindings: the loop engine's device layer.

From body graphs that torch captured into the graph pool and the loop's
device cells (``_loop``), this layer builds one graph per loop. A loop of
one body, ``every`` steps per iteration of its first WHILE node::

    loop_begin(h1)                         steps = 0, running = 1; h1 = limit >= every
    WHILE h1:                              (only where every > 1)
        body, loop_count, body, ... body   `every` clones of the body, each step counted
        loop_check(h1)                     h1 = running && steps + every <= limit
    loop_tail(h2)                          h2 = running && steps < limit
    WHILE h2:                              the steps left under the limit, one an iteration
        body
        loop_check(h2)

A step counts while no step before it set ``stop`` (``running``); the steps
after it in the same iteration run masked and count nothing, so the stop is
checked every ``every`` steps and the limit is never passed. A shrinking
loop (``RowTables``) has several bodies, one per row count (ascending), and
each iteration starts with ``loop_choose``: the active rows move to the
front in order (a stable partition of every row buffer), and the smallest
body that holds them runs, chosen on the device by a SWITCH node, or an IF
node per body where the driver or the bindings have no SWITCH; the body is
a WHILE node of its own that stays on it while it still holds the active
rows (nested; flat, a choice every iteration, where the driver refuses it)::

        loop_choose(hs)                    partition; the branch of the live count
        SWITCH hs: {loop_enter(hi); WHILE hi: {body_i, loop_count, ... body_i, loop_stay(hi)}}
        loop_check(h)                      (flat: {body_i, loop_count, ... body_i})

and after both WHILE nodes ``loop_restore`` puts each step's history back in
the launch's row order. ``choose_replay`` alone in front of a SWITCH (or IF
nodes) over plain graphs is a replay chosen on the device (``ReplayPlan``).
All kernels are one NVRTC module, compiled once per device.

``load_conditional`` imports cuda-bindings and compiles the kernels;
whatever makes a WHILE loop impossible raises ``LoopUnavailableError`` with
a ``LoopFallback`` reason. The protocols ``_Driver`` and ``_Nvrtc`` type the
calls made here, with the CUDA API's names.
"""

# ruff: noqa: N802, N815  (the protocols spell the CUDA API's names)

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import importlib
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Final, Literal, Protocol, SupportsInt, TypeAlias, TypeVar, cast

import torch

from ._kernels import KERNELS, LIMIT, NUM_COUNTERS, PRELUDES, SOURCE, STEPS

#: The oldest driver (``cuDriverGetVersion``) whose WHILE nodes take a default launch value.
MIN_DRIVER_VERSION: Final = 12040
#: The oldest driver with SWITCH conditional nodes; before it, a choice is an IF node per body.
MIN_SWITCH_DRIVER_VERSION: Final = 12080
#: The most rows a shrinking loop keeps in order (its kernels hold a row's worth in shared memory).
MAX_CHOICE_ROWS: Final = 2048

Status = SupportsInt  # a CUresult or nvrtcResult: 0 is success
T = TypeVar("T")
#: How a graph chooses among its bodies on the device: one SWITCH node, or an IF node per body.
Choice: TypeAlias = Literal["switch", "if_chain"]


class LoopFallback(enum.Enum):
    """Why a loop is not a WHILE graph: the keys of ``loop_fallback_counts()``."""

    NO_BINDINGS = "no_bindings"  # cuda-bindings is not installed, or too old for conditional nodes
    OLD_TORCH = "old_torch"  # torch cannot hand over a captured graph (CUDAGraph.raw_cuda_graph)
    OLD_DRIVER = "old_driver"  # the CUDA driver predates 12.4: no WHILE node with a launch value
    NVRTC_FAILED = "nvrtc_failed"  # NVRTC could not compile the condition kernels
    DRIVER_REFUSED = "driver_refused"  # the driver refused the kernels, the WHILE node or its body


class LoopUnavailableError(Exception):
    """A WHILE loop (or a choice) cannot be built here: ``reason``, and ``detail`` in words."""

    def __init__(self, reason: LoopFallback, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason: Final = reason
        self.detail: Final = detail


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LoopCells:
    """The device cells of loops, allocated outside the graph pool, kept by every loop that uses them.

    ``counters``: ``[NUM_COUNTERS]`` int64 (``STEPS``, ``LIMIT``, ``RUNNING``,
    ...); ``steps`` (the steps run by the current launch: the body's step
    index while it runs) and ``limit`` are ``[]`` views of it. ``stop``:
    ``[]`` bool or int32, the caller's flag that the body sets when every
    request is done. Loops that share cells run one at a time.
    """

    counters: torch.Tensor
    steps: torch.Tensor
    limit: torch.Tensor
    stop: torch.Tensor

    @staticmethod
    def new(stop: torch.Tensor, max_steps: int) -> LoopCells:
        counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=stop.device)
        counters[LIMIT] = max_steps
        return LoopCells(counters, counters[STEPS], counters[LIMIT], stop)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RowTables:
    """A shrinking loop's device tables (``_loop`` allocates them, outside the graph pool).

    ``sizes`` ``[n]`` int64: each body's rows, ascending. ``active`` ``[rows]``
    bool: the caller's flags. ``buffers``: the caller's row buffers (dim 0 the
    row, each row contiguous), moved with the rows. ``scratch``: uint8, a
    buffer's worth of rows. ``order`` ``[rows]`` int32: each row's row at the
    launch's start. ``orders`` ``[max_epochs, rows]`` int32, ``epoch_steps``
    ``[max_epochs]`` int64, ``epoch_rows`` ``[max_epochs]`` int32: the epochs
    of a launch. ``branch_steps`` ``[n]`` int64: the steps each body ran.
    ``history`` ``[steps, >= rows]`` int64 whose columns are rows, restored
    to the launch's order after it; ``fill``: its value for rows not computed.
    """

    sizes: torch.Tensor
    active: torch.Tensor
    buffers: tuple[torch.Tensor, ...]
    scratch: torch.Tensor
    order: torch.Tensor
    orders: torch.Tensor
    epoch_steps: torch.Tensor
    epoch_rows: torch.Tensor
    branch_steps: torch.Tensor
    history: torch.Tensor
    fill: int

    @property
    def rows(self) -> int:
        return int(self.active.shape[0])

    @property
    def max_epochs(self) -> int:
        return int(self.orders.shape[0])


class RecordedGraph(Protocol):
    """A recorded graph (``torch.cuda.CUDAGraph(keep_graph=True)``, or a test's fake)."""

    def replay(self) -> None: ...

    def raw_cuda_graph(self) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LoopPlan:
    """What one loop graph holds: its bodies (ascending rows; one: no choice), cells, steps per iteration.

    ``every``: the steps an iteration of the first WHILE node runs (1: a
    single WHILE node of one step an iteration). ``rows``: a shrinking
    loop's tables (``None`` for one body).
    """

    bodies: tuple[RecordedGraph, ...]
    cells: LoopCells
    every: int
    rows: RowTables | None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ReplayPlan:
    """A replay chosen on the device: ``graphs`` (ascending ``sizes``, ``[n]`` int64), ``live`` ``[]``
    int32 or int64 (the count to hold), ``chosen`` ``[]`` int64 (the index replayed; -1: none)."""

    graphs: tuple[RecordedGraph, ...]
    sizes: torch.Tensor
    live: torch.Tensor
    chosen: torch.Tensor


class WhileGraph(Protocol):
    """An instantiated graph: ``launch()`` queues it on the current stream of its device.

    ``choice``: how it chooses among several bodies (``None``: it has one).
    """

    @property
    def choice(self) -> Choice | None: ...

    def launch(self) -> None: ...


class ConditionalLoops(Protocol):
    """Builds loop and choice graphs on one device (``CudaConditional``, or a test's fake)."""

    def build(self, plan: LoopPlan) -> WhileGraph:
        """The loop of ``plan``; ``LoopUnavailableError`` if the driver refuses it."""
        ...

    def build_replay(self, plan: ReplayPlan) -> WhileGraph:
        """The replay chosen on the device of ``plan``; ``LoopUnavailableError`` if the driver refuses it."""
        ...


# ---------------------------------------------------------------------------
# cuda-bindings, typed: only what this layer calls
# ---------------------------------------------------------------------------


class _ConditionalParams(Protocol):  # CUDA_CONDITIONAL_NODE_PARAMS
    handle: object
    type: object
    size: int
    ctx: object

    @property
    def phGraph_out(self) -> Sequence[object]: ...


class _NodeParams(Protocol):  # CUgraphNodeParams
    type: object

    @property
    def conditional(self) -> _ConditionalParams: ...


class _KernelNodeParams(Protocol):  # CUDA_KERNEL_NODE_PARAMS
    func: object
    gridDimX: int
    gridDimY: int
    gridDimZ: int
    blockDimX: int
    blockDimY: int
    blockDimZ: int
    sharedMemBytes: int
    kernelParams: int


class _NodeTypes(Protocol):
    CU_GRAPH_NODE_TYPE_CONDITIONAL: object


#: ``cuGraphAddNode`` with edge data: (graph, dependencies, edge data, count, params) -> node.
_AddNode = Callable[[object, Sequence[object], None, int, _NodeParams], tuple[Status, object]]


class _Driver(Protocol):  # cuda.bindings.driver
    CU_GRAPH_COND_ASSIGN_DEFAULT: int
    CUgraphNodeType: _NodeTypes
    CUgraphConditionalNodeType: object  # CU_GRAPH_COND_TYPE_WHILE, _IF, _SWITCH (12.8+): read by name

    def CUgraphNodeParams(self) -> _NodeParams: ...
    def CUDA_KERNEL_NODE_PARAMS(self) -> _KernelNodeParams: ...
    def CUgraph(self, handle: int) -> object: ...
    def CUstream(self, handle: int) -> object: ...
    def cuDriverGetVersion(self) -> tuple[Status, int]: ...
    def cuCtxGetCurrent(self) -> tuple[Status, object]: ...
    def cuModuleLoadData(self, image: bytes) -> tuple[Status, object]: ...
    def cuModuleGetFunction(self, module: object, name: bytes) -> tuple[Status, object]: ...
    def cuGraphCreate(self, flags: int) -> tuple[Status, object]: ...
    def cuGraphConditionalHandleCreate(
        self, graph: object, ctx: object, default: int, flags: int
    ) -> tuple[Status, SupportsInt]: ...
    def cuGraphAddKernelNode(
        self, graph: object, deps: Sequence[object] | None, count: int, params: _KernelNodeParams
    ) -> tuple[Status, object]: ...
    def cuGraphAddChildGraphNode(
        self, graph: object, deps: Sequence[object] | None, count: int, child: object
    ) -> tuple[Status, object]: ...
    def cuGraphInstantiate(self, graph: object, flags: int) -> tuple[Status, object]: ...
    def cuGraphLaunch(self, graph_exec: object, stream: object) -> tuple[Status]: ...
    def cuGraphExecDestroy(self, graph_exec: object) -> tuple[Status]: ...
    def cuGraphDestroy(self, graph: object) -> tuple[Status]: ...


class _Nvrtc(Protocol):  # cuda.bindings.nvrtc
    def nvrtcCreateProgram(
        self, source: bytes, name: bytes, num_headers: int, headers: list[bytes], names: list[bytes]
    ) -> tuple[Status, object]: ...
    def nvrtcCompileProgram(self, program: object, count: int, options: list[bytes]) -> tuple[Status]: ...
    def nvrtcGetProgramLogSize(self, program: object) -> tuple[Status, int]: ...
    def nvrtcGetProgramLog(self, program: object, log: bytes) -> tuple[Status]: ...
    def nvrtcGetCUBINSize(self, program: object) -> tuple[Status, int]: ...
    def nvrtcGetCUBIN(self, program: object, cubin: bytes) -> tuple[Status]: ...
    def nvrtcDestroyProgram(self, program: object) -> tuple[Status]: ...


class _CallError(RuntimeError):
    """A cuda-bindings call returned an error status."""


def _value(what: str, result: tuple[Status, T]) -> T:
    """The value of a ``(status, value)`` result; ``_CallError`` naming ``what`` on an error."""
    status, value = result
    if int(status) != 0:
        raise _CallError(f"{what} failed: {status!r}")
    return value


def _why(error: Exception) -> str:
    """An error in words: a failed call says what failed; anything else says its type too."""
    return str(error) if isinstance(error, _CallError) else f"{type(error).__name__}: {error}"


def _done(what: str, result: tuple[Status]) -> None:
    """Check a ``(status,)`` result; ``_CallError`` naming ``what`` on an error."""
    if int(result[0]) != 0:
        raise _CallError(f"{what} failed: {result[0]!r}")


# ---------------------------------------------------------------------------
# Opening the layer on a device: every check that can make WHILE impossible
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Kernels:
    """The kernels, loaded into the device's primary context for the life of the process."""

    ctx: object
    module: object
    functions: dict[str, object]


def open_conditional(
    device: int,
    capability: tuple[int, int],
    import_module: Callable[[str], object] = importlib.import_module,
) -> CudaConditional:
    """The layer on CUDA device ``device`` (compute ``capability``), uncached.

    Checks, in order: cuda-bindings (imported through ``import_module``),
    torch, the driver's version, NVRTC, loading the kernels. The first that
    fails raises ``LoopUnavailableError`` with its reason.
    """
    driver, nvrtc, add_node = _bindings(import_module)
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
        raise LoopUnavailableError(LoopFallback.OLD_TORCH, f"torch {torch.__version__} has no raw_cuda_graph")
    try:
        version = _value("cuDriverGetVersion", driver.cuDriverGetVersion())
    except _CallError as error:
        raise LoopUnavailableError(LoopFallback.OLD_DRIVER, str(error)) from error
    if version < MIN_DRIVER_VERSION:
        raise LoopUnavailableError(
            LoopFallback.OLD_DRIVER, f"driver version {version} < {MIN_DRIVER_VERSION}"
        )
    image = compile_kernels(nvrtc, capability)
    try:
        kernels = _load_kernels(driver, image, device)
    except Exception as error:  # an error status, or bindings whose API differs
        raise LoopUnavailableError(LoopFallback.DRIVER_REFUSED, _why(error)) from error
    switch = version >= MIN_SWITCH_DRIVER_VERSION and _node_kind(driver, "SWITCH") is not None
    return CudaConditional(driver, add_node, kernels, device, switch=switch)


def _bindings(import_module: Callable[[str], object]) -> tuple[_Driver, _Nvrtc, _AddNode]:
    """cuda-bindings' driver and NVRTC modules, and its ``cuGraphAddNode`` that takes edge data."""
    try:
        package = import_module("cuda.bindings")
        driver = cast(_Driver, import_module("cuda.bindings.driver"))
        nvrtc = cast(_Nvrtc, import_module("cuda.bindings.nvrtc"))
    except ImportError as error:
        raise LoopUnavailableError(
            LoopFallback.NO_BINDINGS, f"cannot import {error.name or 'cuda.bindings'}"
        ) from error
    version = str(getattr(package, "__version__", "0"))
    # 13.x: cuGraphAddNode takes edge data; 12.3 to 12.9: the same call is cuGraphAddNode_v2.
    name = "cuGraphAddNode" if int(version.split(".")[0] or 0) >= 13 else "cuGraphAddNode_v2"
    add_node = getattr(driver, name, None)
    if add_node is None or not hasattr(driver, "cuGraphConditionalHandleCreate"):
        raise LoopUnavailableError(
            LoopFallback.NO_BINDINGS, f"cuda-bindings {version} has no conditional nodes"
        )
    return driver, nvrtc, cast(_AddNode, add_node)


def _node_kind(driver: _Driver, kind: str) -> object | None:
    """The bindings' ``CU_GRAPH_COND_TYPE_{kind}`` (WHILE, IF, SWITCH), or ``None`` where they lack it."""
    return getattr(getattr(driver, "CUgraphConditionalNodeType", None), f"CU_GRAPH_COND_TYPE_{kind}", None)


def compile_kernels(nvrtc: _Nvrtc, capability: tuple[int, int]) -> bytes:
    """The kernels as a cubin for ``sm_{major}{minor}``; ``LoopUnavailableError`` if NVRTC fails."""
    errors = []
    for prelude in PRELUDES:
        try:
            return _compile(nvrtc, SOURCE.format(prelude=prelude).encode(), capability)
        except Exception as error:  # an error status, or bindings whose API differs
            errors.append(_why(error))
    raise LoopUnavailableError(LoopFallback.NVRTC_FAILED, " | ".join(errors))


def _compile(nvrtc: _Nvrtc, source: bytes, capability: tuple[int, int]) -> bytes:
    program = _value("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(source, b"loop_condition.cu", 0, [], []))
    try:
        options = [f"--gpu-architecture=sm_{capability[0]}{capability[1]}".encode()]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(status) != 0:
            log = b" " * _value("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(program))
            nvrtc.nvrtcGetProgramLog(program, log)  # fills the buffer
            text = log.decode(errors="replace").strip(" \x00\n")
            raise _CallError(f"nvrtcCompileProgram failed: {status!r}: {text}")
        cubin = b" " * _value("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(program))
        _done("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(program, cubin))  # fills the buffer
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _load_kernels(driver: _Driver, image: bytes, device: int) -> _Kernels:
    """Load ``image`` into ``device``'s primary context, the one torch's runtime uses."""
    with torch.cuda.device(device):
        torch.cuda.current_stream(device).query()  # a runtime call: the primary context is current here
        ctx = _value("cuCtxGetCurrent", driver.cuCtxGetCurrent())
        module = _value("cuModuleLoadData", driver.cuModuleLoadData(image))
    functions = {
        name: _value(f"cuModuleGetFunction({name})", driver.cuModuleGetFunction(module, name.encode()))
        for name in KERNELS
    }
    return _Kernels(ctx, module, functions)


_layers: Final[dict[int, CudaConditional | LoopUnavailableError]] = {}
_layers_lock: Final = threading.Lock()


def load_conditional(device: int) -> CudaConditional:
    """The layer on CUDA device ``device``, opened once per process (a failure is kept too).

    Raises ``LoopUnavailableError`` (a new one each time) where WHILE loops cannot be built.
    """
    with _layers_lock:
        layer = _layers.get(device)
        if layer is None:
            try:
                layer = open_conditional(device, torch.cuda.get_device_capability(device))
            except LoopUnavailableError as why:
                layer = why
            _layers[device] = layer
    if isinstance(layer, LoopUnavailableError):
        raise LoopUnavailableError(layer.reason, layer.detail)
    return layer


# ---------------------------------------------------------------------------
# Building and launching a graph
# ---------------------------------------------------------------------------

_Arg: TypeAlias = ctypes.c_uint64 | ctypes.c_void_p | ctypes.c_int | ctypes.c_longlong
#: A kernel node's launch shape: (blocks, threads per block, dynamic shared memory bytes).
_ONE_THREAD: Final = (1, 1, 0)


def _ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if tensor is None else tensor.data_ptr())


def _threads(rows: int) -> int:
    """A block for ``rows`` rows: whole warps, at most 1024 threads."""
    return min(1024, max(32, -(-rows // 32) * 32))


class CudaConditional:
    """Builds loop and choice graphs on one device (a ``ConditionalLoops``).

    ``switch``: the driver and the bindings have SWITCH nodes (else a choice
    is an IF node per body). Every graph is instantiated from a template
    destroyed once instantiated (the executable is a copy); the recorded
    bodies must outlive the result (its nodes use their pool memory), and
    so must the cells and tables (their addresses are baked in).
    """

    __slots__ = ("_add_node", "_device", "_driver", "_kernels", "switch")

    def __init__(
        self, driver: _Driver, add_node: _AddNode, kernels: _Kernels, device: int, *, switch: bool
    ) -> None:
        self._driver: Final = driver
        self._add_node: Final = add_node
        self._kernels: Final = kernels
        self._device: Final = device
        self.switch: Final = switch

    def build(self, plan: LoopPlan) -> CudaWhileGraph:
        """The loop of ``plan``, instantiated; ``LoopUnavailableError`` if the driver refuses it.

        A choice is a SWITCH node where the driver has one, else (or where it
        refused the SWITCH) an IF node per body.
        """
        if plan.rows is None:
            return self._instantiate(None, False, lambda nodes: nodes.loop(plan))
        return self._first_built(lambda nodes: nodes.loop(plan), nested=True)

    def build_replay(self, plan: ReplayPlan) -> CudaWhileGraph:
        """The replay chosen on the device of ``plan``; ``LoopUnavailableError`` if the driver refuses it."""
        return self._first_built(lambda nodes: nodes.replay(plan), nested=False)

    def _first_built(self, fill: Callable[[_GraphNodes], None], *, nested: bool) -> CudaWhileGraph:
        """A graph choosing with SWITCH where there is one, else (or refused) with IF nodes; each
        branch a WHILE node of its own where ``nested`` (and the driver builds it), else flat."""
        choices: tuple[Choice, ...] = ("switch", "if_chain") if self.switch else ("if_chain",)
        shapes = (True, False) if nested else (False,)
        refused: list[str] = []
        for choice in choices:
            for inner in shapes:
                try:
                    return self._instantiate(choice, inner, fill)
                except LoopUnavailableError as error:
                    refused.append(f"{choice}{' nested' if inner else ''}: {error.detail}")
        raise LoopUnavailableError(LoopFallback.DRIVER_REFUSED, "; ".join(refused))

    def _instantiate(
        self, choice: Choice | None, nested: bool, fill: Callable[[_GraphNodes], None]
    ) -> CudaWhileGraph:
        """A template filled by ``fill``, instantiated, destroyed; ``LoopUnavailableError`` if refused."""
        driver = self._driver
        graph = _value("cuGraphCreate", driver.cuGraphCreate(0))
        nodes = _GraphNodes(driver, self._add_node, self._kernels, graph, (choice, nested))
        try:
            fill(nodes)
            graph_exec = _value("cuGraphInstantiate", driver.cuGraphInstantiate(graph, 0))
        except Exception as error:  # an error status, or bindings whose API differs
            raise LoopUnavailableError(LoopFallback.DRIVER_REFUSED, _why(error)) from error
        finally:
            driver.cuGraphDestroy(graph)  # the conditional nodes' body graphs go with it
        return CudaWhileGraph(driver, graph_exec, self._device, choice, tuple(nodes.tables), nested=nested)


class _GraphNodes:
    """Fills one template graph: the loop's or the replay's nodes, choosing by ``choice``.

    ``shape``: the choice (``None``: a loop of one body) and whether each
    branch of a shrinking loop's first WHILE node is a WHILE node of its own
    (``nested``: it stays on its body while that still fits, so the choice
    runs only where the body changes; else the choice runs every
    iteration). ``tables``: the device tables the kernels' arguments point
    to (kept by the executable); ``_params``: the host structures the driver
    wrote the body graphs into, alive until the template is instantiated.
    """

    __slots__ = ("_add_node", "_choice", "_driver", "_kernels", "_nested", "_params", "graph", "tables")

    def __init__(
        self,
        driver: _Driver,
        add_node: _AddNode,
        kernels: _Kernels,
        graph: object,
        shape: tuple[Choice | None, bool],
    ) -> None:
        self._driver: Final = driver
        self._add_node: Final = add_node
        self._kernels: Final = kernels
        self._choice: Final = shape[0]
        self._nested: Final = shape[1]
        self._params: Final[list[object]] = []
        self.graph: Final = graph
        self.tables: Final[list[torch.Tensor]] = []

    # -- what a graph holds --

    def loop(self, plan: LoopPlan) -> None:
        """``loop_begin``, [a WHILE of ``every`` steps, ``loop_tail``], a WHILE of one, ``loop_restore``.

        Nested, the first WHILE node runs whatever ``every`` is (its bodies' own
        WHILE nodes keep the count of each step), and a tail only where
        ``every`` > 1.
        """
        graph, counters, rows = self.graph, plan.cells.counters, plan.rows
        nested = self._nested and rows is not None
        # The WHILE node of `every` steps an iteration (nested: of the bodies' own WHILE nodes), then
        # the WHILE node of one step (the steps left under the limit; every step of a flat k = 1 loop).
        main = self._handle(graph) if plan.every > 1 or nested else None
        tail = self._handle(graph) if plan.every > 1 or not nested else None
        first = main if main is not None else tail  # a handle is made only for a node that uses it
        assert first is not None
        begin: list[_Arg] = [
            ctypes.c_uint64(int(first)),
            _ptr(counters),
            ctypes.c_int(plan.every),
            ctypes.c_int(0 if rows is None else rows.rows),
            _ptr(None if rows is None else rows.order),
            _ptr(None if rows is None else rows.branch_steps),
            ctypes.c_int(0 if rows is None else len(plan.bodies)),
        ]
        threads = _threads(0 if rows is None else rows.rows)
        node = self._kernel(graph, None, "loop_begin", begin, (1, threads, 0))
        if main is not None:
            node = self._while(node, main, plan, plan.every, nested=nested)
            if tail is not None:
                node = self._kernel(graph, [node], "loop_tail", [ctypes.c_uint64(int(tail)), _ptr(counters)])
        if tail is not None:
            node = self._while(node, tail, plan, 1, nested=False)
        if rows is not None:
            self._restore(node, counters, rows)

    def replay(self, plan: ReplayPlan) -> None:
        """``choose_replay`` -> the graphs behind a SWITCH node or IF nodes."""
        graph = self.graph
        values, handles = self._branch_handles(graph, len(plan.graphs), plan.sizes.device)
        args: list[_Arg] = [
            _ptr(handles),
            ctypes.c_int(len(values)),
            ctypes.c_int(self._choice == "switch"),
            _ptr(plan.live),
            ctypes.c_int(plan.live.element_size()),
            _ptr(plan.sizes),
            ctypes.c_int(len(plan.graphs)),
            _ptr(plan.chosen),
        ]
        pick = self._kernel(graph, None, "choose_replay", args)
        self._branches(graph, pick, values, plan.graphs, lambda into, body: self._child(into, None, body))

    def _while(
        self, after: object, handle: SupportsInt, plan: LoopPlan, every: int, *, nested: bool
    ) -> object:
        """A WHILE node on ``handle`` after ``after``: ``every`` steps an iteration (``nested``: a
        body's own WHILE node of them, which counts them), then ``loop_check``."""
        node, (body,) = self._conditional(self.graph, [after], handle, "WHILE", 1)
        rows, cells = plan.rows, plan.cells
        if rows is None:
            last = [self._steps(body, plan.bodies[0], every, cells)]
        else:
            last = self._choose(body, plan, rows, every, nested=nested)
        check: list[_Arg] = [
            ctypes.c_uint64(int(handle)),
            _ptr(cells.counters),
            _ptr(cells.stop),
            ctypes.c_int(cells.stop.element_size()),
            ctypes.c_int(every),
            _ptr(None if rows is None else rows.branch_steps),
            ctypes.c_int(not nested),
        ]
        self._kernel(body, last, "loop_check", check)
        return node

    def _steps(self, graph: object, body: RecordedGraph, every: int, cells: LoopCells) -> object:
        """``every`` clones of ``body`` in ``graph``, a ``loop_count`` between two; the last node."""
        count: list[_Arg] = [_ptr(cells.counters), _ptr(cells.stop), ctypes.c_int(cells.stop.element_size())]
        node = self._child(graph, None, body)
        for _ in range(every - 1):
            node = self._kernel(graph, [node], "loop_count", count)
            node = self._child(graph, [node], body)
        return node

    def _stay(
        self, graph: object, body: RecordedGraph, every: int, plan: LoopPlan, rows: RowTables
    ) -> object:
        """A body's own WHILE node in ``graph``: ``every`` steps an iteration, while the body still fits."""
        handle = self._handle(graph)
        enter = self._kernel(graph, None, "loop_enter", [ctypes.c_uint64(int(handle))])
        node, (inner,) = self._conditional(graph, [enter], handle, "WHILE", 1)
        cells = plan.cells
        last = self._steps(inner, body, every, cells)
        stay: list[_Arg] = [
            ctypes.c_uint64(int(handle)),
            _ptr(cells.counters),
            _ptr(cells.stop),
            ctypes.c_int(cells.stop.element_size()),
            ctypes.c_int(every),
            _ptr(rows.active),
            _ptr(rows.sizes),
            ctypes.c_int(len(plan.bodies)),
        ]
        self._kernel(inner, [last], "loop_stay", stay, (1, _threads(rows.rows), 0))
        return node

    def _choose(
        self, graph: object, plan: LoopPlan, rows: RowTables, every: int, *, nested: bool
    ) -> list[object]:
        """``loop_choose``, then the bodies behind a SWITCH node or IF nodes; the nodes to wait for."""
        buffers = (*rows.buffers, rows.order)  # the order last: moved with the rows
        table = _row_table(buffers, rows.active.device)
        values, handles = self._branch_handles(graph, len(plan.bodies), rows.active.device)
        self.tables.append(table)
        args: list[_Arg] = [
            _ptr(handles),
            ctypes.c_int(len(values)),
            ctypes.c_int(self._choice == "switch"),
            _ptr(plan.cells.counters),
            _ptr(rows.active),
            _ptr(rows.sizes),
            ctypes.c_int(len(plan.bodies)),
            _ptr(table),
            ctypes.c_int(len(buffers)),
            _ptr(rows.scratch),
            _ptr(rows.order),
            _ptr(rows.orders),
            _ptr(rows.epoch_steps),
            _ptr(rows.epoch_rows),
            ctypes.c_int(rows.max_epochs),
            ctypes.c_int(rows.rows),
        ]
        pick = self._kernel(graph, None, "loop_choose", args, (1, _threads(rows.rows), 4 * rows.rows))
        cells = plan.cells

        def fill(into: object, body: RecordedGraph) -> object:
            if nested:
                return self._stay(into, body, every, plan, rows)
            return self._steps(into, body, every, cells)

        return self._branches(graph, pick, values, plan.bodies, fill)

    def _branches(
        self,
        graph: object,
        pick: object,
        handles: Sequence[SupportsInt],
        bodies: Sequence[RecordedGraph],
        fill: Callable[[object, RecordedGraph], object],
    ) -> list[object]:
        """The bodies after ``pick``: one SWITCH node of them, or an IF node each; the nodes to wait for."""
        if self._choice == "switch":
            node, outs = self._conditional(graph, [pick], handles[0], "SWITCH", len(bodies))
            for out, body in zip(outs, bodies, strict=True):
                fill(out, body)
            return [node]
        nodes = []
        for handle, body in zip(handles, bodies, strict=True):
            node, (out,) = self._conditional(graph, [pick], handle, "IF", 1)
            fill(out, body)
            nodes.append(node)
        return nodes

    def _branch_handles(
        self, graph: object, count: int, device: torch.device
    ) -> tuple[list[SupportsInt], torch.Tensor]:
        """The handles a choice sets (one SWITCH's, or an IF node's each), and their device table."""
        handles = [self._handle(graph) for _ in range(1 if self._choice == "switch" else count)]
        bits = [int(h) - (1 << 64) if int(h) >= 1 << 63 else int(h) for h in handles]  # as int64
        table = torch.tensor(bits, dtype=torch.int64, device=device)
        self.tables.append(table)
        return handles, table

    def _restore(self, after: object, counters: torch.Tensor, rows: RowTables) -> None:
        """``loop_restore`` after the loop: a block per step of the history."""
        history = rows.history
        args: list[_Arg] = [
            _ptr(counters),
            _ptr(history),
            ctypes.c_longlong(history.stride(0)),
            ctypes.c_int(rows.rows),
            _ptr(rows.orders),
            _ptr(rows.epoch_steps),
            _ptr(rows.epoch_rows),
            ctypes.c_int(rows.max_epochs),
            ctypes.c_longlong(rows.fill),
        ]
        shape = (int(history.shape[0]), _threads(rows.rows), 16 * rows.rows)
        self._kernel(self.graph, [after], "loop_restore", args, shape)

    # -- nodes --

    def _handle(self, graph: object) -> SupportsInt:
        """A conditional handle of ``graph``, set by a kernel before its node on every launch."""
        driver = self._driver
        return _value(
            "cuGraphConditionalHandleCreate",
            driver.cuGraphConditionalHandleCreate(graph, self._kernels.ctx, 0, 0),
        )

    def _conditional(
        self, graph: object, deps: Sequence[object], handle: SupportsInt, kind: str, size: int
    ) -> tuple[object, list[object]]:
        """A conditional node of ``kind`` (WHILE, IF, SWITCH) after ``deps``: the node, its body graphs."""
        driver = self._driver
        node_kind = _node_kind(driver, kind)
        if node_kind is None:
            raise _CallError(f"cuda-bindings has no CU_GRAPH_COND_TYPE_{kind}")
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = node_kind
        params.conditional.size = size
        params.conditional.ctx = self._kernels.ctx
        node = _value(f"cuGraphAddNode({kind})", self._add_node(graph, list(deps), None, len(deps), params))
        self._params.append(params)
        return node, list(params.conditional.phGraph_out)[:size]  # owned by the node

    def _child(self, graph: object, deps: Sequence[object] | None, body: RecordedGraph) -> object:
        """A child graph node: a clone of torch's graph, the same kernels on the same (pool) addresses."""
        driver = self._driver
        child = driver.CUgraph(body.raw_cuda_graph())
        count = 0 if deps is None else len(deps)
        return _value("cuGraphAddChildGraphNode", driver.cuGraphAddChildGraphNode(graph, deps, count, child))

    def _kernel(
        self,
        graph: object,
        deps: Sequence[object] | None,
        name: str,
        args: Sequence[_Arg],
        shape: tuple[int, int, int] = _ONE_THREAD,
    ) -> object:
        """A launch of ``name(*args)`` in ``graph`` after ``deps``; ``shape``: blocks, threads, shared."""
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(arg) for arg in args))
        params = self._driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = self._kernels.functions[name]
        params.gridDimX, params.blockDimX, params.sharedMemBytes = shape
        params.gridDimY = params.gridDimZ = params.blockDimY = params.blockDimZ = 1
        params.kernelParams = ctypes.addressof(pointers)  # void*[]: read (copied) by the call below
        count = 0 if deps is None else len(deps)
        return _value("cuGraphAddKernelNode", self._driver.cuGraphAddKernelNode(graph, deps, count, params))


def _row_table(buffers: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The kernels' ``RowBuffer`` table of ``buffers`` (uint8, on ``device``)."""
    packed = b"".join(struct.pack("<QqiI", *row_layout(buffer)) for buffer in buffers)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(device)


def row_layout(buffer: torch.Tensor) -> tuple[int, int, int, int]:
    """``(address, row stride, row bytes, copy unit)`` of a buffer whose rows are contiguous (in bytes)."""
    size = buffer.element_size()
    row_bytes = size * (buffer[0].numel() if buffer.shape[0] else 0)
    stride = size * buffer.stride(0)
    address = buffer.data_ptr()
    unit = next(u for u in (8, 4, 2, 1) if (row_bytes | stride | address) % u == 0)
    return address, stride, row_bytes, unit


class CudaWhileGraph:
    """An instantiated graph (a ``WhileGraph``); the executable is destroyed with this object.

    ``nested``: a shrinking loop whose bodies are WHILE nodes of their own.
    """

    __slots__ = ("__weakref__", "_device", "_driver", "_exec", "_keep", "choice", "nested")

    def __init__(
        self,
        driver: _Driver,
        graph_exec: object,
        device: int,
        choice: Choice | None,
        keep: tuple[object, ...] = (),
        *,
        nested: bool = False,
    ) -> None:
        self._driver: Final = driver
        self._exec: Final = graph_exec
        self._device: Final = device
        self._keep: Final = keep
        self.choice: Final = choice
        self.nested: Final = nested
        # An executable destroyed while a launch is in flight is freed when that launch completes.
        weakref.finalize(self, _destroy_exec, driver, graph_exec)

    def launch(self) -> None:
        """Queue the graph on the current stream of its device; no host synchronization."""
        stream = torch.cuda.current_stream(self._device).cuda_stream
        _done("cuGraphLaunch", self._driver.cuGraphLaunch(self._exec, self._driver.CUstream(stream)))


def _destroy_exec(driver: _Driver, graph_exec: object) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone already
        driver.cuGraphExecDestroy(graph_exec)
