"""A WHILE loop graph built with the CUDA driver, through cuda-bindings: the loop engine's device layer.

From a body graph that torch captured into the graph pool and the loop's
device scalars (``_loop``), this layer builds one graph that runs the body
until the condition says stop::

    loop_start(steps)                    steps = 0
    WHILE handle (1 on every launch):    the body runs once before the first check
        child graph: the body            a clone of torch's graph: its nodes, not its memory
        loop_next(handle, steps, ...)    steps += 1; handle = steps < limit && !stop

``load_conditional`` imports cuda-bindings and compiles the condition kernels
(NVRTC, once per device); whatever makes a WHILE loop impossible raises
``LoopUnavailableError`` with a ``LoopFallback`` reason. The protocols
``_Driver`` and ``_Nvrtc`` type the calls made here, with the CUDA API's names.
"""

# ruff: noqa: N802, N815  (the protocols spell the CUDA API's names)

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import importlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Final, Protocol, SupportsInt, TypeVar, cast

import torch

#: The oldest driver (``cuDriverGetVersion``) whose WHILE nodes take a default launch value.
MIN_DRIVER_VERSION: Final = 12040

#: The condition kernels; ``{prelude}`` declares the handle type where NVRTC does not.
_SOURCE: Final = r"""{prelude}
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// Before the loop: no iteration has run yet.
extern "C" __global__ void loop_start(long long *steps) {{ steps[0] = 0; }}

// After each iteration (ordered after the whole body by the graph's edge): count it,
// and run another while the count is under the limit and the body has not set stop.
extern "C" __global__ void loop_next(cudaGraphConditionalHandle handle, long long *steps,
                                     const long long *limit, const void *stop, int stop_bytes) {{
  long long taken = steps[0] + 1;
  steps[0] = taken;
  bool stopped = stop_bytes == 4 ? *(const int *)stop != 0 : *(const unsigned char *)stop != 0;
  cudaGraphSetConditional(handle, taken < limit[0] && !stopped ? 1u : 0u);
}}
"""
#: NVRTC of CUDA 12.4+ knows ``cudaGraphConditionalHandle``; older ones need the typedef.
_PRELUDES: Final = ("", "typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;")

Status = SupportsInt  # a CUresult or nvrtcResult: 0 is success
T = TypeVar("T")


class LoopFallback(enum.Enum):
    """Why a loop is not a WHILE graph: the keys of ``loop_fallback_counts()``."""

    NO_BINDINGS = "no_bindings"  # cuda-bindings is not installed, or too old for conditional nodes
    OLD_TORCH = "old_torch"  # torch cannot hand over a captured graph (CUDAGraph.raw_cuda_graph)
    OLD_DRIVER = "old_driver"  # the CUDA driver predates 12.4: no WHILE node with a launch value
    NVRTC_FAILED = "nvrtc_failed"  # NVRTC could not compile the condition kernels
    DRIVER_REFUSED = "driver_refused"  # the driver refused the kernels, the WHILE node or its body


class LoopUnavailableError(Exception):
    """A WHILE loop cannot be built here: ``reason``, and ``detail`` in words."""

    def __init__(self, reason: LoopFallback, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason: Final = reason
        self.detail: Final = detail


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LoopCells:
    """The device scalars of one loop, allocated outside the graph pool and kept by the loop.

    ``steps``: ``[]`` int64, the iterations run by the current launch (the
    body's iteration index while it runs). ``limit``: ``[]`` int64, this
    launch's step limit. ``stop``: ``[]`` bool or int32, the caller's flag
    that the body sets when every request is done.
    """

    steps: torch.Tensor
    limit: torch.Tensor
    stop: torch.Tensor


class RecordedGraph(Protocol):
    """A recorded graph (``torch.cuda.CUDAGraph(keep_graph=True)``, or a test's fake)."""

    def replay(self) -> None: ...

    def raw_cuda_graph(self) -> int: ...


class WhileGraph(Protocol):
    """An instantiated loop graph: ``launch()`` queues it on the current stream of its device."""

    def launch(self) -> None: ...


class ConditionalLoops(Protocol):
    """Builds loop graphs on one device (``CudaConditional``, or a test's fake)."""

    def build(self, body: RecordedGraph, cells: LoopCells) -> WhileGraph:
        """The loop of ``body`` over ``cells``; ``LoopUnavailableError`` if the driver refuses it."""
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


class _ConditionalTypes(Protocol):
    CU_GRAPH_COND_TYPE_WHILE: object


#: ``cuGraphAddNode`` with edge data: (graph, dependencies, edge data, count, params) -> node.
_AddNode = Callable[[object, Sequence[object], None, int, _NodeParams], tuple[Status, object]]


class _Driver(Protocol):  # cuda.bindings.driver
    CU_GRAPH_COND_ASSIGN_DEFAULT: int
    CUgraphNodeType: _NodeTypes
    CUgraphConditionalNodeType: _ConditionalTypes

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
    """The condition kernels, loaded into the device's primary context for the life of the process."""

    ctx: object
    module: object
    start: object
    next: object


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
    return CudaConditional(driver, add_node, kernels, device)


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


def compile_kernels(nvrtc: _Nvrtc, capability: tuple[int, int]) -> bytes:
    """The condition kernels as a cubin for ``sm_{major}{minor}``; ``LoopUnavailableError`` if NVRTC fails."""
    errors = []
    for prelude in _PRELUDES:
        try:
            return _compile(nvrtc, _SOURCE.format(prelude=prelude).encode(), capability)
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
    start = _value("cuModuleGetFunction(loop_start)", driver.cuModuleGetFunction(module, b"loop_start"))
    next_ = _value("cuModuleGetFunction(loop_next)", driver.cuModuleGetFunction(module, b"loop_next"))
    return _Kernels(ctx, module, start, next_)


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
# Building and launching a loop
# ---------------------------------------------------------------------------


class CudaConditional:
    """Builds WHILE loop graphs on one device (a ``ConditionalLoops``)."""

    __slots__ = ("_add_node", "_device", "_driver", "_kernels")

    def __init__(self, driver: _Driver, add_node: _AddNode, kernels: _Kernels, device: int) -> None:
        self._driver: Final = driver
        self._add_node: Final = add_node
        self._kernels: Final = kernels
        self._device: Final = device

    def build(self, body: RecordedGraph, cells: LoopCells) -> CudaWhileGraph:
        """The loop of ``body`` over ``cells``, instantiated; ``LoopUnavailableError`` if the driver refuses.

        The template graph is destroyed once instantiated (the executable is a
        copy); ``body`` must outlive the result (its memory is the pool's, held
        by the torch graph), and so must the cells (their addresses are baked in).
        """
        driver = self._driver
        graph = _value("cuGraphCreate", driver.cuGraphCreate(0))
        try:
            self._add_loop(graph, body, cells)
            graph_exec = _value("cuGraphInstantiate", driver.cuGraphInstantiate(graph, 0))
        except Exception as error:  # an error status, or bindings whose API differs
            raise LoopUnavailableError(LoopFallback.DRIVER_REFUSED, _why(error)) from error
        finally:
            driver.cuGraphDestroy(graph)  # the conditional node's body graph goes with it
        return CudaWhileGraph(driver, graph_exec, self._device)

    def _add_loop(self, graph: object, body: RecordedGraph, cells: LoopCells) -> None:
        """``loop_start`` -> WHILE { the body as a child graph -> ``loop_next`` }, into ``graph``."""
        driver, kernels = self._driver, self._kernels
        start = self._kernel_node(graph, None, kernels.start, [ctypes.c_void_p(cells.steps.data_ptr())])
        # 1 at every launch (ASSIGN_DEFAULT): the body runs once before loop_next first decides.
        handle = _value(
            "cuGraphConditionalHandleCreate",
            driver.cuGraphConditionalHandleCreate(graph, kernels.ctx, 1, driver.CU_GRAPH_COND_ASSIGN_DEFAULT),
        )
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = kernels.ctx
        _value("cuGraphAddNode(WHILE)", self._add_node(graph, [start], None, 1, params))
        loop_body = params.conditional.phGraph_out[0]  # owned by the WHILE node
        # A child graph node clones torch's graph: the same kernels on the same (pool) addresses.
        child_graph = driver.CUgraph(body.raw_cuda_graph())
        child = _value(
            "cuGraphAddChildGraphNode", driver.cuGraphAddChildGraphNode(loop_body, None, 0, child_graph)
        )
        stop = cells.stop
        args: list[ctypes.c_uint64 | ctypes.c_void_p | ctypes.c_int] = [
            ctypes.c_uint64(int(handle)),
            ctypes.c_void_p(cells.steps.data_ptr()),
            ctypes.c_void_p(cells.limit.data_ptr()),
            ctypes.c_void_p(stop.data_ptr()),
            ctypes.c_int(stop.element_size()),
        ]
        self._kernel_node(loop_body, [child], kernels.next, args)  # after every node of the body

    def _kernel_node(
        self,
        graph: object,
        deps: Sequence[object] | None,
        function: object,
        args: Sequence[ctypes.c_uint64 | ctypes.c_void_p | ctypes.c_int],
    ) -> object:
        """A one-thread launch of ``function(*args)`` in ``graph`` after ``deps``."""
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(arg) for arg in args))
        params = self._driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = function
        params.gridDimX = params.gridDimY = params.gridDimZ = 1
        params.blockDimX = params.blockDimY = params.blockDimZ = 1
        params.sharedMemBytes = 0
        params.kernelParams = ctypes.addressof(pointers)  # void*[]: read (copied) by the call below
        count = 0 if deps is None else len(deps)
        return _value("cuGraphAddKernelNode", self._driver.cuGraphAddKernelNode(graph, deps, count, params))


class CudaWhileGraph:
    """An instantiated loop graph (a ``WhileGraph``); the executable is destroyed with this object."""

    __slots__ = ("__weakref__", "_device", "_driver", "_exec")

    def __init__(self, driver: _Driver, graph_exec: object, device: int) -> None:
        self._driver: Final = driver
        self._exec: Final = graph_exec
        self._device: Final = device
        # An executable destroyed while a launch is in flight is freed when that launch completes.
        weakref.finalize(self, _destroy_exec, driver, graph_exec)

    def launch(self) -> None:
        """Queue the loop on the current stream of its device; no host synchronization."""
        stream = torch.cuda.current_stream(self._device).cuda_stream
        _done("cuGraphLaunch", self._driver.cuGraphLaunch(self._exec, self._driver.CUstream(stream)))


def _destroy_exec(driver: _Driver, graph_exec: object) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone already
        driver.cuGraphExecDestroy(graph_exec)
