"""The 8B-like decoder on a paged KV cache with FlexAttention: steps, capture time and graph memory.

- Steps (uniform decode of 1, 16, 64 and 256 requests; one mixed batch of
  512 tokens: a prefill chunk and decodes), each candidate interleaved round
  by round with the others in this run: eager (under ``inference_mode``), the
  manager in FULL and in FULL_AND_PIECEWISE, hand-written
  ``torch.cuda.CUDAGraph`` replays of the same forward (one recorded as a
  uniform key, laying each request on its own batch row, the decode kernel;
  one as a mixed key, one packed sequence), and
  ``torch.compile(mode="reduce-overhead")`` of the same model and attention.
  FULL mode has no uniform keys: its decode steps replay the mixed key's
  packed layout (FlexAttention's tiles of 16 queries read the union of their
  requests' pages), which FULL_AND_PIECEWISE's uniform keys avoid.
- Capture: ``estimate_memory()`` then ``capture()`` of the 51 default sizes up
  to 512, in FULL and in FULL_AND_PIECEWISE: seconds, the report's device
  bytes, the estimate's error.

Every candidate's output is checked against eager first. Figures go into
``extra_info``; ``tests/benchmarks/report.py`` tabulates them.
``CUDAGRAPH_BENCH_ATTENTION=gather`` (``varlen``, ``split_decode``) runs the
same rows on another backend; a backend below ``ALWAYS`` has no hand-written
graph of a mixed key (its FULL graph would bake the capture's plan), and its
FULL manager resolves to FULL_AND_PIECEWISE.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Final

import pytest
import torch

from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_dispatch.support import GraphSupport
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch, metadata_extra
from examples.config import DecoderConfig
from examples.inputs import make_paged_inputs
from examples.paged import (
    BACKENDS,
    PagedBackend,
    PagedDecoder,
    PagedLayout,
    make_backend,
    paged_static_inputs,
)
from tests.benchmarks.support import BenchmarkFixture, interleave, record_interleaved
from tests.torch_support import rel_err

pytestmark = pytest.mark.gpu

M: Final = CUDAGraphMode
_DECODE_BATCHES: Final = (1, 16, 64, 256)
_MIXED_TOKENS: Final = 512
_SIZES: Final = CaptureSizes.default(512)  # 51 sizes
_PAGE: Final = 64  # the 8B-like preset's sequences are 64 tokens: one page each
_ROUNDS: Final = 11
_STEPS_PER_CALL: Final = 10
_TOLERANCE: Final = 3e-2  # bf16, graph vs eager (rounding; a bug is of order 1)
_MODES: Final = {"full": M.FULL, "full_and_piecewise": M.FULL_AND_PIECEWISE}
#: The attention backend of every row (``examples.paged.BACKENDS``): FlexAttention by default.
_BACKEND: Final = os.environ.get("CUDAGRAPH_BENCH_ATTENTION", "flex")
if _BACKEND not in BACKENDS:
    raise ValueError(f"CUDAGRAPH_BENCH_ATTENTION: expected one of {list(BACKENDS)}, got {_BACKEND!r}")


@pytest.fixture(scope="module")
def model() -> Iterator[PagedDecoder]:
    torch.manual_seed(0)
    config = DecoderConfig.llama_8b_like()
    layout = PagedLayout.for_config(config, page_size=_PAGE)
    decoder = PagedDecoder(config, layout=layout, backend=_BACKEND, device="cuda")
    decoder.warm_up(_SIZES.max)  # its attention's compiles, before any capture or estimate
    yield decoder
    del decoder
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def managers(model: PagedDecoder) -> Iterator[dict[str, CUDAGraphManager[torch.Tensor]]]:
    built = _captured(model, _SIZES)
    yield built
    for manager in built.values():
        manager.release()


def _captured(model: PagedDecoder, sizes: CaptureSizes) -> dict[str, CUDAGraphManager[torch.Tensor]]:
    """A manager per mode of ``_MODES`` over ``model``, its graphs of ``sizes`` captured."""
    built: dict[str, CUDAGraphManager[torch.Tensor]] = {}
    for name, mode in _MODES.items():
        config = DispatchConfig(mode, sizes, max_num_seqs=model.config.max_num_seqs)
        manager = CUDAGraphManager(
            model,
            paged_static_inputs(model.layout),
            config,
            strict=True,
            options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
        )
        with torch.no_grad():
            manager.capture(progress=False)
        built[name] = manager
    return built


def _inputs(model: PagedDecoder, num_tokens: int, uniform: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(num_tokens)
    return make_paged_inputs(
        model.config, model.layout, num_tokens, uniform_decode=uniform, generator=generator, device="cuda"
    )


def _eager(model: PagedDecoder, inputs: dict[str, torch.Tensor], uniform: bool) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model.step(inputs, uniform_decode=uniform)

    return step


def _shape(key: BatchDescriptor, mode: CUDAGraphMode) -> BatchShape:
    assert key.num_reqs is not None
    return BatchShape.of_key(mode, key, key.num_reqs)


def _refill(
    backend: PagedBackend[object], inputs: dict[str, torch.Tensor], shape: BatchShape
) -> dict[str, object]:
    """The backend's metadata of ``inputs`` as ``shape`` (buffers refilled), as forward-context extras."""
    batch = StepBatch(inputs["input_ids"].shape[0], inputs["query_lens"].shape[0], inputs)
    return metadata_extra(backend, backend.build(batch, shape))


def _hand_written(
    model: PagedDecoder, inputs: dict[str, torch.Tensor], key: BatchDescriptor
) -> tuple[Callable[[], None], torch.Tensor]:
    """One ``torch.cuda.CUDAGraph`` recorded as ``key``: copy the inputs in, refill the metadata, replay."""
    static = {name: t.clone() for name, t in inputs.items()}
    shape = _shape(key, M.FULL)
    extra = _refill(model.backend, static, shape)
    # Each forward under a context of its own (docs/design.md, "The attention seam"): an attention
    # derives its per-forward plan again, so the graph records it instead of reading the warm-up's.
    with torch.no_grad():
        with set_forward_context(M.NONE, key, **extra):
            model(**static)  # warm-up: compiles, allocator blocks
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with set_forward_context(M.NONE, key, **extra), torch.cuda.graph(graph):
            out = model(**static)  # [T, hidden]
    pairs = [(static[name], inputs[name]) for name in inputs]

    def step() -> None:
        for dst, src in pairs:
            dst.copy_(src)
        _refill(model.backend, static, shape)  # the metadata buffers the graph reads
        graph.replay()

    return step, out


def _reduce_overhead(
    model: PagedDecoder, inputs: dict[str, torch.Tensor], uniform: bool
) -> Callable[[], torch.Tensor]:
    """``torch.compile(mode="reduce-overhead")`` of the model with the same attention, inlined (not a break).

    The metadata is built outside the compiled call, into the backend's
    buffers, as the manager builds it.
    """
    config = model.config
    backend = make_backend(
        _BACKEND,
        model.layout,
        config.dtype,
        max_tokens=config.max_num_seqs * model.layout.max_seq_len,
        max_reqs=config.max_num_seqs,
        device="cuda",
        breakable=False,
    )
    twin = model.with_backend(backend)
    for cache in twin.kv_caches():
        torch._dynamo.mark_static_address(cache)  # mutated in place every step: a graph input
    compiled = torch.compile(twin, mode="reduce-overhead", dynamic=False)
    num_tokens, num_reqs = inputs["input_ids"].shape[0], inputs["query_lens"].shape[0]
    key = BatchDescriptor(num_tokens, num_reqs, uniform)
    shape = BatchShape.eager(num_tokens, num_reqs, uniform)

    def step() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]  # untyped in torch
        with (
            torch.no_grad(),
            warnings.catch_warnings(),
            set_forward_context(M.NONE, key, **_refill(backend, inputs, shape)),
        ):
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty", category=UserWarning)
            out = compiled(**inputs)
        assert isinstance(out, torch.Tensor)
        return out

    return step


def _run(
    manager: CUDAGraphManager[torch.Tensor], inputs: dict[str, torch.Tensor], uniform: bool
) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        return manager.run_batch(inputs, uniform_decode=uniform)

    return step


def _repeat(step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(_STEPS_PER_CALL):
            step()
        torch.cuda.synchronize()

    return run


@pytest.mark.parametrize(
    ("num_tokens", "uniform"),
    [*((b, True) for b in _DECODE_BATCHES), (_MIXED_TOKENS, False)],
    ids=[*(f"decode{b}" for b in _DECODE_BATCHES), f"mixed{_MIXED_TOKENS}"],
)
def test_paged_8b_step(
    benchmark: BenchmarkFixture,
    model: PagedDecoder,
    managers: dict[str, CUDAGraphManager[torch.Tensor]],
    num_tokens: int,
    uniform: bool,
) -> None:
    inputs = _inputs(model, num_tokens, uniform)
    num_reqs = int(inputs["seq_lens"].shape[0])
    eager = _eager(model, inputs, uniform)
    expected = eager().clone()
    candidates: dict[str, Callable[[], object]] = {"eager": eager}
    for name, manager in managers.items():
        out = manager.run_batch(inputs, uniform_decode=uniform)
        assert rel_err(out, expected) < _TOLERANCE, name
        candidates[f"manager_{name}"] = _run(manager, inputs, uniform)
    keys: dict[str, BatchDescriptor] = {}
    if model.backend.support.level is GraphSupport.ALWAYS:  # below it, no FULL graph of a mixed key holds
        keys["cuda_graph_mixed_key"] = BatchDescriptor(num_tokens, min(num_tokens, model.config.max_num_seqs))
    if uniform:
        keys["cuda_graph_uniform_key"] = BatchDescriptor(num_tokens, num_reqs, True)
    for label, key in keys.items():
        step, out = _hand_written(model, inputs, key)
        step()
        assert rel_err(out, expected) < _TOLERANCE, label
        candidates[label] = step
    info = benchmark.extra_info
    try:
        with warnings.catch_warnings():
            # cudagraph trees record a partition with no kernel (around a graph break) as an empty graph
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty", category=UserWarning)
            compiled = _reduce_overhead(model, inputs, uniform)
            for _ in range(3):
                compiled()
            assert rel_err(compiled(), expected) < _TOLERANCE, "reduce-overhead"
        candidates["reduce_overhead"] = compiled
    except Exception as error:  # a baseline that cannot run is reported, not hidden
        info["reduce_overhead_error"] = f"{type(error).__name__}: {error}"[:400]
    benchmark.group = f"8B-like paged {_BACKEND}, {'decode' if uniform else 'mixed'} {num_tokens} tokens"
    benchmark.pedantic(_repeat(candidates["manager_full_and_piecewise"]), rounds=_ROUNDS, warmup_rounds=1)
    timed = interleave(candidates, rounds=_ROUNDS, calls_per_round=_STEPS_PER_CALL)
    info.update(
        label="paged_8b", attention=_BACKEND, num_tokens=num_tokens, uniform=uniform, num_reqs=num_reqs
    )
    ratios = {
        f"manager_{name}_vs_{other}": (f"manager_{name}", other)
        for name in managers
        for other in candidates
        if other != f"manager_{name}"
    }
    record_interleaved(info, timed, ratios)
    for manager in managers.values():
        assert manager.stats.eager_steps == 0


@pytest.mark.parametrize("name", list(_MODES))
def test_paged_8b_capture_and_estimate(benchmark: BenchmarkFixture, model: PagedDecoder, name: str) -> None:
    """``estimate_memory()``, then ``capture()`` of the 51 sizes: time, the report's bytes, the error."""
    config = DispatchConfig(_MODES[name], _SIZES, max_num_seqs=model.config.max_num_seqs)
    figures: dict[str, float] = {}

    def capture_once() -> None:
        manager = CUDAGraphManager(
            model,
            paged_static_inputs(model.layout),
            config,
            strict=True,
            options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
        )
        with torch.no_grad():
            estimate = manager.estimate_memory()
            report = manager.capture(progress=False)
        figures.update(
            graphs=report.num_graphs,
            capture_s=report.seconds,
            device_bytes=report.device_bytes,
            reserved_bytes=report.reserved_bytes,
            estimate_bytes=estimate.total_bytes,
            estimate_s=estimate.seconds,
        )
        manager.release()

    benchmark.group = f"8B-like paged {_BACKEND}: capture of the 51 default sizes"
    benchmark.pedantic(capture_once, rounds=1, warmup_rounds=1, iterations=1)
    error = figures["estimate_bytes"] - figures["device_bytes"]
    info = benchmark.extra_info
    info.update(label=f"paged_8b_capture_{name}", **figures)
    info["estimate_error_bytes"] = error
    info["estimate_error_fraction"] = error / max(figures["device_bytes"], 1)
    assert figures["graphs"] == sum(len(keys) for _, keys in manager_plan(model, config))


def manager_plan(
    model: PagedDecoder, config: DispatchConfig
) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
    """The capture plan a manager of ``config`` over ``model`` has (its dispatcher's, resolved)."""
    return CUDAGraphManager(model, paged_static_inputs(model.layout), config).dispatcher.capture_plan()


# --- every backend's graphs against its eager step (issue 40, item 4) ----------------------------

#: The 8B-like layers, fewer of them: every backend fits one run (the ratios are per layer).
_FLOOR_LAYERS: Final = 4
_FLOOR_DECODES: Final = (1, 16, 64)
_FLOOR_SIZES: Final = CaptureSizes([*_FLOOR_DECODES, _MIXED_TOKENS])
_FLOOR_ROUNDS: Final = 7
#: ``CUDAGRAPH_BENCH_FLOOR_PLANNED=1`` adds ``split_decode`` on its host-planned prefill path (the
#: baseline of its default varlen one) as the backend ``split_decode_planned``.
_FLOOR_BACKENDS: Final = (
    *BACKENDS,
    *(("split_decode_planned",) if os.environ.get("CUDAGRAPH_BENCH_FLOOR_PLANNED") == "1" else ()),
)

Floor = tuple[str, PagedDecoder, dict[str, CUDAGraphManager[torch.Tensor]]]


@pytest.fixture(scope="module", params=_FLOOR_BACKENDS)
def floor(request: pytest.FixtureRequest) -> Iterator[Floor]:
    """Per backend: the 8B-like model of ``_FLOOR_LAYERS`` layers, its managers' graphs of 4 sizes."""
    name = request.param
    assert isinstance(name, str)
    torch.manual_seed(0)
    config = dataclasses.replace(DecoderConfig.llama_8b_like(), num_layers=_FLOOR_LAYERS)
    layout = PagedLayout.for_config(config, page_size=_PAGE)
    backend: str | PagedBackend[object] = name
    if name == "split_decode_planned":
        from examples.paged.split_decode import SplitDecodeAttention

        backend = SplitDecodeAttention(
            layout,
            max_tokens=config.max_num_seqs * layout.max_seq_len,
            max_reqs=config.max_num_seqs,
            device="cuda",
            prefill="planned",
        )
    decoder = PagedDecoder(config, layout=layout, backend=backend, device="cuda")
    decoder.warm_up(_FLOOR_SIZES.max)
    built = _captured(decoder, _FLOOR_SIZES)
    yield name, decoder, built
    for manager in built.values():
        manager.release()
    del decoder, built
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    ("num_tokens", "uniform"),
    [*((b, True) for b in _FLOOR_DECODES), (_MIXED_TOKENS, False)],
    ids=[*(f"decode{b}" for b in _FLOOR_DECODES), f"mixed{_MIXED_TOKENS}"],
)
def test_paged_graph_vs_eager(
    benchmark: BenchmarkFixture, floor: Floor, num_tokens: int, uniform: bool
) -> None:
    """Each backend's FULL and FULL_AND_PIECEWISE steps against its eager step, interleaved.

    ``eager_over_manager_<mode>``: the speed-up of the graphs (above 1: the
    graph is faster); ``full_mixed_key_over_uniform_key`` at decodes: FULL
    mode's mixed key over FULL_AND_PIECEWISE's uniform key (flex's packed
    layout against its per-request one, ``docs/benchmarks-notes.md``).
    """
    name, model, built = floor
    inputs = _inputs(model, num_tokens, uniform)
    eager = _eager(model, inputs, uniform)
    expected = eager().clone()
    candidates: dict[str, Callable[[], object]] = {"eager": eager}
    for mode, manager in built.items():
        assert rel_err(manager.run_batch(inputs, uniform_decode=uniform), expected) < _TOLERANCE, mode
        candidates[f"manager_{mode}"] = _run(manager, inputs, uniform)
    kind = "decode" if uniform else "mixed"
    benchmark.group = f"paged {name} graph vs eager, {_FLOOR_LAYERS} 8B-like layers, {kind} {num_tokens}"
    benchmark.pedantic(_repeat(candidates["manager_full"]), rounds=3, warmup_rounds=1)
    timed = interleave(candidates, rounds=_FLOOR_ROUNDS, calls_per_round=_STEPS_PER_CALL)
    info = benchmark.extra_info
    info.update(label="paged_floor", attention=name, num_tokens=num_tokens, uniform=uniform)
    info.update(num_reqs=int(inputs["seq_lens"].shape[0]), layers=_FLOOR_LAYERS)
    for label in candidates:
        info[f"{label}_us"] = timed.median(label) * 1e6
    for mode in built:
        rounds = [
            e / g for e, g in zip(timed.samples["eager"], timed.samples[f"manager_{mode}"], strict=True)
        ]
        info[f"eager_over_manager_{mode}"] = timed.ratio("eager", f"manager_{mode}")
        info[f"eager_over_manager_{mode}_spread"] = [min(rounds), max(rounds)]
    if uniform:
        info["full_mixed_key_over_uniform_key"] = timed.ratio("manager_full", "manager_full_and_piecewise")
    for manager in built.values():
        assert manager.stats.eager_steps == 0
