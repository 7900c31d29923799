r"""The decode loop at its floor, A/B in one run: where ``run_loop``'s per-iteration cost goes (a GPU).

Usage: ``python -m tests.benchmarks.loop_floor_ab [--out DIR] [--batches 64 8 1] [--rounds 7]
[--profile]``.

Issue 40 item 3. ``loop_floor --part manager`` measured ``run_loop`` on the
default paged model (flex, 64 steps) at 1.010, 1.022, 1.038 of its floor at
1, 8, 64 requests (+1.7, +7.2, +29.3 us per iteration), while a WHILE loop
over a synthetic body of GEMMs was no slower than replays. The floor is the
same forward and advance (the same ops: ``PagedAdvance``, masking finished
requests included) as one torch graph replayed. The loop body differs from
it in where it runs (a WHILE node's child graph, ``loop_next`` after it) and
in what it holds that the synthetic bodies do not: 11 to 13 memcpy nodes
(each layer's attention output, the advance's inputs). Per batch, these run
interleaved, each at 1 and ``S`` steps (the slope is the cost per iteration):

- ``floor``: the floor graph, replayed from the host;
- ``floor_while_memcpy`` / ``floor_while_kernels``: that very graph as the
  body of the project's WHILE loop (``CudaConditional``), its memcpy nodes
  as they are / rewritten as ``loop_copy`` kernels (``CopyRewrite``);
- ``while_memcpy`` / ``while_kernels``: ``run_loop`` of two managers of one
  model, captured with the rewrite off / on (the new default).

Reading it: ``floor_while_memcpy - floor`` is what running the floor's own
graph in a WHILE node costs; ``while_memcpy - floor_while_memcpy`` what the
manager's body and call add beyond it (if near 0, the bodies do the same
work: the floor is fair); ``*_kernels - *_memcpy`` what the rewrite saves.
Also printed: the node types of the floor graph and of the manager's loop
body, their kernel names' difference and their memcpy sizes; with
``--profile``, the kernels whose device time differs most between a loop
call and a floor call at the first batch (torch.profiler). Every variant's
tokens are checked equal to the floor's before timing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Final

import torch

from cudagraph_capture._conditional import CudaWhileGraph, LoopCells, load_conditional
from cudagraph_capture._copy_nodes import CopyRewrite
from cudagraph_capture._loop import TorchGraphs
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from cudagraph_manager import CUDAGraphManager, LoopState
from cudagraph_manager.attention import BatchShape, StepBatch, metadata_extra
from examples import DecoderConfig
from examples.paged import PAGED_INPUT_NAMES, PagedDecoder, PagedLayout
from examples.paged.loop import NO_TOKEN, PagedAdvance, decode_batch, greedy_advance
from tests.benchmarks.support import Interleaved, Spread, interleave

STEPS: Final = 64
PAGE_SIZE: Final = 128
WAYS: Final = ("floor", "floor_while_memcpy", "floor_while_kernels", "while_memcpy", "while_kernels")


@dataclasses.dataclass(frozen=True, slots=True)
class Models:
    """The default paged model, its advance, two WHILE managers (rewrite off, on) and their loop bodies."""

    model: PagedDecoder
    advance: PagedAdvance
    managers: dict[str, CUDAGraphManager[torch.Tensor]]
    bodies: dict[tuple[str, int], torch.cuda.CUDAGraph]  # (way, num_reqs): the loop body torch recorded


@contextlib.contextmanager
def _kept_bodies(bodies: list[tuple[BatchDescriptor | None, torch.cuda.CUDAGraph]]) -> Iterator[None]:
    """Every loop body recorded meanwhile (``TorchGraphs.record``, wrapped here), with its key."""
    original = TorchGraphs.record

    def record(self: TorchGraphs, work: Callable[[], object], *, instantiate: bool) -> torch.cuda.CUDAGraph:
        graph = original(self, work, instantiate=instantiate)
        bodies.append((self.descriptor, graph))
        return graph

    TorchGraphs.record = record  # type: ignore[method-assign]  # this script's probe, restored below
    try:
        yield
    finally:
        TorchGraphs.record = original  # type: ignore[method-assign]


def models() -> Models:
    """The model and both managers captured (keys 1, 8, 64 and their loops: the bench's ``_manager``)."""
    from tests.benchmarks.test_bench_decode_loop import _manager  # GPU-only: imported here

    torch.manual_seed(0)
    config = DecoderConfig()
    model = PagedDecoder(config, layout=PagedLayout.for_config(config, page_size=PAGE_SIZE), device="cuda")
    advance = greedy_advance(model, eos_id=None, max_len=config.max_seq_len)
    managers, bodies = {}, {}
    for way, rewrite in (("while_memcpy", False), ("while_kernels", True)):
        manager = _manager(model, advance, STEPS, None)
        recorded: list[tuple[BatchDescriptor | None, torch.cuda.CUDAGraph]] = []
        previous, CopyRewrite.on = CopyRewrite.on, rewrite
        try:
            with torch.no_grad(), _kept_bodies(recorded):
                manager.capture(progress=False)
        finally:
            CopyRewrite.on = previous
        managers[way] = manager
        bodies.update({(way, key.num_tokens): graph for key, graph in recorded if key is not None})
    return Models(model, advance, managers, bodies)


def batch_of(m: Models, num_reqs: int) -> dict[str, torch.Tensor]:
    """Prompts of 1 to ``max_len - STEPS - 1`` tokens: nobody finishes within the loop (as the bench)."""
    max_len = m.advance.max_len
    generator = torch.Generator().manual_seed(num_reqs)
    lens = torch.randint(1, max_len - STEPS, (num_reqs,), generator=generator).tolist()
    return decode_batch(m.model, lens, max_len=max_len, generator=generator, device="cuda")


class Floor:
    """The forward and the advance as one torch graph of the batch (``keep_graph``: a WHILE may clone it)."""

    def __init__(self, m: Models, batch: Mapping[str, torch.Tensor]) -> None:
        self.m, self.batch = m, batch
        self.num_reqs = num_reqs = batch["input_ids"].shape[0]
        self.static = {name: tensor.clone() for name, tensor in batch.items()}
        self.shape = BatchShape(num_reqs, num_reqs, 1, CUDAGraphMode.FULL)
        metadata = m.model.backend.build(StepBatch(num_reqs, num_reqs, self.static), self.shape)
        self.context = metadata_extra(m.model.backend, metadata)
        self.key = BatchDescriptor(num_reqs, num_reqs, True)
        device = "cuda"
        self.state = LoopState(
            torch.zeros((), dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.bool, device=device),
            torch.ones(num_reqs, dtype=torch.bool, device=device),
            torch.full((STEPS, num_reqs), NO_TOKEN, dtype=torch.int64, device=device),
        )
        self.graph = self._record()

    def body(self) -> None:
        with torch.no_grad(), set_forward_context(CUDAGraphMode.FULL, self.key, **self.context):
            model = self.m.model
            self.m.advance(model(*(self.static[n] for n in PAGED_INPUT_NAMES)), self.static, self.state)
            self.state.step.add_(1)

    def _record(self) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.body()  # the warm-up
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            self.body()
        graph.instantiate()
        return graph

    def reset(self) -> None:
        """The batch copied in, its metadata built, the state reset: what a loop's call starts from."""
        num_reqs = self.num_reqs
        for name, tensor in self.batch.items():
            self.static[name].copy_(tensor)
        self.m.model.backend.build(StepBatch(num_reqs, num_reqs, self.static), self.shape)
        self.state.active.fill_(True)
        self.state.step.zero_()
        self.state.stop.zero_()

    def replays(self, steps: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            self.reset()
            for _ in range(steps):
                self.graph.replay()
            return self.state.tokens[:steps]

        return run

    def looped(self, rewrite: bool) -> tuple[Callable[[int], Callable[[], torch.Tensor]], CudaWhileGraph]:
        """This graph as the body of the project's WHILE loop (memcpy nodes rewritten or not)."""
        cells = LoopCells(
            torch.zeros((), dtype=torch.int64, device="cuda"),
            torch.full((), STEPS, dtype=torch.int64, device="cuda"),
            self.state.stop,
        )
        previous, CopyRewrite.on = CopyRewrite.on, rewrite
        try:
            loop = load_conditional(torch.cuda.current_device()).build(self.graph, cells)
        finally:
            CopyRewrite.on = previous

        def launcher(steps: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                self.reset()
                cells.limit.fill_(steps)
                loop.launch()
                return self.state.tokens[:steps]

            return run

        return launcher, loop


def _calls(
    m: Models, floor: Floor, batch: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, object]]:
    """Every way at 1 and ``STEPS`` steps; and the WHILE loops' rewrite counts."""
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    counts: dict[str, object] = {}
    for steps in (1, STEPS):
        calls[f"floor_{steps}"] = floor.replays(steps)
    for rewrite, way in ((False, "floor_while_memcpy"), (True, "floor_while_kernels")):
        launcher, loop = floor.looped(rewrite)
        counts[way] = dataclasses.asdict(loop.copies)
        for steps in (1, STEPS):
            calls[f"{way}_{steps}"] = launcher(steps)
    for way, manager in m.managers.items():
        for steps in (1, STEPS):
            calls[f"{way}_{steps}"] = _run_loop(manager, batch, steps)
        counts[way] = _manager_copies(manager, floor.num_reqs)
    return calls, counts


def _run_loop(
    manager: CUDAGraphManager[torch.Tensor], batch: Mapping[str, torch.Tensor], steps: int
) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        return manager.run_loop(max_steps=steps, **batch).tokens

    return run


def _manager_copies(manager: CUDAGraphManager[torch.Tensor], num_reqs: int) -> object:
    """The rewrite counts of ``manager``'s loop for ``num_reqs`` (its WHILE graph), or why none."""
    for key, loop in manager._table.loops.items():
        if key.num_tokens == num_reqs:
            graph = getattr(getattr(loop, "_run", None), "graph", None)
            return dataclasses.asdict(graph.copies) if isinstance(graph, CudaWhileGraph) else f"{loop.kind}"
    return "no loop"


def _check_tokens(calls: Mapping[str, Callable[[], torch.Tensor]]) -> dict[str, bool]:
    """Each way's ``STEPS``-step tokens equal the floor's (no request finishes: all steps run)."""
    with torch.no_grad():
        want = calls[f"floor_{STEPS}"]().clone()
        torch.cuda.synchronize()
        same = {}
        for way in WAYS[1:]:
            got = calls[f"{way}_{STEPS}"]().clone()
            torch.cuda.synchronize()
            same[way] = bool(torch.equal(got, want))
    return same


def figures(timed: Interleaved) -> dict[str, object]:
    """Per way: us per step (the slope), added per iteration over the floor's, its spread, the ratio."""

    def slope(way: str) -> list[float]:
        return [
            (a - b) / (STEPS - 1) * 1e6
            for a, b in zip(timed.samples[f"{way}_{STEPS}"], timed.samples[f"{way}_1"], strict=True)
        ]

    floor = slope("floor")
    out: dict[str, object] = {"floor_us_per_step": statistics.median(floor)}
    for way in WAYS[1:]:
        added = [a - b for a, b in zip(slope(way), floor, strict=True)]
        out[way] = {
            "us_per_step": statistics.median(slope(way)),
            "added_us_per_iteration": statistics.median(added),
            "added_spread": str(Spread.of(added)),
            "over_floor": timed.ratio(f"{way}_{STEPS}", f"floor_{STEPS}"),
            "over_floor_spread": str(timed.spread(f"{way}_{STEPS}", f"floor_{STEPS}")),
            "us_per_call_1_step": timed.median(f"{way}_1") * 1e6,
        }
    return out


def batch_part(
    m: Models, num_reqs: int, rounds: int, kept: dict[int, Mapping[str, Callable[[], object]]]
) -> dict[str, object]:
    """One batch's A/B; its calls are left in ``kept`` (a profile may run them after every batch)."""
    batch = batch_of(m, num_reqs)
    floor = Floor(m, batch)
    calls, counts = _calls(m, floor, batch)
    out: dict[str, object] = {"same_tokens": _check_tokens(calls), "copy_rewrites": counts}
    with torch.no_grad():
        timed = interleave(calls, rounds=rounds, calls_per_round=1)
    out.update(figures(timed))
    out["nodes"] = {
        "floor": graph_nodes(floor.graph.raw_cuda_graph()),
        **{
            way: graph_nodes(m.bodies[(way, num_reqs)].raw_cuda_graph())
            for way in m.managers
            if (way, num_reqs) in m.bodies
        },
    }
    kept[num_reqs] = calls
    return out


# ---------------------------------------------------------------------------
# The graphs' nodes: types, kernel names, memcpy sizes
# ---------------------------------------------------------------------------


def _ok(result: object) -> object:
    values = result if isinstance(result, tuple) else (result,)
    if int(values[0]) != 0:
        raise RuntimeError(f"CUDA error {values[0]!r}")
    return values[1] if len(values) == 2 else values[1:]


def graph_nodes(raw_graph: int) -> dict[str, object]:
    """A graph's node types, its kernels by name, its memcpy nodes' byte counts (cuda-bindings)."""
    cu = importlib.import_module("cuda.bindings.driver")
    graph = cu.CUgraph(raw_graph)
    count = int(cu.cuGraphGetNodes(graph, 0)[-1])
    nodes = cu.cuGraphGetNodes(graph, count)[1]
    types: collections.Counter[str] = collections.Counter()
    kernels: collections.Counter[str] = collections.Counter()
    copies: list[int] = []
    for node in nodes:
        kind = _ok(cu.cuGraphNodeGetType(node))
        name = str(getattr(kind, "name", kind)).removeprefix("CU_GRAPH_NODE_TYPE_")
        types[name] += 1
        if name == "KERNEL":
            kernels[_kernel_name(cu, node)] += 1
        elif name == "MEMCPY":
            with contextlib.suppress(Exception):
                copies.append(int(_ok(cu.cuGraphMemcpyNodeGetParams(node)).WidthInBytes))  # type: ignore[attr-defined]
    return {"types": dict(types), "kernels": dict(kernels), "memcpy_bytes": sorted(copies)}


def _kernel_name(cu: object, node: object) -> str:
    """A kernel node's function name: its ``func``, else its ``kern`` (a library kernel, CUDA 12.3+)."""
    try:
        params = _ok(cu.cuGraphKernelNodeGetParams(node))  # type: ignore[attr-defined]
    except Exception as error:
        return f"? ({type(error).__name__})"
    for getter, field in (("cuFuncGetName", "func"), ("cuKernelGetName", "kern")):
        with contextlib.suppress(Exception):
            name = _ok(getattr(cu, getter)(getattr(params, field)))
            return (name.decode() if isinstance(name, bytes) else str(name))[:80]
    return "?"


def node_diff(nodes: Mapping[str, object], way: str) -> dict[str, int]:
    """Kernel names whose counts differ: ``way``'s body minus the floor graph's."""
    floor: collections.Counter[str] = collections.Counter(nodes["floor"]["kernels"])  # type: ignore[index]
    body: collections.Counter[str] = collections.Counter(nodes[way]["kernels"])  # type: ignore[index]
    names = set(floor) | set(body)
    return {n: body[n] - floor[n] for n in sorted(names) if body[n] != floor[n]}


# ---------------------------------------------------------------------------
# Optional: the kernels whose device time differs, loop call against floor call
# ---------------------------------------------------------------------------


def profile(calls: Mapping[str, Callable[[], object]], ways: tuple[str, ...]) -> dict[str, object]:
    """Per kernel name, device us of one ``STEPS``-step call of each way (torch.profiler); the top diffs."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    times: dict[str, dict[str, float]] = {}
    for way in ways:
        call = calls[f"{way}_{STEPS}"]
        call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        times[way] = {e.key[:70]: e.device_time_total for e in prof.key_averages() if e.device_time_total > 0}
    base = times[ways[0]]
    out: dict[str, object] = {f"{w}_total_us": sum(t.values()) for w, t in times.items()}
    for way in ways[1:]:
        diff = {k: times[way].get(k, 0.0) - base.get(k, 0.0) for k in set(base) | set(times[way])}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:8]
        out[f"{way}_minus_{ways[0]}_us"] = {k: round(v, 1) for k, v in top}
    return out


# ---------------------------------------------------------------------------


def summary(results: Mapping[str, object]) -> str:
    lines = [
        f"loop floor A/B: {results.get('machine')}  (S={STEPS} steps; us per iteration over the floor's)"
    ]
    for key, part in results.items():
        if not key.startswith("batch") or not isinstance(part, dict):
            continue
        if "error" in part:
            lines.append(f"[{key}] error: {part['error']}")
            continue
        lines.append(
            f"[{key}] floor {part['floor_us_per_step']:.1f} us/step; same tokens: {part['same_tokens']}"
        )
        for way in WAYS[1:]:
            w = part[way]
            lines.append(
                f"  {way:>20}: +{w['added_us_per_iteration']:6.2f} us/it [{w['added_spread']}]  "
                f"over floor {w['over_floor']:.4f} [{w['over_floor_spread']}]"
            )
        lines.append(f"  copy rewrites: {part['copy_rewrites']}")
        nodes = part["nodes"]
        lines.append("  node types: " + "; ".join(f"{k} {v['types']}" for k, v in nodes.items()))
        lines.append(f"  memcpy bytes: floor {nodes['floor']['memcpy_bytes']}")
        for way in ("while_memcpy",):
            if way in nodes:
                lines.append(f"  kernels {way} body - floor: {node_diff(nodes, way)}")
    if results.get("profile"):
        lines.append(f"profile (device us of one {STEPS}-step call; top differences): {results['profile']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 8, 1])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler kernel diff at the first batch"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    start = time.perf_counter()
    results: dict[str, object] = {
        "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    }
    m = models()
    results["setup_s"] = round(time.perf_counter() - start, 1)
    kept: dict[int, Mapping[str, Callable[[], object]]] = {}
    for num_reqs in args.batches:
        try:
            results[f"batch{num_reqs}"] = batch_part(m, num_reqs, args.rounds, kept)
        except Exception as error:
            traceback.print_exc()
            results[f"batch{num_reqs}"] = {"error": f"{type(error).__name__}: {error}"}
        _write(args.out, results)  # after each batch: a timeout keeps the rest
    first = args.batches[0]
    if args.profile and first in kept:  # last: the slowest part, and the least needed
        results["profile"] = {f"batch{first}": _profiled(kept[first])}
        _write(args.out, results)
    print(summary(results), flush=True)


def _write(out: Path, results: Mapping[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "loop_floor_ab.json").write_text(json.dumps(results, indent=2, default=str))


def _profiled(calls: Mapping[str, Callable[[], object]]) -> object:
    try:
        with torch.no_grad():
            return profile(calls, ("floor", "floor_while_memcpy", "while_memcpy", "while_kernels"))
    except Exception as error:
        return f"profile failed: {type(error).__name__}: {error}"


if __name__ == "__main__":
    main()
