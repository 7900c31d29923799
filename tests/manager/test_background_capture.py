"""Serving from step 0: ``start_capture()`` captures in a thread while ``run()`` serves.

Every served step is compared with eager. On the CPU the fake engines check the
bookkeeping: eager steps counted while keys are pending, keys switched in once
captured, errors and retries on the handle, missed keys captured first, and
the calls refused while a capture runs. On the GPU the real engines serve the
reference decoder during the capture in every mode, every served step equal to
the same steps run in order on an identical copy of the model; and a
device-wide sync injected during a capture leads to a retried capture, not a
broken graph.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
from collections.abc import Iterator
from typing import Final

import pytest
import torch

from cudagraph_capture import CaptureError, CaptureInvalidatedError
from cudagraph_capture._gc import collector_paused
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    get_forward_context,
)
from cudagraph_manager import BackgroundCapture, CUDAGraphManager, ManagerOptions, NoGraphError
from cudagraph_manager._graphs import _thread as _background_module
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from tests.torch_support import rel_err

from .helpers import (
    INPUTS,
    MAX_NUM_SEQS,
    SIZES,
    TOL,
    Backend,
    FakeEngines,
    FirstRecordingGate,
    ToyModel,
    config_for,
    make_batch,
    make_manager,
)

FULL: Final = CUDAGraphMode.FULL
PIECEWISE: Final = CUDAGraphMode.PIECEWISE
CPU: Final = torch.device("cpu")
#: How long a test waits for the capture thread before it fails (never hangs).
WAIT_S: Final = 120.0


def _wait(gate: threading.Event) -> None:
    """Hold a capture until the test opens ``gate``."""
    assert gate.wait(WAIT_S)


def _serve_until_done(
    manager: CUDAGraphManager[torch.Tensor], model: ToyModel, handle: BackgroundCapture, device: torch.device
) -> tuple[int, int]:
    """Serve random steps until the capture is done, each checked against eager; (eager, replayed) steps.

    On CUDA the steps run on a stream of their own: the legacy default stream
    (and a device-wide sync) would invalidate the capture in flight.
    """
    own = torch.cuda.Stream() if device.type == "cuda" else None  # type: ignore[no-untyped-call]  # untyped stubs
    serving = torch.cuda.stream(own) if own is not None else contextlib.nullcontext()
    try:
        with serving:
            return _serve(manager, model, handle, device)
    finally:
        handle.wait(WAIT_S)  # never leave a capture thread running into the next test


def _serve(
    manager: CUDAGraphManager[torch.Tensor], model: ToyModel, handle: BackgroundCapture, device: torch.device
) -> tuple[int, int]:
    eager = replayed = 0
    seed = 0
    while not handle.done or seed < 5:
        tokens = 1 + seed * 7 % max(SIZES)
        batch = make_batch(tokens, min(tokens, 3), device, seed=seed)
        before = manager.stats.num_replays
        out = manager.run_batch(batch)
        assert rel_err(out, model.eager(batch)) < TOL, f"step {seed} ({tokens} tokens)"
        if manager.stats.num_replays > before:
            replayed += 1
        else:
            eager += 1
        seed += 1
        assert seed < 100_000, "the background capture never finished"
    return eager, replayed


@pytest.mark.parametrize("mode", [FULL, PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_steps_are_served_during_the_capture_and_switch_to_graphs(
    backend: Backend, mode: CUDAGraphMode
) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, mode)
    planned = len(manager.dispatcher.capture_plan()[0][1]) + (
        len(manager.dispatcher.capture_plan()[1][1]) if len(manager.dispatcher.capture_plan()) > 1 else 0
    )
    handle = manager.start_capture()
    eager, replayed = _serve_until_done(manager, model, handle, backend.device)
    report = handle.wait(WAIT_S)
    assert handle.errors == ()
    assert handle.progress == (planned, planned)
    assert report.num_graphs == manager.num_captured == planned
    stats = manager.stats
    # Only steps whose key was not captured yet ran eagerly: a ready graph always replays.
    assert stats.eager_steps == stats.eager_reasons.get("not_captured", 0) == eager
    assert stats.num_replays == replayed
    # After the capture every key replays, on fresh inputs: mixed steps of every
    # size, and uniform decode steps of every size that has a decode graph.
    replayed_keys = set()
    steps = [(tokens, min(tokens, 3), False) for tokens in SIZES]
    steps += [(tokens, tokens, True) for tokens in SIZES if tokens <= MAX_NUM_SEQS]
    for tokens, reqs, uniform in steps:
        batch = make_batch(tokens, reqs, backend.device, seed=1000 + tokens)
        before = manager.stats.num_replays
        out = manager.run_batch(batch, uniform_decode=uniform)
        assert rel_err(out, model.eager(batch)) < TOL
        assert manager.stats.num_replays == before + 1
        replayed_keys.add(manager.dispatcher.dispatch(tokens, uniform_decode=uniform).descriptor)
    planned_keys = {key for _, keys in manager.dispatcher.capture_plan() for key in keys}
    assert replayed_keys == planned_keys  # every captured key replayed at least once


def test_a_failed_key_is_reported_on_the_handle_and_serving_goes_on(backend: Backend) -> None:
    model = ToyModel(backend.device)
    failing = BatchDescriptor(8, 8)

    def fail_one(**inputs: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()  # the capture runs under FULL (its warm-up under NONE)
        if context is not None and context.batch_descriptor == failing and context.runtime_mode is FULL:
            raise RuntimeError("boom")
        return model.eager(inputs)

    manager = make_manager(backend, fail_one)
    handle = manager.start_capture()
    _serve_until_done(manager, model, handle, backend.device)
    handle.wait(WAIT_S)
    assert len(handle.errors) == 1
    assert "boom" in str(handle.errors[0])
    assert handle.retries == 0  # the model's own error: no retry mends it (only an invalidated capture)
    assert manager.num_captured == len(SIZES) - 1
    batch = make_batch(7, 3, backend.device, seed=1)  # pads to the failed key: eager, counted
    assert manager.dispatcher.dispatch(7).descriptor == failing
    not_captured = manager.stats.eager_reasons.get("not_captured", 0)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert manager.stats.eager_reasons["not_captured"] == not_captured + 1  # this one step


def test_a_failed_warm_up_is_reported_naming_its_key(backend: Backend) -> None:
    """A warm-up the model fails is a ``CaptureError`` naming the key, as in ``capture()``."""
    model = ToyModel(backend.device)

    def fail_warm_ups(**inputs: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()  # a warm-up runs under NONE on the capture thread
        on_capture_thread = threading.current_thread() is not threading.main_thread()
        if on_capture_thread and context is not None and context.runtime_mode is CUDAGraphMode.NONE:
            raise RuntimeError("warm-up boom")
        return model.eager(inputs)

    manager = make_manager(backend, fail_warm_ups)
    (_, (largest, *_)), *_ = manager.dispatcher.capture_plan()
    handle = manager.start_capture()
    _serve_until_done(manager, model, handle, backend.device)
    handle.wait(WAIT_S)
    warm_up_errors = [error for error in handle.errors if "warm-up boom" in str(error)]
    assert len(warm_up_errors) == 1  # the first warm-up failed; the captures went on
    (error,) = warm_up_errors
    assert isinstance(error, CaptureError)
    assert error.descriptor == largest


def test_a_key_that_fails_once_is_tried_again() -> None:
    model = ToyModel(CPU)
    tries: list[int] = []

    def fail_first() -> None:
        tries.append(1)
        if len(tries) == 1:
            raise CaptureInvalidatedError("CUDA invalidated the capture", None)

    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(fail_first)),
    )
    handle = manager.start_capture()
    handle.wait(WAIT_S)
    assert (handle.errors, handle.retries, manager.num_captured) == ((), 1, len(SIZES))


def test_keys_that_steps_miss_are_captured_first() -> None:
    model = ToyModel(CPU)
    gate = FirstRecordingGate(WAIT_S)
    manager = gate.manager_on_cpu(model)
    handle = manager.start_capture()
    assert gate.entered.wait(WAIT_S)  # the largest key is being captured
    batch = make_batch(3, 2, CPU, seed=0)  # needs the graph of 4 tokens: a miss
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    gate.open()
    report = handle.wait(WAIT_S)
    order = [g.descriptor.num_tokens for g in report.graphs]
    assert order[0] == max(SIZES)  # already under way when the step missed
    assert order[1] == 4  # the missed key next, before the larger ones
    assert order[2:] == sorted((s for s in SIZES if s not in (4, max(SIZES))), reverse=True)


def test_a_ready_graph_replays_while_another_key_records() -> None:
    """A step whose graph is captured replays while another key's recording is in progress."""
    model = ToyModel(CPU)
    gate, holding = threading.Event(), threading.Event()
    captures: list[int] = []

    def hold_the_second() -> None:
        captures.append(1)
        if len(captures) == 2:
            holding.set()
            _wait(gate)

    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(hold_the_second)),
    )
    handle = manager.start_capture()
    try:
        assert holding.wait(WAIT_S)  # the largest key is captured, the next one is held mid-capture
        batch = make_batch(max(SIZES), 3, CPU, seed=0)  # the largest key's step: its graph is ready
        assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
        assert dict(manager.stats.eager_reasons) == {}
        assert manager.stats.num_replays == 1
        assert not handle.done  # the second key is still being recorded
    finally:
        gate.set()
        handle.wait(WAIT_S)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert manager.stats.num_replays == 2


def test_strict_allows_eager_steps_only_while_capturing() -> None:
    model = ToyModel(CPU)
    gate = threading.Event()
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(FULL),
        device="cpu",
        strict=True,
        options=ManagerOptions(engine_factory=FakeEngines(lambda: _wait(gate))),
    )
    handle = manager.start_capture()
    batch = make_batch(5, 3, CPU, seed=0)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL  # eager: allowed during the capture
    gate.set()
    handle.wait(WAIT_S)
    manager.clear()
    with pytest.raises(NoGraphError, match="not captured yet"):
        manager.run_batch(batch)


def test_calls_that_would_race_the_capture_are_refused() -> None:
    gate = threading.Event()
    manager = CUDAGraphManager(
        ToyModel(CPU),
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(lambda: _wait(gate))),
    )
    handle = manager.start_capture()
    try:
        with pytest.raises(
            RuntimeError, match="start_capture: a background capture of this manager is running"
        ):
            manager.start_capture()
        with pytest.raises(RuntimeError, match="capture: a background capture of this manager is running"):
            manager.capture()
        with pytest.raises(RuntimeError, match="clear: a background capture of this manager is running"):
            manager.clear()
        with pytest.raises(TimeoutError, match=r"not done after 0\.01 s"):
            handle.wait(0.01)
    finally:
        gate.set()
    handle.wait(WAIT_S)
    assert manager.start_capture().wait(WAIT_S).num_graphs == 0  # nothing left to capture


def test_without_cuda_the_handle_is_done_at_once_and_says_why() -> None:
    manager = CUDAGraphManager(ToyModel(CPU), INPUTS, config_for(FULL), device="cpu")
    handle = manager.start_capture()
    assert handle.done
    report = handle.wait(0)
    assert report.num_graphs == 0
    assert report.no_graphs == manager.capture().no_graphs  # the same reason as capture()'s
    assert str(report).startswith("Captured no CUDA graphs: CUDA graphs need a CUDA device")


# ---------------------------------------------------------------------------
# GPU: the reference decoder served during the capture
# ---------------------------------------------------------------------------

_DECODER: Final = DecoderConfig.small()
_STEP_TOL: Final = 2e-3  # fp32 decoder, graph against eager on a padded batch


def _decoder_manager(
    mode: CUDAGraphMode,
) -> tuple[ReferenceDecoder, ReferenceDecoder, CUDAGraphManager[torch.Tensor]]:
    torch.manual_seed(0)
    model = ReferenceDecoder(_DECODER, device="cuda")
    twin = copy.deepcopy(model)  # the same weights and cache: replays the served steps eagerly
    config = DispatchConfig(mode, CaptureSizes.default(_MAX_TOKENS), max_num_seqs=_DECODER.max_num_seqs)
    return model, twin, CUDAGraphManager(model.forward, static_inputs(_DECODER), config)


_MAX_TOKENS: Final = 64  # 11 capture sizes: each round's capture lasts long enough to serve beside
_STEPS_DURING_CAPTURES: Final = 700  # per mode; over the three modes, more than 2,000


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [FULL, PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_decoder_steps_served_during_captures_equal_eager(mode: CUDAGraphMode) -> None:
    """Rounds of clear() + start_capture(), served throughout; then every step checked in order."""
    model, twin, manager = _decoder_manager(mode)
    generator = torch.Generator().manual_seed(1)
    served: list[tuple[dict[str, torch.Tensor], bool, torch.Tensor]] = []
    during = rounds = 0
    serving = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    with torch.no_grad(), torch.cuda.stream(serving):  # a stream of its own, never the legacy default
        while during < _STEPS_DURING_CAPTURES:
            manager.clear()
            handle = manager.start_capture()
            rounds += 1
            while not handle.done:
                uniform = len(served) % 3 == 0
                limit = _DECODER.max_num_seqs if uniform else _MAX_TOKENS + 8  # some above the largest
                tokens = int(torch.randint(1, limit + 1, (), generator=generator))
                inputs = make_step_inputs(
                    _DECODER, tokens, uniform_decode=uniform, generator=generator, device="cuda"
                )
                served.append((inputs, uniform, manager.run_batch(inputs, uniform_decode=uniform).clone()))
                during += 1
            handle.wait(WAIT_S)
            assert handle.errors == ()
        serving.synchronize()
    stats = manager.stats
    assert stats.eager_reasons.get("not_captured", 0) > 0, "no step was served eagerly during a capture"
    assert stats.num_replays > 0, "no step replayed a graph during the captures"
    with torch.no_grad():
        for index, (inputs, _, out) in enumerate(served):  # in order: the cache evolves as it did
            expected = twin(inputs["input_ids"], inputs["positions"], inputs["cache_rows"])
            err = rel_err(out, expected)
            assert err < _STEP_TOL, (
                f"served step {index} of {len(served)} ({rounds} rounds) differs: {err:.2e}"
            )
        for tokens in (1, 7, 16, 40):  # after the capture every key replays, checked against eager
            inputs = make_step_inputs(
                _DECODER, tokens, uniform_decode=False, generator=generator, device="cuda"
            )
            before = manager.stats.num_replays
            out = manager.run_batch(inputs).clone()
            assert manager.stats.num_replays == before + 1
            expected = model(inputs["input_ids"], inputs["positions"], inputs["cache_rows"])
            assert rel_err(out, expected) < _STEP_TOL


@pytest.mark.gpu
def test_a_device_sync_during_a_capture_leads_to_a_retry_not_a_broken_graph() -> None:
    model = ToyModel(torch.device("cuda"))
    capturing, synced = threading.Event(), threading.Event()

    def forward(**inputs: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() and not capturing.is_set():
            capturing.set()  # the first recording: let the serving thread sync the device now
            assert synced.wait(WAIT_S)
        return model.eager(inputs)

    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(forward, INPUTS, config_for(FULL))
    handle = manager.start_capture()
    try:
        assert capturing.wait(WAIT_S)
        # Forbidden during a background capture: it invalidates the capture, and the
        # serving thread gets "operation not permitted when stream is capturing" too.
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize()
    finally:
        synced.set()
        handle.wait(WAIT_S)
    assert handle.errors == ()
    assert handle.retries >= 1
    assert manager.num_captured == len(SIZES)
    for tokens in SIZES:
        batch = make_batch(tokens, min(tokens, 3), manager.device, seed=tokens)
        assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert manager.stats.num_replays == len(SIZES)


def test_the_collector_is_paused_one_key_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The background capture pauses the collector around each key's recording, never the whole run."""
    events: list[str] = []
    real = collector_paused

    @contextlib.contextmanager
    def watched(gc_disable: bool = True) -> Iterator[None]:
        events.append("pause")
        with real(gc_disable):
            yield
        events.append("resume")

    monkeypatch.setattr(_background_module, "collector_paused", watched)
    recorded_paused: list[bool] = []
    manager = CUDAGraphManager(
        ToyModel(CPU),
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(
            engine_factory=FakeEngines(lambda: recorded_paused.append(not gc.isenabled()))
        ),
    )
    was_enabled = gc.isenabled()
    manager.start_capture().wait(WAIT_S)
    assert events == ["pause", "resume"] * len(SIZES)  # one pause per key, each ended before the next
    assert recorded_paused == [was_enabled] * len(SIZES)  # paused while recording (if it was running)
    assert gc.isenabled() is was_enabled
