"""Every bad input of the public API, in one module (docs/design.md, "Conventions").

A public entry point checks its arguments at run time (callers are often
untyped engine code) and rejects a bad one with a ``ValueError`` that names the
argument and shows the value, before any state changes: "expected an
integer" without saying which argument and what was passed sends the caller
hunting. ``bool`` is not an ``int`` here, and a string is not a ``bool``
(``"no"`` is truthy). Three tables, one per way a rejection is observed:

- ``BAD_INPUTS``: a call and a pattern that must find the argument's name and
  the bad value in the error; no forward context and no capture switch was
  changed. By package: dispatch, capture, manager.
- ``BAD_RUNS``: bad inputs to ``CUDAGraphManager.run`` (and ``run_batch``) on
  each backend of ``tests.manager.helpers``: the message holds the listed
  fragments, no static buffer was written and no run was counted.
- ``BAD_DEMO_ARGS``: command lines of the demo that make no valid run: they end
  as argparse errors (exit status 2, the message on stderr), never a traceback.

Rows that only make sense with or without CUDA are marked so, and skip with a
reason elsewhere. A new bad input is a new row here.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, cast

import pytest
import torch
from torch import nn

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    BreakableCUDAGraphWrapper,
    CaptureError,
    CaptureOptions,
    CUDAGraphWrapper,
    DeviceLoop,
    LoopKind,
    LoopPolicy,
    capture_enabled,
    eager_break_during_capture,
    graph_engine,
    set_capture_enabled,
)
from cudagraph_capture._choice import SwitchReplay
from cudagraph_capture._enabled import check_capture_enabled
from cudagraph_capture._gc import collector_paused
from cudagraph_capture._pool import capture_stream, shared_pool
from cudagraph_capture._weakref import weak_ref_tensors
from cudagraph_capture.lowlevel import (
    LoopRows,
    RecordSeconds,
    ReservedMemory,
    release_graph_memory,
    resolve_device,
)
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    DispatchConfig,
    RankRequest,
    agree_across_ranks,
    get_forward_context,
    set_forward_context,
)
from cudagraph_dispatch.budgets import Pack, TokenBudgets
from cudagraph_dispatch.lowlevel import check_bool, check_int
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager import (
    CompiledModel,
    CUDAGraphManager,
    DecodeLoop,
    KVCacheMemory,
    ManagerOptions,
    StaticInput,
    compile_for_capture,
)
from cudagraph_manager.attention import (
    AttentionOptions,
    BatchKind,
    BatchShape,
    PackedMetadata,
    PackedMetadataBuilder,
    StepBatch,
    SupportCheckOptions,
    check_attention_support,
    metadata_extra,
    pad_offsets,
    pad_rows,
)
from cudagraph_manager.lowlevel import GraphEngineFactory
from cudagraph_manager.ranks import RankAgreement
from examples.config import DecoderConfig
from examples.demo import main as demo_main
from examples.encoder import EncoderConfig, EncoderRunner, ViTEncoder, encoder_static_inputs, random_items
from examples.ep.decoder import ExpertParallelDecoder
from examples.ep.moe import ExpertParallelMoE, MoeConfig, MoeWeights
from examples.inputs import make_paged_inputs, make_step_inputs, request_lengths
from examples.paged import PagedBuffers, PagedDecoder, PagedLayout, make_backend, paged_static_inputs
from examples.reference import ReferenceDecoder, static_inputs
from examples.tensor_parallel import TensorParallelDecoder, check_shards
from tests.capture.helpers import cuda
from tests.manager.helpers import (
    BACKENDS,
    DIM,
    INPUTS,
    MAX_NUM_SEQS,
    Backend,
    FakeEngines,
    ToyModel,
    assert_unchanged,
    config_for,
    make_batch,
    make_manager,
    snapshot,
)

M: Final = CUDAGraphMode
SIZES: Final = CaptureSizes([1, 8])
DISPATCHER: Final = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, SIZES, 8))
KEY: Final = BatchDescriptor(8)
#: Uniform decode batches of 2 tokens per request (one speculative token).
QUERY_LEN_2: Final = CUDAGraphDispatcher(
    DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([1, 2, 4, 8]), 4, 2)
)
#: Sizes above max_num_seqs=8 requests (a uniform decode batch of 16 tokens has 16 requests).
WIDE: Final = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([1, 8, 32]), 8))
WIDE_NONE: Final = CUDAGraphDispatcher(DispatchConfig(M.NONE, CaptureSizes([1, 8, 32]), 8))
CPU: Final = torch.device("cpu")

NO_CUDA: Final = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the error raised where there is no CUDA device"
)
#: 'cuda:7' on a GPU machine: a device that does not exist.
NO_CUDA_7: Final = (
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="this machine has a cuda:7"),
)


# ---------------------------------------------------------------------------
# BAD_INPUTS: a call, and a pattern naming the argument and the value
# ---------------------------------------------------------------------------


def call(fn: Callable[..., object], *args: object, **kwargs: object) -> Callable[[], object]:
    """``fn(*args, **kwargs)``, deferred. Typed loosely on purpose: the arguments are the bad inputs."""
    return lambda: fn(*args, **kwargs)


def row(name: str, thunk: Callable[[], object], pattern: str, *marks: pytest.MarkDecorator) -> object:
    """One row: ``thunk()`` raises ``ValueError`` (wrong types too: docs/design.md, "Conventions")."""
    return pytest.param(thunk, pattern, id=name, marks=marks)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _two_inputs(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x


def _collector_paused(gc_disable: object) -> None:
    with collector_paused(cast(bool, gc_disable)):  # entered and left: the collector is restored
        pass


def construct(
    *, watch_factory: bool = True, fields: Mapping[str, object] | None = None, **overrides: object
) -> Callable[[], object]:
    """A CPU ``CUDAGraphManager`` from valid arguments with ``overrides`` applied, deferred.

    ``fields``: of the ``ManagerOptions`` built inside the call (over the fake
    engines' factory), so a bad field is rejected there, when the options are
    built; an ``options`` override replaces them. With ``watch_factory`` (and
    no ``engine_factory`` field), a rejection must also come before any engine
    was built: the engine factory is the caller's code, and calling it is a
    state change.
    """

    def build() -> object:
        engines = FakeEngines()
        make_options = cast(Callable[..., object], ManagerOptions)  # fields deliberately of any type
        make = cast(Callable[..., object], CUDAGraphManager)  # arguments deliberately of any type
        try:
            arguments: dict[str, object] = {
                "model": ToyModel(CPU),
                "inputs": INPUTS,
                "config": config_for(M.FULL),
                "device": "cpu",
                "options": make_options(**{"engine_factory": engines, **(fields or {})}),
                **overrides,
            }
            return make(**arguments)
        except ValueError:
            assert not (watch_factory and engines.engines), "rejected after the engine factory ran"
            raise

    return build


def _wait_for(timeout: object) -> object:
    """``wait(timeout)`` of a finished background capture (a CPU manager's: done at once)."""
    manager = construct()()
    assert isinstance(manager, CUDAGraphManager)
    return manager.start_capture().wait(cast(float, timeout))


def _start_with(keys_per_step: object) -> object:
    """``start_capture(keys_per_step=...)`` of a CPU manager (without ranks), refused before it starts."""
    manager = construct()()
    assert isinstance(manager, CUDAGraphManager)
    session = manager.start_capture(keys_per_step=cast(int, keys_per_step))
    raise AssertionError(f"started {session!r}")


def _loop_with_ranks() -> object:
    """``ManagerOptions`` with a decode loop and ranks (an agreement's stand-in: no process group)."""
    ranks = object.__new__(RankAgreement)  # isinstance holds; nothing of it is used
    return ManagerOptions(ranks=ranks, decode_loop=DecodeLoop(lambda *_: None, max_steps=4))


def _advance(outputs: object, inputs: object, state: object) -> None:
    """A decode loop's advance that does nothing (the loop is never run)."""


def _advance_of_two(outputs: object, inputs: object) -> None:
    """An advance that forgot the loop's state."""


def _advance_of_four(outputs: object, inputs: object, state: object, extra: object) -> None:
    """An advance that wants one argument more than a loop gives."""


def _advance_of_keywords(*, outputs: object, inputs: object, state: object) -> None:
    """An advance whose arguments are keywords only (a loop passes them by position)."""


def _lockstep_wait_for(timeout: object) -> object:
    """``wait(timeout)`` of a lockstep capture (ranks: an agreement's stand-in), refused before its steps."""
    ranks = object.__new__(RankAgreement)  # never reached: the timeout is checked first
    options: ManagerOptions[torch.Tensor] = ManagerOptions(engine_factory=FakeEngines(), ranks=ranks)
    manager = CUDAGraphManager(ToyModel(CPU), INPUTS, config_for(M.FULL), device="cpu", options=options)
    return manager.start_capture().wait(cast(float, timeout))


def _step_field(field: object) -> object:
    """``RankAgreement.route_step(field=...)`` of an agreement's stand-in: checked before the exchange."""
    ranks = object.__new__(RankAgreement)
    request = RankRequest(3)
    return ranks.route_step(DISPATCHER, request, can_replay=True, field=cast(tuple[int, ...], field))


def _exchange(row: object) -> object:
    """``RankAgreement.exchange(row)`` of an agreement's stand-in: the row is checked before any exchange."""
    ranks = object.__new__(RankAgreement)
    return ranks.exchange(cast(list[int], row))


def _capture_with_progress(progress: object) -> object:
    manager = construct()()
    assert isinstance(manager, CUDAGraphManager)
    return manager.capture(progress=cast(bool, progress))


def _reserved(size: int = 16) -> ReservedMemory:
    """A reservation on the CPU: an ordinary allocation of ``size`` bytes (the fallback)."""
    return ReservedMemory(size, device="cpu", fallback_size=size)


def _closed_twice() -> object:
    memory = _reserved()
    memory.close()
    memory.close()
    raise AssertionError("closed twice")


def _kv(device: str = "cpu") -> KVCacheMemory:
    """A KV cache of 4 units of 4 floats, 2 of them always backed (on the CPU: an ordinary allocation)."""
    return KVCacheMemory((4,), torch.float32, min_units=2, fallback_units=4, device=device)


def _kv_closed_twice() -> object:
    kv = _kv()
    kv.close()
    kv.close()
    raise AssertionError("closed twice")


def _more_than_free() -> object:
    """Back every unit of a reservation as large as the device: more than it has free."""
    kv = KVCacheMemory((1 << 20,), torch.uint8, device="cuda")
    before = kv.units  # min_units, rounded up to the device's granularity (2 MiB: 2 units)
    try:
        return kv.back(kv.max_units)
    finally:
        assert kv.units == before, "backed anyway"
        kv.close()


def _kv_on_another_device() -> object:
    model = ToyModel(torch.device("cuda"))
    config = config_for(M.FULL)
    return CUDAGraphManager(model, INPUTS, config, device="cuda", options=ManagerOptions(kv_cache=_kv()))


def _back_kv_cache(**kwargs: object) -> object:
    manager = construct(fields={"kv_cache": _kv()})()
    assert isinstance(manager, CUDAGraphManager)
    back = cast(Callable[..., int], manager.back_kv_cache)  # arguments deliberately of any type
    return back(**kwargs)


def _body(steps: object) -> None:
    """A loop body that is never run."""


def _switch_replay_counting_on_the_cpu() -> object:
    """``SwitchReplay.of`` of a real FULL graph, its count on the CPU."""
    x = torch.zeros(8, device="cuda")
    engine = graph_engine(lambda x: x.add_(1), M.FULL)
    with set_forward_context(M.FULL, KEY):
        entry = engine.record(KEY, {"x": x})
    return SwitchReplay.of({KEY: entry}, torch.zeros((), dtype=torch.int32))


def _shrink_two_loops(**changes: object) -> object:
    """``DeviceLoop.shrinking`` of two real WHILE loops on shared cells, with ``changes`` to good rows."""
    stop = torch.zeros((), dtype=torch.bool, device="cuda")
    x = torch.zeros(8, device="cuda")
    rows = {
        "active": torch.zeros(8, dtype=torch.bool, device="cuda"),
        "buffers": (x,),
        "history": torch.zeros(4, 8, dtype=torch.int64, device="cuda"),
        **changes,
    }
    big = DeviceLoop.capture(
        lambda steps: x.add_(1), stop=stop, max_steps=4, descriptor=BatchDescriptor(8, 8, True)
    )
    small = DeviceLoop.capture(
        lambda steps: x[:4].add_(1),
        stop=stop,
        max_steps=4,
        descriptor=BatchDescriptor(4, 4, True),
        shared_with=big,
    )
    return DeviceLoop.shrinking([big, small], rows=LoopRows(**rows))  # type: ignore[arg-type]  # the bad rows


def _int32(rows: int, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(rows, dtype=torch.int32, device=device)


def _int32s(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------------------
# Issue 51 (misuse, round three): the newer APIs (budgets, the encoder, expert
# parallelism, options, the tiers' helpers) and the examples' entry points.
# A call on an object that exists already is wrapped in ``unchanged``: its
# state (buffers, views, counters) must be as it was when the call refuses.
# ---------------------------------------------------------------------------


def _copied(value: object) -> object:
    """``value`` with every tensor in it cloned (a snapshot of state to compare later)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(_copied(v) for v in value)
    return value


def _assert_same(before: object, after: object, where: str = "state") -> None:
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), f"{where} changed"
        assert torch.equal(before, after), f"{where} changed"
    elif isinstance(before, dict):
        assert isinstance(after, Mapping), f"{where} changed"
        assert set(before) == set(after), f"{where} changed"
        for key, value in before.items():
            _assert_same(value, after[key], f"{where}[{key!r}]")
    elif isinstance(before, tuple):
        assert isinstance(after, (tuple, list)), f"{where} changed"
        assert len(before) == len(after), f"{where} changed"
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            _assert_same(b, a, f"{where}[{i}]")
    else:
        assert before == after, f"{where} changed: {before!r} -> {after!r}"


def unchanged(state: Callable[[], object], thunk: Callable[[], object]) -> Callable[[], object]:
    """``thunk``, deferred; where it raises ``ValueError``, ``state()`` must be what it was before."""

    def run() -> object:
        before = _copied(state())
        try:
            return thunk()
        except ValueError:
            _assert_same(before, _copied(state()))
            raise

    return run


class _Builder:
    """A minimal ``AttentionMetadataBuilder`` (its metadata: the shape), for the seam's rows."""

    support = AttentionSupport(GraphSupport.ALWAYS, name="shape")

    def build(self, batch: StepBatch, shape: BatchShape, /) -> BatchShape:
        return shape

    def build_for_capture(self, shape: BatchShape, /) -> BatchShape:
        return shape


class _MetaBuilder(_Builder):
    """A builder whose buffers live on ``meta``: not the CPU manager's device."""

    device = torch.device("meta")


def _make_kind(kind: BatchKind, num_tokens: int, num_reqs: int, generator: torch.Generator) -> object:
    return make_batch(num_tokens, num_reqs, CPU, seed=0)


_BUDGETS: Final = TokenBudgets([16, 32, 64], max_items=4)


@functools.cache
def _packed() -> PackedMetadataBuilder:
    """A CPU builder with one graph shape's view made (16 tokens, 4 items)."""
    builder = PackedMetadataBuilder(_BUDGETS, device="cpu")
    builder.build_for_capture(BatchShape(16, 4, None, M.FULL))
    return builder


def _packed_views() -> object:
    meta = _packed().build_for_capture(BatchShape(16, 4, None, M.FULL))
    return meta.offsets


def _packed_build(batch: object, shape: object) -> Callable[[], object]:
    builder = _packed()
    return unchanged(_packed_views, call(builder.build, batch, shape))


def _write_offsets(lengths: object) -> Callable[[], object]:
    meta = _packed().build_for_capture(BatchShape(16, 4, None, M.FULL))
    return unchanged(lambda: meta.offsets, call(meta.write_offsets, lengths))


def _lengths(*values: int, dtype: torch.dtype = torch.int32) -> dict[str, torch.Tensor]:
    return {"item_lens": torch.tensor(values, dtype=dtype)}


@functools.cache
def _runner() -> EncoderRunner:
    """The small encoder's runner on the CPU (every pack eager), one valid batch run."""
    runner = EncoderRunner(EncoderConfig.small(), _BUDGETS, device="cpu")
    runner.encode(_items(5, 9))
    return runner


def _items(*lengths: int) -> list[torch.Tensor]:
    return random_items(EncoderConfig.small(), lengths, torch.Generator().manual_seed(0), "cpu")


def _runner_state() -> object:
    """The runner's manager: its static buffers, and every counter of its steps."""
    manager = _runner().manager
    return dict(manager.static_buffers), repr(manager.stats)


def _encode(items: object) -> Callable[[], object]:
    return unchanged(_runner_state, lambda: _runner().encode(cast(list[torch.Tensor], items)))


def _run_encoder(item_lens: torch.Tensor) -> Callable[[], object]:
    """The runner's manager run on 8 patches with these item lengths (a CPU step: eager)."""
    patches = torch.randn(8, EncoderConfig.small().patch_dim)
    return unchanged(_runner_state, lambda: _runner().manager.run(patches=patches, item_lens=item_lens))


def _entry_engine(entry: Callable[[object], object]) -> GraphEngineFactory:
    """An engine factory whose ``record`` returns ``entry(model output)``: no ``GraphEntry``."""

    class Engine:
        def __init__(self, model: Callable[..., object], mode: object, options: object) -> None:
            self.model = model

        def warm_up(self, key: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
            pass

        def record(self, key: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> object:
            return entry(self.model(**inputs))

    return cast(GraphEngineFactory, Engine)


class _Entry:
    def __init__(self, output: object, seconds: object, *, replay: bool = True) -> None:
        self.output = output
        self.seconds = seconds
        if replay:
            self.replay = lambda: None


def _capture_with(entry: Callable[[object], object]) -> Callable[[], object]:
    """``capture()`` over engines whose entries are ``entry``'s: refused, nothing kept, the next step runs."""

    def run() -> object:
        manager = construct(fields={"engine_factory": _entry_engine(entry)})()
        assert isinstance(manager, CUDAGraphManager)
        try:
            return manager.capture(progress=False)
        except ValueError:
            assert manager.num_captured == 0
            assert manager.run_batch(make_batch(5, 3, CPU, seed=1)).shape == (5, DIM)  # eagerly: not captured
            raise

    return run


def compile_decoder(model: ReferenceDecoder) -> object:
    """``examples.compiled.compile_decoder``, imported on call (it registers a custom op)."""
    from examples.compiled import compile_decoder as compile_it

    return compile_it(model)


def kv_sizing_start_up(manager: object, model: ReferenceDecoder, margin_bytes: int) -> object:
    """``examples.kv_sizing.start_up``, imported on call; its checks come before any device is used."""
    from examples.kv_sizing import start_up

    return start_up(cast("CUDAGraphManager[torch.Tensor]", manager), model, margin_bytes)


_MOE: Final = MoeConfig(num_experts=4, expert_size=8)


@functools.cache
def _moe_weights() -> MoeWeights:
    return MoeWeights(_MOE, num_layers=2, hidden_size=16, vocab_size=32, device=None, dtype=torch.float32)


@functools.cache
def _paged() -> tuple[PagedDecoder, CUDAGraphManager[torch.Tensor], dict[str, torch.Tensor]]:
    """A paged decoder (gather) on the CPU, its manager after one valid step, and that step's inputs."""
    config = DecoderConfig.small()
    layout = PagedLayout.for_config(config, page_size=8)
    model = PagedDecoder(config, layout=layout, backend="gather")
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([8, 16]), max_num_seqs=16),
        device="cpu",
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    step = make_paged_inputs(
        config, layout, 3, uniform_decode=False, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        manager.run_batch(step)
    return model, manager, step


def _paged_state() -> object:
    _, manager, _ = _paged()
    return dict(manager.static_buffers), repr(manager.stats)


def _paged_run_with_token(token: int) -> Callable[[], object]:
    """The paged manager's step with its first token id replaced: refused before a buffer is written."""

    def run() -> object:
        _, manager, step = _paged()
        bad = {name: t.clone() for name, t in step.items()}
        bad["input_ids"][0] = token
        with torch.no_grad():
            return manager.run_batch(bad)

    return unchanged(_paged_state, run)


def _encode_cpu_items_on_cuda() -> object:
    """A CUDA runner given items on the CPU: refused naming the item, before its manager's buffers change."""
    runner = EncoderRunner(EncoderConfig.small(), _BUDGETS, device="cuda")
    state = lambda: dict(runner.manager.static_buffers)  # noqa: E731
    return unchanged(state, lambda: runner.encode(_items(5)))()


def _write_cpu_lengths_on_cuda() -> object:
    meta = PackedMetadataBuilder(_BUDGETS, device="cuda").build_for_capture(BatchShape(16, 2, None, M.FULL))
    return unchanged(lambda: meta.offsets, lambda: meta.write_offsets(_int32s(3, 5)))()


def _paged_cuda_eager_step_with_token(token: int) -> object:
    """On a GPU: a step above the largest size (eager), a bad token id: refused before a buffer is written."""
    config = DecoderConfig.small()
    layout = PagedLayout.for_config(config, page_size=8)
    model = PagedDecoder(config, layout=layout, backend="gather", device="cuda")
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(layout),
        DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([8, 16]), max_num_seqs=16),
        device="cuda",
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )
    step = make_paged_inputs(
        config, layout, 20, uniform_decode=False, generator=torch.Generator().manual_seed(1), device="cuda"
    )
    step["input_ids"][0] = token
    state = lambda: (dict(manager.static_buffers), repr(manager.stats))  # noqa: E731
    with torch.no_grad():
        return unchanged(state, lambda: manager.run_batch(step))()


ROUND_THREE_GPU: Final = [
    row(
        "manager-on-cuda-builder-on-cpu",
        call(
            lambda: construct(
                model=ToyModel(cuda()),
                device="cuda",
                fields={
                    "attention": AttentionOptions(
                        metadata_builder=PackedMetadataBuilder(_BUDGETS, device="cpu")
                    )
                },
                watch_factory=False,
            )()
        ),
        r"^options\.attention\.metadata_builder: its buffers are on cpu, "
        r"but the manager's device is cuda:\d+; ",
        pytest.mark.gpu,
    ),
    row(
        "vit-device-cpu-builder-on-cuda",
        call(
            lambda: ViTEncoder(
                EncoderConfig.small(), PackedMetadataBuilder(_BUDGETS, device="cuda"), device="cpu"
            )
        ),
        r"^device: 'cpu', but the builder's offsets are on cuda:\d+: ",
        pytest.mark.gpu,
    ),
    row(
        "encoder-items-on-cpu-runner-on-cuda",
        _encode_cpu_items_on_cuda,
        r"^items\[0\]: expected torch\.float32 on cuda:\d+, got torch\.float32 on cpu$",
        pytest.mark.gpu,
    ),
    row(
        "packed-write_offsets-cpu-lengths-cuda-offsets",
        _write_cpu_lengths_on_cuda,
        r"^lengths: on cpu, but the offsets are on cuda:\d+$",
        pytest.mark.gpu,
    ),
    row(
        "moe_weights-device-cuda-7-missing",
        call(
            MoeWeights,
            _MOE,
            num_layers=1,
            hidden_size=16,
            vocab_size=32,
            device="cuda:7",
            dtype=torch.float32,
        ),
        r"^device: 'cuda:7' does not exist",
        *NO_CUDA_7,
    ),
    row(
        "paged-cuda-eager-step-input_ids-vocab",
        call(_paged_cuda_eager_step_with_token, 512),
        r"^input_ids: expected token ids in \[0, 512\), got \[512\]$",
        pytest.mark.gpu,
    ),
]


ROUND_THREE: Final = [
    # == cudagraph_dispatch ==
    # -- lowlevel: the shared checks name their own bad arguments --
    row(
        "check_int-minimum-none",
        call(check_int, "size", 3, minimum=None),
        r"^minimum: expected an integer, got None$",
    ),
    row(
        "check_int-maximum-string",
        call(check_int, "size", 3, minimum=0, maximum="9"),
        r"^maximum: .*, got '9'$",
    ),
    row(
        "check_int-field-int",
        call(check_int, 3, "x", minimum=0),
        r"^field: .* name \(a non-empty str\), got 3$",
    ),
    row("check_bool-field-none", call(check_bool, None, "x"), r"^field: .*, got None$"),
    # -- budgets --
    row(
        "budgets-2**40",
        call(TokenBudgets, [64, 2**40]),
        r"^budgets\[1\]: expected an integer <= 1048576, got 1099511627776$",
    ),
    *(
        row(
            f"budget_for-{label}",
            call(_BUDGETS.budget_for, value),
            rf"^tokens: expected an integer >= 0, got {shown}$",
        )
        for label, value, shown in (
            ("negative", -1, "-1"),
            ("float", 1.5, r"1\.5"),
            ("none", None, "None"),
            ("bool", True, "True"),
        )
    ),
    row(
        "pack-tokens-above-budget",
        call(Pack, 16, (0,), 32),
        r"^tokens: a pack's 32 tokens exceed its budget 16$",
    ),
    row("pack-items-int", call(Pack, 16, 3, 8), r"^items: expected a tuple of item indices .*, got 3$"),
    row("pack-budget-string", call(Pack, "16", (0,), 8), r"^budget: expected an integer >= 1, got '16'$"),
    row("pack-tokens-negative", call(Pack, 16, (0,), -1), r"^tokens: expected an integer >= 1, got -1$"),
    # == cudagraph_capture ==
    row(
        "options-warmup_runs-2**40",
        call(CaptureOptions, warmup_runs=2**40),
        r"^warmup_runs: expected an integer <= 100, got 1099511627776$",
    ),
    row(
        "loop_policy-unroll-2**40",
        call(LoopPolicy, unroll=2**40),
        r"^unroll: expected an integer <= 1024, got 1099511627776$",
    ),
    row(
        "device_loop-max_steps-2**64",
        call(DeviceLoop.capture, lambda steps: None, stop=torch.zeros((), dtype=torch.bool), max_steps=2**64),
        r"^max_steps: expected an integer <= 9223372036854775807, got 18446744073709551616$",
    ),
    row(  # checked before the flag's device (a CPU flag is refused next)
        "device_loop-options-dict",
        call(
            DeviceLoop.capture,
            lambda steps: None,
            stop=torch.zeros((), dtype=torch.bool),
            max_steps=4,
            options={},
        ),
        r"^options: expected CaptureOptions or None, got \{\}$",
    ),
    *(
        row(
            f"{name}-runnable-class",
            thunk,
            r"^runnable: expected the callable to capture .*got the class ToyModel; ",
        )
        for name, thunk in (
            ("graph_engine", call(graph_engine, ToyModel, M.FULL)),
            ("wrapper", call(CUDAGraphWrapper, ToyModel, M.FULL)),
            ("breakable-wrapper", call(BreakableCUDAGraphWrapper, ToyModel)),
        )
    ),
    row("eager_break-class", call(eager_break_during_capture, ToyModel), r"^fn: .*got the class ToyModel$"),
    row(
        "record_seconds-negative",
        call(RecordSeconds, -1.0, 0.0),
        r"^recording: expected seconds, .*got -1\.0$",
    ),
    row("record_seconds-nan", call(RecordSeconds, 0.0, math.nan), r"^instantiation: .*got nan$"),
    row("record_seconds-string", call(RecordSeconds, "1", 0.0), r"^recording: .*got '1'$"),
    *(
        row(
            f"weak_ref_tensors-{label}",
            call(weak_ref_tensors, value),
            rf"^obj: expected a tensor or a pytree .*got {shown}$",
        )
        for label, value, shown in (
            ("int", 5, "5"),
            ("string", "abc", "'abc'"),
            ("none", None, "None"),
            ("ints", [1, 2], r"\[1, 2\]"),
        )
    ),
    row(
        "capture_error-message-int",
        call(CaptureError, 3),
        r"^message: expected the error's message \(a str\), got 3$",
    ),
    row(
        "capture_error-descriptor-int",
        call(CaptureError, "failed", 8),
        r"^descriptor: expected None or a BatchDescriptor, got 8$",
    ),
    # == cudagraph_manager ==
    row(
        "compiled_model-model-int",
        call(CompiledModel, 3, _identity, ()),
        r"^model: expected a callable, got 3$",
    ),
    row(
        "compiled_model-batched-list",
        call(CompiledModel, _identity, _identity, ["x"]),
        r"^batched: expected a tuple of input names, got \['x'\]$",
    ),
    # -- options: a class where an instance goes, values no run can use --
    row(
        "attention-metadata_builder-class",
        call(AttentionOptions, metadata_builder=_Builder),
        r"^attention\.metadata_builder: expected an AttentionMetadataBuilder instance, "
        r"got the class _Builder; ",
    ),
    row(
        "support_check-builder-class",
        call(check_attention_support, ToyModel(CPU), INPUTS, _Builder, _make_kind),
        r"^builder: expected an AttentionMetadataBuilder instance, got the class _Builder",
    ),
    *(
        row(
            f"support_check-{field}-{label}",
            call(SupportCheckOptions, **{field: value}),
            rf"^options\.{field}: .*got {shown}$",
        )
        for field, label, value, shown in (
            ("seed", "2**64", 2**64, "18446744073709551616"),
            ("seed", "below-int64", -(2**63) - 1, "-9223372036854775809"),
            ("max_num_seqs", "2**40", 2**40, "1099511627776"),
            ("trials", "2**40", 2**40, "1099511627776"),
            ("query_len", "2**40", 2**40, "1099511627776"),
        )
    ),
    row(
        "static-shape-2**64",
        call(StaticInput, shape=(4, 2**64)),
        r"^shape: a dim above 2\*\*63 - 1 .*got \(4, 18446744073709551616\)$",
    ),
    row(
        "compile-model-class",
        call(compile_for_capture, ToyModel, INPUTS),
        r"^model: expected the model to compile .*got the class ToyModel; ",
    ),
    row(
        "compile-backend-unknown",
        call(compile_for_capture, _identity, INPUTS, backend="no_such_backend"),
        r"^backend: expected a torch\.compile backend \(.*eager.*\), got 'no_such_backend'$",
    ),
    row(
        "manager-builder-on-another-device",
        construct(
            fields={"attention": AttentionOptions(metadata_builder=_MetaBuilder())}, watch_factory=False
        ),
        r"^options\.attention\.metadata_builder: its buffers are on meta, but the manager's device is cpu; ",
    ),
    *(
        row(
            f"manager-engine-entry-{label}",
            _capture_with(entry),
            rf"^options\.engine_factory: the FULL engine's record\(\) returned .*; it lacks {lacks}$",
        )
        for label, entry, lacks in (
            ("none", lambda out: None, r"replay\(\), output, seconds, .*"),
            (
                "seconds-none",
                lambda out: _Entry(out, None),
                r"seconds, a RecordSeconds\(recording, instantiation\) of finite seconds >= 0",
            ),
            ("seconds-tuple", lambda out: _Entry(out, (0.1, 0.0)), r"seconds, .*"),
            ("no-replay", lambda out: _Entry(out, RecordSeconds(0.0, 0.0), replay=False), r"replay\(\)"),
        )
    ),
    # -- the attention tier's values --
    *(
        row(f"batch_shape-{label}", call(BatchShape, *args), pattern)
        for label, args, pattern in (
            ("negative-tokens", (-1, 0, None, M.NONE), r"^num_tokens: expected an integer >= 0, got -1$"),
            ("string-tokens", ("4", 1, None, M.NONE), r"^num_tokens: .*got '4'$"),
            ("reqs-above-tokens", (4, 8, None, M.NONE), r"^num_reqs: expected an integer <= 4, got 8$"),
            ("query_len-zero", (4, 2, 0, M.NONE), r"^query_len: expected an integer >= 1, got 0$"),
            (
                "query_len-mismatch",
                (4, 2, 3, M.FULL),
                r"^query_len: 2 requests of 3 tokens are not the shape's 4 tokens$",
            ),
            ("mode-string", (4, 2, None, "FULL"), r"^mode: expected a runtime CUDAGraphMode .*got 'FULL'$"),
            ("mode-config", (4, 2, None, M.FULL_AND_PIECEWISE), r"^mode: .*FULL_AND_PIECEWISE"),
        )
    ),
    *(
        row(
            f"metadata_extra-builder-{label}",
            call(metadata_extra, value, BatchShape(1, 1, None, M.NONE)),
            rf"^builder: expected an AttentionMetadataBuilder.*{shown}",
        )
        for label, value, shown in (
            ("int", 3, "got 3, which lacks"),
            ("none", None, "got None$"),
            ("class", _Builder, "got the class _Builder"),
        )
    ),
    # -- PackedMetadataBuilder: devices, its input's name, shapes, batches, the offsets --
    *(
        row(
            f"packed_builder-device-{label}",
            call(PackedMetadataBuilder, _BUDGETS, device=device),
            pattern,
            *marks,
        )
        for label, device, pattern, marks in (
            (
                "cuda-7-without-cuda",
                "cuda:7",
                r"^device: 'cuda:7' is a CUDA device, but CUDA is not available here$",
                (NO_CUDA,),
            ),
            (
                "cuda-7-missing",
                "cuda:7",
                r"^device: 'cuda:7' does not exist; this machine has \d+ CUDA device",
                NO_CUDA_7,
            ),
            (
                "int-without-cuda",
                0,
                r"^device: 0 is a CUDA device, but CUDA is not available here$",
                (NO_CUDA,),
            ),
            ("mps", "mps", r"^device: expected a CUDA device or the CPU, got 'mps'$", ()),
            ("meta", "meta", r"^device: expected a CUDA device or the CPU, got 'meta'$", ()),
            ("cpu-1", "cpu:1", r"^device: the CPU is one device, .*got 'cpu:1'$", ()),
        )
    ),
    row(
        "packed_builder-lengths-not-an-identifier",
        call(PackedMetadataBuilder, _BUDGETS, lengths="item lens"),
        r"^lengths: expected an input name \(an identifier.*got 'item lens'$",
    ),
    row(
        "packed_builder-budgets-config",
        call(PackedMetadataBuilder, _BUDGETS.config()),
        r"^budgets: expected TokenBudgets, got DispatchConfig\(",
    ),
    row(
        "packed-build_for_capture-none",
        lambda: _packed().build_for_capture(cast(BatchShape, None)),
        r"^shape: expected a BatchShape, got None$",
    ),
    row(
        "packed-build-shape-tuple",
        _packed_build(StepBatch(8, 2, _lengths(3, 5)), (16, 4)),
        r"^shape: expected a BatchShape, got \(16, 4\)$",
    ),
    row(
        "packed-build-batch-list",
        _packed_build([8, 2], BatchShape(16, 4, None, M.FULL)),
        r"^batch: expected a StepBatch, got \[8, 2\]$",
    ),
    *(
        row(f"packed-build-eager-{label}", _packed_build(batch, BatchShape(8, 2, None, M.NONE)), pattern)
        for label, batch, pattern in (
            (
                "sum-past-tokens",
                StepBatch(8, 2, _lengths(5, 7)),
                r"^item_lens: expected lengths >= 1 summing to the 8 tokens, got \[5, 7\]$",
            ),
            (
                "sum-short",
                StepBatch(8, 2, _lengths(2, 2)),
                r"^item_lens: .*summing to the 8 tokens, got \[2, 2\]$",
            ),
            ("zero-length", StepBatch(8, 2, _lengths(0, 8)), r"^item_lens: .*got \[0, 8\]$"),
            (
                "float-lengths",
                StepBatch(8, 2, _lengths(4, 4, dtype=torch.float32)),
                r"^item_lens: expected the 2 items' lengths, a 1-D integer tensor, "
                r"got shape \(2,\) of torch\.float32$",
            ),
            (
                "one-row-for-two",
                StepBatch(8, 2, _lengths(8)),
                r"^item_lens: expected the 2 items' lengths.*shape \(1,\)",
            ),
            ("no-lengths", StepBatch(8, 2, {}), r"^item_lens: the step has no input of the items' lengths$"),
            (
                "more-items-than-the-shape",
                StepBatch(8, 3, _lengths(3, 3, 2)),
                r"^batch: 8 tokens of 3 items do not fit the shape's 8 tokens of 2 items$",
            ),
        )
    ),
    row(
        "packed-build-validate-graph-shape",
        call(
            PackedMetadataBuilder(_BUDGETS, device="cpu", validate=True).build,
            StepBatch(4, 2, _lengths(3, 5)),
            BatchShape(16, 2, None, M.FULL),
        ),
        r"^item_lens: expected lengths >= 1 summing to the 4 tokens, got \[3, 5\]$",
    ),
    *(
        row(f"packed-write_offsets-{label}", _write_offsets(value), pattern)
        for label, value, pattern in (
            ("list", [3, 5, 0, 0], r"^lengths: expected a tensor of the items' lengths, got \[3, 5, 0, 0\]$"),
            ("float", torch.ones(4), r"^lengths: expected integer item lengths, got torch\.float32$"),
            (
                "bool",
                torch.ones(4, dtype=torch.bool),
                r"^lengths: expected integer item lengths, got torch\.bool$",
            ),
            (
                "meta",
                torch.ones(4, dtype=torch.int32, device="meta"),
                r"^lengths: on meta, but the offsets are on cpu$",
            ),
        )
    ),
    *(
        row(f"packed_metadata-{label}", call(PackedMetadata, *args), pattern)
        for label, args, pattern in (
            (
                "offsets-list",
                ([0, 3], 16, 16),
                r"^offsets: expected a 1-D int32 tensor \(cu_seqlens\), got \[0, 3\]$",
            ),
            (
                "offsets-one-row",
                (torch.zeros(1, dtype=torch.int32), 16, 16),
                r"^offsets: expected 2 rows at least",
            ),
            (
                "max_seqlen-negative",
                (torch.zeros(4, dtype=torch.int32), -1, 16),
                r"^max_seqlen: expected an integer >= 0, got -1$",
            ),
            ("num_tokens-string", (torch.zeros(4, dtype=torch.int32), 16, "16"), r"^num_tokens: .*got '16'$"),
        )
    ),
    # -- ranks: timeouts torch cannot count (checked before any process group is looked for) --
    *(
        row(
            f"ranks-timeout-{label}",
            call(RankAgreement, timeout=value),
            rf"^timeout: expected a positive datetime\.timedelta of 1 ms to 365 days .*got {shown}$",
        )
        for label, value, shown in (
            ("max", datetime.timedelta.max, r"datetime\.timedelta\(days=999999999, .*"),
            ("a-million-days", datetime.timedelta(days=10**6), r"datetime\.timedelta\(days=1000000\)"),
            ("a-microsecond", datetime.timedelta(microseconds=1), r"datetime\.timedelta\(microseconds=1\)"),
        )
    ),
    # == examples ==
    # -- the encoder --
    *(
        row(f"encoder_config-{label}", call(EncoderConfig, **fields), pattern)
        for label, fields, pattern in (
            ("heads-not-dividing", {"hidden": 64, "heads": 5}, r"^heads: must divide hidden=64, got 5$"),
            (
                "hidden-2**40",
                {"hidden": 2**40},
                r"^hidden: expected an integer <= 1048576, got 1099511627776$",
            ),
            ("patch_dim-zero", {"patch_dim": 0}, r"^patch_dim: expected an integer >= 1, got 0$"),
            ("layers-float", {"layers": 2.0}, r"^layers: .*got 2\.0$"),
            (
                "dtype-int",
                {"dtype": torch.int32},
                r"^dtype: expected a floating torch\.dtype, got torch\.int32$",
            ),
        )
    ),
    row(
        "vit-config-none",
        call(ViTEncoder, None, PackedMetadataBuilder(_BUDGETS, device="cpu")),
        r"^config: expected an EncoderConfig, got None$",
    ),
    row(
        "vit-builder-budgets",
        call(ViTEncoder, EncoderConfig.small(), _BUDGETS),
        r"^builder: expected a PackedMetadataBuilder, got TokenBudgets\(",
    ),
    row(
        "vit-device-other-than-the-builders",
        call(ViTEncoder, EncoderConfig.small(), PackedMetadataBuilder(_BUDGETS, device="cpu"), device="meta"),
        r"^device: 'meta', but the builder's offsets are on cpu: ",
    ),
    row(
        "vit-device-mps",
        call(ViTEncoder, EncoderConfig.small(), PackedMetadataBuilder(_BUDGETS, device="cpu"), device="mps"),
        r"^device: expected a CUDA device or the CPU, got 'mps'$",
    ),
    *(
        row(
            f"encoder_runner-device-{label}",
            call(EncoderRunner, EncoderConfig.small(), _BUDGETS, device=device),
            pattern,
            *marks,
        )
        for label, device, pattern, marks in (
            (
                "cuda-7-without-cuda",
                "cuda:7",
                r"^device: 'cuda:7' is a CUDA device, but CUDA is not available here$",
                (NO_CUDA,),
            ),
            ("cuda-7-missing", "cuda:7", r"^device: 'cuda:7' does not exist", NO_CUDA_7),
            (
                "int-without-cuda",
                0,
                r"^device: 0 is a CUDA device, but CUDA is not available here$",
                (NO_CUDA,),
            ),
            ("mps", "mps", r"^device: expected a CUDA device or the CPU, got 'mps'$", ()),
        )
    ),
    row(
        "encoder_runner-budgets-list",
        call(EncoderRunner, EncoderConfig.small(), [16, 64], device="cpu"),
        r"^budgets: expected TokenBudgets, got \[16, 64\]$",
    ),
    row(
        "encoder_runner-config-none",
        call(EncoderRunner, None, _BUDGETS, device="cpu"),
        r"^config: expected an EncoderConfig, got None$",
    ),
    row(
        "encoder_runner-strict-string",
        call(EncoderRunner, EncoderConfig.small(), _BUDGETS, device="cpu", strict="yes"),
        r"^strict: expected True or False, got 'yes'$",
    ),
    *(
        row(f"encode-{label}", _encode(items), pattern)
        for label, items, pattern in (
            ("none", None, r"^items: expected a list or tuple of \[patches, patch_dim\] tensors, got None$"),
            ("a-tensor", torch.zeros(3, 48), r"^items: expected a list or tuple .*got tensor\("),
            (
                "wrong-width",
                [torch.zeros(3, 49)],
                r"^items\[0\]: expected \[patches, 48\], got shape \(3, 49\)$",
            ),
            (
                "wrong-dtype",
                [torch.zeros(3, 48, dtype=torch.float64)],
                r"^items\[0\]: expected torch\.float32 on cpu, got torch\.float64 on cpu$",
            ),
            (
                "empty-item",
                [torch.zeros(3, 48), torch.zeros(0, 48)],
                r"^items\[1\]: expected \[patches, 48\], got shape \(0, 48\)$",
            ),
            (
                "above-the-largest-budget",
                [torch.zeros(65, 48)],
                r"^items\[0\]: an item of 65 patches exceeds the largest budget 64; ",
            ),
            ("not-a-tensor", [[0.0] * 48], r"^items\[0\]: expected a tensor \[patches, 48\], got \[0\.0, "),
        )
    ),
    row(
        "encode_alone-1d",
        call(lambda item: _runner().encode_alone(item), torch.zeros(48)),
        r"^item: expected \[patches, 48\], got shape \(48,\)$",
    ),
    row(
        "eager_forward-lens-list",
        call(lambda: _runner().eager_forward(torch.zeros(8, 48), cast(torch.Tensor, [4, 4]))),
        r"^lens: expected a 1-D tensor of the items' lengths on cpu, got \[4, 4\]$",
    ),
    row(
        "eager_forward-lens-sum-past",
        call(lambda: _runner().eager_forward(torch.zeros(8, 48), _int32s(5, 7))),
        r"^item_lens: expected lengths >= 1 summing to the 8 tokens, got \[5, 7\]$",
    ),
    # The runner's default builder checks an eager step's lengths (issue 51: they ran, clamped, before).
    row(
        "encoder-run-item_lens-sum-past",
        _run_encoder(_int32s(5, 7)),
        r"^item_lens: expected lengths >= 1 summing to the 8 tokens, got \[5, 7\]$",
    ),
    row("encoder-run-item_lens-zero", _run_encoder(_int32s(0, 8)), r"^item_lens: .*got \[0, 8\]$"),
    row(
        "random_items-lengths-negative",
        call(random_items, EncoderConfig.small(), [3, -1], torch.Generator(), "cpu"),
        r"^lengths\[1\]: expected an integer >= 1, got -1$",
    ),
    row(
        "random_items-generator-none",
        call(random_items, EncoderConfig.small(), [3], None, "cpu"),
        r"^generator: expected a torch\.Generator, got None$",
    ),
    row(
        "random_items-device-mps",
        call(random_items, EncoderConfig.small(), [3], torch.Generator(), "mps"),
        r"^device: expected a CUDA device or the CPU, got 'mps'$",
    ),
    row(
        "encoder_static_inputs-none",
        call(encoder_static_inputs, None),
        r"^config: expected an EncoderConfig, got None$",
    ),
    # -- expert parallelism --
    *(
        row(
            f"moe_config-capacity_factor-{label}",
            call(MoeConfig, capacity_factor=value),
            rf"^capacity_factor: expected None or a finite number > 0, got {shown}$",
        )
        for label, value, shown in (
            ("inf", math.inf, "inf"),
            ("nan", math.nan, "nan"),
            ("zero", 0.0, r"0\.0"),
        )
    ),
    row(
        "moe_config-num_experts-2**40",
        call(MoeConfig, num_experts=2**40),
        r"^num_experts: expected an integer <= 1048576, got 1099511627776$",
    ),
    row(
        "moe-capacity-negative-tokens",
        call(MoeConfig(capacity_factor=1.0).capacity, -8, 2),
        r"^num_tokens: expected an integer >= 0, got -8$",
    ),
    row(
        "moe-capacity-exact-negative-tokens",
        call(MoeConfig().capacity, -8, 2),
        r"^num_tokens: expected an integer >= 0, got -8$",
    ),
    row(
        "moe-capacity-zero-ranks",
        call(MoeConfig(capacity_factor=1.0).capacity, 8, 0),
        r"^world_size: expected an integer >= 1, got 0$",
    ),
    row(
        "moe-capacity-ranks-not-sharing",
        call(MoeConfig().capacity, 8, 3),
        r"^world_size: 3 ranks cannot share num_experts=8 experts evenly$",
    ),
    row("moe-capacity-float-tokens", call(MoeConfig().capacity, 8.0, 2), r"^num_tokens: .*got 8\.0$"),
    row(
        "moe-buffer_bytes-hidden-zero",
        call(MoeConfig().buffer_bytes, 8, 2, 0, 4),
        r"^hidden_size: expected an integer >= 1, got 0$",
    ),
    row(
        "moe_weights-num_layers-zero",
        call(MoeWeights, _MOE, num_layers=0, hidden_size=16, vocab_size=32, device=None, dtype=torch.float32),
        r"^num_layers: expected an integer >= 1, got 0$",
    ),
    row(
        "moe_weights-dtype-int",
        call(MoeWeights, _MOE, num_layers=1, hidden_size=16, vocab_size=32, device=None, dtype=torch.int64),
        r"^dtype: expected a floating torch\.dtype, got torch\.int64$",
    ),
    row(
        "moe_weights-device-mps",
        call(
            MoeWeights, _MOE, num_layers=1, hidden_size=16, vocab_size=32, device="mps", dtype=torch.float32
        ),
        r"^device: expected a CUDA device or the CPU, got 'mps'$",
    ),
    row(  # before any collective: no process group is needed to be told
        "moe-layer-past-the-weights",
        call(lambda: ExpertParallelMoE(_moe_weights(), 2, _MOE, None)),
        r"^layer: expected an integer <= 1, got 2$",
    ),
    row(
        "moe-config-other-experts",
        call(lambda: ExpertParallelMoE(_moe_weights(), 0, MoeConfig(), None)),
        r"^config: num_experts=8, but the weights hold 4 experts$",
    ),
    row(
        "ep_decoder-weights-other-layers",
        call(lambda: ExpertParallelDecoder(ReferenceDecoder(DecoderConfig.small()), _moe_weights(), _MOE)),
        r"^weights: 2 layers of hidden size 16, but the decoder has 2 of 128$",
    ),
    # -- the paged example --
    row(
        "paged_layout-page_size-2**40",
        call(PagedLayout, 2**40, 4, 2),
        r"^page_size: expected an integer <= 1048576, got 1099511627776$",
    ),
    row(
        "paged_layout-num_pages-2**31",
        call(PagedLayout, 16, 2**31, 2),
        r"^num_pages: expected an integer <= 2147483647, got 2147483648$",
    ),
    row(
        "paged_buffers-layout-none",
        call(PagedBuffers, None, 8, 4, "cpu"),
        r"^layout: expected a PagedLayout, got None$",
    ),
    row(
        "paged_buffers-max_tokens-2**40",
        call(PagedBuffers, PagedLayout(8, 4, 2), 2**40, 4, "cpu"),
        r"^max_tokens: expected an integer <= 2147483646, got 1099511627776$",
    ),
    row(
        "paged_buffers-max_reqs-string",
        call(PagedBuffers, PagedLayout(8, 4, 2), 8, "4", "cpu"),
        r"^max_reqs: .*got '4'$",
    ),
    row(
        "paged_buffers-device-mps",
        call(PagedBuffers, PagedLayout(8, 4, 2), 8, 4, "mps"),
        r"^device: expected a CUDA device or the CPU, got 'mps'$",
    ),
    row(
        "paged_buffers-device-cuda-7",
        call(PagedBuffers, PagedLayout(8, 4, 2), 8, 4, "cuda:7"),
        r"^device: 'cuda:7' is a CUDA device, but CUDA is not available here$",
        NO_CUDA,
    ),
    row(
        "make_backend-dtype-string",
        call(make_backend, "gather", PagedLayout(8, 4, 2), "float32", max_tokens=8, max_reqs=4),
        r"^dtype: expected the model's floating torch\.dtype, got 'float32'$",
    ),
    row(
        "make_backend-layout-none",
        call(make_backend, "gather", None, torch.float32, max_tokens=8, max_reqs=4),
        r"^layout: expected a PagedLayout, got None$",
    ),
    row(
        "make_backend-device-cpu-1",
        call(
            make_backend,
            "gather",
            PagedLayout(8, 4, 2),
            torch.float32,
            max_tokens=8,
            max_reqs=4,
            device="cpu:1",
        ),
        r"^device: the CPU is one device",
    ),
    row(
        "paged-warm_up-2**40",
        call(lambda: _paged()[0].warm_up(2**40)),
        r"^max_tokens: expected an integer <= 1024, got 1099511627776$",
    ),
    row(
        "paged-warm_up-query_len-above",
        call(lambda: _paged()[0].warm_up(8, query_len=16)),
        r"^query_len: expected an integer <= 8, got 16$",
    ),
    row(
        "paged-step-none",
        call(lambda: _paged()[0].step(cast(dict[str, torch.Tensor], None))),
        r"^inputs: expected a mapping of \['input_ids', .*got None$",
    ),
    row(
        "paged-step-missing",
        call(lambda: _paged()[0].step({"input_ids": torch.zeros(1, dtype=torch.int64)})),
        r"^inputs: expected a mapping of \['input_ids', ",
    ),
    row(
        "paged-step-uniform_decode-int",
        call(lambda: _paged()[0].step(_paged()[2], uniform_decode=cast(bool, 0))),
        r"^uniform_decode: expected True or False, got 0$",
    ),
    # Issue 51: checked in forward, after the step was copied into the static buffers; now in build.
    *(
        row(
            f"paged-run-input_ids-{label}",
            _paged_run_with_token(token),
            rf"^input_ids: expected token ids in \[0, 512\), got \[{token}\]$",
        )
        for label, token in (("vocab", 512), ("negative", -1), ("2**40", 2**40))
    ),
    # -- the reference decoder and the random inputs --
    row(
        "decoder_config-hidden_size-2**40",
        call(DecoderConfig, hidden_size=2**40),
        r"^hidden_size: expected an integer <= 1048576, got 1099511627776$",
    ),
    row(
        "reference-device-mps",
        call(ReferenceDecoder, DecoderConfig.small(), device="mps"),
        r"^device: expected a CUDA device or the CPU, got 'mps'$",
    ),
    row(
        "reference-device-cpu-1",
        call(ReferenceDecoder, DecoderConfig.small(), device="cpu:1"),
        r"^device: the CPU is one device",
    ),
    row("static_inputs-none", call(static_inputs, None), r"^config: expected a DecoderConfig, got None$"),
    row(
        "make_step_inputs-num_tokens-string",
        call(make_step_inputs, DecoderConfig.small(), "4", uniform_decode=False),
        r"^num_tokens: .*got '4'$",
    ),
    row(
        "make_step_inputs-uniform_decode-int",
        call(make_step_inputs, DecoderConfig.small(), 4, uniform_decode=1),
        r"^uniform_decode: expected True or False, got 1$",
    ),
    row(
        "make_step_inputs-device-mps",
        call(make_step_inputs, DecoderConfig.small(), 4, uniform_decode=False, device="mps"),
        r"^device: expected a CUDA device or the CPU, got 'mps'$",
    ),
    row(
        "make_step_inputs-generator-int",
        call(make_step_inputs, DecoderConfig.small(), 4, uniform_decode=False, generator=3),
        r"^generator: expected a torch\.Generator or None, got 3$",
    ),
    row(
        "request_lengths-query_len-zero",
        call(request_lengths, DecoderConfig.small(), 4, uniform_decode=True, query_len=0),
        r"^query_len: expected an integer >= 1, got 0$",
    ),
    row(
        "tensor_parallel-full-none",
        call(lambda: TensorParallelDecoder(cast(ReferenceDecoder, None))),
        r"^full: expected a ReferenceDecoder, got None$",
    ),
    row(
        "check_shards-world_size-zero",
        call(check_shards, DecoderConfig.small(), 0),
        r"^world_size: expected an integer >= 1, got 0$",
    ),
    row(
        "check_shards-config-none",
        call(check_shards, None, 2),
        r"^config: expected a DecoderConfig, got None$",
    ),
    row(
        "compile_decoder-model-none",
        call(lambda: compile_decoder(cast(ReferenceDecoder, None))),
        r"^model: expected a ReferenceDecoder, got None$",
    ),
    row(
        "kv_sizing-start_up-margin-negative",
        call(lambda: kv_sizing_start_up(construct()(), ReferenceDecoder(DecoderConfig.small()), -1)),
        r"^margin_bytes: expected an integer >= 0, got -1$",
    ),
    row(
        "make_paged_inputs-layout-none",
        call(make_paged_inputs, DecoderConfig.small(), None, 4, uniform_decode=False),
        r"^layout: expected a PagedLayout, got None$",
    ),
]


BAD_INPUTS: Final = [
    # == cudagraph_dispatch ==
    # -- CUDAGraphMode --
    row("parse-not-a-string", call(M.parse, 5), r"text.*5"),
    row("parse-unknown-name", call(M.parse, "bogus"), r"text.*'bogus'"),
    row("has_mode-string", call(M.FULL.has_mode, "FULL"), r"mode.*'FULL'"),
    row("has_mode-config-mode", call(M.FULL.has_mode, M.FULL_DECODE_ONLY), r"mode.*FULL_DECODE_ONLY"),
    # -- BatchDescriptor --
    row("descriptor-negative-tokens", call(BatchDescriptor, -5, "x"), r"num_tokens.*-5"),
    row("descriptor-bool-tokens", call(BatchDescriptor, True), r"num_tokens.*True"),
    row("descriptor-float-tokens", call(BatchDescriptor, 2.0), r"num_tokens.*2\.0"),
    row("descriptor-string-reqs", call(BatchDescriptor, 5, "x"), r"num_reqs.*'x'"),
    row("descriptor-zero-reqs", call(BatchDescriptor, 5, 0), r"num_reqs.*0"),
    row("descriptor-reqs-above-tokens", call(BatchDescriptor, 4, 8), r"num_reqs: 8 requests for 4 tokens"),
    row("descriptor-string-uniform", call(BatchDescriptor, 5, uniform="yes"), r"uniform.*'yes'"),
    row("descriptor-int-has_lora", call(BatchDescriptor, 5, has_lora=1), r"has_lora.*1"),
    row("descriptor-negative-loras", call(BatchDescriptor, 5, num_active_loras=-1), r"num_active_loras.*-1"),
    # The newcomer's 9: contradictions that named graphs which can never exist.
    row(
        "descriptor-loras-without-has_lora",
        call(BatchDescriptor, 8, has_lora=False, num_active_loras=2),
        r"num_active_loras: 2 active adapters with has_lora=False",
    ),
    row(
        "descriptor-uniform-without-reqs",
        call(BatchDescriptor, 8, uniform=True),
        r"uniform: a uniform key names its request count \(num_reqs\)",
    ),
    # -- CaptureSizes --
    row("sizes-int", call(CaptureSizes, 5), r"capture_sizes.*5"),
    row("sizes-none", call(CaptureSizes, None), r"capture_sizes.*None"),
    row("sizes-string", call(CaptureSizes, "48"), r"capture_sizes.*'48'"),
    row("sizes-empty", call(CaptureSizes, []), r"capture_sizes.*\[\]"),
    row("sizes-zero", call(CaptureSizes, [1, 0]), r"capture_sizes\[1\].*0"),
    row("sizes-bool", call(CaptureSizes, [8, True]), r"capture_sizes\[1\].*True"),
    row("sizes-float", call(CaptureSizes, [2.5]), r"capture_sizes\[0\].*2\.5"),
    row(
        "sizes-2**40",
        call(CaptureSizes, [8, 2**40]),
        r"capture_sizes\[1\]: expected an integer <= 1048576, got 1099511627776",
    ),
    row("sizes-2**63", call(CaptureSizes, [2**63]), r"capture_sizes\[0\]: expected an integer <= 1048576"),
    row("default-zero", call(CaptureSizes.default, 0), r"max_size.*0"),
    row(
        "default-10**9",
        call(CaptureSizes.default, 10**9),
        r"max_size: expected an integer <= 1048576, got 1000000000",
    ),
    row("default-bool", call(CaptureSizes.default, True), r"max_size.*True"),
    row("default-string", call(CaptureSizes.default, "512"), r"max_size.*'512'"),
    row("pad-bool", call(SIZES.pad, True), r"^n: .*True"),
    row("pad-float", call(SIZES.pad, 2.5), r"^n: .*2\.5"),
    row("pad-string", call(SIZES.pad, "3"), r"^n: .*'3'"),
    row("pad-negative", call(SIZES.pad, -1), r"^n: .*-1"),
    # -- DispatchConfig --
    row("config-mode-string", call(DispatchConfig, "FULL", SIZES, 8), r"mode.*'FULL'"),
    row("config-sizes-list", call(DispatchConfig, M.FULL, [1, 2], 8), r"capture_sizes.*\[1, 2\]"),
    row("config-max_num_seqs-zero", call(DispatchConfig, M.FULL, SIZES, 0), r"max_num_seqs.*0"),
    row("config-max_num_seqs-bool", call(DispatchConfig, M.FULL, SIZES, True), r"max_num_seqs.*True"),
    row("config-max_num_seqs-string", call(DispatchConfig, M.FULL, SIZES, "4"), r"max_num_seqs.*'4'"),
    row("config-query_len-zero", call(DispatchConfig, M.FULL, SIZES, 8, 0), r"uniform_decode_query_len.*0"),
    row("config-lora_counts-int", call(DispatchConfig, M.FULL, SIZES, 8, 1, 3), r"lora_counts.*3"),
    row("config-lora_counts-zero", call(DispatchConfig, M.FULL, SIZES, 8, 1, (0,)), r"lora_counts.*0"),
    row("config-lora_counts-float", call(DispatchConfig, M.FULL, SIZES, 8, 1, (1.5,)), r"lora_counts.*1\.5"),
    # Issue 33: accepted before, a max_num_seqs no static buffer could have and a LoRA count no batch can.
    row(
        "config-max_num_seqs-10**12",
        call(DispatchConfig, M.FULL, SIZES, 10**12),
        r"^max_num_seqs: expected an integer <= 1048576, got 1000000000000$",
    ),
    row(
        "config-lora_counts-10**9",
        call(DispatchConfig, M.FULL, SIZES, 8, 1, (1, 10**9)),
        r"^lora_counts\[1\]: expected at most max_num_seqs=8 active adapters .*got 1000000000$",
    ),
    row(
        "config-lora_counts-above-max_num_seqs",
        call(DispatchConfig, M.FULL, SIZES, 4, 1, (5,)),
        r"^lora_counts\[0\]: expected at most max_num_seqs=4 .*got 5$",
    ),
    row(
        "config-query_len-10**12",
        call(DispatchConfig, M.FULL, SIZES, 8, 10**12),
        r"^uniform_decode_query_len: expected an integer <= 1048576, got 1000000000000$",
    ),
    # -- CUDAGraphDispatcher --
    row("dispatcher-no-config", call(CUDAGraphDispatcher, None), r"config.*None"),
    row(  # issue 33: named resolve_mode's "strict" before
        "dispatcher-strict_attention-string",
        call(CUDAGraphDispatcher, DispatchConfig(M.FULL, SIZES, 8), strict_attention="yes"),
        r"^strict_attention: expected True or False, got 'yes'$",
    ),
    row(  # issue 33: a TypeError from list(None) before
        "weakest-none", call(AttentionSupport.weakest, None), r"^supports: expected an iterable .*got None$"
    ),
    row(
        "weakest-one-support",
        call(AttentionSupport.weakest, AttentionSupport()),
        r"^supports: expected an iterable .*got AttentionSupport\(",
    ),
    row("keys-string", call(DISPATCHER.keys, "FULL"), r"mode.*'FULL'"),
    row("keys-config-mode", call(DISPATCHER.keys, M.FULL_AND_PIECEWISE), r"mode.*FULL_AND_PIECEWISE"),
    row("dispatch-negative", call(DISPATCHER.dispatch, -1), r"num_tokens.*-1"),
    row("dispatch-bool-tokens", call(DISPATCHER.dispatch, True), r"num_tokens.*True"),
    row("dispatch-float-tokens", call(DISPATCHER.dispatch, 2.5), r"num_tokens.*2\.5"),
    row("dispatch-string-tokens", call(DISPATCHER.dispatch, "3"), r"num_tokens.*'3'"),
    row(
        "dispatch-string-uniform", call(DISPATCHER.dispatch, 3, uniform_decode="no"), r"uniform_decode.*'no'"
    ),
    row("dispatch-int-uniform", call(DISPATCHER.dispatch, 3, uniform_decode=1), r"uniform_decode.*1"),
    row("dispatch-none-uniform", call(DISPATCHER.dispatch, 3, uniform_decode=None), r"uniform_decode.*None"),
    row(
        "dispatch-negative-loras", call(DISPATCHER.dispatch, 3, num_active_loras=-1), r"num_active_loras.*-1"
    ),
    row(
        "dispatch-bool-loras", call(DISPATCHER.dispatch, 3, num_active_loras=True), r"num_active_loras.*True"
    ),
    row(
        "dispatch-invalid_modes-set",
        call(DISPATCHER.dispatch, 3, invalid_modes={M.FULL}),
        r"invalid_modes.*\{<CUDAGraphMode\.FULL",
    ),
    row(
        "dispatch-invalid_modes-none-mode",
        call(DISPATCHER.dispatch, 3, invalid_modes=frozenset({M.NONE})),
        r"invalid_modes.*NONE",
    ),
    row(
        "dispatch-invalid_modes-string",
        call(DISPATCHER.dispatch, 3, invalid_modes="FULL"),
        r"invalid_modes.*'FULL'",
    ),
    # Issue 33: a uniform batch of 5 tokens with q=2 got the 8-token, 4-request graph.
    *(
        row(
            f"{name}-uniform-not-a-multiple-of-q",
            call(method, 5, uniform_decode=True),
            r"^num_tokens: a uniform decode batch has a multiple of uniform_decode_query_len=2 .*got 5$",
        )
        for name, method in (
            ("dispatch", QUERY_LEN_2.dispatch),
            ("route", QUERY_LEN_2.route),
            ("explain", QUERY_LEN_2.explain),
        )
    ),
    row(
        "dispatch-uniform-above-sizes-not-a-multiple-of-q",
        call(QUERY_LEN_2.dispatch, 11, uniform_decode=True),
        r"^num_tokens: .*uniform_decode_query_len=2 .*got 11$",
    ),
    row("explain-negative", call(DISPATCHER.explain, -1), r"num_tokens.*-1"),
    row("explain-string-uniform", call(DISPATCHER.explain, 3, uniform_decode="no"), r"uniform_decode.*'no'"),
    # -- set_forward_context --
    row("context-mode-string", call(set_forward_context, "FULL", KEY), r"runtime_mode.*'FULL'"),
    row(
        "context-config-mode",
        call(set_forward_context, M.FULL_AND_PIECEWISE, KEY),
        r"runtime_mode.*FULL_AND_PIECEWISE",
    ),
    row("context-graph-without-key", call(set_forward_context, M.FULL, None), r"batch_descriptor.*None"),
    row("context-key-tuple", call(set_forward_context, M.FULL, (8,)), r"batch_descriptor.*\(8,\)"),
    # -- data parallelism --
    row("rank-negative-tokens", call(RankRequest, -1), r"num_tokens.*-1"),
    row("rank-bool-tokens", call(RankRequest, True), r"num_tokens.*True"),
    row("rank-string-uniform", call(RankRequest, 4, uniform_decode="yes"), r"uniform_decode.*'yes'"),
    row("rank-negative-loras", call(RankRequest, 4, num_active_loras=-2), r"num_active_loras.*-2"),
    row("ranks-ints", call(agree_across_ranks, DISPATCHER, [5, 7]), r"requests\[0\].*5"),
    row("ranks-not-a-sequence", call(agree_across_ranks, DISPATCHER, 5), r"requests.*5"),
    row("ranks-none", call(agree_across_ranks, DISPATCHER, []), r"requests.*\[\]"),
    # The newcomer's 7: a bare AttributeError before.
    row(
        "ranks-no-dispatcher", call(agree_across_ranks, None, [RankRequest(3)]), r"dispatcher: expected.*None"
    ),
    row(
        "ranks-invalid_modes-string",
        call(agree_across_ranks, DISPATCHER, [RankRequest(3)], invalid_modes="FULL"),
        r"invalid_modes.*'FULL'",
    ),
    row(
        "ranks-uniform-not-a-multiple-of-q",
        call(agree_across_ranks, QUERY_LEN_2, [RankRequest(4, True), RankRequest(0), RankRequest(5, True)]),
        r"^requests\[2\]\.num_tokens: .*uniform_decode_query_len=2 .*got 5$",
    ),
    row(  # checked even where another rank already sends every rank eager (1000 tokens: no graph)
        "ranks-uniform-not-a-multiple-of-q-after-an-eager-rank",
        call(agree_across_ranks, QUERY_LEN_2, [RankRequest(1000), RankRequest(5, True)]),
        r"^requests\[1\]\.num_tokens: .*got 5$",
    ),
    # Issue 39: accepted silently before.
    row(
        "sizes-dict",
        call(CaptureSizes, {1: "a", 8: "b"}),
        r"^capture_sizes: expected .*got \{1: 'a', 8: 'b'\}$",
    ),
    row(
        "sizes-mapping-proxy",
        call(CaptureSizes, MappingProxyType({8: 8})),
        r"^capture_sizes: expected .*got mappingproxy\(\{8: 8\}\)$",
    ),
    row("sizes-bytes", call(CaptureSizes, b"\x08"), r"^capture_sizes: .*got b'\\x08'$"),
    row("sizes-string-element", call(CaptureSizes, (1, "8")), r"^capture_sizes\[1\]: .*got '8'$"),
    row("sizes-none-element", call(CaptureSizes, iter([8, None])), r"^capture_sizes\[1\]: .*got None$"),
    row(
        "weakest-dict",
        call(AttentionSupport.weakest, {AttentionSupport(): "flash"}),
        r"^supports: expected .*got \{AttentionSupport\(",
    ),
    row(
        "descriptor-uniform-tokens-not-a-multiple-of-reqs",
        call(BatchDescriptor, 5, 2, uniform=True),
        r"^uniform: a uniform key's 5 tokens do not split evenly over num_reqs=2 requests ",
    ),
    row(
        "descriptor-uniform-7-over-3",
        call(BatchDescriptor, 7, 3, True, True, 1),
        r"^uniform: .*7 tokens .*num_reqs=3",
    ),
    *(
        row(
            f"{name}-uniform-above-max_num_seqs",
            call(method, *args, uniform_decode=True),
            rf"^num_tokens: a uniform decode batch of {args[0]} tokens is {args[0] // q} requests "
            rf"\(num_reqs = num_tokens / uniform_decode_query_len={q}\), above max_num_seqs={m}$",
        )
        for name, method, args, q, m in (
            ("dispatch", WIDE.dispatch, (16,), 1, 8),
            ("route", WIDE.route, (9,), 1, 8),
            ("explain", WIDE.explain, (32,), 1, 8),
            ("dispatch-above-sizes", WIDE.dispatch, (40,), 1, 8),
            ("dispatch-q-2", QUERY_LEN_2.dispatch, (10,), 2, 4),
            ("dispatch-mode-none", WIDE_NONE.dispatch, (9,), 1, 8),
        )
    ),
    *(
        row(
            f"{name}-more-adapters-than-tokens",
            call(method, *args, num_active_loras=loras),
            rf"^num_active_loras: {loras} active adapters for {tokens} tokens; a request runs one adapter "
            r"and has at least one token$",
        )
        for name, method, args, loras, tokens in (
            ("dispatch", DISPATCHER.dispatch, (2,), 4, 2),
            ("route", DISPATCHER.route, (2, False), 4, 2),
            ("explain", DISPATCHER.explain, (1,), 4, 1),
            ("dispatch-empty", DISPATCHER.dispatch, (0,), 1, 0),
            ("rank-request", RankRequest, (3, False), 5, 3),
        )
    ),
    row(
        "dispatch-uniform-more-adapters-than-requests",
        call(QUERY_LEN_2.dispatch, 4, uniform_decode=True, num_active_loras=3),
        r"^num_active_loras: 3 active adapters for a uniform decode batch of 2 requests \(4 tokens\)",
    ),
    row(
        "route-uniform-more-adapters-than-requests",
        call(QUERY_LEN_2.route, 8, True, 5),
        r"^num_active_loras: 5 active adapters for a uniform decode batch of 4 requests \(8 tokens\)",
    ),
    row(
        "dispatch-more-adapters-than-max_num_seqs",
        call(WIDE.dispatch, 32, num_active_loras=9),
        r"^num_active_loras: 9 active adapters, above max_num_seqs=8 ",
    ),
    row(
        "ranks-uniform-above-max_num_seqs",
        call(agree_across_ranks, WIDE, [RankRequest(4, True), RankRequest(12, True)]),
        r"^requests\[1\]\.num_tokens: a uniform decode batch of 12 tokens is 12 requests",
    ),
    row(
        "ranks-more-adapters-than-max_num_seqs",
        call(agree_across_ranks, WIDE, [RankRequest(4), RankRequest(30, num_active_loras=10)]),
        r"^requests\[1\]\.num_active_loras: 10 active adapters, above max_num_seqs=8 ",
    ),
    # -- the shared checks --
    row("check_int-bool", call(check_int, "size", True, minimum=0), r"size.*True"),
    row("check_int-below", call(check_int, "size", -1, minimum=0), r"size.*>= 0.*-1"),
    row("check_int-string", call(check_int, "size", "3", minimum=0), r"size.*'3'"),
    row("check_bool-string", call(check_bool, "flag", "no"), r"flag.*'no'"),
    row("check_bool-int", call(check_bool, "flag", 1), r"flag.*1"),
    row("check_bool-none", call(check_bool, "flag", None), r"flag.*None"),
    # == cudagraph_capture ==
    # -- CaptureOptions --
    row(
        "options-weak_ref_output-string", call(CaptureOptions, weak_ref_output="no"), r"weak_ref_output.*'no'"
    ),
    row("options-gc_disable-int", call(CaptureOptions, gc_disable=1), r"gc_disable.*got 1$"),
    row(
        "options-check_input_addresses-string",
        call(CaptureOptions, check_input_addresses="yes"),
        r"check_input_addresses.*'yes'",
    ),
    row("options-warmup_runs-negative", call(CaptureOptions, warmup_runs=-1), r"warmup_runs.*-1"),
    row("options-warmup_runs-bool", call(CaptureOptions, warmup_runs=True), r"warmup_runs.*True"),
    row("options-pool-int", call(CaptureOptions, pool=3), r"pool.*3"),
    # Issue 33: a made-up handle was accepted (a handle is a plain tuple: torch must have made it).
    row("options-pool-made-up", call(CaptureOptions, pool=(0, 1)), r"^pool: .*\(0, 1\)", NO_CUDA),
    row(
        "options-pool-never-issued",
        call(CaptureOptions, pool=(0, 2**62)),
        r"^pool: .*\(0, 4611686018427387904\)",
    ),
    row("options-pool-both-ids", call(CaptureOptions, pool=(3, 4)), r"^pool: .*\(3, 4\)"),
    row(
        "breakable-capture-pool-made-up",
        call(BreakableCUDAGraphCapture, pool=(0, 1)),
        r"^pool: .*\(0, 1\)",
        NO_CUDA,
    ),
    row("options-stream-int", call(CaptureOptions, stream=5), r"stream.*5"),
    # -- the wrappers --
    row("wrapper-mode-none", call(CUDAGraphWrapper, _identity, M.NONE), r"runtime_mode.*NONE"),
    row(
        "wrapper-config-mode",
        call(CUDAGraphWrapper, _identity, M.FULL_AND_PIECEWISE),
        r"runtime_mode.*FULL_AND_PIECEWISE",
    ),
    row("wrapper-mode-string", call(CUDAGraphWrapper, _identity, "FULL"), r"runtime_mode.*'FULL'"),
    row("wrapper-runnable-int", call(CUDAGraphWrapper, 5, M.FULL), r"runnable.*5"),
    row("wrapper-options-dict", call(CUDAGraphWrapper, _identity, M.FULL, options={}), r"options.*\{\}"),
    row("breakable-wrapper-runnable-int", call(BreakableCUDAGraphWrapper, 5), r"runnable.*5"),
    row(
        "breakable-wrapper-options-int", call(BreakableCUDAGraphWrapper, _identity, options=3), r"options.*3"
    ),
    row(
        "wrapper-capture-int-descriptor",
        call(CUDAGraphWrapper(_identity, M.FULL).capture, 8, torch.zeros(1)),
        r"descriptor.*got 8$",
    ),
    # Issue 33: on a CPU these said "needs a CUDA device", not what was wrong with the arguments.
    *(
        row(
            f"{name}-inputs-list",
            call(method, KEY, [torch.zeros(1)]),
            r"^inputs: expected a mapping .*got \[",
        )
        for name, method in (
            ("wrapper-warm_up", CUDAGraphWrapper(_identity, M.FULL).warm_up),
            ("wrapper-record", CUDAGraphWrapper(_identity, M.FULL).record),
            ("breakable-wrapper-warm_up", BreakableCUDAGraphWrapper(_identity).warm_up),
            ("breakable-wrapper-record", BreakableCUDAGraphWrapper(_identity).record),
        )
    ),
    row(
        "wrapper-warm_up-inputs-not-tensors",
        call(CUDAGraphWrapper(_identity, M.FULL).warm_up, KEY, {"x": [1.0, 2.0]}),
        r"^inputs\['x'\]: expected a torch.Tensor, got list$",
    ),
    row(
        "wrapper-warm_up-inputs-int-key",
        call(CUDAGraphWrapper(_identity, M.FULL).warm_up, KEY, {0: torch.zeros(1)}),
        r"^inputs: expected keyword names \(str\), got 0$",
    ),
    row(
        "wrapper-warm_up-descriptor-before-inputs",
        call(CUDAGraphWrapper(_identity, M.FULL).warm_up, 8, None),
        r"^descriptor: .*got 8$",
    ),
    row(
        "breakable-wrapper-capture-int-descriptor",
        call(BreakableCUDAGraphWrapper(_identity).capture, 8, torch.zeros(1)),
        r"descriptor.*got 8$",
    ),
    # -- BreakableCUDAGraphCapture, eager breaks, the collector, the capture switch --
    row(
        "breakable-capture-gc_disable-string",
        call(BreakableCUDAGraphCapture, gc_disable="no"),
        r"gc_disable.*'no'",
    ),
    row("breakable-capture-pool-int", call(BreakableCUDAGraphCapture, pool=3), r"pool.*3"),
    row("breakable-capture-stream-string", call(BreakableCUDAGraphCapture, stream="side"), r"stream.*'side'"),
    row("breakable-capture-descriptor-int", call(BreakableCUDAGraphCapture, descriptor=8), r"descriptor.*8"),
    row("eager_break-not-callable", call(eager_break_during_capture, 5), r"fn.*5"),
    row("collector_paused-string", call(_collector_paused, "no"), r"gc_disable.*'no'"),
    row("set_capture_enabled-string", call(set_capture_enabled, "no"), r"flag.*'no'"),
    # Issue 39: a descriptor that is not one was a KeyError, or accepted (False, None, nothing).
    *(
        row(
            f"{name}-{label}",
            call(method, value),
            rf"^descriptor: expected a BatchDescriptor, got {pattern}$",
        )
        for name, method in (
            ("wrapper-replay", CUDAGraphWrapper(_identity, M.FULL).replay),
            ("wrapper-is_captured", CUDAGraphWrapper(_identity, M.FULL).is_captured),
            ("wrapper-discard", CUDAGraphWrapper(_identity, M.PIECEWISE).discard),
            ("breakable-wrapper-replay", BreakableCUDAGraphWrapper(_identity).replay),
            ("breakable-wrapper-is_captured", BreakableCUDAGraphWrapper(_identity).is_captured),
            ("breakable-wrapper-discard", BreakableCUDAGraphWrapper(_identity).discard),
            ("breakable-wrapper-capture_for", BreakableCUDAGraphWrapper(_identity).capture_for),
        )
        for label, value, pattern in (
            ("int", 2, "2"),
            ("list", [8], r"\[8\]"),
            ("none", None, "None"),
            ("tuple", (8, None), r"\(8, None\)"),
        )
    ),
    row(
        "check_capture_enabled-string",
        call(check_capture_enabled, "x"),
        r"^descriptor: expected None or a BatchDescriptor, got 'x'$",
    ),
    row(
        "check_capture_enabled-int",
        call(check_capture_enabled, 8),
        r"^descriptor: expected None or a BatchDescriptor, got 8$",
    ),
    # -- devices --
    row("resolve_device-bool", call(resolve_device, True), r"device.*True"),
    row("resolve_device-unknown-string", call(resolve_device, "gpu"), r"device.*'gpu'"),
    row("resolve_device-negative-index", call(resolve_device, -1), r"device.*-1"),
    # Issue 33: a meta device was accepted, and a manager on it built buffers that hold no data.
    row(
        "resolve_device-meta",
        call(resolve_device, "meta"),
        r"^device: expected a CUDA device or the CPU, got 'meta'$",
    ),
    row(
        "resolve_device-meta-device",
        call(resolve_device, torch.device("meta")),
        r"^device: expected a CUDA device or the CPU, got device\(type='meta'\)$",
    ),
    row(
        "resolve_device-cuda-7-without-cuda",
        call(resolve_device, "cuda:7"),
        r"device: 'cuda:7' is a CUDA device, but CUDA is not available here",
        NO_CUDA,
    ),
    row(
        "resolve_device-cuda-7-missing",
        call(resolve_device, "cuda:7"),
        r"device: 'cuda:7' does not exist; this machine has \d+ CUDA device",
        *NO_CUDA_7,
    ),
    # Issue 39: the CPU with an index other than 0 was accepted (its tensors are on 'cpu').
    row(
        "resolve_device-cpu-1",
        call(resolve_device, "cpu:1"),
        r"^device: the CPU is one device, 'cpu' \(or 'cpu:0'\), got 'cpu:1'$",
    ),
    row(
        "resolve_device-cpu-device-3",
        call(resolve_device, torch.device("cpu", 3)),
        r"^device: the CPU is one device, .*got device\(type='cpu', index=3\)$",
    ),
    row("resolve_device-float", call(resolve_device, 0.0), r"^device: expected a torch.device, .*got 0\.0$"),
    row(
        "resolve_device-bytes",
        call(resolve_device, b"cpu"),
        r"^device: expected a torch.device, .*got b'cpu'$",
    ),
    row(
        "resolve_device-upper-case",
        call(resolve_device, "CPU"),
        r"^device: expected a torch.device, .*'CPU'$",
    ),
    row(
        "resolve_device-mps",
        call(resolve_device, "mps"),
        r"^device: expected a CUDA device or the CPU, got 'mps'$",
    ),
    row("shared_pool-cpu", call(shared_pool, "cpu"), r"device: expected a CUDA device, got 'cpu'"),
    row(
        "release_graph_memory-cpu",
        call(release_graph_memory, "cpu"),
        r"device: expected a CUDA device, got 'cpu'",
    ),
    row("capture_stream-cpu", call(capture_stream, "cpu"), r"device: expected a CUDA device, got 'cpu'"),
    # -- ReservedMemory (issue 48) --
    row("reserved-size-zero", call(ReservedMemory, 0), r"^size: expected an integer >= 1, got 0$"),
    row("reserved-size-bool", call(ReservedMemory, True), r"^size: expected an integer >= 1, got True$"),
    row(
        "reserved-fallback_size-negative",
        call(ReservedMemory, 16, fallback_size=-1),
        r"^fallback_size: expected an integer >= 0, got -1$",
    ),
    row("reserved-device-meta", call(ReservedMemory, 16, device="meta"), r"^device: .*'meta'$"),
    row(
        "reserved-view-past-the-reservation",
        lambda: _reserved().view(torch.float32, (5,)),
        r"^shape: \[5\] of torch.float32 from offset 0 ends at byte 20, past the reservation's 16$",
    ),
    row(
        "reserved-view-offset-unaligned",
        lambda: _reserved().view(torch.float32, (1,), offset=2),
        r"^offset: 2 is not a multiple of torch.float32's 4 bytes$",
    ),
    row("reserved-view-dtype-string", lambda: _reserved().view("f4", (1,)), r"^dtype: .*'f4'$"),  # type: ignore[arg-type]
    row(
        "reserved-back-past-the-reservation",
        lambda: _reserved().back(17),
        r"^nbytes: 17 is more than the reservation's 16 bytes$",
    ),
    row("reserved-second-close", _closed_twice, r"^close: this ReservedMemory is closed$"),
    # == cudagraph_manager ==
    # -- CUDAGraphManager (on the CPU, with fake engines) --
    row("manager-model-int", construct(model=3), re.escape("model: expected a callable, got 3")),
    # Issue 39, the class of engine_factory=object: a callable that cannot be the model.
    row(
        "manager-model-class",
        construct(model=ToyModel),
        r"^model: expected the model to call \(an instance or a function\), got the class ToyModel; "
        r"pass an instance \(ToyModel\(\.\.\.\)\)$",
    ),
    row(
        "manager-model-without-an-input",
        construct(model=lambda ids, x, scale: x),
        r"^model: cannot take the inputs as keywords \(ids, x, scale, bias\): got an unexpected keyword "
        r"argument 'bias'$",
    ),
    row(
        "manager-model-positional-only",
        construct(model=_identity),
        r"^model: cannot take the inputs as keywords \(ids, x, scale, bias\): ",
    ),
    row(
        "manager-module-forward-without-an-input",
        construct(model=nn.Linear(2, 2)),
        r"^model: cannot take the inputs as keywords \(ids, x, scale, bias\): ",
    ),
    row(
        "manager-config-string",
        construct(config="FULL"),
        re.escape("config: expected a DispatchConfig, got 'FULL'"),
    ),
    row(
        "manager-inputs-empty",
        construct(inputs={}),
        re.escape("inputs: expected a non-empty mapping of names to StaticInput, got {}"),
    ),
    row(
        "manager-inputs-list",
        construct(inputs=[StaticInput()]),
        re.escape("inputs: expected a non-empty mapping of names to StaticInput, got [StaticInput("),
    ),
    row(
        "manager-input-name-not-an-identifier",
        construct(inputs={"input ids": StaticInput()}),
        re.escape("inputs: names are passed as keywords, so must be identifiers, got 'input ids'"),
    ),
    row(
        "manager-input-name-int",
        construct(inputs={3: StaticInput()}),
        re.escape("inputs: names are passed as keywords, so must be identifiers, got 3"),
    ),
    row(
        "manager-input-name-reserved",
        construct(inputs={"x": StaticInput(), "uniform_decode": StaticInput()}),
        re.escape("inputs['uniform_decode']: the name is a keyword of run() itself"),
    ),
    row(
        "manager-static-buffer-beyond-memory",
        construct(
            inputs={"ids": StaticInput((), torch.int64), "x": StaticInput((10**12,))}, model=_two_inputs
        ),
        r"inputs\['x'\]: its static buffer \[\d+, 1000000000000\] of torch.float32 needs \d+ bytes, "
        r"more than",
    ),
    row(
        "manager-input-spec-tuple",
        construct(inputs={"x": (DIM,)}),
        re.escape(f"inputs['x']: expected a StaticInput, got ({DIM},)"),
    ),
    row(
        "manager-inputs-without-tokens",
        construct(inputs={"s": StaticInput(rows="reqs"), "b": StaticInput(rows=None)}),
        re.escape("inputs: at least one input needs rows='tokens'"),
    ),
    row("manager-strict-int", construct(strict=1), re.escape("strict: expected True or False, got 1")),
    row(
        "manager-options-dict",
        construct(options={"gc_disable": True}),
        re.escape("options: expected ManagerOptions or None, got {'gc_disable': True}"),
    ),
    row(
        "manager-options-capture-options",
        construct(options=CaptureOptions(gc_disable=False)),
        r"^options: expected ManagerOptions or None, "
        r"got CaptureOptions\(weak_ref_output=True, gc_disable=False.*; "
        r"CaptureOptions go in ManagerOptions\(capture=\.\.\.\)$",
    ),
    row(
        "manager-options-capture-dict",
        construct(fields={"capture": {"gc_disable": True}}),
        re.escape("options.capture: expected CaptureOptions or None, got {'gc_disable': True}"),
    ),
    row(
        "manager-device-meta",
        construct(device="meta"),
        re.escape("device: expected a CUDA device or the CPU, got 'meta'"),
    ),
    row(
        "manager-device-unknown-string",
        construct(device="gpu7"),
        re.escape("device: expected a torch.device, a device string or a CUDA index, got 'gpu7'"),
    ),
    *(
        row(
            f"manager-device-{device}-without-cuda",
            construct(device=device),
            re.escape(f"device: {device!r} is a CUDA device, but CUDA is not available here"),
            NO_CUDA,
        )
        for device in (0, "cuda", "cuda:0", torch.device("cuda", 1), "cuda:7")
    ),
    row(
        "manager-device-cuda-7-missing",
        construct(device="cuda:7"),
        r"device: 'cuda:7' does not exist; this machine has \d+ CUDA device",
        *NO_CUDA_7,
    ),
    # Issue 39: 'cpu:0' was kept as given, then every valid step was refused; 'cpu:1' accepted.
    row(
        "manager-device-cpu-1",
        construct(device="cpu:1"),
        r"^device: the CPU is one device, 'cpu' \(or 'cpu:0'\), got 'cpu:1'$",
    ),
    row(
        "manager-device-list",
        construct(device=["cpu"]),
        r"^device: expected a torch.device, .*got \['cpu'\]$",
    ),
    row(
        "manager-device-bogus", construct(device="bogus"), r"^device: expected a torch.device, .*got 'bogus'$"
    ),
    # Issue 39: a model on meta (no data) under a CPU manager failed with torch's cross-device error.
    row(
        "manager-model-on-meta",
        construct(model=ToyModel(torch.device("meta"))),
        r"^model: its parameter 'embed' is on meta \(it holds no data\), but the manager's device is cpu; ",
    ),
    row(
        "manager-model-on-cpu-manager-on-cuda",
        construct(model=ToyModel(CPU), device="cuda"),
        r"^model: its parameters and buffers are on cpu \('embed', \.\.\.\), but the manager's device is "
        r"cuda:\d+; move the model there \(model\.to\(device\)\) or pass device=",
        pytest.mark.gpu,
    ),
    row(
        "manager-output_rows-unknown",
        construct(fields={"output_rows": "rows"}),
        re.escape("options.output_rows: expected 'tokens', 'reqs' or None, got 'rows'"),
    ),
    row(
        "manager-output_rows-list",
        construct(fields={"output_rows": ["reqs"]}),
        re.escape(
            "options.output_rows: expected 'tokens', 'reqs', None, a mapping or a tuple of them, got ['reqs']"
        ),
    ),
    row(
        "manager-output_rows-bad-entry",
        construct(fields={"output_rows": {"a": "token"}}),
        re.escape("options.output_rows['a']: expected 'tokens', 'reqs' or None, got 'token'"),
    ),
    row(
        "manager-output_rows-int-key",
        construct(fields={"output_rows": {0: "reqs"}}),
        re.escape("options.output_rows: a mapping is keyed by the output dict's keys (str), got 0"),
    ),
    row(
        "manager-output_rows-reqs-without-reqs-input",
        construct(inputs={"x": StaticInput((DIM,))}, fields={"output_rows": "reqs"}),
        re.escape("options.output_rows: an output follows 'reqs', but no input has rows='reqs'"),
    ),
    row(
        "manager-check_overwritten_outputs-string",
        construct(fields={"check_overwritten_outputs": "yes"}, watch_factory=False),
        re.escape("options.check_overwritten_outputs: expected True or False, got 'yes'"),
    ),
    row(
        "manager-check_overwritten_outputs-string-before-the-engines",
        construct(fields={"check_overwritten_outputs": "yes"}),
        re.escape("options.check_overwritten_outputs: expected True or False, got 'yes'"),
    ),
    row(
        "manager-check_overwritten_outputs-int",
        construct(fields={"check_overwritten_outputs": 1}),
        re.escape("options.check_overwritten_outputs: expected True or False, got 1"),
    ),
    # Issue 40: capture()'s warm-up policy, a closed set of names.
    row(
        "manager-warm_ups-unknown-name",
        construct(fields={"warm_ups": "per_key"}),
        re.escape("options.warm_ups: expected one of ('auto', 'every_key', 'per_class'), got 'per_key'"),
    ),
    row(
        "manager-warm_ups-bool",
        construct(fields={"warm_ups": True}),
        re.escape("options.warm_ups: expected one of ('auto', 'every_key', 'per_class'), got True"),
    ),
    row(
        "manager-warm_ups-none",
        construct(fields={"warm_ups": None}, watch_factory=False),
        re.escape("options.warm_ups: expected one of ('auto', 'every_key', 'per_class'), got None"),
    ),
    row(
        "manager-engine_factory-int",
        construct(fields={"engine_factory": 3}),
        re.escape("options.engine_factory: expected None or a GraphEngineFactory, got 3"),
    ),
    # Issue 39: a callable that is no engine factory, or one whose product is no engine, failed at capture().
    row(
        "manager-engine_factory-object",
        construct(fields={"engine_factory": object}),
        r"^options\.engine_factory: expected a GraphEngineFactory, "
        r"called as factory\(model, mode, options\), got <class 'object'>",
    ),
    row(
        "manager-engine_factory-one-argument",
        construct(fields={"engine_factory": _identity}),
        r"^options\.engine_factory: expected a GraphEngineFactory, .*got <function _identity",
    ),
    row(
        "manager-engine_factory-builtin-type",
        construct(fields={"engine_factory": dict}),
        r"^options\.engine_factory: <class 'dict'> cannot be called as factory\(model, mode, options\)",
    ),
    row(
        "manager-engine_factory-returns-none",
        construct(fields={"engine_factory": lambda model, mode, options: None}),
        r"^options\.engine_factory: returned None for mode (FULL|PIECEWISE), expected a GraphEngine; "
        r"it lacks warm_up\(\), record\(\)$",
    ),
    row(
        "manager-engine_factory-returns-the-model",
        construct(fields={"engine_factory": lambda model, mode, options: model}),
        r"^options\.engine_factory: returned ToyModel\(.*for mode FULL, expected a GraphEngine; "
        r"it lacks warm_up\(\), record\(\)$",
    ),
    row(
        "manager-ranks-int",
        construct(fields={"ranks": 2}),
        re.escape("options.ranks: expected a RankAgreement or None, got 2"),
    ),
    row(
        "manager-decode_loop-function",
        construct(fields={"decode_loop": _identity}),
        r"^options\.decode_loop: expected a DecodeLoop or None, got <function _identity",
    ),
    row(
        "manager-decode_loop-with-ranks",
        call(_loop_with_ranks),
        r"^options\.decode_loop: ranks step together through run\(\); a loop would step alone$",
    ),
    row(
        "manager-attention-support",
        construct(fields={"attention": AttentionSupport()}),
        r"^options\.attention: expected AttentionOptions, "
        r"got AttentionSupport\(level=<GraphSupport.ALWAYS.*; "
        r"it goes in AttentionOptions\(support=\.\.\.\)$",
    ),
    row(
        "manager-attention-none",
        construct(fields={"attention": None}),
        re.escape("options.attention: expected AttentionOptions, got None"),
    ),
    # -- KVCacheMemory, the manager's KV calls (issue 48) --
    row(
        "kv-unit_shape-zero",
        call(KVCacheMemory, (0, 4), torch.float32),
        r"^unit_shape: expected a sequence of integers >= 1, got \(0, 4\)$",
    ),
    row("kv-unit_shape-string", call(KVCacheMemory, "44", torch.float32), r"^unit_shape: .*'44'$"),
    row(
        "kv-dtype-string",
        call(KVCacheMemory, (4,), "float32"),
        r"^dtype: expected a torch.dtype, got 'float32'$",
    ),
    row(
        "kv-min_units-zero",
        call(KVCacheMemory, (4,), torch.float32, min_units=0),
        r"^min_units: .*>= 1, got 0$",
    ),
    row(
        "kv-max_units-below-min_units",
        call(KVCacheMemory, (4,), torch.float32, max_units=1, min_units=2),
        r"^max_units: expected an integer >= 2, got 1$",
    ),
    row(
        "kv-fallback_units-below-min_units",
        call(KVCacheMemory, (4,), torch.float32, min_units=3, fallback_units=2),
        r"^fallback_units: expected at least min_units=3, got 2$",
    ),
    row("kv-back-past-max_units", lambda: _kv().back(5), r"^units: expected an integer <= 4, got 5$"),
    row("kv-back-below-min_units", lambda: _kv().back(1), r"^units: expected an integer >= 2, got 1$"),
    row(
        "kv-shrink-without-in_use",
        lambda: _kv().back(2),
        r"^in_use: shrinking from 4 to 2 units needs the ids of the units in use \(in_use=\(\) where none",
    ),
    row(
        "kv-shrink-under-live-units",
        lambda: _kv().back(2, in_use=[0, 3]),
        r"^in_use: unit\(s\) \[3\] in use lie at or past the new end 2: free them first",
    ),
    row("kv-in_use-string", lambda: call(_kv().back, 2, in_use="3")(), r"^in_use: expected unit ids .*'3'$"),
    row(
        "kv-margin-negative",
        lambda: _kv().back_from_free(-1),
        r"^margin_bytes: expected an integer >= 0, got -1$",
    ),
    row("kv-second-close", _kv_closed_twice, r"^close: this KVCacheMemory is closed$"),
    row(
        "kv-more-than-free",
        _more_than_free,
        r"^units: \d+ units need \d+ more bytes of device memory; cuda:\d+ has \d+ free \(nothing was",
        pytest.mark.gpu,
    ),
    row(
        "options-kv_cache-string",
        call(ManagerOptions, kv_cache="kv"),
        r"^options.kv_cache: expected a KVCacheMemory or None, got 'kv'$",
    ),
    row(
        "manager-kv_cache-on-another-device",
        _kv_on_another_device,
        r"^options.kv_cache: its memory is on cpu, the manager's device is cuda:\d+$",
        pytest.mark.gpu,
    ),
    row(
        "back_kv_cache-both",
        lambda: _back_kv_cache(margin_bytes=0, units=3),
        r"^margin_bytes, units: expected one of them, got margin_bytes=0 and units=3$",
    ),
    row("back_kv_cache-neither", _back_kv_cache, r"^margin_bytes, units: expected one of them"),
    row(
        "back_kv_cache-units-bool",
        lambda: _back_kv_cache(units=True),
        r"^units: expected an integer >= 2, got True$",
    ),
    # -- AttentionOptions --
    row(
        "attention-support-level",
        call(AttentionOptions, support=GraphSupport.ALWAYS),
        re.escape("attention.support: expected an AttentionSupport or None, got <GraphSupport.ALWAYS"),
    ),
    row(
        "attention-strict-string",
        call(AttentionOptions, strict="yes"),
        re.escape("attention.strict: expected True or False, got 'yes'"),
    ),
    row(
        "attention-strict-int",
        call(AttentionOptions, strict=1),
        re.escape("attention.strict: expected True or False, got 1"),
    ),
    row(
        "attention-metadata_builder-object",
        call(AttentionOptions, metadata_builder="builder"),
        re.escape(
            "attention.metadata_builder: expected an AttentionMetadataBuilder, got 'builder', "
            "which lacks build(), build_for_capture(), a support of type AttentionSupport"
        ),
    ),
    # -- RankAgreement (checked before it looks for a process group) --
    row("ranks-group-string", call(RankAgreement, "world"), re.escape("group: expected a torch.distributed")),
    row("ranks-backend-mpi", call(RankAgreement, backend="mpi"), r"backend: expected 'gloo', 'nccl'.*'mpi'"),
    row("ranks-timeout-seconds", call(RankAgreement, timeout=30), r"timeout: expected a positive.*got 30"),
    row(
        "ranks-timeout-zero",
        call(RankAgreement, timeout=datetime.timedelta(0)),
        r"timeout: expected a positive.*timedelta\(0\)",
    ),
    # -- issue 39: the decode loop's settings; RankAgreement's rows, backends and devices --
    row(
        "decode_loop-advance-of-two-arguments",
        call(DecodeLoop, _advance_of_two, 4),
        r"^advance: expected a callable taking \(outputs, inputs, state\), got <function _advance_of_two"
        r".* whose signature \(outputs, inputs\) does not: too many positional arguments",
    ),
    row(
        "decode_loop-advance-of-four-arguments",
        call(DecodeLoop, _advance_of_four, 4),
        r"^advance: .* whose signature \(outputs, inputs, state, extra\) does not: "
        r"missing a required argument: 'extra'",
    ),
    row(
        "decode_loop-advance-of-keywords",
        call(DecodeLoop, _advance_of_keywords, 4),
        r"^advance: .*signature \(\*, outputs, inputs, state\) does not: too many positional arguments",
    ),
    row(
        "manager-decode_loop-without-request-rows",
        construct(
            inputs={"ids": INPUTS["ids"], "x": INPUTS["x"]},
            model=_two_inputs,
            fields={"decode_loop": DecodeLoop(_advance, max_steps=4)},
        ),
        r"^options\.decode_loop: a decode loop keeps a row per request \(its tokens, its active flag\), "
        r"but no input has rows='reqs' to count the requests",
    ),
    row(
        "manager-decode_loop-forced-while-with-fake-engines",
        construct(fields={"decode_loop": DecodeLoop(_advance, 4, LoopPolicy(LoopKind.WHILE))}),
        r"^options\.decode_loop\.policy: LoopKind\.WHILE was asked for, but decode loops are captured on "
        r"a CUDA device only, and the manager's device is cpu",
    ),
    row(
        "manager-decode_loop-forced-host-loop-without-graphs",
        construct(
            fields={
                "engine_factory": None,
                "decode_loop": DecodeLoop(_advance, 4, LoopPolicy(LoopKind.HOST_LOOP)),
            }
        ),
        r"^options\.decode_loop\.policy: LoopKind\.HOST_LOOP was asked for, but .* device is cpu",
    ),
    row(
        "loop_policy-unrolled-by-one",
        call(LoopPolicy, LoopKind.UNROLLED, 1),
        r"^unroll: LoopKind\.UNROLLED launches graphs of 2 or more iterations .*, got 1",
    ),
    # -- issue 53: stop checked every check_every steps; shrinking loops; replays chosen on the device --
    row(
        "loop_policy-check-every-zero",
        call(LoopPolicy, None, 8, 0),
        r"^check_every: expected an integer >= 1, got 0$",
    ),
    row("loop_policy-check-every-bool", call(LoopPolicy, check_every=True), r"^check_every: .*, got True$"),
    row("loop_policy-check-every-float", call(LoopPolicy, check_every=4.0), r"^check_every: .*, got 4\.0$"),
    row(
        "loop_policy-check-every-above-64",
        call(LoopPolicy, check_every=65),
        r"^check_every: expected an integer <= 64, got 65$",
    ),
    row(
        "decode_loop-request-rows-not-tensors",
        call(DecodeLoop, _advance, 4, LoopPolicy(), [1, 2]),
        r"^request_rows: expected a sequence of tensors, got \[1, 2\]",
    ),
    row(
        "decode_loop-request-rows-a-tensor",
        call(DecodeLoop, _advance, 4, request_rows=torch.zeros(8)),
        r"^request_rows: expected a sequence of tensors, got tensor",
    ),
    row(
        "manager-decode_loop-request-rows-too-few",
        construct(fields={"decode_loop": DecodeLoop(_advance, 4, request_rows=(torch.zeros(2),))}),
        r"^options\.decode_loop\.request_rows\[0\]: expected a tensor on cpu with a contiguous row per "
        r"request \(at least max_num_seqs=\d+ rows\), got a torch\.float32 tensor of shape \(2,\)",
    ),
    row(
        "manager-decode_loop-request-rows-scalar",
        construct(fields={"decode_loop": DecodeLoop(_advance, 4, request_rows=(torch.zeros(()),))}),
        r"^options\.decode_loop\.request_rows\[0\]: .* got a torch\.float32 tensor of shape \(\)",
    ),
    row(
        "device_loop-shared-with-string",
        call(DeviceLoop.capture, _body, stop=torch.zeros((), dtype=torch.bool), max_steps=4, shared_with="x"),
        r"^shared_with: expected a DeviceLoop or None, got 'x'$",
    ),
    row(
        "device_loop-shrinking-no-loops",
        call(DeviceLoop.shrinking, [], rows=None),
        r"^loops: expected two or more",
    ),
    row(
        "device_loop-shrinking-one-loop-string",
        call(DeviceLoop.shrinking, "loops", rows=None),
        r"^loops: expected two or more DeviceLoops, got 'loops'",
    ),
    row(
        "switch_replay-entries-empty",
        call(SwitchReplay.of, {}, torch.zeros((), dtype=torch.int32)),
        r"^entries: expected a mapping of keys to captured graphs, got \{\}$",
    ),
    row(
        "switch_replay-entries-int-keys",
        call(SwitchReplay.of, {8: None}, torch.zeros((), dtype=torch.int32)),
        r"^entries: expected BatchDescriptor keys, got 8$",
    ),
    row(
        "switch_replay-entries-of-two-classes",
        call(
            SwitchReplay.of,
            {BatchDescriptor(8, 8, True): None, KEY: None},
            torch.zeros((), dtype=torch.int32),
        ),
        r"^entries: BatchDescriptor\(num_tokens=8, num_reqs=None.* is not of the class of",
    ),
    row(
        "switch_replay-entries-not-graphs",
        call(SwitchReplay.of, {KEY: "graph"}, torch.zeros((), dtype=torch.int32)),
        r"^entries\[BatchDescriptor\(num_tokens=8.*\]: expected an entry of graph_engine\(FULL\) .* got str",
    ),
    row(
        "switch_replay-live-float",
        call(SwitchReplay.of, {KEY: None}, torch.zeros(())),
        r"^live: expected a one-element int32 or int64 tensor, got tensor\(0\.\)",
    ),
    row(
        "switch_replay-live-two-elements",
        call(SwitchReplay.of, {KEY: None}, torch.zeros(2, dtype=torch.int64)),
        r"^live: expected a one-element int32 or int64 tensor, got tensor\(\[0, 0\]\)",
    ),
    row(
        "switch_replay-live-on-the-cpu",
        call(_switch_replay_counting_on_the_cpu),
        r"^live: expected a CUDA tensor, got one on cpu$",
        pytest.mark.gpu,
    ),
    row(
        "device_loop-shrinking-rows-active-int32",
        call(_shrink_two_loops, active=torch.zeros(8, dtype=torch.int32)),
        r"^rows\.active: expected a torch\.bool on cuda:\d, got torch\.int32 on cpu",
        pytest.mark.gpu,
    ),
    row(
        "device_loop-shrinking-rows-buffer-of-too-few-rows",
        call(_shrink_two_loops, buffers=(torch.zeros(2),)),
        r"^rows\.buffers\[0\]: expected a tensor on cuda:\d, got torch\.float32 on cpu",
        pytest.mark.gpu,
    ),
    row(
        "device_loop-shrinking-rows-history-float",
        call(_shrink_two_loops, history=torch.zeros(4, 8)),
        r"^rows\.history: expected a torch\.int64 on cuda:\d, got torch\.float32 on cpu",
        pytest.mark.gpu,
    ),
    row(
        "ranks-exchange-above-int64",
        call(_exchange, [2**70]),
        r"^row\[0\]: expected an int in the int64 range .*, got 1180591620717411303424$",
    ),
    row(
        "ranks-exchange-below-int64",
        call(_exchange, (0, -(2**63) - 1)),
        r"^row\[1\]: .*, got -9223372036854775809$",
    ),
    row("ranks-exchange-bool", call(_exchange, [True]), r"^row\[0\]: expected an int .*, got True$"),
    row("ranks-exchange-float", call(_exchange, [1, 1.5]), r"^row\[1\]: expected an int .*, got 1\.5$"),
    row(
        "ranks-exchange-string",
        call(_exchange, "12"),
        r"^row: expected a list or tuple of ints \(one at least\), got '12'$",
    ),
    row("ranks-exchange-empty", call(_exchange, []), r"^row: expected a list or tuple of ints .*, got \[\]$"),
    row(
        "ranks-nccl-unavailable",
        call(RankAgreement, backend="nccl"),
        r"^backend: 'nccl' is not available in this build of torch .*; use 'gloo'",
        pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch has NCCL"),
    ),
    row(
        "ranks-nccl-device-cpu",
        call(RankAgreement, backend="nccl", device="cpu"),
        r"^device: the nccl backend exchanges on a CUDA device, got 'cpu'",
        pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="this torch has no NCCL"),
    ),
    row(
        "ranks-device-meta",
        call(RankAgreement, device="meta"),
        r"^device: expected a CUDA device or the CPU, got 'meta'",
    ),
    row(
        "ranks-device-bogus",
        call(RankAgreement, device="bogus"),
        r"^device: expected a torch\.device, .*, got 'bogus'",
    ),
    row("ranks-device-float", call(RankAgreement, backend=None, device=1.5), r"^device: .*, got 1\.5"),
    row(
        "ranks-gloo-device-cuda-without-cuda",
        call(RankAgreement, device="cuda:0"),
        r"^device: 'cuda:0' is a CUDA device, but CUDA is not available here",
        NO_CUDA,
    ),
    row(
        "ranks-gloo-device-cuda",
        call(RankAgreement, device="cuda:0"),
        r"^device: backend 'gloo' exchanges on the CPU; a device is for backend='nccl', got 'cuda:0'",
        pytest.mark.gpu,
    ),
    row("manager-capture-progress-string", call(_capture_with_progress, "yes"), r"progress.*'yes'"),
    row("background-wait-negative", call(_wait_for, -1), r"timeout: expected None or a number .* got -1"),
    row("background-wait-string", call(_wait_for, "1"), r"timeout: .* got '1'"),
    row("background-wait-bool", call(_wait_for, True), r"timeout: .* got True"),
    row("background-wait-nan", call(_wait_for, float("nan")), r"timeout: .* got nan"),
    # Issue 54: a lockstep capture's wait() checks its timeout (honoured between its steps) first.
    row("lockstep-wait-negative", call(_lockstep_wait_for, -1), r"timeout: expected None or a number .* -1"),
    row("lockstep-wait-bool", call(_lockstep_wait_for, True), r"timeout: .* got True"),
    row("ranks-step-field-too-wide", call(_step_field, (0,) * 5), r"^field: at most 4 ints, got 5"),
    # Issue 41: start_capture() with ranks captures keys_per_step keys a step; checked on every manager.
    row("background-keys-per-step-zero", call(_start_with, 0), r"keys_per_step: expected an int >= 1, got 0"),
    row("background-keys-per-step-float", call(_start_with, 1.0), r"keys_per_step: .* got 1\.0"),
    row("background-keys-per-step-bool", call(_start_with, True), r"keys_per_step: .* got True"),
    row("background-keys-per-step-string", call(_start_with, "2"), r"keys_per_step: .* got '2'"),
    row(
        "background-keys-per-step-without-ranks",
        call(_start_with, 2),
        r"keys_per_step: the keys a step captures, with ranks .* got 2",
    ),
    # -- compile_for_capture --
    row(
        "compile-model-int",
        call(compile_for_capture, 3, INPUTS),
        re.escape("model: expected a callable, got 3"),
    ),
    row("compile-inputs-empty", call(compile_for_capture, _identity, {}), r"inputs: .*, got \{\}"),
    row(
        "compile-mode-reduce-overhead",
        call(compile_for_capture, _identity, INPUTS, mode="reduce-overhead"),
        r"mode: 'reduce-overhead' records CUDA graphs of inductor's own",
    ),
    row(
        "compile-mode-max-autotune",
        call(compile_for_capture, _identity, INPUTS, mode="max-autotune"),
        r"mode: 'max-autotune' records CUDA graphs .*'max-autotune-no-cudagraphs'",
    ),
    row(
        "compile-mode-unknown",
        call(compile_for_capture, _identity, INPUTS, mode="fastest"),
        r"mode: expected one of .*, got 'fastest'",
    ),
    row("compile-mode-none", call(compile_for_capture, _identity, INPUTS, mode=None), r"mode: .*got None"),
    row(
        "compile-fullgraph-string",
        call(compile_for_capture, _identity, INPUTS, fullgraph="yes"),
        re.escape("fullgraph: expected True or False, got 'yes'"),
    ),
    row(
        "compile-backend-int",
        call(compile_for_capture, _identity, INPUTS, backend=3),
        r"backend: expected the name of a torch.compile backend, got 3",
    ),
    row(
        "compile-backend-mode-mismatch",
        call(compile_for_capture, _identity, INPUTS, mode="max-autotune-no-cudagraphs", backend="eager"),
        r"mode: 'max-autotune-no-cudagraphs' is an inductor mode, but backend is 'eager'",
    ),
    # -- StaticInput --
    row(
        "static-shape-int",
        call(StaticInput, shape=4),
        re.escape("shape: expected a tuple of integers >= 1 (the trailing dims), got 4"),
    ),
    row("static-shape-zero", call(StaticInput, shape=(4, 0)), r"shape: expected a tuple .*, got \(4, 0\)"),
    row("static-shape-negative", call(StaticInput, shape=(-1,)), r"shape: expected a tuple .*, got \(-1,\)"),
    row("static-shape-bool", call(StaticInput, shape=(True,)), r"shape: expected a tuple .*, got \(True,\)"),
    row("static-shape-float", call(StaticInput, shape=(2.0,)), r"shape: expected a tuple .*, got \(2\.0,\)"),
    row(
        "static-dtype-string",
        call(StaticInput, dtype="float32"),
        re.escape("dtype: expected a torch.dtype, got 'float32'"),
    ),
    row(
        "static-dtype-quantized",
        call(StaticInput, dtype=torch.quint8),
        re.escape("dtype: expected a floating, integer or bool torch.dtype, got torch.quint8"),
    ),
    row(
        "static-dtype-complex",
        call(StaticInput, dtype=torch.complex64),
        re.escape("dtype: expected a floating, integer or bool torch.dtype, got torch.complex64"),
    ),
    row(
        "static-rows-unknown",
        call(StaticInput, rows="requests"),
        re.escape("rows: expected 'tokens', 'reqs' or None, got 'requests'"),
    ),
    row(
        "static-pad_value-string",
        call(StaticInput, pad_value="0"),
        re.escape("pad_value: expected an int or a float, got '0'"),
    ),
    row(
        "static-pad_value-bool-for-bool",
        call(StaticInput, dtype=torch.bool, pad_value=True),
        re.escape("pad_value: expected an int or a float, got True"),
    ),
    row(
        "static-pad_value-bool-for-float",
        call(StaticInput, pad_value=True),
        re.escape("pad_value: expected an int or a float, got True"),
    ),
    row(
        "static-pad_value-fractional-for-int",
        call(StaticInput, dtype=torch.int64, pad_value=0.5),
        r"pad_value: 0\.5 is not an integer",
    ),
    row(
        "static-pad_value-below-uint8",
        call(StaticInput, dtype=torch.uint8, pad_value=-1),
        re.escape("pad_value: -1 is out of range for torch.uint8"),
    ),
    row(
        "static-pad_value-above-int8",
        call(StaticInput, dtype=torch.int8, pad_value=128),
        re.escape("pad_value: 128 is out of range for torch.int8"),
    ),
    row(
        "static-pad_value-2-for-bool",
        call(StaticInput, dtype=torch.bool, pad_value=2),
        re.escape("pad_value: expected 0 or 1 for dtype torch.bool, got 2"),
    ),
    row(
        "static-pad_value-nan-for-float",
        call(StaticInput, pad_value=float("nan")),
        r"pad_value: expected a finite number .*, got nan",
    ),
    row(
        "static-pad_value-nan-for-int",
        call(StaticInput, dtype=torch.int32, pad_value=float("nan")),
        r"pad_value: expected a finite number .*, got nan",
    ),
    row(
        "static-pad_value-inf",
        call(StaticInput, pad_value=float("inf")),
        r"pad_value: expected a finite number .*, got inf",
    ),
    row(
        "static-pad_value-overflows-half",
        call(StaticInput, dtype=torch.float16, pad_value=1e6),
        r"pad_value: 1000000\.0 overflows",
    ),
    row(
        "allocate_kv_cache-too-few",
        lambda: ReferenceDecoder(DecoderConfig.small()).allocate_kv_cache(3),
        r"num_rows: expected an integer >= max_num_seqs \+ 1 = 17, got 3",
    ),
    row(
        "allocate_kv_cache-bool",
        lambda: ReferenceDecoder(DecoderConfig.small()).allocate_kv_cache(True),
        r"num_rows: expected an integer >= max_num_seqs \+ 1 = 17, got True",
    ),
    # -- pad_offsets, pad_rows (issue 39: only the row count was checked; the rest failed in torch or ran) --
    *(
        row(f"pad_offsets-{name}", call(pad_offsets, *args), pattern)
        for name, args, pattern in (
            (
                "offsets-2d",
                (_int32(5), torch.zeros(2, 2, dtype=torch.int32), 8),
                r"^offsets: .*shape \(2, 2\)",
            ),
            ("offsets-float", (_int32(5), torch.tensor([0.0, 2.0]), 8), r"^offsets: .*torch\.float32"),
            ("offsets-list", (_int32(5), [0, 2], 8), r"^offsets: .*got \[0, 2\]"),
            (
                "offsets-not-from-0",
                (_int32(5), _int32s(3, 5), 8),
                r"^offsets: expected to start at 0, got \[3, 5\]",
            ),
            (
                "offsets-decreasing",
                (_int32(5), _int32s(0, 5, 3), 8),
                r"^offsets: expected non-decreasing.*\[0, 5, 3\]",
            ),
            (
                "offsets-other-device",
                (_int32(5, "meta"), _int32s(0, 2), 8),
                r"^offsets: on cpu, but out is on meta",
            ),
            ("out-0d", (torch.tensor(0, dtype=torch.int32), _int32s(0, 2), 8), r"^out: .*got a 0-d tensor"),
            ("out-list", ([0, 0, 0], _int32s(0, 2), 8), r"^out: .*got \[0, 0, 0\]"),
            ("out-float", (torch.zeros(5), _int32s(0, 2), 8), r"^out: .*torch\.float32"),
            ("padded_total-none", (_int32(5), _int32s(0, 2), None), r"^padded_total: .*got None"),
            ("padded_total-string", (_int32(5), _int32s(0, 2), "8"), r"^padded_total: .*got '8'"),
            ("padded_total-negative", (_int32(5), _int32s(0, 2), -1), r"^padded_total: .*got -1"),
            ("padded_total-float", (_int32(5), _int32s(0, 2), 7.5), r"^padded_total: .*got 7\.5"),
            ("padded_total-bool", (_int32(5), _int32s(0, 2), True), r"^padded_total: .*got True"),
            ("padded_total-overflows", (_int32(5), _int32s(0, 2), 2**31), r"^padded_total: .*<= 2147483647"),
            (
                "padded_total-below-real",
                (_int32(5), _int32s(0, 2, 6), 4),
                r"^padded_total: 4 is below the real total 6",
            ),
            ("offsets-empty", (_int32(4), torch.zeros(0, dtype=torch.int32), 8), r"^offsets: .*got 0"),
        )
    ),
    *(
        row(f"pad_rows-{name}", call(pad_rows, *args), pattern)
        for name, args, pattern in (
            ("out-0d", (torch.tensor(0, dtype=torch.int32), _int32s(1), 0), r"^out: .*got a 0-d tensor"),
            ("out-list", ([0, 0], _int32s(1), 0), r"^out: .*got \[0, 0\]"),
            ("rows-0d", (_int32(4), torch.tensor(1, dtype=torch.int32), 0), r"^rows: .*got a 0-d tensor"),
            ("rows-list", (_int32(4), [1, 2], 0), r"^rows: .*got \[1, 2\]"),
            (
                "rows-broadcast",
                (torch.zeros(4, 3), torch.ones(3), 0),
                r"^rows: shape \(3,\) does not match.*\(4, 3\)",
            ),
            (
                "rows-trailing",
                (torch.zeros(4, 3), torch.ones(2, 2), 0),
                r"^rows: shape \(2, 2\) does not match",
            ),
            (
                "rows-float-into-int",
                (_int32(4), torch.tensor([1.5]), 0),
                r"^rows: torch\.float32 rows do not fit .*int32",
            ),
            ("rows-other-device", (_int32(4, "meta"), _int32s(1), 0), r"^rows: on cpu, but out is on meta"),
            ("pad_value-string", (_int32(4), _int32s(1), "x"), r"^pad_value: .*got 'x'"),
            ("pad_value-none", (_int32(4), _int32s(1), None), r"^pad_value: .*got None"),
            (
                "pad_value-int8-300",
                (torch.zeros(4, dtype=torch.int8), torch.ones(1, dtype=torch.int8), 300),
                r"^pad_value: 300 is out of range for torch\.int8",
            ),
            ("pad_value-half-into-int", (_int32(4), _int32s(1), 0.5), r"^pad_value: 0\.5 is not an integer"),
            (
                "rows-int64-beyond-int32",
                (_int32(4), torch.tensor([2**40, 1]), 0),
                r"^rows: values in \[1, 1099511627776\] do not fit out's torch\.int32",
            ),
            (
                "rows-bool-into-float",
                (torch.zeros(4), torch.ones(2, dtype=torch.bool), 0.0),
                r"^rows: torch\.bool",
            ),
            (
                "pad_value-inf",
                (torch.zeros(4), torch.ones(1), float("inf")),
                r"^pad_value: expected a finite",
            ),
        )
    ),
    *ROUND_THREE,
    *ROUND_THREE_GPU,
]


@pytest.mark.parametrize(("thunk", "pattern"), BAD_INPUTS)
def test_bad_input_names_the_argument_and_the_value(thunk: Callable[[], object], pattern: str) -> None:
    """The call raises ``ValueError`` naming the argument and showing the value, and changes nothing."""
    enabled = capture_enabled()
    with pytest.raises(ValueError, match=pattern):
        thunk()
    assert get_forward_context() is None  # a rejected context was never entered
    assert capture_enabled() is enabled  # a rejected flag was never stored


# ---------------------------------------------------------------------------
# BAD_RUNS: run() on each backend; no buffer written, no run counted
# ---------------------------------------------------------------------------

#: One step of a manager: ``run`` or ``run_batch`` with bad inputs.
Step = Callable[[CUDAGraphManager[torch.Tensor]], object]
#: A bad step: from a valid 5-token, 3-request batch and the backend, the step
#: and the fragments its error message must hold.
BadRun = Callable[[dict[str, torch.Tensor], Backend], tuple[Step, tuple[str, ...]]]


def run_with(kwargs: Mapping[str, object]) -> Step:
    """``manager.run(**kwargs)``, with deliberately wrong types (what an untyped caller may pass)."""
    return lambda manager: manager.run(**kwargs)  # type: ignore[arg-type]  # the wrong types are the point


def run_batch_with(inputs: object) -> Step:
    """``manager.run_batch(inputs)``, with an argument of any type."""
    return lambda manager: manager.run_batch(cast(Mapping[str, torch.Tensor], inputs))


def _replace(batch: dict[str, torch.Tensor], name: str, value: object) -> Step:
    return run_with({**batch, name: value})


def _fresh(num_tokens: int, num_reqs: int, backend: Backend, **kwargs: object) -> Step:
    return run_with({**make_batch(num_tokens, num_reqs, backend.device, seed=1), **kwargs})


def bad_run(name: str, make: BadRun, *marks: pytest.MarkDecorator) -> object:
    return pytest.param(make, id=name, marks=marks)


BAD_RUNS: Final = [
    bad_run(
        "run-unknown-name", lambda b, _: (run_with({**b, "idz": b["ids"]}), ("unknown input(s) ['idz']",))
    ),
    bad_run(
        "run-missing-name",
        lambda b, _: (
            run_with({k: v for k, v in b.items() if k != "scale"}),
            ("missing input(s) ['scale']",),
        ),
    ),
    bad_run("run-not-a-tensor", lambda b, _: (_replace(b, "x", b["x"].tolist()), ("input 'x'", "got list"))),
    bad_run(
        "run-dtype",
        lambda b, _: (_replace(b, "ids", b["ids"].to(torch.int32)), ("input 'ids'", "torch.int32")),
    ),
    bad_run(
        "run-device",
        lambda b, be: (
            _replace(b, "x", b["x"].to(be.foreign_device)),
            ("input 'x'", f"got one on {be.foreign_device.type}"),
        ),
    ),
    bad_run(
        "run-trailing-shape",
        lambda b, be: (_replace(b, "x", torch.randn(5, DIM + 1, device=be.device)), ("input 'x'", "(5, 33)")),
    ),
    bad_run(
        "run-no-row-dim",
        lambda b, be: (_replace(b, "scale", torch.tensor(2.0, device=be.device)), ("input 'scale'", "()")),
    ),
    bad_run("run-extra-dim", lambda b, _: (_replace(b, "ids", b["ids"][:, None]), ("input 'ids'", "(5, 1)"))),
    bad_run(
        "run-sparse-second-input",  # after 'ids' was checked: nothing may be copied before 'x' is
        lambda b, _: (_replace(b, "x", b["x"].to_sparse()), ("input 'x'", "layout torch.sparse_coo")),
    ),
    bad_run(
        "run-unbatched-shape",
        lambda b, be: (
            _replace(b, "bias", torch.randn(1, DIM, device=be.device)),
            ("input 'bias'", "(1, 32)"),
        ),
    ),
    bad_run(
        "run-token-rows-differ",
        lambda b, be: (
            _replace(b, "x", torch.randn(6, DIM, device=be.device)),
            ("input 'x': 6 rows", "input 'ids' has 5"),
        ),
    ),
    bad_run(
        "run-reqs-above-max_num_seqs",
        lambda _, be: (
            _fresh(20, MAX_NUM_SEQS + 1, be),
            ("input 'scale'", f"{MAX_NUM_SEQS + 1} rows", f"max_num_seqs={MAX_NUM_SEQS}"),
        ),
    ),
    bad_run(
        "run-more-reqs-than-tokens",
        lambda _, be: (_fresh(3, 4, be), ("input 'scale'", "4 requests for 3 tokens")),
    ),
    bad_run(  # the newcomer's 8: ran silently before, padding the request rows
        "run-tokens-without-reqs",
        lambda b, be: (
            _replace(b, "scale", torch.ones(0, device=be.device)),
            ("input 'scale'", "0 rows (num_reqs) for 5 tokens"),
        ),
    ),
    bad_run(
        "run-not-uniform",
        lambda b, _: (run_with({**b, "uniform_decode": True}), ("uniform_decode", "5 tokens for 3 requests")),
    ),
    bad_run(
        "run-uniform_decode-string",
        lambda _, be: (_fresh(3, 3, be, uniform_decode="yes"), ("uniform_decode", "got 'yes'")),
    ),
    bad_run(
        "run-uniform_decode-string-mixed-batch",
        lambda b, _: (run_with({**b, "uniform_decode": "yes"}), ("uniform_decode", "got 'yes'")),
    ),
    bad_run(
        "run-negative-loras",
        lambda b, _: (run_with({**b, "num_active_loras": -1}), ("num_active_loras", "-1")),
    ),
    bad_run(
        "run-bool-loras",
        lambda b, _: (run_with({**b, "num_active_loras": True}), ("num_active_loras", "True")),
    ),
    bad_run(
        "run-invalid_modes-none-mode",
        lambda b, _: (run_with({**b, "invalid_modes": frozenset({M.NONE})}), ("invalid_modes", "NONE")),
    ),
    # Issue 39: more active adapters than requests was accepted silently.
    bad_run(
        "run-more-loras-than-requests",
        lambda b, _: (
            run_with({**b, "num_active_loras": 4}),
            ("num_active_loras: 4 active adapters for 3 requests",),
        ),
    ),
    bad_run(
        "run-loras-on-two-requests",
        lambda _, be: (_fresh(2, 2, be, num_active_loras=3), ("num_active_loras: 3", "for 2 requests")),
    ),
    bad_run(
        "run-loras-on-an-idle-step",
        lambda _, be: (_fresh(0, 0, be, num_active_loras=1), ("num_active_loras: 1", "for 0 requests")),
    ),
    bad_run(
        "run_batch-list",
        lambda b, _: (
            run_batch_with(list(b.values())),
            ("inputs: expected a mapping of input names to tensors, got list",),
        ),
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    torch.manual_seed(0)
    return Backend.of(str(request.param))


@pytest.mark.parametrize("make", BAD_RUNS)
def test_bad_run_raises_before_touching_a_buffer(backend: Backend, make: BadRun) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    manager.capture()
    manager.run_batch(make_batch(8, 8, backend.device, seed=0))  # real data in the buffers
    before = snapshot(manager.static_buffers)
    stats = manager.stats
    step, fragments = make(make_batch(5, 3, backend.device, seed=2), backend)
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as info:
        step(manager)
    for fragment in fragments[1:]:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    assert_unchanged(before, manager.static_buffers)
    assert manager.stats == stats


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_uniform_step_without_request_rows_is_a_multiple_of_q(backend: Backend) -> None:
    """Issue 33: no "reqs" input to count the requests, so the dispatcher's route refuses 5 tokens at q=2."""
    config = config_for(M.FULL_AND_PIECEWISE, query_len=2)
    manager = CUDAGraphManager(
        _double,
        {"x": StaticInput((DIM,))},
        config,
        device=backend.device,
        options=ManagerOptions(engine_factory=backend.factory),
    )
    manager.capture()
    manager.run(x=torch.randn(8, DIM, device=backend.device))  # real data in the buffers
    before = snapshot(manager.static_buffers)
    stats = manager.stats
    with pytest.raises(ValueError, match=r"^num_tokens: .*uniform_decode_query_len=2 .*got 5$"):
        manager.run(x=torch.randn(5, DIM, device=backend.device), uniform_decode=True)
    assert_unchanged(before, manager.static_buffers)
    assert manager.stats == stats
    x = torch.randn(6, DIM, device=backend.device)
    torch.testing.assert_close(manager.run(x=x, uniform_decode=True), x * 2)  # 3 requests of 2 tokens


# ---------------------------------------------------------------------------
# BAD_DEMO_ARGS: command lines of the demo; argparse errors, never a traceback
# ---------------------------------------------------------------------------

DEMO_PROG: Final = "python -m examples.demo"


def demo_args(argv: str, pattern: str, *marks: pytest.MarkDecorator) -> object:
    return pytest.param(argv.split(), pattern, id=argv, marks=marks)


BAD_DEMO_ARGS: Final = [
    demo_args("--hidden 100 --heads 3", re.escape("num_heads: must divide hidden_size=100, got 3")),
    demo_args("--hidden 96 --heads 32", r"heads\b.*\b32\b"),
    demo_args("--layers 0", re.escape("num_layers: expected an integer >= 1, got 0")),
    demo_args("--heads 0", re.escape("num_heads: expected an integer >= 1, got 0")),
    demo_args("--max-seq-len 0", re.escape("max_seq_len: expected an integer >= 1, got 0")),
    demo_args("--max-size 0", r"--max-size\b.*\b0\b"),
    demo_args("--steps 0", r"--steps\b.*\b0\b"),
    demo_args("--iters 0", r"--iters\b.*\b0\b"),
    demo_args("--warmup -1", r"--warmup\b.*-1\b"),
    demo_args("--tolerance 0", re.escape("--tolerance must be > 0, got 0.0")),
    demo_args("--tolerance nan", re.escape("--tolerance must be > 0, got nan")),
    demo_args("--dtype int8", re.escape("argument --dtype: invalid choice: 'int8'")),
    demo_args("--max-size x", re.escape("argument --max-size: invalid int value: 'x'")),
    # The newcomer's 3: a traceback, and an error that never named the flag, before.
    demo_args("--max-size 5000000", r"--max-size: max_size: expected an integer <= 1048576, got 5000000"),
    demo_args("--max-seq-len 1", r"--max-seq-len: the last step has 264 tokens.*pass at least 2"),
]


@pytest.mark.parametrize(("argv", "pattern"), BAD_DEMO_ARGS)
def test_bad_demo_arguments_are_argparse_errors(
    argv: list[str], pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit status 2 with ``prog: error: ...`` naming the argument and the value; the demo never starts."""
    with pytest.raises(SystemExit) as info:
        demo_main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert out == "", "the demo started"
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith(f"{DEMO_PROG}: error: "), err
    assert re.search(pattern, last), f"{pattern!r} not in {last!r}"


def test_kv_sizing_answers_help_and_bad_arguments_before_looking_for_a_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The newcomer's 4: ``--help`` and ``bogus`` both answered "needs a CUDA device" before."""
    from examples.kv_sizing import main as kv_sizing_main

    with pytest.raises(SystemExit) as done:
        kv_sizing_main(["--help"])
    assert done.value.code == 0
    assert "--attention" in capsys.readouterr().out
    for argv, pattern in (
        (["bogus"], r"argument model: invalid choice: 'bogus'"),
        (["--attention", "paged"], r"argument --attention: invalid choice: 'paged'"),
        (["--margin-mib", "-1"], r"--margin-mib must be >= 0, got -1"),
    ):
        with pytest.raises(SystemExit) as done:
            kv_sizing_main(argv)
        assert done.value.code == 2
        assert re.search(pattern, capsys.readouterr().err), argv


def test_several_gpus_refuses_a_world_size_its_decoder_cannot_shard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The newcomer's 11: a traceback from every rank before; one usage line now, no rank started."""
    from examples.several_gpus import main as several_gpus_main

    with pytest.raises(SystemExit) as done:
        several_gpus_main(["--device", "cpu", "--world-size", "3"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--world-size 3: config.num_heads=4 does not divide over 3 ranks" in err
    assert "Traceback" not in err


def test_ep_moe_refuses_bad_arguments_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51: an infinite capacity factor started both ranks, which failed deep in the first MoE step."""
    from examples.ep_moe import main as ep_moe_main

    for argv, pattern in (
        (
            ["--capacity-factor", "inf"],
            r"--capacity-factor: capacity_factor: expected None or a finite number > 0, got inf",
        ),
        (["--capacity-factor", "nan"], r"--capacity-factor: .*got nan"),
        (["--capacity-factor", "0"], r"--capacity-factor: .*got 0\.0"),
        (["--steps", "0"], r"--steps: expected an integer >= 1, got 0"),
    ):
        with pytest.raises(SystemExit) as done:
            ep_moe_main(argv)
        assert done.value.code == 2, argv
        err = capsys.readouterr().err
        assert re.search(pattern, err), (argv, err)
        assert "Traceback" not in err


@pytest.mark.parametrize(
    "descriptor",
    [
        lambda: BatchDescriptor(4, 2, has_lora=True, num_active_loras=3),
        lambda: BatchDescriptor(1, 1, uniform=True, has_lora=True, num_active_loras=4),
        lambda: BatchDescriptor(8, has_lora=True, num_active_loras=16),
    ],
    ids=["4-tokens-2-reqs-3-adapters", "1-token-uniform-4-adapters", "relaxed-8-tokens-16-adapters"],
)
def test_a_keys_adapter_count_is_a_capacity_not_refused(descriptor: Callable[[], BatchDescriptor]) -> None:
    """Issue 51 asked: a key naming more adapters than requests is a graph of a LoRA case (a capacity, like
    its padded tokens: vLLM keys every size with every case), valid by design (docs/design.md, "Keys")."""
    key = descriptor()
    assert key.has_lora
    assert key.num_active_loras > (key.num_reqs or key.num_tokens)  # more adapters than its requests
