"""Benchmarks of the manager against its baselines, all measured in this run.

- Decoder steps (the 8-layer reference decoder, d=1024, bf16, uniform decode
  batches of 1, 13 (graphs padded to 16), 16 and 128 requests): eager under
  ``torch.inference_mode()``, a hand-written ``torch.cuda.CUDAGraph`` with its
  own input copies, the capture engine's breakable replay driven directly,
  the manager in FULL and in PIECEWISE mode, the manager FULL and PIECEWISE
  over the decoder compiled for capture (``compile_decoder``: inductor, no
  inductor graphs, one compile for every size), and
  ``torch.compile(mode="reduce-overhead")``.
- The same steps on the 8B-like preset (32 layers, d=4096): the manager FULL
  and PIECEWISE against the hand-written graph, the engine's breakable
  replay and eager, at batches 1, 16 and 128.
- Host overhead: ``run()`` on a one-kernel model against copy + replay.
- Capture: time and pool memory of the 51 default sizes up to 512 (FULL)
  against the pool memory of the largest size alone.
- Time to ready for the 51 default sizes: compile plus capture of the
  compiled decoder, FULL, against ``"reduce-overhead"``'s cost for one more
  size (compile, record, replay) times 51, an estimate: compiling all 51
  sizes with ``dynamic=False`` would take about ten minutes. Both with
  inductor's caches off, as on a fresh machine.

Every benchmarked callable runs many steps and then synchronizes the device
once, so the time is the device's throughput with the host's launch overhead
in it, not one sync per step. Medians per step and ratios against the
baselines go into ``extra_info``; ``tests/benchmarks/report.py`` tabulates and
plots them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Final

import pytest
import torch

from cudagraph_capture import BreakableCUDAGraphWrapper, CaptureOptions
from cudagraph_capture._pool import GraphPool
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_manager import CaptureReport, CompiledModel, CUDAGraphManager, ManagerOptions, StaticInput
from cudagraph_manager._compiled import dynamo_compiles
from examples.compiled import compile_decoder
from examples.config import DecoderConfig
from examples.demo import run_graph
from examples.inputs import make_step_inputs
from examples.reference import INPUT_NAMES, ReferenceDecoder, static_inputs
from tests.benchmarks.support import BenchmarkFixture, interleave, record_interleaved
from tests.manager.reference_support import pad_step_inputs
from tests.torch_support import rel_err

pytestmark = pytest.mark.gpu

_STEP_BATCHES: Final = (1, 13, 16, 128)  # 13 requests replay the graph of 16
_CAPTURE_SIZES: Final = CaptureSizes([1, 16, 128])
# The 8B-like rows: the captured sizes only, fewer rounds (a step is a few ms, device-bound).
_8B_BATCHES: Final = (1, 16, 128)
_8B_ROUNDS: Final = 11
_STEPS_PER_CALL: Final = 20  # decoder steps between two syncs
_ROUNDS: Final = 15
# The target ratios: more rounds, since a host-bound step (eager, PIECEWISE at
# small batches) swings by 10% and more from one round to the next.
_INTERLEAVED_ROUNDS: Final = 41
_WARMUP_ROUNDS: Final = 2
_TOLERANCE: Final = 3e-2  # bf16 graph vs eager: rounding only (a bug is of order 1)
# torch.compile: batch 1, 16 and 128 always, first (the compiled managers' targets are
# ratios against them); 13 only while the budget lasts (each batch size is a compile of
# its own, tens of seconds).
_COMPILE_BATCHES: Final = (1, 128, 16, 13)
_COMPILE_ALWAYS: Final = frozenset({1, 16, 128})
_COMPILE_BUDGET_S: Final = 60.0
_COMPILE_WARMUPS: Final = 3
# Host overhead: a model of one tiny kernel, many calls between two syncs.
_TINY_ELEMENTS: Final = 64
_HOST_CALLS: Final = 1000
_HOST_ROUNDS: Final = 10
# Capture: the default sizes up to 512 (51 of them), FULL mode.
_CAPTURE_MAX: Final = 512
_DEFAULT_NUM_SIZES: Final = 51
# Time to ready: "reduce-overhead"'s per-size cost is measured on this size, one none of
# the step benchmarks compiled (a compile of its own, not a cache hit).
_READY_PROBE_BATCH: Final = 64
_READY_KEY: Final = -2  # the "batch" of the time-to-ready entries in _MEDIANS
_READY_GROUP: Final = f"time to ready: the {_DEFAULT_NUM_SIZES} default sizes up to {_CAPTURE_MAX}, per size"

# (label, batch) -> median milliseconds per step, for ratios within this run.
_MEDIANS: Final[dict[tuple[str, int], float]] = {}


# -- fixtures: one decoder and its inputs for the whole module --


@pytest.fixture(scope="module")
def decoder() -> Iterator[ReferenceDecoder]:
    torch.manual_seed(0)
    model = ReferenceDecoder(DecoderConfig(), device="cuda")
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def step_inputs(decoder: ReferenceDecoder) -> dict[int, dict[str, torch.Tensor]]:
    """Uniform decode steps: one token per request, requests in distinct cache rows."""
    generator = torch.Generator().manual_seed(1)
    return {
        batch: make_step_inputs(
            decoder.config, batch, uniform_decode=True, generator=generator, device="cuda"
        )
        for batch in _STEP_BATCHES
    }


@pytest.fixture(scope="module")
def managers(decoder: ReferenceDecoder) -> dict[CUDAGraphMode, CUDAGraphManager[torch.Tensor]]:
    """One manager per runtime mode over the same decoder, sizes 1, 16 and 128 captured."""
    built: dict[CUDAGraphMode, CUDAGraphManager[torch.Tensor]] = {}
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
        config = DispatchConfig(mode, _CAPTURE_SIZES, max_num_seqs=decoder.config.max_num_seqs)
        manager = CUDAGraphManager(decoder.forward, static_inputs(decoder.config), config)
        report = manager.capture()
        assert report.num_graphs == len(_CAPTURE_SIZES)
        built[mode] = manager
    return built


class _Compiled:
    """A ``torch.compile(mode="reduce-overhead")`` decoder and the compile time spent on it."""

    __slots__ = ("compile_s", "fn", "model", "spent_s")

    def __init__(self, model: ReferenceDecoder) -> None:
        self.model: Final = model
        self.fn: Final = torch.compile(model, mode="reduce-overhead", dynamic=False)
        self.spent_s = 0.0
        #: Seconds to the first replay of each batch compiled so far (compile, record, replay).
        self.compile_s: Final[dict[int, float]] = {}

    def step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # Inference: each call is a new step (untyped in torch's stubs).
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        out = self.fn(**inputs)
        assert isinstance(out, torch.Tensor)
        return out


@pytest.fixture(scope="module")
def compiled() -> _Compiled:
    # Attention without the break point: one opaque op that writes the cache in place.
    # Same seed as `decoder`: the same weights and initial cache.
    torch.manual_seed(0)
    model = ReferenceDecoder(DecoderConfig(), device="cuda", breakable=False)
    for cache in model.caches:
        # Mutated in place every step: a static address keeps it a graph input.
        torch._dynamo.mark_static_address(cache)
    return _Compiled(model)


# -- helpers --


def _padded(batch: int) -> int:
    padded = _CAPTURE_SIZES.pad(batch)
    assert padded is not None
    return padded


def _group(batch: int) -> str:
    padded = _padded(batch)
    suffix = f" (graphs padded to {padded})" if padded != batch else ""
    return f"decoder step, batch {batch}{suffix}"


def _median_s(benchmark: BenchmarkFixture) -> float:
    metadata = benchmark.stats
    assert metadata is not None, "the benchmark did not run"
    return float(metadata.stats.median)


def _bench_step(
    benchmark: BenchmarkFixture,
    steps: Callable[[], object],
    *,
    label: str,
    batch: int,
    extra: dict[str, object] | None = None,
) -> float:
    """Time ``steps`` (``_STEPS_PER_CALL`` steps, then a sync); record the median per step."""
    benchmark.group = _group(batch)
    benchmark.pedantic(steps, rounds=_ROUNDS, warmup_rounds=_WARMUP_ROUNDS, iterations=1)
    median_ms = _median_s(benchmark) / _STEPS_PER_CALL * 1e3
    _MEDIANS[(label, batch)] = median_ms
    info = benchmark.extra_info
    info.update(
        label=label,
        baseline="eager",
        batch=batch,
        padded_batch=_padded(batch),
        steps_per_call=_STEPS_PER_CALL,
        median_step_ms=median_ms,
    )
    eager = _MEDIANS.get(("eager", batch))
    if eager is not None and label != "eager":
        info["speedup_vs_eager"] = eager / median_ms
    graph = _MEDIANS.get(("cuda_graph", batch))
    if graph is not None and label not in ("eager", "cuda_graph"):
        info["time_vs_cuda_graph"] = median_ms / graph
    if extra:
        info.update(extra)
    return median_ms


def _repeat(step: Callable[[], object], times: int) -> Callable[[], None]:
    """``times`` calls of ``step``, then one device sync: the unit a benchmark times."""

    def run() -> None:
        for _ in range(times):
            step()
        torch.cuda.synchronize()

    return run


def _eager_step(decoder: ReferenceDecoder, inputs: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The eager baseline: one step under ``torch.inference_mode()``, as an engine runs eager.

    The fastest eager there is (no autograd or version-counter work per op):
    about 7% faster than the same step outside it on an H200.
    """

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return decoder.step(inputs)  # [T, hidden]

    return step


def _copier(static: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """Copies ``inputs`` into the first rows of ``static``: what a hand-written replay loop does."""
    num_tokens = inputs["input_ids"].shape[0]
    pairs = [(static[name][:num_tokens], inputs[name]) for name in INPUT_NAMES]  # views built once

    def copy() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    return copy


def _check(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error = rel_err(actual, expected)
    assert error < _TOLERANCE, f"{what}: relative error {error:.3g} against eager"


# -- decoder steps --


@pytest.mark.parametrize("batch", _STEP_BATCHES)
def test_step_eager(
    benchmark: BenchmarkFixture,
    decoder: ReferenceDecoder,
    step_inputs: dict[int, dict[str, torch.Tensor]],
    batch: int,
) -> None:
    inputs = step_inputs[batch]
    step = _eager_step(decoder, inputs)
    step()
    _bench_step(benchmark, _repeat(step, _STEPS_PER_CALL), label="eager", batch=batch)


def _hand_written_step(
    decoder: ReferenceDecoder, inputs: dict[str, torch.Tensor], batch: int
) -> Callable[[], None]:
    """One ``torch.cuda.CUDAGraph`` of the padded size: copy the inputs into its static rows, replay."""
    static = pad_step_inputs(decoder.config, inputs, _padded(batch))  # [padded] each
    decoder.step(static)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decoder.step(static)  # [padded, hidden]
    copy = _copier(static, inputs)

    def step() -> None:
        copy()
        graph.replay()

    step()
    _check(out[:batch].clone(), decoder.step(inputs), "hand-written graph")
    return step


def _breakable_engine_step(
    decoder: ReferenceDecoder, inputs: dict[str, torch.Tensor], batch: int
) -> Callable[[], torch.Tensor]:
    """The capture engine's PIECEWISE replay driven directly, with the same input copies."""
    static = pad_step_inputs(decoder.config, inputs, _padded(batch))  # [padded] each
    wrapper = BreakableCUDAGraphWrapper(decoder.forward)
    key = BatchDescriptor(_padded(batch))
    decoder.step(static)  # warm-up
    ids, positions, cache_rows = (static[name] for name in INPUT_NAMES)
    with set_forward_context(CUDAGraphMode.PIECEWISE, key):
        wrapper(ids, positions, cache_rows)  # captures
    copy = _copier(static, inputs)

    def step() -> torch.Tensor:
        copy()
        with set_forward_context(CUDAGraphMode.PIECEWISE, key):
            return wrapper(ids, positions, cache_rows)  # [padded, hidden]

    _check(step()[:batch].clone(), decoder.step(inputs), "breakable engine")
    return step


def _baseline(
    mode: CUDAGraphMode, decoder: ReferenceDecoder, inputs: dict[str, torch.Tensor], batch: int
) -> tuple[str, Callable[[], object]]:
    """The manager's baseline in ``mode``: FULL the hand-written graph, PIECEWISE the engine's replay."""
    if mode is CUDAGraphMode.FULL:
        return "cuda_graph", _hand_written_step(decoder, inputs, batch)
    return "breakable_engine", _breakable_engine_step(decoder, inputs, batch)


@pytest.mark.parametrize("batch", _STEP_BATCHES)
def test_step_cuda_graph(
    benchmark: BenchmarkFixture,
    decoder: ReferenceDecoder,
    step_inputs: dict[int, dict[str, torch.Tensor]],
    batch: int,
) -> None:
    """The baseline: one ``torch.cuda.CUDAGraph`` per size, copies into its static inputs, replay."""
    step = _hand_written_step(decoder, step_inputs[batch], batch)
    _bench_step(benchmark, _repeat(step, _STEPS_PER_CALL), label="cuda_graph", batch=batch)


@pytest.mark.parametrize("batch", _STEP_BATCHES)
def test_step_breakable_engine(
    benchmark: BenchmarkFixture,
    decoder: ReferenceDecoder,
    step_inputs: dict[int, dict[str, torch.Tensor]],
    batch: int,
) -> None:
    """The capture engine's PIECEWISE replay driven directly: the manager's floor in that mode."""
    step = _breakable_engine_step(decoder, step_inputs[batch], batch)
    _bench_step(benchmark, _repeat(step, _STEPS_PER_CALL), label="breakable_engine", batch=batch)


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=["full", "piecewise"])
@pytest.mark.parametrize("batch", _STEP_BATCHES)
def test_step_manager(
    benchmark: BenchmarkFixture,
    decoder: ReferenceDecoder,
    step_inputs: dict[int, dict[str, torch.Tensor]],
    managers: dict[CUDAGraphMode, CUDAGraphManager[torch.Tensor]],
    batch: int,
    mode: CUDAGraphMode,
) -> None:
    inputs = step_inputs[batch]
    manager = managers[mode]
    _check(run_graph(manager, False, inputs).clone(), decoder.step(inputs), f"manager {mode.name}")
    replays_before = manager.stats.replays_of(mode)
    label = f"manager_{mode.name.lower()}"
    _bench_step(
        benchmark,
        _repeat(lambda: run_graph(manager, False, inputs), _STEPS_PER_CALL),
        label=label,
        batch=batch,
    )
    stats = manager.stats
    assert stats.eager_steps == 0
    assert stats.replays_of(mode) - replays_before == (_ROUNDS + _WARMUP_ROUNDS) * _STEPS_PER_CALL
    # The target ratios, from rounds alternating with the baseline (drift-free);
    # FULL against the hand-written graph, PIECEWISE against the engine's own replay.
    baseline_label, baseline = _baseline(mode, decoder, inputs, batch)
    candidates: dict[str, Callable[[], object]] = {
        label: lambda: run_graph(manager, False, inputs),
        baseline_label: baseline,
    }
    if mode is CUDAGraphMode.PIECEWISE:  # the other target: PIECEWISE over FULL at large batches
        full = managers[CUDAGraphMode.FULL]
        candidates["manager_full"] = lambda: run_graph(full, False, inputs)
    else:  # and FULL against eager: the host's speed drifts too, and eager is host-bound
        candidates["eager"] = _eager_step(decoder, inputs)
        # For reference: the same eager step outside inference mode (autograd's
        # per-op bookkeeping included), as a model called without it runs.
        candidates["eager_default_mode"] = lambda: decoder.step(inputs)
    timed = interleave(candidates, rounds=_INTERLEAVED_ROUNDS, calls_per_round=_STEPS_PER_CALL)
    info = benchmark.extra_info
    ratios = {f"interleaved_vs_{other}": (label, other) for other in candidates if other != label}
    record_interleaved(info, timed, ratios, medians=False)
    info["interleaved_step_us"] = timed.median(label) * 1e6
    info[f"interleaved_{baseline_label}_step_us"] = timed.median(baseline_label) * 1e6


@pytest.mark.parametrize("batch", _COMPILE_BATCHES)
def test_step_torch_compile(
    benchmark: BenchmarkFixture,
    compiled: _Compiled,
    step_inputs: dict[int, dict[str, torch.Tensor]],
    batch: int,
) -> None:
    """``torch.compile(mode="reduce-overhead", dynamic=False)``: one compile per batch size."""
    if batch not in _COMPILE_ALWAYS and compiled.spent_s > _COMPILE_BUDGET_S:
        pytest.skip(f"torch.compile budget spent ({compiled.spent_s:.0f} s > {_COMPILE_BUDGET_S:.0f} s)")
    inputs = step_inputs[batch]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inductor's advice (TF32 and the like) is not a failure here
        compile_s = _ready_reduce_overhead(compiled, batch, inputs)
        out = compiled.step(inputs)
        _check(out.clone(), compiled.model.step(inputs), "torch.compile")
        _bench_step(
            benchmark,
            _repeat(lambda: compiled.step(inputs), _STEPS_PER_CALL),
            label="torch_compile",
            batch=batch,
            extra={"compile_s": compile_s, "cudagraph_skips": _cudagraph_skips()},
        )


def _cudagraph_skips() -> int:
    """How often inductor fell back from CUDA graphs (0: the timing is of graphs)."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def _cold_inductor() -> contextlib.AbstractContextManager[None]:
    """Inductor with its caches off (in memory and on disk): compile times as a fresh machine sees them."""
    import torch._inductor.config as inductor_config

    patch: contextlib.AbstractContextManager[None] = inductor_config.patch(force_disable_caches=True)
    return patch


def _ready_reduce_overhead(compiled: _Compiled, batch: int, inputs: dict[str, torch.Tensor]) -> float:
    """Seconds until ``"reduce-overhead"`` serves ``batch``: compile, record the tree, replay once."""
    with _cold_inductor():
        start = time.perf_counter()
        for _ in range(_COMPILE_WARMUPS):
            compiled.step(inputs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    compiled.spent_s += seconds
    compiled.compile_s[batch] = seconds
    return seconds


# -- the decoder compiled for capture: time to ready, steps --


class _CompiledManagers:
    """The decoder compiled for capture, a FULL manager of the 51 default sizes over it, and its cost.

    Built with inductor's caches off; ``ready_s`` is the compile plus the
    capture of all 51 sizes (the compile happens in the capture's first
    warm-up). ``piecewise()`` adds a PIECEWISE manager of the step sizes
    over the same compile.
    """

    def __init__(self, decoder: ReferenceDecoder) -> None:
        self.decoder: Final = decoder
        before = dynamo_compiles() or 0  # None: dynamo not loaded yet, nothing compiled
        skips_before = _cudagraph_skips()
        sizes = CaptureSizes.default(_CAPTURE_MAX)
        assert len(sizes) == _DEFAULT_NUM_SIZES
        config = DispatchConfig(CUDAGraphMode.FULL, sizes, max_num_seqs=decoder.config.max_num_seqs)
        with warnings.catch_warnings(), _cold_inductor():
            warnings.simplefilter("ignore")  # inductor's advice is not a failure here
            start = time.perf_counter()
            self.compiled: Final[CompiledModel[torch.Tensor]] = compile_decoder(decoder)
            self.full: Final = CUDAGraphManager(self.compiled, static_inputs(decoder.config), config)
            self.report: Final = self.full.capture(progress=False)
            self.ready_s: Final = time.perf_counter() - start
        self.compiles: Final = (dynamo_compiles() or 0) - before
        self.cudagraph_skips: Final = _cudagraph_skips() - skips_before
        self._piecewise: CUDAGraphManager[torch.Tensor] | None = None

    def piecewise(self) -> CUDAGraphManager[torch.Tensor]:
        if self._piecewise is None:
            config = DispatchConfig(
                CUDAGraphMode.PIECEWISE, _CAPTURE_SIZES, max_num_seqs=self.decoder.config.max_num_seqs
            )
            manager = CUDAGraphManager(self.compiled, static_inputs(self.decoder.config), config)
            manager.capture(progress=False)  # the FULL manager's compile serves it
            self._piecewise = manager
        return self._piecewise


#: The compiled managers of this run: built by the time-to-ready benchmark, or by the fixture.
_COMPILED_MANAGERS: Final[list[_CompiledManagers]] = []


@pytest.fixture(scope="module")
def compiled_managers(decoder: ReferenceDecoder) -> _CompiledManagers:
    if not _COMPILED_MANAGERS:
        _COMPILED_MANAGERS.append(_CompiledManagers(decoder))
    return _COMPILED_MANAGERS[-1]


def test_ready_reduce_overhead_per_size(
    benchmark: BenchmarkFixture, compiled: _Compiled, decoder: ReferenceDecoder
) -> None:
    """``"reduce-overhead"`` for one more size, caches off: its per-size cost, times 51 an estimate."""
    batch = _READY_PROBE_BATCH
    inputs = make_step_inputs(decoder.config, batch, uniform_decode=True, device="cuda")
    assert batch not in compiled.compile_s
    seconds: list[float] = []
    benchmark.group = _READY_GROUP
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        benchmark.pedantic(
            lambda: seconds.append(_ready_reduce_overhead(compiled, batch, inputs)),
            rounds=1,
            iterations=1,
        )
    _check(compiled.step(inputs).clone(), compiled.model.step(inputs), "torch.compile")
    (per_size,) = seconds
    _MEDIANS[("reduce_overhead_per_size", _READY_KEY)] = per_size
    benchmark.extra_info.update(
        label="reduce_overhead_per_size",
        steps_per_call=1,
        measured=f"one size ({batch} tokens), caches off: compile, record, replay",
        estimate_51_sizes_s=per_size * _DEFAULT_NUM_SIZES,
        other_sizes_s=", ".join(f"{b}: {s:.1f}" for b, s in compiled.compile_s.items() if b != batch),
        cudagraph_skips=_cudagraph_skips(),
    )


def test_ready_compiled_default_sizes(benchmark: BenchmarkFixture, decoder: ReferenceDecoder) -> None:
    """Ours: one compile of the decoder for capture, then the 51 FULL graphs, caches off."""
    _COMPILED_MANAGERS.clear()  # a fresh compile, timed
    benchmark.group = _READY_GROUP
    benchmark.pedantic(lambda: _COMPILED_MANAGERS.append(_CompiledManagers(decoder)), rounds=1, iterations=1)
    (built,) = _COMPILED_MANAGERS
    assert built.report.num_graphs == _DEFAULT_NUM_SIZES
    # One graph for 2+ tokens (the token count symbolic), one for 1 token (dynamo specializes it).
    assert built.compiles == 2
    assert built.cudagraph_skips == 0
    for num_tokens in (_CAPTURE_MAX, 1):
        inputs = make_step_inputs(decoder.config, num_tokens, uniform_decode=False, device="cuda")
        _check(run_graph(built.full, False, inputs).clone(), decoder.step(inputs), f"compiled {num_tokens}")
    info = benchmark.extra_info
    info.update(
        label="manager_full_compiled_51",
        baseline="reduce_overhead_per_size",
        steps_per_call=_DEFAULT_NUM_SIZES,  # per size, like the baseline
        ready_s=built.ready_s,
        # The two compiles happen in the warm-ups of the first key (512) and of the key of 1 token.
        compile_keys_s=sum(
            g.seconds for g in built.report.graphs if g.descriptor.num_tokens in (1, _CAPTURE_MAX)
        ),
        other_keys_s=sum(
            g.seconds for g in built.report.graphs if g.descriptor.num_tokens not in (1, _CAPTURE_MAX)
        ),
        compiles=built.compiles,
        cudagraph_skips=built.cudagraph_skips,
    )
    per_size = _MEDIANS.get(("reduce_overhead_per_size", _READY_KEY))
    if per_size is not None:  # the target: at most a fifth of the estimate
        info["ready_vs_reduce_overhead_estimate"] = built.ready_s / (per_size * _DEFAULT_NUM_SIZES)


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=["full", "piecewise"])
@pytest.mark.parametrize("batch", _STEP_BATCHES)
def test_step_manager_compiled(
    benchmark: BenchmarkFixture,
    decoder: ReferenceDecoder,
    step_inputs: dict[int, dict[str, torch.Tensor]],
    managers: dict[CUDAGraphMode, CUDAGraphManager[torch.Tensor]],
    compiled_managers: _CompiledManagers,
    compiled: _Compiled,
    batch: int,
    mode: CUDAGraphMode,
) -> None:
    """The manager over the decoder compiled for capture: FULL, and PIECEWISE over compiled segments.

    Interleaved with its baselines: FULL against ``"reduce-overhead"`` (where
    this run compiled that batch), the plain manager and the hand-written
    graph; PIECEWISE against FULL over the same compile and the plain
    PIECEWISE manager.
    """
    inputs = step_inputs[batch]
    full = compiled_managers.full
    manager = full if mode is CUDAGraphMode.FULL else compiled_managers.piecewise()
    label = f"manager_{mode.name.lower()}_compiled"
    _check(run_graph(manager, False, inputs).clone(), decoder.step(inputs), label)
    replays_before = manager.stats.replays_of(mode)
    _bench_step(
        benchmark,
        _repeat(lambda: run_graph(manager, False, inputs), _STEPS_PER_CALL),
        label=label,
        batch=batch,
        extra={"compiles": compiled_managers.compiles, "cudagraph_skips": compiled_managers.cudagraph_skips},
    )
    stats = manager.stats
    assert stats.eager_steps == 0
    assert stats.replays_of(mode) - replays_before == (_ROUNDS + _WARMUP_ROUNDS) * _STEPS_PER_CALL
    plain = managers[mode]
    candidates: dict[str, Callable[[], object]] = {
        label: lambda: run_graph(manager, False, inputs),
        f"manager_{mode.name.lower()}": lambda: run_graph(plain, False, inputs),
    }
    if mode is CUDAGraphMode.FULL:
        if batch in compiled.compile_s:  # the targets: against "reduce-overhead" at batch 1, 16, 128
            candidates["torch_compile"] = lambda: compiled.step(inputs)
        candidates["cuda_graph"] = _hand_written_step(decoder, inputs, batch)
    else:  # the target: PIECEWISE over FULL, both over the same compile, at batch 128
        candidates["manager_full_compiled"] = lambda: run_graph(full, False, inputs)
    timed = interleave(candidates, rounds=_INTERLEAVED_ROUNDS, calls_per_round=_STEPS_PER_CALL)
    info = benchmark.extra_info
    ratios = {f"interleaved_vs_{other}": (label, other) for other in candidates if other != label}
    record_interleaved(info, timed, ratios, medians=False)
    info["interleaved_step_us"] = timed.median(label) * 1e6


# -- the 8B-like decoder: the step rows at an engine's shape --


@pytest.fixture(scope="module")
def decoder_8b() -> Iterator[ReferenceDecoder]:
    """The 8B-like preset (32 layers, d=4096, random bf16 weights: 16 GB)."""
    torch.manual_seed(0)
    model = ReferenceDecoder(DecoderConfig.llama_8b_like(), device="cuda")
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def managers_8b(
    decoder_8b: ReferenceDecoder,
) -> Iterator[dict[CUDAGraphMode, CUDAGraphManager[torch.Tensor]]]:
    built: dict[CUDAGraphMode, CUDAGraphManager[torch.Tensor]] = {}
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
        config = DispatchConfig(mode, _CAPTURE_SIZES, max_num_seqs=decoder_8b.config.max_num_seqs)
        manager = CUDAGraphManager(decoder_8b.forward, static_inputs(decoder_8b.config), config)
        assert manager.capture(progress=False).num_graphs == len(_CAPTURE_SIZES)
        built[mode] = manager
    yield built
    for manager in built.values():
        manager.release()


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE], ids=["full", "piecewise"])
@pytest.mark.parametrize("batch", _8B_BATCHES)
def test_step_8b_like(
    benchmark: BenchmarkFixture,
    decoder_8b: ReferenceDecoder,
    managers_8b: dict[CUDAGraphMode, CUDAGraphManager[torch.Tensor]],
    batch: int,
    mode: CUDAGraphMode,
) -> None:
    """The manager's step on the 8B-like decoder, interleaved with the same baselines as above."""
    generator = torch.Generator().manual_seed(2)
    inputs = make_step_inputs(
        decoder_8b.config, batch, uniform_decode=True, generator=generator, device="cuda"
    )
    manager = managers_8b[mode]
    _check(run_graph(manager, False, inputs).clone(), decoder_8b.step(inputs), f"8B-like {mode.name}")
    label = f"manager_{mode.name.lower()}"
    baseline_label, baseline = _baseline(mode, decoder_8b, inputs, batch)
    candidates: dict[str, Callable[[], object]] = {
        label: lambda: run_graph(manager, False, inputs),
        baseline_label: baseline,
        "eager": _eager_step(decoder_8b, inputs),
    }
    benchmark.group = f"8B-like decoder step, batch {batch}"
    benchmark.pedantic(
        _repeat(candidates[label], _STEPS_PER_CALL), rounds=_8B_ROUNDS, warmup_rounds=1, iterations=1
    )
    timed = interleave(candidates, rounds=_8B_ROUNDS, calls_per_round=_STEPS_PER_CALL)
    info = benchmark.extra_info
    info.update(
        label=f"8b_{label}",
        batch=batch,
        steps_per_call=_STEPS_PER_CALL,
        median_step_ms=_median_s(benchmark) / _STEPS_PER_CALL * 1e3,
        interleaved_step_us=timed.median(label) * 1e6,
    )
    ratios = {f"interleaved_vs_{other}": (label, other) for other in candidates if other != label}
    record_interleaved(info, timed, ratios, medians=False)
    assert manager.stats.eager_steps == 0


# -- host overhead of run() --


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # [n]


@pytest.fixture(scope="module")
def tiny_input() -> torch.Tensor:
    return torch.randn(_TINY_ELEMENTS, device="cuda")  # [64]


def _bench_host(benchmark: BenchmarkFixture, call: Callable[[], object], *, label: str) -> None:
    benchmark.group = f"host overhead: {_HOST_CALLS} calls of x * 2 ({_TINY_ELEMENTS} elements), one sync"
    benchmark.pedantic(_repeat(call, _HOST_CALLS), rounds=_HOST_ROUNDS, warmup_rounds=1, iterations=1)
    per_call_us = _median_s(benchmark) / _HOST_CALLS * 1e6
    _MEDIANS[(label, 0)] = per_call_us
    info = benchmark.extra_info
    info.update(
        label=label,
        baseline="cuda_graph",
        steps_per_call=_HOST_CALLS,
        median_call_us=per_call_us,
        median_step_ms=per_call_us / 1e3,
    )
    graph = _MEDIANS.get(("cuda_graph", 0))
    if graph is not None and label != "cuda_graph":
        info["time_vs_cuda_graph"] = per_call_us / graph
        info["overhead_vs_cuda_graph_us"] = per_call_us - graph


def test_host_overhead_eager(benchmark: BenchmarkFixture, tiny_input: torch.Tensor) -> None:
    _bench_host(benchmark, lambda: _double(tiny_input), label="eager")


def _hand_written_tiny(tiny_input: torch.Tensor) -> Callable[[], None]:
    """The host-overhead baseline: a copy into the graph's static input, and its replay."""
    static = tiny_input.clone()  # [64]
    _double(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _double(static)

    def step() -> None:
        static.copy_(tiny_input)
        graph.replay()

    step()
    torch.testing.assert_close(out, tiny_input * 2)
    return step


def test_host_overhead_cuda_graph(benchmark: BenchmarkFixture, tiny_input: torch.Tensor) -> None:
    _bench_host(benchmark, _hand_written_tiny(tiny_input), label="cuda_graph")


def test_host_overhead_manager_run(benchmark: BenchmarkFixture, tiny_input: torch.Tensor) -> None:
    manager = CUDAGraphManager(
        _double,
        {"x": StaticInput(shape=(), dtype=torch.float32, rows="tokens")},
        DispatchConfig(CUDAGraphMode.FULL, CaptureSizes([_TINY_ELEMENTS]), max_num_seqs=_TINY_ELEMENTS),
    )
    manager.capture()
    torch.testing.assert_close(manager.run(x=tiny_input), tiny_input * 2)
    _bench_host(benchmark, lambda: manager.run(x=tiny_input), label="manager_full")
    stats = manager.stats
    assert stats.eager_steps == 0
    assert stats.replays_of(CUDAGraphMode.FULL) == 1 + (_HOST_ROUNDS + 1) * _HOST_CALLS
    # The target figure: rounds alternating with the hand-written copy + replay, so the host's
    # drift between the two measurements above (microseconds per call) cancels.
    baseline = _hand_written_tiny(tiny_input)
    timed = interleave(
        {"manager_full": lambda: manager.run(x=tiny_input), "cuda_graph": baseline},
        rounds=_INTERLEAVED_ROUNDS,
        calls_per_round=_HOST_CALLS,
    )
    pairs = zip(timed.samples["manager_full"], timed.samples["cuda_graph"], strict=True)
    benchmark.extra_info["interleaved_overhead_vs_cuda_graph_us"] = (
        statistics.median(mine - theirs for mine, theirs in pairs) * 1e6
    )


# -- capture time and pool memory --

_CAPTURE_GROUP: Final = f"capture: FULL graphs of the decoder up to {_CAPTURE_MAX} tokens, own pool"


def _pool_bytes(pool: GraphPool) -> int:
    """Bytes of the device segments that belong to graph pool ``pool``."""
    snapshot = torch.cuda.memory._snapshot()
    wanted = tuple(pool)
    return sum(
        int(segment["total_size"])
        for segment in snapshot["segments"]
        if tuple(segment.get("segment_pool_id", ())) == wanted
    )


def _bench_capture(
    benchmark: BenchmarkFixture, decoder: ReferenceDecoder, sizes: CaptureSizes, label: str
) -> None:
    pool = torch.cuda.graph_pool_handle()  # a pool of its own: its segments are this capture's memory
    config = DispatchConfig(CUDAGraphMode.FULL, sizes, max_num_seqs=decoder.config.max_num_seqs)
    manager = CUDAGraphManager(
        decoder.forward,
        static_inputs(decoder.config),
        config,
        options=ManagerOptions(capture=CaptureOptions(pool=pool)),
    )
    decoder.step(make_step_inputs(decoder.config, _CAPTURE_MAX, uniform_decode=False, device="cuda"))
    reports: list[CaptureReport] = []
    benchmark.group = _CAPTURE_GROUP
    benchmark.pedantic(lambda: reports.append(manager.capture(progress=False)), rounds=1, iterations=1)
    (report,) = reports
    assert report.num_graphs == len(sizes)
    pool_bytes = _pool_bytes(pool)
    assert pool_bytes > 0, "no segment of the capture's pool found in the memory snapshot"
    _MEDIANS[(label, -1)] = float(pool_bytes)
    info = benchmark.extra_info
    info.update(
        label=label,
        baseline="largest_only",
        num_graphs=report.num_graphs,
        seconds_per_graph=report.seconds / report.num_graphs,
        pool_mib=pool_bytes / 2**20,
        report_pool_mib=report.pool_bytes / 2**20,
        report_reserved_mib=report.reserved_bytes / 2**20,
    )
    largest = _MEDIANS.get(("largest_only", -1))
    if largest is not None and label != "largest_only":
        info["pool_vs_largest_only"] = pool_bytes / largest
    # Every graph replays correctly from the shared pool: check the largest and the smallest.
    for num_tokens in (sizes.max, sizes.sizes[0]):
        inputs = make_step_inputs(decoder.config, num_tokens, uniform_decode=False, device="cuda")
        _check(
            run_graph(manager, False, inputs).clone(), decoder.step(inputs), f"capture {label} {num_tokens}"
        )
    assert manager.stats.eager_steps == 0


def test_capture_largest_size_alone(benchmark: BenchmarkFixture, decoder: ReferenceDecoder) -> None:
    _bench_capture(benchmark, decoder, CaptureSizes([_CAPTURE_MAX]), "largest_only")


def test_capture_default_sizes(benchmark: BenchmarkFixture, decoder: ReferenceDecoder) -> None:
    sizes = CaptureSizes.default(_CAPTURE_MAX)
    assert len(sizes) == _DEFAULT_NUM_SIZES
    _bench_capture(benchmark, decoder, sizes, "default_sizes")
