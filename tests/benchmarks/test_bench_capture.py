"""Benchmarks of the capture engines against their baselines, all measured in this run.

- Host overhead: one ``CUDAGraphWrapper`` call replaying a one-kernel graph,
  against a bare ``torch.cuda.CUDAGraph.replay()`` of the same graph.
- Decoder step (the reference decoder: 8 layers, d=1024, bf16, static KV
  cache; uniform decode batches of 1, 16, 128): eager, a hand-written
  ``torch.cuda.CUDAGraph``, our monolithic wrapper, and, with attention as an
  eager break (8 breaks), ``breakable_cuda_graphs`` and our breakable wrapper.
- Per-break cost: a chain of 33 tiny segments split by 32 no-op breaks,
  replayed by our breakable capture and by ``breakable_cuda_graphs``, minus
  a one-graph replay of the same kernels, the three interleaved round by
  round (ours over the peer's, with its spread across rounds).
- Capture time of the first 35 default sizes (1 .. 256) of the decoder: our
  monolithic and breakable wrappers, a hand-written ``torch.cuda.graph`` loop,
  ``breakable_cuda_graphs``. Each size gets one eager warm-up then a capture,
  in every variant (our wrappers warm up themselves).

Every variant of the decoder runs the same step the same way, so the
comparison is of the engines alone: one model (the same weights and KV
caches), ``forward_with_metadata`` on static inputs whose attention metadata
is built eagerly, outside every graph and the timing (``StaticStep``), and
``cached_attention`` as the attention, called directly (eager, monolithic
graphs) or behind the engine's own break decorator (ours:
``eager_break_during_capture``, the peer's: ``no_graph``). The metadata has
to be outside for the peer: during capture it runs each eager break before
the segment ahead of it has run, so a break reading metadata computed in that
segment would read garbage (cache indices out of range). Our engine runs
each segment as it captures it and needs no such care, but gets the same step.

Every benchmarked callable runs many steps (or calls) and synchronizes the
device once at the end. The host cost, the per-break cost, the capture time
and the decoder step's target ratios come from rounds that alternate the
variants (``interleave``): each ratio is the median of the per-round ratios,
with its spread across rounds, in ``extra_info``. The decoder step of each
variant is timed on its own too (one entry per variant, for the report's
table and plot), its ratios against the baselines measured earlier in this
module. No timing is
asserted; only results are (a graph that replays garbage is not fast): every
decoder variant is checked against eager ``forward`` on the step it was
captured with and on fresh random steps.
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
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder
from examples.reference_attention import AttentionMetadata, cached_attention
from tests.benchmarks.support import BenchmarkFixture, Interleaved, interleave, record_interleaved
from tests.manager.reference_support import StaticStep
from tests.torch_support import rel_err

pytestmark = pytest.mark.gpu

# Host overhead: a one-kernel graph, many calls between two syncs.
_HOST_CALLS: Final = 1000
_HOST_ROUNDS: Final = 15
# Decoder steps.
_STEP_BATCHES: Final = (1, 16, 128)
_STEPS_PER_CALL: Final = 20
_STEP_ROUNDS: Final = 10
_WARMUP_ROUNDS: Final = 2
_BF16_TOL: Final = 3e-2  # bf16 graph vs eager: rounding only (a bug is of order 1)
_FRESH_STEPS: Final = 2  # fresh random steps each decoder variant is checked on
_FRESH: Final = torch.Generator().manual_seed(2)  # draws those steps
# Per-break cost.
_BREAKS: Final = 32
_CHAIN_REPLAYS: Final = 100
_CHAIN_ROUNDS: Final = 21
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


def _host_calls(
    x: torch.Tensor, host_times: dict[str, list[float]]
) -> tuple[dict[str, Callable[[], object]], Callable[[], torch.Tensor]]:
    """Each variant's ``_HOST_CALLS`` calls replaying ``x + 1``, its host time appended to ``host_times``.

    Also returns one call of the wrapper, for the check of what it replays.

    ``bare_replay``: ``CUDAGraph.replay()``; ``wrapper_call``: our wrapper in
    one forward context around all the calls; ``wrapper_call_with_context``:
    a context per call, as an engine sets it per step.
    """
    desc = BatchDescriptor(64)
    _warm_up_on_side_stream(lambda: _add_one(x))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _add_one(x)
    wrapper = CUDAGraphWrapper(_add_one, CUDAGraphMode.FULL)
    with set_forward_context(CUDAGraphMode.FULL, desc):
        wrapper(x)

    def bare_replay() -> None:
        for _ in range(_HOST_CALLS):
            graph.replay()

    def wrapper_call() -> None:
        with set_forward_context(CUDAGraphMode.FULL, desc):
            for _ in range(_HOST_CALLS):
                wrapper(x)

    def wrapper_call_with_context() -> None:
        for _ in range(_HOST_CALLS):
            with set_forward_context(CUDAGraphMode.FULL, desc):
                wrapper(x)

    def timed(label: str, calls: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            start = time.perf_counter()
            calls()
            host_times[label].append(time.perf_counter() - start)  # before interleave's sync

        return run

    def one_call() -> torch.Tensor:
        with set_forward_context(CUDAGraphMode.FULL, desc):
            return wrapper(x)

    variants = dict(zip(_HOST_LABELS, (bare_replay, wrapper_call, wrapper_call_with_context), strict=True))
    return {label: timed(label, calls) for label, calls in variants.items()}, one_call


def test_host_overhead_of_one_call(benchmark: BenchmarkFixture) -> None:
    """Time of one call replaying a one-kernel graph: bare CUDAGraph.replay against our wrapper, interleaved.

    ``extra_info``: each variant's median per call (host and device,
    ``{label}_us``), its host enqueue time per call, and our calls over the
    bare replay with their spread across rounds.
    """
    benchmark.group = "capture: host cost of one replay (one-kernel graph)"
    x = torch.randn(64, device="cuda")
    host_times: dict[str, list[float]] = {label: [] for label in _HOST_LABELS}
    candidates, one_call = _host_calls(x, host_times)
    results: list[Interleaved] = []
    benchmark.pedantic(
        lambda: results.append(interleave(candidates, rounds=_HOST_ROUNDS, calls_per_round=1)),
        rounds=1,
        iterations=1,
    )
    (timed,) = results
    info = benchmark.extra_info
    info["label"] = "interleaved"
    ratios = {f"{label}_over_bare": (label, "bare_replay") for label in _HOST_LABELS[1:]}
    record_interleaved(info, timed, ratios, per_call=_HOST_CALLS)
    for label, times in host_times.items():
        info[f"{label}_host_enqueue_us"] = statistics.median(times) / _HOST_CALLS * 1e6
    # Sanity: the wrapper's replay computes x + 1 for the current x.
    x.copy_(torch.randn(64, device="cuda"))
    expected = x + 1.0
    got = one_call().clone()
    torch.cuda.synchronize()
    assert rel_err(got, expected) < 1e-6


# ---------------------------------------------------------------------------
# b) Decoder step
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder() -> Iterator[ReferenceDecoder]:
    """The one decoder every variant runs; its attention is our break (``breakable_cached_attention``)."""
    torch.manual_seed(0)
    model = ReferenceDecoder(DecoderConfig(), device="cuda")
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def static_step(decoder: ReferenceDecoder) -> StaticStep:
    """Static inputs and metadata of a uniform decode step of ``max_num_seqs`` requests.

    A batch of B uses rows [:B]; every step loaded into it fills all rows
    (``_draw_step``), so its first B rows are always a valid step of their own.
    """
    return StaticStep(decoder, _draw_step(decoder.config))


def _draw_step(config: DecoderConfig) -> dict[str, torch.Tensor]:
    """A random uniform decode step filling every cache row: one token per request."""
    return make_step_inputs(config, config.max_num_seqs, uniform_decode=True, generator=_FRESH, device="cuda")


def _with_attention(label: str, decoder: ReferenceDecoder) -> ReferenceDecoder:
    """``decoder`` (its weights and caches) with the attention op variant ``label`` calls.

    Eager and monolithic graphs: ``cached_attention`` itself. Our breakable
    engine: the decoder's own, that function behind ``eager_break_during_capture``.
    The peer: that function behind its own break decorator, ``no_graph``.
    """
    if label == "ours_breakable":
        return decoder
    if label == "peer_breakable":
        return decoder.with_attention(_peer().no_graph(cached_attention))
    return decoder.with_attention(cached_attention)


def _check_against_eager(
    step: Callable[[], torch.Tensor],
    decoder: ReferenceDecoder,
    static: StaticStep,
    num_tokens: int,
    label: str,
) -> None:
    """``step`` against eager ``forward``: on the step in ``static`` now, then on fresh ones.

    Call it right after capturing, before loading another step: its first run
    is then on the step the graphs were captured with, and rewrites that
    step's cache rows with real K/V. The peer's capture left garbage there: it
    runs each break before the segment that computes the break's q, k and v
    has ever run.
    """
    for index in range(1 + _FRESH_STEPS):
        if index:
            static.load(_draw_step(decoder.config))
        got = step().clone()
        expected = decoder.step(static.step_inputs(num_tokens))
        err = rel_err(got, expected)
        assert err < _BF16_TOL, (
            f"{label}, {num_tokens} tokens, run {index}: differs from eager, rel err {err:.3e}"
        )


_STEP_LABELS: Final = ("eager", "cuda_graph", "ours_full", "peer_breakable", "ours_breakable")
_STEP_BASELINES: Final[dict[str, tuple[str, ...]]] = {
    "eager": (),
    "cuda_graph": ("eager",),
    "ours_full": ("cuda_graph", "eager"),
    "peer_breakable": ("cuda_graph", "eager"),
    "ours_breakable": ("peer_breakable", "cuda_graph", "eager"),
}


def _decoder_step(
    label: str, decoder: ReferenceDecoder, ids: torch.Tensor, meta: AttentionMetadata
) -> Callable[[], torch.Tensor]:
    """One decode step of variant ``label``, captured if it is a graph variant (inputs static)."""
    model = _with_attention(label, decoder)
    desc = BatchDescriptor(ids.shape[0])
    step: Callable[[], torch.Tensor]

    if label == "eager":

        def step() -> torch.Tensor:
            return model.forward_with_metadata(ids, meta)

    elif label == "cuda_graph":
        _warm_up_on_side_stream(lambda: model.forward_with_metadata(ids, meta))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            graph_out = model.forward_with_metadata(ids, meta)

        def step() -> torch.Tensor:
            graph.replay()
            return graph_out

    elif label == "ours_full":
        full = CUDAGraphWrapper(model.forward_with_metadata, CUDAGraphMode.FULL)
        with set_forward_context(CUDAGraphMode.FULL, desc):
            full(ids, meta)

        def step() -> torch.Tensor:
            with set_forward_context(CUDAGraphMode.FULL, desc):
                return full(ids, meta)

    elif label == "ours_breakable":
        breakable = BreakableCUDAGraphWrapper(model.forward_with_metadata)
        with set_forward_context(CUDAGraphMode.PIECEWISE, desc):
            breakable(ids, meta)

        def step() -> torch.Tensor:
            with set_forward_context(CUDAGraphMode.PIECEWISE, desc):
                return breakable(ids, meta)

    else:
        peer = _peer()
        _warm_up_on_side_stream(lambda: model.forward_with_metadata(ids, meta))
        peer_graph = peer.BreakableCUDAGraph()
        with peer.breakable_graph(peer_graph):
            peer_out = model.forward_with_metadata(ids, meta)

        def step() -> torch.Tensor:
            peer_graph.replay()
            return peer_out

    return step


@pytest.mark.parametrize(
    ("batch", "label"), [(batch, label) for batch in _STEP_BATCHES for label in _STEP_LABELS]
)
def test_decoder_step(
    benchmark: BenchmarkFixture,
    decoder: ReferenceDecoder,
    static_step: StaticStep,
    batch: int,
    label: str,
) -> None:
    """One decode step of the 8-layer decoder: eager, hand-written graph, our engines, the peer."""
    group = f"capture: decoder step, batch {batch}"
    benchmark.group = group
    step = _decoder_step(label, decoder, *static_step.rows(batch))
    _check_against_eager(step, decoder, static_step, batch, label)

    def steps() -> None:
        for _ in range(_STEPS_PER_CALL):
            step()
        torch.cuda.synchronize()

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
    decoder: ReferenceDecoder,
    static_step: StaticStep,
    batch: int,
) -> None:
    """The target ratios from rounds that alternate every variant (drift-free; see support.py).

    The benchmark itself times our monolithic step; ``extra_info`` holds each
    variant's interleaved median and ours over hand-written and over the peer.
    """
    benchmark.group = f"capture: decoder step, interleaved ratios, batch {batch}"
    ids, meta = static_step.rows(batch)
    labels = [label for label in _STEP_LABELS if label != "peer_breakable" or _peer_available()]
    steps = {label: _decoder_step(label, decoder, ids, meta) for label in labels}
    for label, step in steps.items():
        _check_against_eager(step, decoder, static_step, batch, label)
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
    ratios = {
        "full_vs_cuda_graph": ("ours_full", "cuda_graph"),
        "breakable_vs_full": ("ours_breakable", "ours_full"),
    }
    if "peer_breakable" in steps:
        ratios["breakable_vs_peer"] = ("ours_breakable", "peer_breakable")
    record_interleaved(info, timed, ratios, medians=False)


# ---------------------------------------------------------------------------
# c) Per-break host cost
# ---------------------------------------------------------------------------


def _noop_break(t: torch.Tensor) -> None:
    """An eager break that does nothing: its cost is the engine's alone."""


_CHAIN_LABELS: Final = ("one_graph", "peer_breakable", "ours_breakable")


def _chain_replay(label: str, x: torch.Tensor) -> Callable[[], None]:
    """The replay of 33 one-kernel segments (``x += 1`` each) as variant ``label`` captured them."""

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
        return graph.replay
    if label == "ours_breakable":
        ours = eager_break_during_capture(_noop_break)
        capture = BreakableCUDAGraphCapture()
        with capture:
            chain(ours)
        assert (capture.num_graphs, capture.num_eager_breaks) == (_BREAKS + 1, _BREAKS)
        return capture.replay
    peer = _peer()
    peer_noop = peer.no_graph(_noop_break)
    peer_graph = peer.BreakableCUDAGraph()
    with peer.breakable_graph(peer_graph):
        chain(peer_noop)
    replay: Callable[[], None] = peer_graph.replay
    return replay


def test_per_break_cost(benchmark: BenchmarkFixture) -> None:
    """Per break: a breakable replay of 33 tiny segments less a one-graph replay, ours against the peer.

    The three replays alternate round by round (``interleave``); a round's
    per-break cost is its breakable replay less its one-graph replay, over
    32 breaks. ``extra_info``: each variant's median per replay, each
    engine's per-break cost, and ours over the peer's (the target: at most 1)
    with its spread across rounds. The benchmark itself times the whole run.
    """
    benchmark.group = f"capture: replay of {_BREAKS + 1} tiny segments, {_BREAKS} no-op breaks"
    x = torch.zeros(16, device="cuda")
    labels = [label for label in _CHAIN_LABELS if label != "peer_breakable" or _peer_available()]
    replays = {label: _chain_replay(label, x) for label in labels}
    for label, replay in replays.items():
        x.zero_()
        replay()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, _BREAKS + 1.0)), f"{label}: the chain replayed wrong"
    results: list[Interleaved] = []
    benchmark.pedantic(
        lambda: results.append(interleave(replays, rounds=_CHAIN_ROUNDS, calls_per_round=_CHAIN_REPLAYS)),
        rounds=1,
        iterations=1,
    )
    (timed,) = results
    info = benchmark.extra_info
    info["label"] = "interleaved"
    ratios = {f"{label}_over_one_graph": (label, "one_graph") for label in labels if label != "one_graph"}
    record_interleaved(info, timed, ratios)
    added = timed.minus("one_graph")  # per round: what the breaks add to the same kernels
    for label in added.samples:
        info[f"{label}_per_break_us"] = added.median(label) / _BREAKS * 1e6
    if "peer_breakable" in added.samples:  # the target: at most 1
        info["per_break_ours_over_peer"] = added.ratio("ours_breakable", "peer_breakable")
        info["per_break_ours_over_peer_spread"] = str(added.spread("ours_breakable", "peer_breakable"))


# ---------------------------------------------------------------------------
# d) Capture time of 35 sizes
# ---------------------------------------------------------------------------


_CAPTURE_LABELS: Final = ("cuda_graph_loop", "ours_full", "peer_breakable", "ours_breakable")

_Rows = dict[int, tuple[torch.Tensor, AttentionMetadata]]
_Replay = Callable[[], torch.Tensor]


def _capture_cuda_graph_loop(model: ReferenceDecoder, rows: _Rows, sizes: list[int]) -> _Replay:
    """A hand-written ``torch.cuda.graph`` loop over ``sizes``: a warm-up then a capture each."""
    pool = torch.cuda.graph_pool_handle()
    graphs: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []
    side = _new_stream()
    for n in sizes:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.forward_with_metadata(*rows[n])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side):
            out = model.forward_with_metadata(*rows[n])
        graphs.append((graph, out))
    torch.cuda.synchronize()
    first_graph, first_out = graphs[0]

    def replay_largest() -> torch.Tensor:
        first_graph.replay()
        return first_out

    return replay_largest


def _capture_ours(model: ReferenceDecoder, rows: _Rows, sizes: list[int], *, breakable: bool) -> _Replay:
    """Our monolithic (or breakable) wrapper called once per size: it warms up and captures itself."""
    wrapper: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]
    if breakable:
        wrapper, mode = BreakableCUDAGraphWrapper(model.forward_with_metadata), CUDAGraphMode.PIECEWISE
    else:
        wrapper, mode = CUDAGraphWrapper(model.forward_with_metadata, CUDAGraphMode.FULL), CUDAGraphMode.FULL
    for n in sizes:
        with set_forward_context(mode, BatchDescriptor(n)):
            wrapper(*rows[n])
    torch.cuda.synchronize()

    def replay_largest() -> torch.Tensor:
        with set_forward_context(mode, BatchDescriptor(sizes[0])):
            return wrapper(*rows[sizes[0]])

    return replay_largest


def _capture_peer(model: ReferenceDecoder, rows: _Rows, sizes: list[int]) -> _Replay:
    """``breakable_cuda_graphs`` over ``sizes``: a warm-up then a capture each, one pool."""
    peer = _peer()
    pool = torch.cuda.graph_pool_handle()
    graphs: list[tuple[_PeerGraph, torch.Tensor]] = []
    side = _new_stream()
    for n in sizes:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.forward_with_metadata(*rows[n])
        torch.cuda.current_stream().wait_stream(side)
        graph = peer.BreakableCUDAGraph(pool=pool)
        with peer.breakable_graph(graph):
            out = model.forward_with_metadata(*rows[n])
        graphs.append((graph, out))
    torch.cuda.synchronize()
    first_graph, first_out = graphs[0]

    def replay_largest() -> torch.Tensor:
        first_graph.replay()
        return first_out

    return replay_largest


def _capture(label: str, model: ReferenceDecoder, rows: _Rows, sizes: list[int]) -> _Replay:
    """Variant ``label``'s capture of every size; returns a replay of the largest."""
    if label == "cuda_graph_loop":
        return _capture_cuda_graph_loop(model, rows, sizes)
    if label == "peer_breakable":
        return _capture_peer(model, rows, sizes)
    return _capture_ours(model, rows, sizes, breakable=label == "ours_breakable")


def test_capture_time(
    benchmark: BenchmarkFixture, decoder: ReferenceDecoder, static_step: StaticStep
) -> None:
    """Time to warm up and capture the first 35 default sizes (1 .. 256), largest first, interleaved.

    ``extra_info``: each variant's median per round of every size
    (``{label}_us``) and per size, and each over the hand-written loop with its
    spread across rounds.
    """
    benchmark.group = f"capture: capture time of {len(_CAPTURE_SIZES)} sizes (1 .. {max(_CAPTURE_SIZES)})"
    sizes = sorted(_CAPTURE_SIZES, reverse=True)
    assert sizes[0] <= decoder.config.max_num_seqs
    labels = [label for label in _CAPTURE_LABELS if label != "peer_breakable" or _peer_available()]
    models = {label: _with_attention(label, decoder) for label in labels}
    rows = {n: static_step.rows(n) for n in sizes}  # views built once, outside the timing
    for model in models.values():  # lazy initialization (cuBLAS plans per shape) happens before timing
        for n in sizes:
            model.forward_with_metadata(*rows[n])
    torch.cuda.synchronize()
    last: dict[str, _Replay] = {}  # each variant's last round, for the check: a replay of the largest size

    def round_of(label: str) -> Callable[[], None]:
        def capture() -> None:
            last.pop(label, None)  # the previous round's graphs go before this round's are captured
            last[label] = _capture(label, models[label], rows, sizes)

        return capture

    candidates = {label: round_of(label) for label in labels}
    results: list[Interleaved] = []
    benchmark.pedantic(
        lambda: results.append(
            interleave(candidates, rounds=_CAPTURE_ROUNDS, calls_per_round=1, warmup_rounds=1)
        ),
        rounds=1,
        iterations=1,
    )
    (timed,) = results
    info = benchmark.extra_info
    info["label"] = "interleaved"
    info["sizes"] = len(sizes)
    ratios = {f"{label}_over_loop": (label, "cuda_graph_loop") for label in labels[1:]}
    record_interleaved(info, timed, ratios)
    for label in labels:
        info[f"{label}_ms_per_size"] = timed.median(label) / len(sizes) * 1e3
    for label, replay in last.items():
        _check_against_eager(replay, decoder, static_step, sizes[0], label)
    last.clear()
    torch.cuda.empty_cache()
