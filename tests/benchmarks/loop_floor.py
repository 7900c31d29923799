r"""What a device loop's iteration adds over a replay, measured apart (a GPU; the lead's profile of issue 40).

Usage: ``python -m tests.benchmarks.loop_floor [--out DIR] [--part synthetic|manager|all]``.

Part ``synthetic``: two bodies, a one-kernel body (``tiny``: ``x += 1``) and
a ~300 us step of 64 kernels (``step``: 32 layers of a 4096x4096 bf16 GEMM
and a tanh on 8 rows, the decode step's shape and length), each run ``N``
times by every variant below, interleaved round by round (``interleave``):

- ``replays``: a torch graph of the body and ``steps += 1``, replayed ``N``
  times back to back (the floor of the decode-loop benchmark);
- ``unrolled``: one torch graph of ``N`` copies of it (nothing between
  iterations: the device's floor);
- ``device_loop``: the project's ``DeviceLoop`` (WHILE over the body as a
  child graph, then the ``loop_check`` kernel: ``LoopPolicy.check_every`` steps an iteration);
- ``while_child_uU``: a WHILE node built here whose body graph is the torch
  graph of ``U`` copies of the body and ``steps += 1`` as a child graph node,
  then a condition kernel (``steps < limit``);
- ``while_inline_uU``: the same, the torch work captured straight into the
  WHILE node's body graph (``cuStreamBeginCaptureToGraph``; no child graph);
- for ``U`` in 1 and 4: 4 amortizes the conditional over four iterations.

Per iteration, in microseconds: what each variant adds over ``unrolled`` and
over ``replays``; so ``while_inline_u1 - unrolled`` is the conditional node
and its condition kernel alone, ``while_child_u1 - while_inline_u1`` the
child graph, ``replays - unrolled`` what a host replay pays between two
steps. Ratios over ``replays`` come with their spread across rounds.

Part ``manager``: ``run_loop`` of the decode-loop benchmark's default paged
model (1, 8, 64 requests) at 1 and ``S`` steps, against its floor (the
forward and the advance as one torch graph, replayed) at 1 and ``S`` steps,
interleaved. The slopes give what each loop iteration adds over a replay;
the intercepts what each call adds (its checks, the metadata, the copies,
the launch, the read-back of the steps). The host time before the loop's
launch is timed too (``DeviceLoop.launch`` wrapped here, not in the package).

Writes ``loop_floor.json`` and prints a summary; nothing is asserted but
that every variant ran its ``N`` iterations (a variant that fails to build
is reported with its error, and the rest still run).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import importlib
import json
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Final

import torch

from cudagraph_capture import DeviceLoop, LoopKind
from cudagraph_capture._conditional import _compile
from cudagraph_capture._kernels import PRELUDES
from cudagraph_capture._loop import TorchGraphs
from tests.benchmarks.support import Interleaved, Spread, interleave, plain_graph

if TYPE_CHECKING:
    from tests.benchmarks.test_bench_decode_loop import Setup

ROUNDS: Final = 11
#: (body, iterations per call, calls per round).
BODIES: Final = {"tiny": (256, 4), "step": (32, 1)}
STEP_LAYERS: Final = 32
STEP_WIDTH: Final = 4096
STEP_ROWS: Final = 8
UNROLLS: Final = (1, 4)

_CONDITION: Final = r"""{prelude}
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __global__ void loop_while(cudaGraphConditionalHandle handle, const long long *steps,
                                      const long long *limit) {{
  cudaGraphSetConditional(handle, steps[0] < limit[0] ? 1u : 0u);
}}
"""


# ---------------------------------------------------------------------------
# cuda-bindings, untyped (ModuleType attributes are Any): the WHILE graphs built here
# ---------------------------------------------------------------------------


def _ok(result: object) -> object:
    """The value of a cuda-bindings ``(status, value...)`` result; ``RuntimeError`` on an error status."""
    values = result if isinstance(result, tuple) else (result,)
    if int(values[0]) != 0:
        raise RuntimeError(f"CUDA error {values[0]!r}")
    return values[1] if len(values) == 2 else values[1:] or None


@dataclasses.dataclass(frozen=True, slots=True)
class _Driver:
    """cuda-bindings' driver, this device's context and the condition kernel."""

    cu: ModuleType
    ctx: object
    condition: object

    @staticmethod
    def open() -> _Driver:
        cu = importlib.import_module("cuda.bindings.driver")
        nvrtc = importlib.import_module("cuda.bindings.nvrtc")
        torch.cuda.current_stream().query()  # a runtime call: the primary context is current
        errors = []
        for prelude in PRELUDES:
            try:
                image = _compile(nvrtc, _CONDITION.format(prelude=prelude).encode(), _capability())
                break
            except Exception as error:
                errors.append(str(error))
        else:
            raise RuntimeError(" | ".join(errors))
        module = _ok(cu.cuModuleLoadData(image))
        condition = _ok(cu.cuModuleGetFunction(module, b"loop_while"))
        return _Driver(cu, _ok(cu.cuCtxGetCurrent()), condition)

    def add_node(self, graph: object, deps: list[object], params: object) -> object:
        major = int(str(importlib.import_module("cuda.bindings").__version__).split(".")[0])
        add = self.cu.cuGraphAddNode if major >= 13 else self.cu.cuGraphAddNode_v2
        return _ok(add(graph, deps, None, len(deps), params))


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


@dataclasses.dataclass(frozen=True, slots=True)
class _Cells:
    """The loop's counter and limit (``[]`` int64), allocated outside every graph."""

    steps: torch.Tensor
    limit: torch.Tensor


class _While:
    """A WHILE graph built here: ``launch()`` zeroes the counter, then launches the executable."""

    def __init__(self, driver: _Driver, graph_exec: object, cells: _Cells, keep: object) -> None:
        self._driver = driver
        self._exec = graph_exec
        self._cells = cells
        self._keep = keep  # the torch graph whose nodes (and pool memory) the loop uses

    def launch(self) -> None:
        self._cells.steps.zero_()
        stream = self._driver.cu.CUstream(torch.cuda.current_stream().cuda_stream)
        _ok(self._driver.cu.cuGraphLaunch(self._exec, stream))


def _build_while(driver: _Driver, cells: _Cells, work: Callable[[], None], *, child: bool) -> _While:
    """WHILE { ``work`` (a child graph, or captured into the body) -> ``steps < limit`` } , instantiated."""
    cu = driver.cu
    graph = _ok(cu.cuGraphCreate(0))
    handle = _ok(cu.cuGraphConditionalHandleCreate(graph, driver.ctx, 1, cu.CU_GRAPH_COND_ASSIGN_DEFAULT))
    params = cu.CUgraphNodeParams()
    params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
    params.conditional.size = 1
    params.conditional.ctx = driver.ctx
    driver.add_node(graph, [], params)
    body = params.conditional.phGraph_out[0]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    keep: object = None
    deps: list[object] = []
    if child:
        recorded = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(recorded):
            work()
        keep = recorded
        deps = [_ok(cu.cuGraphAddChildGraphNode(body, None, 0, cu.CUgraph(recorded.raw_cuda_graph())))]
    with torch.cuda.stream(side):
        work()  # warm on this stream: cuBLAS's workspace for it exists before the capture
    torch.cuda.synchronize()
    stream = cu.CUstream(side.cuda_stream)
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    _ok(cu.cuStreamBeginCaptureToGraph(stream, body, deps or None, None, len(deps), mode))
    try:
        with torch.cuda.stream(side):
            if not child:
                work()
            _launch_condition(driver, stream, handle, cells)
    finally:
        _ok(cu.cuStreamEndCapture(stream))
    graph_exec = _ok(cu.cuGraphInstantiate(graph, 0))
    cu.cuGraphDestroy(graph)
    return _While(driver, graph_exec, cells, keep)


def _launch_condition(driver: _Driver, stream: object, handle: object, cells: _Cells) -> None:
    args = [
        ctypes.c_uint64(int(handle)),  # type: ignore[call-overload]  # a CUgraphConditionalHandle
        ctypes.c_void_p(cells.steps.data_ptr()),
        ctypes.c_void_p(cells.limit.data_ptr()),
    ]
    pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(arg) for arg in args))
    _ok(
        driver.cu.cuLaunchKernel(driver.condition, 1, 1, 1, 1, 1, 1, 0, stream, ctypes.addressof(pointers), 0)
    )


# ---------------------------------------------------------------------------
# Part synthetic
# ---------------------------------------------------------------------------


def _body(name: str) -> Callable[[], None]:
    """The body ``name``: one tiny kernel, or a ~300 us step of 64 kernels (no allocation: ``out=``)."""
    if name == "tiny":
        x = torch.zeros(1024, device="cuda")

        def tiny() -> None:
            x.add_(1.0)

        return tiny
    torch.manual_seed(0)
    weights = [
        torch.randn(STEP_WIDTH, STEP_WIDTH, device="cuda", dtype=torch.bfloat16) / STEP_WIDTH**0.5
        for _ in range(STEP_LAYERS)
    ]
    h = torch.randn(STEP_ROWS, STEP_WIDTH, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty_like(h)

    def step() -> None:
        for w in weights:
            torch.mm(h, w, out=buf)
            torch.tanh(buf, out=h)

    return step


def _repeat(work: Callable[[], None], times: int) -> Callable[[], None]:
    def repeated() -> None:
        for _ in range(times):
            work()

    return repeated


def _synthetic_variants(
    body: Callable[[], None], n: int
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """Every variant's call of ``n`` iterations of ``body``; and the variants that failed to build, why."""
    cells = _Cells(
        torch.zeros((), dtype=torch.int64, device="cuda"), torch.full((), n, dtype=torch.int64, device="cuda")
    )

    def iteration() -> None:
        body()
        cells.steps.add_(1)

    one = plain_graph(iteration)
    unrolled = plain_graph(_repeat(iteration, n))
    variants: dict[str, Callable[[], object]] = {
        "replays": _repeat(one.replay, n),
        "unrolled": unrolled.replay,
    }
    failed: dict[str, str] = {}
    builders: dict[str, Callable[[], Callable[[], object]]] = {
        "device_loop": lambda: _device_loop(body, n),
    }
    try:
        driver = _Driver.open()
    except Exception as error:
        failed["while_*"] = f"{type(error).__name__}: {error}"
    else:
        for unroll in UNROLLS:
            for child in (True, False):
                name = f"while_{'child' if child else 'inline'}_u{unroll}"
                work = _repeat(iteration, unroll)
                builders[name] = _while_builder(driver, cells, work, child)
    for name, build in builders.items():
        try:
            variants[name] = _checked(name, build(), cells, n)
        except Exception as error:
            failed[name] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
    return variants, failed


def _while_builder(
    driver: _Driver, cells: _Cells, work: Callable[[], None], child: bool
) -> Callable[[], Callable[[], object]]:
    return lambda: _build_while(driver, cells, work, child=child).launch


def _checked(name: str, launch: Callable[[], object], cells: _Cells, n: int) -> Callable[[], object]:
    """``launch`` once: it must run ``n`` iterations (the counter: ``cells.steps``, or the loop's own)."""
    counted = launch()
    torch.cuda.synchronize()
    taken = int(counted) if isinstance(counted, torch.Tensor) else int(cells.steps)
    if taken != n:
        raise RuntimeError(f"{name} ran {taken} iterations, not {n}")
    return launch


def _device_loop(body: Callable[[], None], n: int) -> Callable[[], object]:
    stop = torch.zeros((), dtype=torch.bool, device="cuda")  # never set: every launch runs n
    loop = DeviceLoop.capture(lambda steps: body(), stop=stop, max_steps=n)
    if loop.kind is not LoopKind.WHILE:
        raise RuntimeError(f"DeviceLoop fell back to {loop.kind}: {loop.fallback_reason}")

    def launch() -> torch.Tensor:
        loop.launch()
        return loop.steps_taken  # what _checked reads

    return launch


def _synthetic(name: str) -> dict[str, object]:
    n, calls = BODIES[name]
    body = _body(name)
    variants, failed = _synthetic_variants(body, n)
    timed = interleave(variants, rounds=ROUNDS, calls_per_round=calls)
    return synthetic_result(timed, n, failed)


def synthetic_result(timed: Interleaved, n: int, failed: dict[str, str]) -> dict[str, object]:
    """The figures of one body's variants, ``n`` iterations a call: per iteration, added, over replays."""
    variants = list(timed.samples)
    result: dict[str, object] = {"iterations": n, "failed": failed}
    result["us_per_call"] = {v: timed.median(v) * 1e6 for v in variants}
    result["us_per_iteration"] = {v: timed.median(v) / n * 1e6 for v in variants}
    for base in ("unrolled", "replays"):
        added = timed.minus(base)
        result[f"added_us_per_iteration_over_{base}"] = {v: added.median(v) / n * 1e6 for v in added.samples}
        result[f"added_spread_over_{base}"] = {
            v: str(Spread.of([t / n * 1e6 for t in added.samples[v]])) for v in added.samples
        }
    result["ratio_over_replays"] = {v: timed.ratio(v, "replays") for v in variants}
    result["ratio_spread_over_replays"] = {v: str(timed.spread(v, "replays")) for v in variants}
    return result


# ---------------------------------------------------------------------------
# Part manager: run_loop's slope and intercept against its floor
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _launch_marks(marks: list[float]) -> Iterator[None]:
    """``DeviceLoop.launch`` wrapped: the host time just before each launch appended to ``marks``."""
    original = DeviceLoop.launch

    def launch(self: DeviceLoop, max_steps: int | None = None) -> None:
        marks.append(time.perf_counter())
        original(self, max_steps)

    DeviceLoop.launch = launch  # type: ignore[method-assign]  # this script's probe, restored below
    try:
        yield
    finally:
        DeviceLoop.launch = original  # type: ignore[method-assign]


def node_census(raw_graph: int) -> dict[str, int]:
    """How many nodes of each type a CUDA graph has (``CU_GRAPH_NODE_TYPE_KERNEL``: 40, ...)."""
    cu = importlib.import_module("cuda.bindings.driver")
    graph = cu.CUgraph(raw_graph)
    status, _, count = cu.cuGraphGetNodes(graph, 0)  # (status, nodes, count): the count first
    status, nodes, count = cu.cuGraphGetNodes(graph, count)
    if int(status) != 0:
        raise RuntimeError(f"cuGraphGetNodes failed: {status!r}")
    census: dict[str, int] = {}
    for node in nodes:
        kind = _ok(cu.cuGraphNodeGetType(node))
        name = str(getattr(kind, "name", kind)).removeprefix("CU_GRAPH_NODE_TYPE_")
        census[name] = census.get(name, 0) + 1
    return census


@contextlib.contextmanager
def _recorded_census(census: list[dict[str, int]]) -> Iterator[None]:
    """Every loop body recorded meanwhile (``TorchGraphs.record``, wrapped here): its node types."""
    original = TorchGraphs.record

    def record(self: TorchGraphs, work: Callable[[], object], *, instantiate: bool) -> torch.cuda.CUDAGraph:
        graph = original(self, work, instantiate=instantiate)
        try:
            census.append(node_census(graph.raw_cuda_graph()))
        except Exception as error:
            census.append({f"census failed: {type(error).__name__}: {error}"[:200]: 0})
        return graph

    TorchGraphs.record = record  # type: ignore[method-assign]  # this script's probe, restored below
    try:
        yield
    finally:
        TorchGraphs.record = original  # type: ignore[method-assign]


def _manager_part(batches: tuple[int, ...]) -> dict[str, object]:
    from tests.benchmarks.test_bench_decode_loop import _setup  # GPU-only: imported here

    census: list[dict[str, int]] = []
    with _recorded_census(census):
        setup = _setup("default")
    out: dict[str, object] = {"steps": setup.steps, "model": "DecoderConfig() paged, flex, pages of 128"}
    out["loop_body_node_types"] = census  # one per loop captured (two managers: WHILE, UNROLLED)
    for num_reqs in batches:
        out[f"batch{num_reqs}"] = _manager_batch(setup, num_reqs)
    return out


def _manager_batch(setup: Setup, num_reqs: int) -> dict[str, object]:
    """``run_loop`` at 1 and ``setup.steps`` steps against its floor, interleaved, for ``num_reqs``."""
    from tests.benchmarks.test_bench_decode_loop import _batch, _floor

    steps = setup.steps
    batch = _batch(setup, num_reqs)
    marks: list[float] = []
    starts: list[float] = []

    def looped(k: int) -> Callable[[], object]:
        def call() -> object:
            starts.append(time.perf_counter())
            return setup.looped.run_loop(max_steps=k, **batch)

        return call

    candidates: dict[str, Callable[[], object]] = {
        "while_1": looped(1),
        f"while_{steps}": looped(steps),
        "floor_1": _floor(setup, batch, steps=1),
        f"floor_{steps}": _floor(setup, batch, steps=steps),
    }
    with torch.no_grad(), _launch_marks(marks):
        timed = interleave(candidates, rounds=ROUNDS, calls_per_round=1)
    return slopes(timed, steps, marks, starts)


def slopes(timed: Interleaved, steps: int, marks: list[float], starts: list[float]) -> dict[str, object]:
    """Per iteration and per call: what the loop adds over its floor (from 1 and ``steps`` steps)."""
    many, one = f"while_{steps}", "while_1"
    loop_slope = [(a - b) / (steps - 1) for a, b in zip(timed.samples[many], timed.samples[one], strict=True)]
    floor_slope = [
        (a - b) / (steps - 1)
        for a, b in zip(timed.samples[f"floor_{steps}"], timed.samples["floor_1"], strict=True)
    ]
    added_iteration = [(a - b) * 1e6 for a, b in zip(loop_slope, floor_slope, strict=True)]
    added_call = [
        (w - f) * 1e6 - it
        for w, f, it in zip(timed.samples[one], timed.samples["floor_1"], added_iteration, strict=True)
    ]
    host_before_launch = sorted((m - s) * 1e6 for m, s in zip(marks, starts, strict=False))
    return {
        "us_per_call": {name: timed.median(name) * 1e6 for name in timed.samples},
        "floor_us_per_step": statistics.median(floor_slope) * 1e6,
        "loop_us_per_step": statistics.median(loop_slope) * 1e6,
        "added_us_per_iteration": statistics.median(added_iteration),
        "added_us_per_iteration_spread": str(Spread.of(added_iteration)),
        "added_us_per_call": statistics.median(added_call),
        "added_us_per_call_spread": str(Spread.of(added_call)),
        "run_loop_host_us_before_launch": statistics.median(host_before_launch),
        f"while_over_floor_{steps}": timed.ratio(many, f"floor_{steps}"),
        f"while_over_floor_{steps}_spread": str(timed.spread(many, f"floor_{steps}")),
    }


# ---------------------------------------------------------------------------


def _machine() -> dict[str, object]:
    return {
        "torch_conditional_capture": [
            m for m in dir(torch.cuda.CUDAGraph) if "conditional" in m or "_node" in m
        ],
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver_version(),
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
    }


def _driver_version() -> object:
    try:
        return _ok(importlib.import_module("cuda.bindings.driver").cuDriverGetVersion())
    except Exception as error:
        return f"unknown ({type(error).__name__})"


def summary(results: dict[str, object]) -> str:
    lines = [f"loop floor profile: {results['machine']}"]
    for name in BODIES:
        part = results.get(f"synthetic_{name}")
        if not isinstance(part, dict):
            continue
        lines.append(
            f"\n[{name} body, {part['iterations']} iterations per call; failed: {part['failed'] or 'none'}]"
        )
        per_it = part["us_per_iteration"]
        over_unrolled = part["added_us_per_iteration_over_unrolled"]
        over_replays = part["added_us_per_iteration_over_replays"]
        ratios, spreads = part["ratio_over_replays"], part["ratio_spread_over_replays"]
        for variant in per_it:
            added = f"+{over_unrolled.get(variant, 0.0):7.2f} / +{over_replays.get(variant, 0.0):7.2f}"
            lines.append(
                f"  {variant:>18}: {per_it[variant]:9.2f} us/it, {added} us/it over unrolled / replays; "
                f"over replays {ratios[variant]:.4f} [{spreads[variant]}]"
            )
    manager = results.get("manager")
    if isinstance(manager, dict):
        lines.append(f"\n[run_loop against its floor, {manager['model']}, 1 and {manager['steps']} steps]")
        lines.append(f"  loop bodies' node types: {manager.get('loop_body_node_types')}")
        for key, value in manager.items():
            if key.startswith("batch") and isinstance(value, dict):
                shown = {
                    k: (round(v, 3) if isinstance(v, float) else v)
                    for k, v in value.items()
                    if k != "us_per_call"
                }
                lines.append(f"  {key}: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--part", choices=("synthetic", "manager", "all"), default="all")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    results: dict[str, object] = {"machine": _machine()}
    parts: dict[str, Callable[[], object]] = {
        f"synthetic_{name}": functools.partial(_synthetic, name) for name in BODIES
    }
    parts["manager"] = lambda: _manager_part((1, 8, 64))
    for key, run in parts.items():
        if args.part != "all" and not key.startswith(args.part):
            continue
        try:
            results[key] = run()
        except Exception as error:
            traceback.print_exc()
            results[key] = {"error": f"{type(error).__name__}: {error}"}
        torch.cuda.synchronize()
        args.out.mkdir(parents=True, exist_ok=True)  # written after each part: a timeout keeps the rest
        (args.out / "loop_floor.json").write_text(json.dumps(results, indent=2, default=str))
        print(summary(results), flush=True)


if __name__ == "__main__":
    main()
