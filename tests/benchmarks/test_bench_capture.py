"""Benchmarks of the capture engines against their baselines, all measured in this run.

- Host overhead: one ``CUDAGraphWrapper`` call replaying a one-kernel graph,
  against a bare ``torch.cuda.CUDAGraph.replay()`` of the same graph.
- Decoder step (8 layers, d=1024, bf16, static KV cache; batch 1, 16, 128):
  eager, a hand-written ``torch.cuda.CUDAGraph``, our monolithic wrapper,
  and, with attention as an eager break (8 breaks), ``breakable_cuda_graphs``
  and our breakable wrapper.
- Per-break cost: a chain of 33 tiny segments split by 32 no-op breaks,
  replayed by our breakable capture and by ``breakable_cuda_graphs``, minus
  a one-graph replay of the same kernels.
- Capture time of the first 35 default sizes (1 .. 256) of the decoder: our
  monolithic and breakable wrappers, a hand-written ``torch.cuda.graph`` loop,
  ``breakable_cuda_graphs``. Each size gets one eager warm-up then a capture,
  in every variant (our wrappers warm up themselves).

Every benchmarked callable runs many steps (or calls) and synchronizes the
device once at the end. Medians per step and ratios against the baselines
measured earlier in this module go into ``extra_info``. No timing is
asserted; only results are (a graph that replays garbage is not fast).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Final, Protocol

import pytest
import torch

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    BreakableCUDAGraphWrapper,
    CUDAGraphWrapper,
    eager_break_during_capture,
)
from cudagraph_dispatch import BatchDescriptor, CaptureSizes, CUDAGraphMode, set_forward_context
from tests.benchmarks.decoder_bench_model import (
    AttentionFn,
    BenchDecoder,
    BenchDecoderConfig,
    attention_reference,
)
from tests.benchmarks.support import BenchmarkFixture, interleave

pytestmark = pytest.mark.gpu

# Host overhead: a one-kernel graph, many calls between two syncs.
_HOST_CALLS: Final = 1000
_HOST_ROUNDS: Final = 10
# Decoder steps.
_STEP_BATCHES: Final = (1, 16, 128)
_STEPS_PER_CALL: Final = 20
_STEP_ROUNDS: Final = 10
_WARMUP_ROUNDS: Final = 2
_BF16_TOL: Final = 3e-2  # bf16 graph vs eager: rounding only (a bug is of order 1)
# Per-break cost.
_BREAKS: Final = 32
_CHAIN_REPLAYS: Final = 100
_CHAIN_ROUNDS: Final = 10
# Capture time: the first 35 of the default sizes up to 512 (1, 2, 4, 8, ..., 248, 256).
_CAPTURE_SIZES: Final = CaptureSizes.default(512).sizes[:35]
_CAPTURE_ROUNDS: Final = 3

# (group, label) -> median seconds per step/call/replay, for ratios within this run.
_MEDIANS: Final[dict[tuple[str, str], float]] = {}


class _Peer(Protocol):
    """What is used of ``breakable_cuda_graphs`` 0.1.0 (untyped; imported in the tests)."""

    def no_graph(self, fn: Callable[..., None]) -> Callable[..., None]: ...

    def BreakableCUDAGraph(self, pool: object = None) -> _PeerGraph: ...  # noqa: N802 - its name

    def breakable_graph(self, graph: _PeerGraph) -> _PeerContext: ...


class _PeerGraph(Protocol):
    def replay(self) -> None: ...

    def pool(self) -> object: ...


class _PeerContext(Protocol):
    def __enter__(self) -> object: ...

    def __exit__(self, *args: object) -> object: ...


def _peer() -> _Peer:
    module: _Peer = pytest.importorskip("breakable_cuda_graphs")  # untyped: ModuleType, attributes Any
    return module


def _peer_available() -> bool:
    return importlib.util.find_spec("breakable_cuda_graphs") is not None


# -- helpers --


def _new_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch's Stream.__new__ is unannotated


def _median_s(benchmark: BenchmarkFixture) -> float:
    metadata = benchmark.stats
    assert metadata is not None, "the benchmark did not run"
    return float(metadata.stats.median)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.double(), expected.double()
    return float(torch.linalg.vector_norm(a - b).item() / torch.linalg.vector_norm(b).item())


def _record(
    benchmark: BenchmarkFixture,
    *,
    group: str,
    label: str,
    per_call: int,
    unit: str,
    baselines: tuple[str, ...] = (),
) -> float:
    """Store this benchmark's median per step/call in ``extra_info``, with ratios to earlier baselines."""
    median = _median_s(benchmark) / per_call
    _MEDIANS[(group, label)] = median
    info = benchmark.extra_info
    info["label"] = label
    info[f"median_{unit}_us"] = median * 1e6
    if per_call > 1:
        info["steps_per_call"] = per_call
    if baselines:
        info["baseline"] = baselines[0]
    for baseline in baselines:
        theirs = _MEDIANS.get((group, baseline))
        if theirs is not None:
            info[f"ratio_vs_{baseline}"] = median / theirs
    return median


def _warm_up_on_side_stream(fn: Callable[[], object], runs: int = 2) -> None:
    """Eager runs on a side stream, as ``torch.cuda.graph`` capture wants before capturing."""
    side = _new_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------
# a) Host overhead of one wrapper call
# ---------------------------------------------------------------------------


def _add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1.0


_HOST_LABELS: Final = ("bare_replay", "wrapper_call", "wrapper_call_with_context")


@pytest.mark.parametrize("label", _HOST_LABELS)
def test_host_overhead_of_one_call(benchmark: BenchmarkFixture, label: str) -> None:
    """Time of one call replaying a one-kernel graph: bare CUDAGraph.replay vs our wrapper."""
    group = "capture: host cost of one replay (one-kernel graph)"
    benchmark.group = group
    x = torch.randn(64, device="cuda")
    desc = BatchDescriptor(64)
    host_times: list[float] = []
    one_call: Callable[[], torch.Tensor]

    if label == "bare_replay":
        _warm_up_on_side_stream(lambda: _add_one(x))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = _add_one(x)
        replay = graph.replay

        def one_call() -> torch.Tensor:
            replay()
            return graph_out

        def calls() -> None:
            start = time.perf_counter()
            for _ in range(_HOST_CALLS):
                replay()
            host_times.append(time.perf_counter() - start)
            torch.cuda.synchronize()

    else:
        wrapper = CUDAGraphWrapper(_add_one, CUDAGraphMode.FULL)
        with set_forward_context(CUDAGraphMode.FULL, desc):
            wrapper(x)

        def one_call() -> torch.Tensor:
            with set_forward_context(CUDAGraphMode.FULL, desc):
                return wrapper(x)

        if label == "wrapper_call":

            def calls() -> None:
                with set_forward_context(CUDAGraphMode.FULL, desc):
                    start = time.perf_counter()
                    for _ in range(_HOST_CALLS):
                        wrapper(x)
                    host_times.append(time.perf_counter() - start)
                torch.cuda.synchronize()

        else:

            def calls() -> None:
                start = time.perf_counter()
                for _ in range(_HOST_CALLS):
                    with set_forward_context(CUDAGraphMode.FULL, desc):
                        wrapper(x)
                host_times.append(time.perf_counter() - start)
                torch.cuda.synchronize()

    benchmark.pedantic(calls, rounds=_HOST_ROUNDS, warmup_rounds=_WARMUP_ROUNDS)
    _record(
        benchmark, group=group, label=label, per_call=_HOST_CALLS, unit="call", baselines=("bare_replay",)
    )
    benchmark.extra_info["host_enqueue_us_per_call"] = statistics.median(host_times) / _HOST_CALLS * 1e6
    # Sanity: a replay computes x + 1 for the current x.
    x.copy_(torch.randn(64, device="cuda"))
    expected = x + 1.0
    got = one_call().clone()
    torch.cuda.synchronize()
    assert _rel_err(got, expected) < 1e-6


# ---------------------------------------------------------------------------
# b) Decoder step
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder() -> Iterator[BenchDecoder]:
    torch.manual_seed(0)
    model = BenchDecoder(BenchDecoderConfig(), torch.device("cuda"))
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def step_buffers(decoder: BenchDecoder) -> tuple[torch.Tensor, torch.Tensor]:
    """Static ``input_ids`` and ``positions`` for the largest batch; a batch of B uses rows [:B]."""
    config = decoder.config
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (config.max_batch,), generator=generator)
    positions = torch.randint(0, config.max_seq_len, (config.max_batch,), generator=generator).cuda()
    decoder.prepare(positions)  # the steps' attention metadata, once, outside every graph
    return ids.cuda(), positions


_STEP_LABELS: Final = ("eager", "cuda_graph", "ours_full", "peer_breakable", "ours_breakable")
_STEP_BASELINES: Final[dict[str, tuple[str, ...]]] = {
    "eager": (),
    "cuda_graph": ("eager",),
    "ours_full": ("cuda_graph", "eager"),
    "peer_breakable": ("cuda_graph", "eager"),
    "ours_breakable": ("peer_breakable", "cuda_graph", "eager"),
}


def _decoder_step(
    label: str,
    decoder: BenchDecoder,
    ids: torch.Tensor,
    positions: torch.Tensor,
    desc: BatchDescriptor,
) -> Callable[[], torch.Tensor]:
    """One decode step of variant ``label``, captured if it is a graph variant (inputs static)."""
    step: Callable[[], torch.Tensor]

    if label == "eager":

        def step() -> torch.Tensor:
            return decoder.run(ids, positions)

    elif label == "cuda_graph":
        _warm_up_on_side_stream(lambda: decoder.run(ids, positions))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            graph_out = decoder.run(ids, positions)

        def step() -> torch.Tensor:
            graph.replay()
            return graph_out

    elif label == "ours_full":
        full = CUDAGraphWrapper(decoder.run, CUDAGraphMode.FULL)
        with set_forward_context(CUDAGraphMode.FULL, desc):
            full(ids, positions)

        def step() -> torch.Tensor:
            with set_forward_context(CUDAGraphMode.FULL, desc):
                return full(ids, positions)

    elif label == "ours_breakable":
        ours: AttentionFn = eager_break_during_capture(attention_reference)
        breakable = BreakableCUDAGraphWrapper(decoder.with_attention(ours).run)
        with set_forward_context(CUDAGraphMode.PIECEWISE, desc):
            breakable(ids, positions)

        def step() -> torch.Tensor:
            with set_forward_context(CUDAGraphMode.PIECEWISE, desc):
                return breakable(ids, positions)

    else:
        peer = _peer()
        peer_model = decoder.with_attention(peer.no_graph(attention_reference))
        _warm_up_on_side_stream(lambda: peer_model.run(ids, positions))
        peer_graph = peer.BreakableCUDAGraph()
        with peer.breakable_graph(peer_graph):
            peer_out = peer_model.run(ids, positions)

        def step() -> torch.Tensor:
            peer_graph.replay()
            return peer_out

    return step


@pytest.mark.parametrize(
    ("batch", "label"), [(batch, label) for batch in _STEP_BATCHES for label in _STEP_LABELS]
)
def test_decoder_step(
    benchmark: BenchmarkFixture,
    decoder: BenchDecoder,
    step_buffers: tuple[torch.Tensor, torch.Tensor],
    batch: int,
    label: str,
) -> None:
    """One decode step of the 8-layer decoder: eager, hand-written graph, our engines, the peer."""
    group = f"capture: decoder step, batch {batch}"
    benchmark.group = group
    ids, positions = step_buffers[0][:batch], step_buffers[1][:batch]
    expected = decoder.run(ids, positions).clone()  # idempotent: every variant computes this
    step = _decoder_step(label, decoder, ids, positions, BatchDescriptor(batch))

    def steps() -> None:
        for _ in range(_STEPS_PER_CALL):
            step()
        torch.cuda.synchronize()

    got = step().clone()
    torch.cuda.synchronize()
    err = _rel_err(got, expected)
    assert err < _BF16_TOL, f"{label}: step differs from eager, rel err {err:.3e}"

    benchmark.pedantic(steps, rounds=_STEP_ROUNDS, warmup_rounds=_WARMUP_ROUNDS)
    median = _record(
        benchmark,
        group=group,
        label=label,
        per_call=_STEPS_PER_CALL,
        unit="step",
        baselines=_STEP_BASELINES[label],
    )
    benchmark.extra_info["median_step_ms"] = median * 1e3
    benchmark.extra_info["batch"] = batch
    benchmark.extra_info["eager_breaks"] = decoder.config.num_layers if "breakable" in label else 0


@pytest.mark.parametrize("batch", _STEP_BATCHES)
def test_decoder_step_interleaved(
    benchmark: BenchmarkFixture,
    decoder: BenchDecoder,
    step_buffers: tuple[torch.Tensor, torch.Tensor],
    batch: int,
) -> None:
    """The target ratios from rounds that alternate every variant (drift-free; see support.py).

    The benchmark itself times our monolithic step; ``extra_info`` holds each
    variant's interleaved median and ours over hand-written and over the peer.
    """
    benchmark.group = f"capture: decoder step, interleaved ratios, batch {batch}"
    ids, positions = step_buffers[0][:batch], step_buffers[1][:batch]
    expected = decoder.run(ids, positions).clone()
    labels = [label for label in _STEP_LABELS if label != "peer_breakable" or _peer_available()]
    steps = {label: _decoder_step(label, decoder, ids, positions, BatchDescriptor(batch)) for label in labels}
    for label, step in steps.items():
        err = _rel_err(step().clone(), expected)
        assert err < _BF16_TOL, f"{label}: step differs from eager, rel err {err:.3e}"
    timed = interleave(steps, rounds=_STEP_ROUNDS, calls_per_round=_STEPS_PER_CALL)
    ours_full = steps["ours_full"]

    def run_steps() -> None:
        for _ in range(_STEPS_PER_CALL):
            ours_full()
        torch.cuda.synchronize()

    benchmark.pedantic(run_steps, rounds=_STEP_ROUNDS, warmup_rounds=_WARMUP_ROUNDS)
    info = benchmark.extra_info
    info["batch"] = batch
    for label in steps:
        info[f"{label}_step_us"] = timed.median(label) * 1e6
    info["full_vs_cuda_graph"] = timed.ratio("ours_full", "cuda_graph")
    info["breakable_vs_full"] = timed.ratio("ours_breakable", "ours_full")
    if "peer_breakable" in steps:
        info["breakable_vs_peer"] = timed.ratio("ours_breakable", "peer_breakable")


# ---------------------------------------------------------------------------
# c) Per-break host cost
# ---------------------------------------------------------------------------


def _noop_break(t: torch.Tensor) -> None:
    """An eager break that does nothing: its cost is the engine's alone."""


_CHAIN_LABELS: Final = ("one_graph", "peer_breakable", "ours_breakable")


@pytest.mark.parametrize("label", _CHAIN_LABELS)
def test_per_break_cost(benchmark: BenchmarkFixture, label: str) -> None:
    """Replay of 33 one-kernel segments split by 32 no-op breaks, minus a one-graph replay, per break."""
    group = f"capture: replay of {_BREAKS + 1} tiny segments, {_BREAKS} no-op breaks"
    benchmark.group = group
    x = torch.zeros(16, device="cuda")
    replay: Callable[[], None]

    def chain(brk: Callable[[torch.Tensor], None] | None) -> None:
        for i in range(_BREAKS + 1):
            x.add_(1.0)  # one kernel per segment: no segment is empty
            if brk is not None and i < _BREAKS:
                brk(x)

    if label == "one_graph":
        _warm_up_on_side_stream(lambda: chain(None))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(None)
        replay = graph.replay
    elif label == "ours_breakable":
        ours = eager_break_during_capture(_noop_break)
        capture = BreakableCUDAGraphCapture()
        with capture:
            chain(ours)
        assert (capture.num_graphs, capture.num_eager_breaks) == (_BREAKS + 1, _BREAKS)
        replay = capture.replay
    else:
        peer = _peer()
        peer_noop = peer.no_graph(_noop_break)
        peer_graph = peer.BreakableCUDAGraph()
        with peer.breakable_graph(peer_graph):
            chain(peer_noop)
        replay = peer_graph.replay

    def replays() -> None:
        for _ in range(_CHAIN_REPLAYS):
            replay()
        torch.cuda.synchronize()

    x.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, _BREAKS + 1.0)), "the chain replayed wrong"

    benchmark.pedantic(replays, rounds=_CHAIN_ROUNDS, warmup_rounds=_WARMUP_ROUNDS)
    median = _record(
        benchmark,
        group=group,
        label=label,
        per_call=_CHAIN_REPLAYS,
        unit="replay",
        baselines=("one_graph",),
    )
    one_graph = _MEDIANS.get((group, "one_graph"))
    if label != "one_graph" and one_graph is not None:
        benchmark.extra_info["per_break_us"] = (median - one_graph) / _BREAKS * 1e6


# ---------------------------------------------------------------------------
# d) Capture time of 35 sizes
# ---------------------------------------------------------------------------


_CAPTURE_LABELS: Final = ("cuda_graph_loop", "ours_full", "peer_breakable", "ours_breakable")


@pytest.mark.parametrize("label", _CAPTURE_LABELS)
def test_capture_time(
    benchmark: BenchmarkFixture,
    decoder: BenchDecoder,
    step_buffers: tuple[torch.Tensor, torch.Tensor],
    label: str,
) -> None:
    """Time to warm up and capture the first 35 default sizes (1 .. 256), largest first."""
    group = f"capture: capture time of {len(_CAPTURE_SIZES)} sizes (1 .. {max(_CAPTURE_SIZES)})"
    benchmark.group = group
    sizes = sorted(_CAPTURE_SIZES, reverse=True)
    assert sizes[0] <= decoder.config.max_batch
    ids_buf, pos_buf = step_buffers
    for n in sizes:  # lazy initialization (cuBLAS plans per shape) happens before timing
        decoder.run(ids_buf[:n], pos_buf[:n])
    torch.cuda.synchronize()
    ours_attention: AttentionFn = eager_break_during_capture(attention_reference)
    ours_model = decoder.with_attention(ours_attention)
    # The last round's result, for the sanity check: a replay of the largest size.
    last: dict[str, Callable[[], torch.Tensor]] = {}

    def capture_cuda_graph_loop() -> None:
        pool = torch.cuda.graph_pool_handle()
        graphs: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []
        side = _new_stream()
        for n in sizes:
            ids, pos = ids_buf[:n], pos_buf[:n]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                decoder.run(ids, pos)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                out = decoder.run(ids, pos)
            graphs.append((graph, out))
        torch.cuda.synchronize()
        first_graph, first_out = graphs[0]

        def replay_largest() -> torch.Tensor:
            first_graph.replay()
            return first_out

        last["replay"] = replay_largest

    def capture_ours(engine: str) -> None:
        if engine == "full":
            wrapper: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = CUDAGraphWrapper(
                decoder.run, CUDAGraphMode.FULL
            )
            mode = CUDAGraphMode.FULL
        else:
            wrapper = BreakableCUDAGraphWrapper(ours_model.run)
            mode = CUDAGraphMode.PIECEWISE
        for n in sizes:
            with set_forward_context(mode, BatchDescriptor(n)):
                wrapper(ids_buf[:n], pos_buf[:n])
        torch.cuda.synchronize()

        def replay_largest() -> torch.Tensor:
            with set_forward_context(mode, BatchDescriptor(sizes[0])):
                return wrapper(ids_buf[: sizes[0]], pos_buf[: sizes[0]])

        last["replay"] = replay_largest

    def capture_peer() -> None:
        peer = _peer()
        peer_model = decoder.with_attention(peer.no_graph(attention_reference))
        pool = torch.cuda.graph_pool_handle()
        graphs: list[tuple[_PeerGraph, torch.Tensor]] = []
        side = _new_stream()
        for n in sizes:
            ids, pos = ids_buf[:n], pos_buf[:n]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                peer_model.run(ids, pos)
            torch.cuda.current_stream().wait_stream(side)
            graph = peer.BreakableCUDAGraph(pool=pool)
            with peer.breakable_graph(graph):
                out = peer_model.run(ids, pos)
            graphs.append((graph, out))
        torch.cuda.synchronize()
        first_peer_graph, first_peer_out = graphs[0]

        def replay_largest() -> torch.Tensor:
            first_peer_graph.replay()
            return first_peer_out

        last["replay"] = replay_largest

    rounds: dict[str, Callable[[], None]] = {
        "cuda_graph_loop": capture_cuda_graph_loop,
        "ours_full": lambda: capture_ours("full"),
        "ours_breakable": lambda: capture_ours("breakable"),
        "peer_breakable": capture_peer,
    }
    if label == "peer_breakable":
        _peer()  # skip before timing when the peer is not installed
    benchmark.pedantic(rounds[label], rounds=_CAPTURE_ROUNDS, warmup_rounds=1)
    median = _record(
        benchmark,
        group=group,
        label=label,
        per_call=1,
        unit="round",
        baselines=("cuda_graph_loop",),
    )
    benchmark.extra_info["sizes"] = len(sizes)
    benchmark.extra_info["ms_per_size"] = median / len(sizes) * 1e3

    expected = decoder.run(ids_buf[: sizes[0]], pos_buf[: sizes[0]]).clone()
    got = last["replay"]().clone()
    torch.cuda.synchronize()
    assert _rel_err(got, expected) < _BF16_TOL
    last.clear()
    torch.cuda.empty_cache()
