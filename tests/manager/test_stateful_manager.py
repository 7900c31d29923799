"""A state machine over CUDAGraphManager: captures (some made to fail, some in the background), clears, steps.

The manager runs on the CPU with ``FakeGraphEngine``s (see ``helpers``), which
keep the graph contract by re-running the model on the tensors a key was
captured with. The machine keeps its own record of what the manager should
hold and have done: the set of captured keys, and per step the outcome
derived from the dispatcher's decision and that set alone (replay iff the
decided key is captured; otherwise idle, eager, or ``NoGraphError`` when
strict). After every rule the manager's ``num_captured``, its engines' keys
and its ``stats`` must equal that record, and each step's outputs must equal
the model run eagerly on the same batch.

"Capture disabled" is the machine's own switch, read by the engines'
``on_capture`` hook: the process-wide ``set_capture_enabled`` flag is never
touched, so nothing needs restoring and no other test can see this one.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cudagraph_capture import CaptureDisabledError, CaptureError, CaptureInvalidatedError
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    ForwardContext,
    get_forward_context,
)
from cudagraph_manager import CUDAGraphManager, ManagerOptions, NoGraphError
from tests.strategies import invalid_mode_sets, manager_step_shapes

from .helpers import (
    ALL_MODES,
    DIM,
    INPUTS,
    MAX_NUM_SEQS,
    TOL,
    FakeEngines,
    ToyModel,
    as_tensor,
    assert_unchanged,
    make_batch,
    rel_err,
    snapshot,
)

NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE
SIZES = (1, 2, 4, 8, 16)
LORA_COUNTS = (1, 2)
CPU = torch.device("cpu")


class _RecordingModel:
    """``ToyModel``, recording each call's forward context and token rows.

    Every path that runs the model shows here: a capture, a fake replay (it
    re-runs the model on the captured tensors), an eager step, and the one
    idle step of a manager that has seen no outputs yet.
    """

    def __init__(self, model: ToyModel) -> None:
        self.model = model
        self.calls: list[tuple[ForwardContext | None, int]] = []

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        self.calls.append((get_forward_context(), inputs["ids"].shape[0]))
        return as_tensor(self.model(**inputs))


class _PlantedCaptureError(CaptureError):
    """The capture failure the machine planted through ``on_capture``."""


class _PlantedInvalidationError(CaptureInvalidatedError):
    """The invalidated capture the machine planted in a background capture (tried again)."""


class ManagerMachine(RuleBasedStateMachine):
    """Drives one manager through captures, clears and steps; checks it against a plain record."""

    def __init__(self) -> None:
        super().__init__()
        # One intra-op thread while the machine runs (restored in teardown). The toy
        # model's matmuls are tiny, and with two threads on a busy 2-core machine each
        # one waits 15-25 ms for the descheduled worker thread (measured): the run
        # then takes minutes instead of seconds.
        self.torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        # What the manager should hold: the keys captured so far.
        self.captured: set[BatchDescriptor] = set()
        # Whether the manager knows its outputs' structure (after a captured key or a model run).
        self.layout_known = False
        # The engines' on_capture hook: the machine's capture switch and a planted failure.
        self.capture_enabled = True
        self.fail_at: int | None = None  # fail the capture with this index in the current capture()
        self.in_background = False  # the planted failure is an invalidated capture (a retry mends it)
        self.captures_in_call = 0
        # The stats the manager should report.
        self.replays: Counter[tuple[CUDAGraphMode, int]] = Counter()
        self.eager_reasons: Counter[str] = Counter()
        self.padded_tokens = 0
        self.idle_steps = 0

    @initialize(
        mode=st.sampled_from(ALL_MODES),
        query_len=st.sampled_from((1, 2)),
        max_num_seqs=st.sampled_from((4, MAX_NUM_SEQS)),
        strict=st.booleans(),
        capture_first=st.booleans(),
    )
    def build(
        self, mode: CUDAGraphMode, query_len: int, max_num_seqs: int, strict: bool, capture_first: bool
    ) -> None:
        """A manager over ``ToyModel``; often captured at once, as an engine does at start-up."""
        self.config = DispatchConfig(mode, CaptureSizes(SIZES), max_num_seqs, query_len, LORA_COUNTS)
        with torch.random.fork_rng(devices=[]):  # fixed weights; the global generator stays as it was
            torch.manual_seed(0)
            self.toy = ToyModel(CPU)
        self.model = _RecordingModel(self.toy)
        self.engines = FakeEngines(self._on_capture)
        self.strict = strict
        self.manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
            self.model,
            INPUTS,
            self.config,
            device=CPU,
            strict=strict,
            options=ManagerOptions(engine_factory=self.engines, warm_ups="every_key"),  # its model: every key
        )
        self.plan = [key for _, keys in self.manager.dispatcher.capture_plan() for key in keys]
        self.modes = {key: mode for mode, keys in self.manager.dispatcher.capture_plan() for key in keys}
        self.warmed: set[BatchDescriptor] = (
            set()
        )  # keys warmed up or captured: their first use is behind them
        assert self.plan, "every mode drawn here has graphs"
        if capture_first:
            self._capture(None)

    def _on_capture(self) -> None:
        index = self.captures_in_call
        self.captures_in_call += 1
        if not self.capture_enabled:
            raise CaptureDisabledError("capture is disabled (the machine's switch)")
        if index == self.fail_at:
            planted = _PlantedInvalidationError if self.in_background else _PlantedCaptureError
            raise planted(f"planted failure at capture #{index} of this call")

    def _pending(self) -> list[BatchDescriptor]:
        """The keys a capture() should capture now, in the plan's order."""
        return [key for key in self.plan if key not in self.captured]

    # -- capture, clear, the capture switch --

    def _capture(self, fail_at: int | None) -> None:
        """capture(), the ``fail_at``-th capture of the call made to fail (``None``: none)."""
        pending = self._pending()
        if pending and not self.capture_enabled:
            fail_at = 0  # the first capture attempt raises
        failing = fail_at is not None and fail_at < len(pending)
        expected = pending[:fail_at] if failing else pending
        self.fail_at, self.captures_in_call = fail_at, 0
        self.model.calls.clear()
        try:
            if failing:
                error = CaptureDisabledError if not self.capture_enabled else _PlantedCaptureError
                event(f"capture: {error.__name__}")
                with pytest.raises(error):
                    self.manager.capture(progress=False)
            else:
                event("capture: complete" if pending else "capture: nothing pending")
                report = self.manager.capture(progress=False)
                assert [g.descriptor for g in report.graphs] == expected
                assert report.no_graphs is None
        finally:
            self.fail_at = None
        # Each key captured in order: its warm-up where one is needed (its first capture, or the
        # smallest pending key of its mode), then its recording; a key whose recording failed (the
        # machine's switch or a planted failure) ran its warm-up only.
        seen = [
            (None if context is None else context.batch_descriptor, rows)
            for context, rows in self.model.calls
        ]
        smallest = {self.modes[key]: key for key in pending}  # the last of each mode: plans are largest first
        warm = {key for key in pending if key not in self.warmed or smallest[self.modes[key]] == key}
        runs = [(key, key.num_tokens) for key in expected for _ in range(1 + (key in warm))]
        if failing:
            assert fail_at is not None
            runs += [(pending[fail_at], pending[fail_at].num_tokens)] * (pending[fail_at] in warm)
        assert seen == runs
        self.warmed.update(expected)
        self.captured.update(expected)
        self.layout_known = self.layout_known or bool(expected)

    @rule(data=st.data())
    def capture(self, data: st.DataObject) -> None:
        """capture(), maybe made to fail at the nth capture of the call or at one chosen key.

        A failure propagates; the keys captured before it stay captured and the
        rest stay pending for a later capture(). Nothing fails where n is past
        the pending keys or the chosen key is captured already.
        """
        how = data.draw(st.sampled_from(("all", "fail_nth", "fail_key")), label="capture")
        if how == "fail_nth":
            self._capture(data.draw(st.integers(min_value=0, max_value=40), label="failing capture"))
        elif how == "fail_key":
            key = data.draw(st.sampled_from(self.plan), label="failing key")
            pending = self._pending()
            self._capture(pending.index(key) if key in pending else None)
        else:
            self._capture(None)

    @rule(fail_first=st.booleans())
    def background_capture(self, fail_first: bool) -> None:
        """start_capture(), waited for: the pending keys in plan order, a failed recording tried again.

        With the machine's capture switch off every recording fails: each key
        is given up at once (a refusal: no retry), and stays pending. Nothing is
        served meanwhile, so no miss reorders the keys.
        """
        pending = self._pending()
        self.fail_at, self.captures_in_call = (0 if fail_first else None), 0
        # The thread's warm-ups follow capture()'s plan ("every_key" here): each pending key's first use,
        # and each mode's smallest; all of them before the first recording, so even a refused one ran.
        self.warmed.update(pending)
        self.in_background = True
        try:
            handle = self.manager.start_capture()
            report = handle.wait(60)
        finally:
            self.fail_at, self.in_background = None, False
        self.model.calls.clear()
        if not pending:
            event("background: nothing pending")
            assert (report.num_graphs, handle.errors, handle.retries) == (0, (), 0)
        elif self.capture_enabled:
            event(f"background: complete{', one retry' if fail_first else ''}")
            assert [g.descriptor for g in report.graphs] == pending
            assert handle.errors == ()
            assert handle.retries == int(fail_first)
            self.captured.update(pending)
            self.warmed.update(pending)  # a recording is a first use too
            self.layout_known = True
        else:
            event("background: capture off, every key given up")
            assert report.num_graphs == 0
            assert len(handle.errors) == len(pending)
            assert all(isinstance(error, CaptureDisabledError) for error in handle.errors)
            assert handle.retries == 0  # a refusal: no retry mends it
        assert handle.progress == (len(pending), len(pending))

    @rule()
    def clear(self) -> None:
        """Every graph freed: steps that had one now run eagerly as not captured."""
        self.manager.clear()
        self.captured.clear()
        assert self.manager.num_captured == 0

    @rule(enabled=st.booleans())
    def switch_capture(self, enabled: bool) -> None:
        """Capture off (the engines' hook raises ``CaptureDisabledError``) or back on."""
        self.capture_enabled = enabled

    @rule()
    def reset_stats(self) -> None:
        """``reset_stats()``: every counter back to 0; the graphs stay."""
        self.manager.reset_stats()
        self.replays.clear()
        self.eager_reasons.clear()
        self.padded_tokens = self.idle_steps = 0

    # -- steps --

    @rule(data=st.data(), count=st.integers(min_value=1, max_value=4))
    def steps(self, data: st.DataObject, count: int) -> None:
        """A few steps in a row, as an engine loop runs them between the other events."""
        for _ in range(count):
            self._step(data)
            self.stats_match()

    def _step(self, data: st.DataObject) -> None:
        """One step through run() or run_batch(): idle, a replay, an eager run or NoGraphError."""
        num_tokens, num_reqs, uniform = data.draw(manager_step_shapes(self.config), label="step shape")
        most = min(max(LORA_COUNTS) + 1, num_reqs)  # one adapter serves a request at least (issue 39)
        loras = data.draw(st.integers(min_value=0, max_value=most), label="active loras")
        invalid_modes = data.draw(st.just(frozenset()) | invalid_mode_sets, label="invalid modes")
        via_batch = data.draw(st.booleans(), label="through run_batch")
        seed = data.draw(st.integers(min_value=0, max_value=2**16), label="batch seed")
        batch = make_batch(num_tokens, num_reqs, CPU, seed=seed)
        mode, key = self.manager.dispatcher.dispatch(
            num_tokens, uniform_decode=uniform, num_active_loras=loras, invalid_modes=invalid_modes
        )
        replays = num_tokens > 0 and mode is not NONE and key in self.captured
        raises = self.strict and num_tokens > 0 and not replays
        before = snapshot(self.manager.static_buffers) if raises else None
        self.model.calls.clear()

        if raises:
            event("step: NoGraphError")
            with pytest.raises(NoGraphError):
                self._run(batch, via_batch, uniform, loras, invalid_modes)
            assert before is not None
            assert_unchanged(before, self.manager.static_buffers)
            assert self.model.calls == []
            return
        out = self._run(batch, via_batch, uniform, loras, invalid_modes)
        assert out.shape == (num_tokens, DIM)

        if num_tokens == 0:  # idle: no model call, unless the manager has never seen an output
            self.idle_steps += 1
            event("step: idle")
            assert len(self.model.calls) == (0 if self.layout_known else 1)
            self.layout_known = True
            return
        assert rel_err(out, self.toy.eager(batch)) < TOL
        self.layout_known = True
        ((context, rows),) = self.model.calls
        if replays:  # the fake replay re-ran the model on the padded static buffers
            self.replays[(mode, key.num_tokens)] += 1
            event(f"step: {mode.name} replay")
            self.padded_tokens += key.num_tokens - num_tokens
            assert rows == key.num_tokens
            self._check_buffers(batch, key)
            if mode is PIECEWISE:  # its eager breaks run for real and may read the context
                assert context is not None
                assert (context.runtime_mode, context.batch_descriptor) == (mode, key)
        else:  # eager on the caller's tensors, unpadded, in a NONE context
            reason = self._eager_reason(num_tokens, uniform, mode, loras, invalid_modes)
            self.eager_reasons[reason] += 1
            event(f"step: eager, {reason}")
            assert rows == num_tokens
            assert context is not None
            assert context.runtime_mode is NONE

    def _check_buffers(self, batch: dict[str, torch.Tensor], key: BatchDescriptor) -> None:
        """After a replay: the step's rows in the static buffers, pad values up to the graph's rows."""
        graph_reqs = (
            key.num_reqs if key.num_reqs is not None else min(key.num_tokens, self.config.max_num_seqs)
        )
        buffers = self.manager.static_buffers
        for name, spec in INPUTS.items():
            real, buffer = batch[name], buffers[name]
            if spec.rows is None:
                assert torch.equal(buffer, real), name
                continue
            graph_rows = key.num_tokens if spec.rows == "tokens" else graph_reqs
            rows = real.shape[0]
            assert torch.equal(buffer[:rows], real), name
            assert bool((buffer[rows:graph_rows] == spec.pad_value).all()), f"{name}: padding rows"

    def _run(
        self,
        batch: dict[str, torch.Tensor],
        via_batch: bool,
        uniform: bool,
        loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> torch.Tensor:
        if via_batch:
            return self.manager.run_batch(
                batch, uniform_decode=uniform, num_active_loras=loras, invalid_modes=invalid_modes
            )
        return self.manager.run(
            uniform_decode=uniform,
            num_active_loras=loras,
            invalid_modes=invalid_modes,
            ids=batch["ids"],
            x=batch["x"],
            scale=batch["scale"],
            bias=batch["bias"],
        )

    def _eager_reason(
        self,
        num_tokens: int,
        uniform: bool,
        mode: CUDAGraphMode,
        loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> str:
        """Why a step with tokens ran without a graph (``EagerReason`` values, as ``stats`` keys them)."""
        if mode is not NONE:
            return "not_captured"
        if num_tokens > max(SIZES):
            return "above_largest_size"
        if loras > max(LORA_COUNTS):
            return "lora_count"
        allowed = self.manager.dispatcher.dispatch(num_tokens, uniform_decode=uniform, num_active_loras=loras)
        if allowed.mode is not NONE:
            return "invalid_modes"  # the same step without them had a graph
        return "no_graph_for_batch"

    def teardown(self) -> None:
        torch.set_num_threads(self.torch_threads)

    # -- invariants --

    @invariant()
    def captured_keys_match(self) -> None:
        assert self.manager.num_captured == len(self.captured)
        held: set[BatchDescriptor] = set()
        for engine in self.engines.engines.values():
            held |= engine.captured()
        assert held == self.captured

    @invariant()
    def stats_match(self) -> None:
        stats = self.manager.stats
        assert dict(stats.replays) == dict(self.replays)
        assert stats.num_replays == self.replays.total()
        assert dict(stats.eager_reasons) == dict(self.eager_reasons)
        assert stats.eager_steps == sum(stats.eager_reasons.values())
        assert stats.uncaptured_steps == stats.eager_reasons.get("not_captured", 0)
        assert stats.padded_tokens == self.padded_tokens
        assert stats.idle_steps == self.idle_steps


# Each step runs the tiny model once or twice (a few hundred microseconds): the
# whole machine takes a couple of seconds, and the profile's deadline applies.
ManagerMachine.TestCase.settings = settings(
    ManagerMachine.TestCase.settings, max_examples=50, stateful_step_count=25
)
TestManagerMachine = ManagerMachine.TestCase
